"""What the controller keeps between deploys (route.json): which hosts are drained, which worker
slot serves, which standbys were promoted (DrainState). The route itself, the ordered stages the
server drives with their epoch, is layerline.server.route.Route.

A drain (drain.yml) or a rejoin (deploy.yml -e layerline_rejoin=HOST) changes the hosts the
pipeline runs on while the server keeps answering. The new route's workers start beside the
old ones, in the other of two slots (other ports, other state dirs: layerline.spec), the
server switches to them at a step boundary, and only then are the old slot's workers stopped.
layerline_home/route.json remembers the drained hosts, so a later deploy.yml keeps them out
until they rejoin, and the slot, so it starts workers where the server looks for them.

A drain or rejoin is a transaction. Before anything starts, route.json keeps the state the change
leads to as `pending` (with the plan it switches to and the plan that ran before it) beside the
state in force, which it leaves alone, and plan.json keeps the running plan (begin, plan_to_keep).
Only once the server routes through the new stages are the new plan and state kept, `pending`
cleared (commit); a failed switch that went back clears it too. A run stopped anywhere in between
(SIGINT, SIGKILL, a lost controller) and run again with the same drain or rejoin resumes the pending
change with its own plan (decide: the new slot's workers keep their argv, a switch already done is a
no-op), so it never answers "drained already" while the server routes through the old slot. Another
change while one is pending is refused in one line naming both.

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
                             f"{', '.join(state.drained) or 'none'}): it serves already, nothing to rejoin (a rejoin "
                             "stopped after its switch was kept is done: deploy.yml without -e finishes its cleanup)")
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


# -- drain and rejoin as transactions (route.json's `pending`) ---------------------------------------


@dataclass(frozen=True)
class Pending:
    """A drain or rejoin under way: the state it leads to, the plan the server switches to, the plan that
    ran before it. Kept in route.json before anything starts; cleared by commit (or a restore)."""
    state: DrainState
    plan: dict | None = None
    plan_before: dict | None = None

    @classmethod
    def from_dict(cls, d) -> "Pending | None":
        if d in (None, {}):
            return None
        if not isinstance(d, dict) or not isinstance(d.get("state"), dict):
            raise LayerlineError(f"{ROUTE_FILE}: pending {str(d)[:80]!r} must be {{state, plan, plan_before}}; "
                                 "re-run the drain or rejoin that wrote it, or remove the key to drop that change")
        for k in ("plan", "plan_before"):
            if d.get(k) is not None and not isinstance(d.get(k), dict):
                raise LayerlineError(f"{ROUTE_FILE}: pending.{k} must be a plan (a JSON object); remove "
                                     "`pending` to drop the change it records")
        return cls(DrainState.from_dict(d["state"]), d.get("plan") or None, d.get("plan_before") or None)

    def to_dict(self) -> dict:
        return {"state": self.state.to_dict(), "plan": self.plan, "plan_before": self.plan_before}


def route_record(value: dict | None) -> dict:
    """What route.json keeps of a value (the one check of it, ControllerHome.save's): the state in force
    and, while a drain or rejoin is under way, its `pending` change."""
    out = DrainState.from_dict(value).to_dict()
    pending = Pending.from_dict((value or {}).get("pending"))
    return out | ({"pending": pending.to_dict()} if pending else {})


def load_pending(home: str | os.PathLike | ControllerHome) -> Pending | None:
    saved = ControllerHome.of(home).read_json("route", "remove it to start from slot 0 with no drained hosts")
    return Pending.from_dict(saved.get("pending")) if isinstance(saved, dict) else None


def _said(drained: tuple[str, ...]) -> str:
    return ", ".join(drained) or "no host"


def decide(before: DrainState, pending: Pending | None, hosts: list[str], drain=None, rejoin=None,
           running_plan: dict | None = None) -> dict:
    """The route a run works towards (the layerline_route filter's answer): {slot, drained, promoted,
    changed (the server must switch), moves (workers start in the other slot), plan (the plan to run
    when it is decided already: a promotion in place, or the pending change's), order, before,
    plan_before (the plan that runs until the switch), resumed}.

    With a change pending (a run stopped before its commit), the same drain or rejoin resumes it; any
    other request is refused, since the server may route through either slot."""
    names = [str(h) for h in hosts]
    after, changed = next_route(before, names, drain, rejoin)
    if pending is not None:
        if set(after.drained) != set(pending.state.drained):
            raise LayerlineError(
                f"{ROUTE_FILE}: a change that leaves {_said(pending.state.drained)} drained is under way (a drain or "
                f"rejoin stopped before its switch was kept); this run asks for {_said(after.drained)} drained. Run "
                "that drain or rejoin again to finish it, then this one")
        return pending.state.to_dict() | {
            "changed": True, "moves": pending.state.slot != before.slot, "plan": pending.plan,
            "order": host_order(names, pending.state), "before": before.to_dict(),
            "plan_before": pending.plan_before or running_plan or {}, "resumed": True}
    inplace = promote_in_place(running_plan, before, after) if changed and running_plan else None
    if inplace:
        after = inplace[1]
    return after.to_dict() | {"changed": changed, "moves": changed and not inplace,
                              "plan": inplace[0] if inplace else None, "order": host_order(names, after),
                              "before": before.to_dict(), "plan_before": running_plan or {}, "resumed": False}


def begin(route: dict, plan: dict | None, plan_before: dict | None) -> dict:
    """route.json as a run keeps it before anything starts: unchanged when nothing is to switch (the state
    in force), else the state before with the change as `pending` (the new plan, the running plan)."""
    state = DrainState.from_dict(route)
    if not route.get("changed"):
        return state.to_dict()
    return DrainState.from_dict(route.get("before")).to_dict() | {
        "pending": Pending(state, plan or None, plan_before or None).to_dict()}


def plan_to_keep(route: dict, plan: dict, plan_before: dict | None) -> dict:
    """plan.json before the switch: the new plan when nothing is to switch (a deploy), else the one that
    runs (a server started meanwhile starts on the stages that answer; the switch moves it)."""
    return plan_before if route.get("changed") and plan_before and plan_before.get("stages") else plan


def commit(route: dict) -> dict:
    """route.json once the server routes through the new stages: the new state, nothing pending."""
    return DrainState.from_dict(route).to_dict()
