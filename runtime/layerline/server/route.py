"""The route: the ordered active stages the engine drives, and an epoch that every switch raises.

DESIGN.md's "Route": the stage endpoints in pipeline order with an epoch. The server's failover
(layerline.server.failover) switches it when a stage goes away or a drain/rejoin changes the plan;
each stage, active or standby, is a StageState as the health monitor sees it. (What the
controller keeps between deploys, route.json's drained hosts and slot, is layerline.routes'
DrainState.)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayerlineError
from ..planner import Plan, pipeline_depth


@dataclass(eq=False)
class StageState:
    """One planned stage as the monitor sees it."""
    host: str
    endpoint: str             # data endpoint
    control: str              # control endpoint (data port + 1 unless the plan says otherwise)
    role: str = "active"      # active | standby
    standby_for: str | None = None
    layers: list | None = None
    planned: dict | None = None   # its plan entry (where it runs: the route's depth reads it); None with --first
    peer: str | None = None   # its host name in the keys dir's peers/: the key its control socket answers with
    up: bool | None = None    # None: not probed yet
    retired: bool = False     # no longer part of the server's stages (after a route switch)
    pid: int | None = None
    uptime_s: float | None = None
    last_ok: float = 0.0
    error: str | None = None

    def report(self) -> dict:
        out = {"name": self.host, "endpoint": self.endpoint, "layers": self.layers, "role": self.role,
               "ok": bool(self.up)}
        if self.standby_for:
            out["standby_for"] = self.standby_for
        if self.up:
            out["uptime_s"] = self.uptime_s
        elif self.error:
            out["error"] = self.error
        return out


@dataclass
class Route:
    """The ordered active stages and an epoch, incremented at every switch."""
    actives: list[StageState]
    epoch: int = 0

    def index(self, host: str) -> int:
        for i, s in enumerate(self.actives):
            if s.host == host:
                return i
        return -1

    def switch(self, i: int, new: StageState) -> None:
        self.actives[i] = new
        self.epoch += 1

    def depth(self) -> int | None:
        """Micro-batches worth keeping in flight through these stages (planner.pipeline_depth), or
        None when a stage has no plan entry (a --first server keeps one per stage)."""
        if any(s.planned is None for s in self.actives):
            return None
        return pipeline_depth([s.planned for s in self.actives])

    @property
    def first(self) -> StageState:
        return self.actives[0]


def check_plan(plan, what: str) -> dict:
    """A plan as the server needs it (typed once, then kept as its JSON): one line when it is not one."""
    if not isinstance(plan, dict) or not isinstance(plan.get("stages"), list):
        raise LayerlineError(f"{what}: not a plan (no stages list); make one with layerline plan --json")
    try:
        Plan.from_dict(plan)
    except (LayerlineError, KeyError, TypeError, ValueError) as e:
        raise LayerlineError(f"{what}: not a valid plan ({e})") from None
    if not any(s.get("role") == "active" and s.get("endpoint") for s in plan["stages"]):
        raise LayerlineError(f"{what}: no active stage with an endpoint")
    return plan
