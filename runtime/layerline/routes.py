"""What the controller keeps between deploys (route.json): which hosts are drained, which worker
slot serves, which standbys were promoted (DrainState). The route itself, the ordered stages the
server drives with their epoch, is layerline.server.route.Route.

A drain (drain.yml) or a rejoin (deploy.yml -e layerline_rejoin=HOST) changes the hosts the
pipeline runs on while the server keeps answering. The new route's workers start beside the
old ones, in the other of two slots (other ports, other state dirs: layerline.spec), the
server switches to them at a step boundary, and only then are the old slot's workers stopped.
layerline_home/route.json remembers the drained hosts, so a later deploy.yml keeps them out
until they rejoin, and the slot, so it starts workers where the server looks for them.

A drained host whose standby (in the plan that runs) answers is not re-planned: the standby is
promoted in place (promote_in_place), so no worker starts or moves; the server switches to it
and its predecessor is pointed at it. route.json then also remembers the promotion, so a later
deploy plans the standby as an active host where the drained one stood (host_order), until the
drained host rejoins.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .endpoints import SLOTS
from .errors import LayerlineError
from .home import ControllerHome

ROUTE_FILE = "route.json"   # in layerline_home (layerline.home.ControllerHome.route)


def _names(v, what: str) -> list[str]:
    """A host or a list of hosts, as inventories and `-e` give them ("w2", "w2,w3", [w2, w3])."""
    if v in (None, "", []):
        return []
    if isinstance(v, str):
        return [h.strip() for h in v.split(",") if h.strip()]
    if isinstance(v, (list, tuple)) and all(isinstance(h, str) for h in v):
        return [h.strip() for h in v if h.strip()]
    raise LayerlineError(f"{what}: {v!r} must be a host name or a list of host names")


@dataclass(frozen=True)
class DrainState:
    """route.json: the drained hosts, the serving slot, the promoted standbys."""
    slot: int = 0
    drained: tuple[str, ...] = field(default_factory=tuple)
    promoted: tuple[tuple[str, str], ...] = field(default_factory=tuple)   # (standby, the host it replaced)

    @classmethod
    def from_dict(cls, d: dict | None) -> "DrainState":
        d = d or {}
        if not isinstance(d, dict):
            raise LayerlineError(f"{ROUTE_FILE}: not a JSON object; remove it to start from slot 0 with no "
                                 "drained hosts")
        slot = d.get("slot", 0)
        if slot not in SLOTS:
            raise LayerlineError(f"{ROUTE_FILE}: slot {slot!r} must be 0 or 1")
        promoted = d.get("promoted") or {}
        if not isinstance(promoted, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in promoted.items()):
            raise LayerlineError(f"{ROUTE_FILE}: promoted {promoted!r} must map a standby to the host it "
                                 "replaced; remove the key to plan the standbys as standbys again")
        return cls(slot=slot, drained=tuple(_names(d.get("drained"), f"{ROUTE_FILE}: drained")),
                   promoted=tuple(promoted.items()))

    def to_dict(self) -> dict:
        out = {"slot": self.slot, "drained": list(self.drained)}
        if self.promoted:
            out["promoted"] = dict(self.promoted)
        return out


def load_route(home: str | os.PathLike | ControllerHome) -> DrainState:
    """The route state kept in layerline_home/route.json: slot 0 with nothing drained when there is
    none (or it is empty). The one place the file is read; the playbooks read it through the
    layerline_route filter and write it through the layerline_home module."""
    saved = ControllerHome.of(home).read_json("route", "remove it to start from slot 0 with no drained hosts")
    return DrainState() if saved is None else DrainState.from_dict(saved)


def next_route(state: DrainState, hosts: list[str], drain=None, rejoin=None) -> tuple[DrainState, bool]:
    """The route after draining and rejoining the named hosts, and whether it changed.

    A change moves the workers to the other slot, so the old route keeps serving until the switch."""
    hosts = list(hosts)
    drain, rejoin = _names(drain, "layerline_drain"), _names(rejoin, "layerline_rejoin")
    for h, what in [(h, "layerline_drain") for h in drain] + [(h, "layerline_rejoin") for h in rejoin]:
        if h not in hosts:
            raise LayerlineError(f"{what}: {h} is not a host of group layerline ({', '.join(hosts)}); "
                                 "name an inventory host")
    both = set(drain) & set(rejoin)
    if both:
        raise LayerlineError(f"layerline_drain and layerline_rejoin both name {', '.join(sorted(both))}; "
                             "give each host to one of them")
    not_drained = [h for h in rejoin if h not in state.drained]
    if not_drained:
        raise LayerlineError(f"layerline_rejoin: {', '.join(not_drained)} is not drained (drained: "
                             f"{', '.join(state.drained) or 'none'}); nothing to rejoin")
    drained = [h for h in state.drained if h not in rejoin and h in hosts]
    drained += [h for h in drain if h not in drained]
    if hosts and set(drained) >= set(hosts):
        raise LayerlineError(f"layerline_drain: draining {', '.join(drain)} would leave no host to serve; "
                             "keep at least one (teardown.yml stops everything)")
    changed = bool(drain or rejoin) and tuple(drained) != state.drained
    slot = (1 - state.slot) if changed else state.slot
    # a promotion lasts while its host is drained and its standby is not
    promoted = tuple((sb, h) for sb, h in state.promoted if h in drained and sb not in drained and sb in hosts)
    return DrainState(slot=slot, drained=tuple(drained), promoted=promoted), changed


def promote_in_place(plan: dict, before: DrainState, after: DrainState) -> tuple[dict, DrainState] | None:
    """The running plan without the newly drained hosts, when that needs no worker to start or
    move: an active host's stage is taken by its standby (which holds the same layers, precision
    and KV), a drained standby just leaves. Returns it with the route state that remembers the
    promotions, in the old slot; None when a drained active host has no standby in the plan, and
    then the hosts that remain are re-planned (next_route's slot flip)."""
    stages = [dict(s) for s in (plan or {}).get("stages") or []]
    newly = [h for h in after.drained if h not in before.drained]
    if not newly or not stages:
        return None
    promoted = dict(after.promoted)
    for host in newly:
        i = next((k for k, s in enumerate(stages) if s.get("host") == host), None)
        if i is None:
            continue                                   # not in the running plan: nothing to take out
        if stages[i].get("role") != "active":
            del stages[i]                              # a standby (or a draining host) just leaves
            continue
        sb = next((s for s in stages if s.get("role") == "standby" and s.get("standby_for") == host
                   and s.get("host") not in after.drained), None)
        if sb is None:
            return None
        stages.remove(sb)
        stages[stages.index(next(s for s in stages if s.get("host") == host))] = \
            {**sb, "role": "active", "standby_for": None}
        promoted[sb["host"]] = host
        for s in stages:                               # the drained host's other mirrors follow
            if s.get("role") == "standby" and s.get("standby_for") == host:
                s["standby_for"] = sb["host"]
    if not any(s.get("role") == "active" for s in stages):
        return None
    return ({**plan, "stages": stages},
            DrainState(slot=before.slot, drained=after.drained, promoted=tuple(promoted.items())))


def host_order(hosts: list[str], state: DrainState) -> list[str]:
    """Inventory order with each promoted standby where the host it replaced stood, so a later
    plan gives it that host's place in the pipeline."""
    promoted = dict(state.promoted)
    if not promoted:
        return list(hosts)
    rest = [h for h in hosts if h not in promoted]
    out = []
    for h in rest:
        out += [sb for sb, was in promoted.items() if was == h] + [h]
    return out
