"""From an inventory's hosts to the planner: a play's hosts as planner Nodes, and their plan.

Each host's variables are read once, into layerline.settings.HostSettings; this module puts a
play's hosts together: their nodes in pipeline order (a standby whose host is drained serves in
its own right), the ports no two workers may share, the plan, and the peers each probe times.
The CLI's `layerline plan --vars` goes through the same function, so the two plan alike for the
same facts. Hosts are looked up by name (never by position), so standbys and drained hosts shift
no one's layers.
"""
from __future__ import annotations

from dataclasses import replace

from .caps import NodeCaps
from .cost import ModelCost
from .endpoints import DEFAULT_PORT  # noqa: F401 - `layerline plan --vars` names it
from .planner import Node, Plan, PlanError, check_nodes, make_plan
from .settings import HostSettings


def settings_of(host_vars: dict[str, dict]) -> dict[str, HostSettings]:
    """Every host's HostSettings, in the order given (pipeline order)."""
    if not host_vars:
        raise PlanError("inventory: no hosts to plan for (put the workers in group layerline)")
    return {h: HostSettings.of(h, v) for h, v in host_vars.items()}


def node_from_vars(host: str, hvars: dict | HostSettings, caps: dict | NodeCaps | None) -> Node:
    return HostSettings.of(host, hvars).node(caps)


def plan_for_hosts(host_vars: dict[str, dict], cost: dict | ModelCost, objective: dict | None = None,
                   policy: str | None = None, reserve_ram_gb: float | None = None) -> Plan:
    """The plan for a play's hosts (in pipeline order); caps come from each one's layerline_caps.
    objective, policy, reserve_ram_gb: as given, else the first host's (group vars)."""
    settings = settings_of(host_vars)
    nodes = _nodes(settings, {h: v.get("layerline_caps") for h, v in host_vars.items()})
    mc = cost if isinstance(cost, ModelCost) else ModelCost.from_dict(cost)
    opts, policy = _group(settings, objective, policy, reserve_ram_gb)
    return make_plan(nodes, mc, opts, policy)


def plan_for_route(host_vars: dict[str, dict], cost: dict | ModelCost, route: dict) -> dict:
    """The plan a route state asks for (the layerline_route filter's answer): its in-place plan where every
    drained host's standby took its place, else a new plan of these hosts (a play's, in any order) in the
    route's order (promoted standbys where their hosts stood), its drained hosts left out as draining."""
    if route.get("plan"):
        return route["plan"]
    drained = set(route.get("drained") or ())
    order = [h for h in route.get("order") or host_vars if h in host_vars]
    return plan_for_hosts({h: {**host_vars[h], **({"layerline_role": "draining"} if h in drained else {})}
                           for h in order}, cost).to_dict()


def check_vars(host_vars: dict[str, dict], objective: dict | None = None, policy: str | None = None,
               reserve_ram_gb: float | None = None) -> None:
    """LayerlineError naming the first variable no plan can take: every host's settings and what
    plan_for_hosts checks before it needs the probes' facts and the model, so a typo fails in
    seconds, before anything is measured."""
    settings = settings_of(host_vars)
    nodes = _nodes(settings, {h: NodeCaps() for h in settings})   # not measured yet
    _, policy = _group(settings, objective, policy, reserve_ram_gb)
    check_nodes(nodes, policy)


def _group(settings: dict[str, HostSettings], objective, policy, reserve_ram_gb):
    """The cost options and policy: the explicit ones, else the first host's (they are group vars)."""
    first = next(iter(settings.values()))
    if objective is not None or reserve_ram_gb is not None or policy is not None:
        first = HostSettings.from_vars(first.host, {
            **first.to_vars(), **({"layerline_objective": objective} if objective is not None else {}),
            **({"layerline_policy": policy} if policy is not None else {}),
            **({"layerline_reserve_ram_gb": reserve_ram_gb} if reserve_ram_gb is not None else {})})
    return first.cost_options(), first.policy


def _nodes(settings: dict[str, HostSettings], caps: dict) -> list[Node]:
    """The planner's nodes for a play's hosts, in pipeline order; each worker's two ports its own."""
    nodes = [s.node(caps.get(h)) for h, s in settings.items()]
    drained = {n.host for n in nodes if n.role == "draining"}
    # a standby whose principal is drained serves in its own right (drain.yml promoted it, or a re-plan does)
    nodes = [replace(n, role="active", standby_for=None) if n.role == "standby" and n.standby_for in drained else n
             for n in nodes]
    taken: dict[tuple[str, int], str] = {}
    for h, s in settings.items():
        for p in s.ports():
            other = taken.get((s.address, p))
            if other:
                raise PlanError(f"{h}: layerline_port {s.data_port()} on {s.address} collides with {other}'s ports; "
                                "give each worker on one address its own port, at least 2 apart")
            taken[(s.address, p)] = h
    return nodes


def peers_of(host_vars: dict[str, dict], me: str) -> list[str]:
    """The other hosts as ADDR:PORT (their ssh port), for the probe's round-trip measurement.

    Hosts on this machine (local connection) are left out: their hop is loopback."""
    out = []
    for h, s in settings_of(host_vars).items():
        if h == me or s.local:
            continue
        out.append(f"{s.address}:{s.ansible_port}")
    return out


def host_errors(noted: dict[str, object]) -> list[str]:
    """The errors hosts noted in a rescue (host -> its message, None where it noted none), in play
    order: what a play that goes on past one host's failure reports, and restores on."""
    return [str(m) for m in noted.values() if m not in (None, "")]


def known_addresses(host_vars: dict[str, dict]) -> list[str]:
    """Names and addresses the inventory already has, so discovery adds none of them again."""
    out: list[str] = []
    for h, s in settings_of(host_vars).items() if host_vars else ():
        out += [h, s.ansible_host, s.addr or "", s.address]
    return [a for a in dict.fromkeys(out) if a]
