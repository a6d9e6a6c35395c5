"""The stages the server drives, and what it asks of them.

- `actives_from_plan` / `standbys_from_plan` / `stages_from_first`: each stage as a StageState (its
  data and control endpoints, its host's key name), from a plan or by following each worker's
  next hop from --first.
- `StageClient`: the controller's side of the workers' control sockets (health, set_next), under
  the controller's CURVE keys.
- `Pipes`: pipelines into the route's first stage (the plan's or --first) or into any stage (a
  standby promoted for stage 0).
- `StageOps`: what the HTTP side asks of the stages: health now, the standbys as the monitor last
  saw them, a switch to a new plan's stages (POST /admin/route).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayerlineError
from ..pipeline import ControlChannel, Pipeline, active_stages, control, pipeline_for_plan, reply_host_for
from ..endpoints import control_endpoint
from .failover import Failover
from .metrics import Metrics
from .route import StageState, check_plan


def actives_from_plan(plan: dict) -> list[StageState]:
    """The plan's active stages in pipeline order."""
    return [StageState(str(s.get("host")), str(s["endpoint"]), control_endpoint(str(s["endpoint"])), "active",
                       None, s.get("layers"), s, peer=str(s.get("host")))
            for s in active_stages(plan)]


def standbys_from_plan(plan: dict) -> list[StageState]:
    return [StageState(str(s.get("host")), str(s["endpoint"]), control_endpoint(str(s["endpoint"])), "standby",
                       s.get("standby_for"), s.get("layers"), s, peer=str(s.get("host")))
            for s in plan["stages"] if s.get("role") == "standby" and s.get("endpoint")]


def kv_tokens(plan: dict) -> int | None:
    """KV tokens every active stage holds across sequences: the least of the plan's kv_bytes over
    its bytes per token of each stage's layers (None when the plan does not say)."""
    bpt = (plan.get("kv") or {}).get("bytes_per_token")
    got = []
    for s in active_stages(plan):
        layers = s.get("layers") or [0, 0]
        if s.get("kv_bytes") and bpt and layers[1] > layers[0]:
            got.append(int(s["kv_bytes"]) // (int(bpt) * (layers[1] - layers[0])))
    return min(got) if got else None


@dataclass(frozen=True)
class StageClient:
    """Control ops on workers' control sockets, as the controller (its keys dir; CURVE as --curve)."""
    keys_dir: str
    curve: str = "auto"
    deadline_s: float = 2.0   # --health-deadline

    def health_at(self, endpoint: str, peer: str | None, timeout_s: float = 3.0) -> dict:
        return control(endpoint, "health", timeout_s=timeout_s, keys_dir=self.keys_dir, peer=peer, curve=self.curve)

    def health(self, st: StageState, timeout_s: float) -> dict:
        return self.health_at(st.control, st.peer, timeout_s)

    def channel(self, st: StageState) -> ControlChannel:
        """A kept connection to the stage's control socket (the health monitor's, one thread's)."""
        return ControlChannel(st.control, keys_dir=self.keys_dir, peer=st.peer, curve=self.curve)

    def set_next(self, pred: StageState, nxt: StageState) -> None:
        """Point `pred`'s output at `nxt` (a standby promoted, a route switched)."""
        control(pred.control, "set_next", timeout_s=self.deadline_s + 3, keys_dir=self.keys_dir, peer=pred.peer,
                curve=self.curve, next=nxt.endpoint, next_key=nxt.host)


def stages_from_first(first: str, client: StageClient, first_key: str | None) -> list[StageState]:
    """Every stage, by asking each worker's control socket for its next hop."""
    out, endpoint, peer = [], first, first_key
    while endpoint and len(out) < 64:
        try:
            h = client.health_at(control_endpoint(endpoint), peer)
        except LayerlineError as e:
            raise LayerlineError(f"--first {first}: stage {len(out)} at {endpoint} does not answer ({e})") from None
        out.append(StageState(h.get("name"), endpoint, control_endpoint(endpoint), "active", None, h.get("layers"),
                              peer=peer))
        endpoint, peer = h.get("next"), h.get("next_key")
    return out


@dataclass
class Pipes:
    """Pipelines into the route: the plan's (plan set) or the one that starts at `first`."""
    keys_dir: str
    curve: str
    timeout_s: float
    reply_host: str | None = None
    plan: dict | None = None
    first: str | None = None
    first_key: str | None = None

    def open(self) -> Pipeline:
        """A pipeline into the route's first stage (the engine's)."""
        if self.plan:
            return pipeline_for_plan(self.plan, keys_dir=self.keys_dir, reply_host=self.reply_host, curve=self.curve,
                                     timeout_s=self.timeout_s)
        return Pipeline(self.first, reply_host=self.reply_host or reply_host_for(self.first), timeout_s=self.timeout_s,
                        keys_dir=self.keys_dir, first_key=self.first_key, curve=self.curve)

    def into(self, st: StageState) -> Pipeline:
        """A pipeline into `st` (a standby promoted for the first stage)."""
        return Pipeline(st.endpoint, reply_host=self.reply_host or reply_host_for(st.endpoint),
                        timeout_s=self.timeout_s, keys_dir=self.keys_dir, first_key=st.peer, curve=self.curve)

    def open_plan(self, plan: dict) -> Pipeline:
        """A pipeline into `plan`'s stages, which becomes the route's plan when it opens."""
        old, self.plan = self.plan, plan
        try:
            return self.open()
        except Exception:
            self.plan = old
            raise


class StageOps:
    """What the HTTP side asks of the stages (health, standbys, POST /admin/route)."""

    def __init__(self, failover: Failover, client: StageClient, pipes: Pipes, metrics: Metrics,
                 switch_timeout_s: float):
        self.failover, self.client, self.pipes, self.metrics = failover, client, pipes, metrics
        self.switch_timeout_s = switch_timeout_s

    def health(self) -> tuple[bool, list[dict]]:
        """The route's active stages, each asked now (blocking)."""
        ok, out = True, []
        for st in self.failover.route.actives:
            rep = {"name": st.host, "endpoint": st.endpoint, "layers": st.layers}
            try:
                h = self.client.health(st, self.client.deadline_s)
                rep.update(ok=True, uptime_s=h.get("uptime_s"))
            except LayerlineError as e:
                ok = False
                rep.update(ok=False, error=str(e))
            out.append(rep)
        return ok, out

    def standbys(self) -> list[dict]:
        """The standby stages as the health monitor last saw them."""
        return self.failover.reports()[1]

    def switch(self, new_plan) -> dict:
        """Drive the new plan's stages from the next step on (layerline.server.failover's module doc)."""
        new_plan = check_plan(new_plan, "plan")
        if self.pipes.plan is None:
            raise LayerlineError("this server was started with --first, not --plan; restart it with --plan to "
                                 "switch routes")
        fo = self.failover
        new_states = actives_from_plan(new_plan) + standbys_from_plan(new_plan)
        if [(s.host, s.endpoint, s.role) for s in new_states] == [(s.host, s.endpoint, s.role) for s in fo.stages]:
            return {"epoch": fo.route.epoch, "carried_over": 0, "unchanged": True,
                    "stages": [s.host for s in fo.route.actives]}
        out = fo.switch(new_states, lambda: self.pipes.open_plan(new_plan), timeout_s=self.switch_timeout_s)
        self.metrics.route_epoch.set(out["epoch"])
        return out
