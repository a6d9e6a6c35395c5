"""The route state kept on the controller: which hosts are drained and which worker slot serves.

A drain (drain.yml) or a rejoin (deploy.yml -e layerline_rejoin=HOST) changes the hosts the
pipeline runs on while the server keeps answering. The new route's workers start beside the
old ones, in the other of two slots (other ports, other state dirs: layerline.spec), the
server switches to them at a step boundary, and only then are the old slot's workers stopped.
layerline_home/route.json remembers the drained hosts, so a later deploy.yml keeps them out
until they rejoin, and the slot, so it starts workers where the server looks for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import LayerlineError
from .spec import SLOTS

ROUTE_FILE = "route.json"


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
class RouteState:
    slot: int = 0
    drained: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, d: dict | None) -> "RouteState":
        d = d or {}
        if not isinstance(d, dict):
            raise LayerlineError(f"{ROUTE_FILE}: not a JSON object; remove it to start from slot 0 with no "
                                 "drained hosts")
        slot = d.get("slot", 0)
        if slot not in SLOTS:
            raise LayerlineError(f"{ROUTE_FILE}: slot {slot!r} must be 0 or 1")
        return cls(slot=slot, drained=tuple(_names(d.get("drained"), f"{ROUTE_FILE}: drained")))

    def to_dict(self) -> dict:
        return {"slot": self.slot, "drained": list(self.drained)}


def next_route(state: RouteState, hosts: list[str], drain=None, rejoin=None) -> tuple[RouteState, bool]:
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
    return RouteState(slot=slot, drained=tuple(drained)), changed
