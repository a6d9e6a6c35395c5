"""Failover: the server's health monitor, its route, and what it does when a stage goes away.

Every `interval` seconds a probe thread per stage (actives and standbys) sends the `health`
control op with a deadline, over a connection it keeps (pipeline.ControlChannel: one CURVE
handshake, not one a probe; dropped after a failed probe and made again at the next). Workers
answer it on a thread of their own, so a long forward does not delay the answer; one slow
answer on a loaded machine is still no reason to fail over. A stage is down after `misses`
consecutive missed deadlines (a window of misses x deadline seconds; --health-misses, default
2), or at once when nothing listens at its control port any more (the connection is refused:
its process is gone; a SIGKILLed worker is failed over within the probe interval). Down is one
log line naming its host and control endpoint, `layerline_stage_up{host,role}` 0; a miss below
the limit is a log line of its own. A stage that answers with another pid than before was
restarted between two probes (its caches are gone just the same).

When an active stage is down (or restarted), the coordinator thread
1. pauses the engine (Engine.fail_over): a new wire epoch, so a stage drops what is still on its
   way from before once a newer forward of that sequence passed it; every request in flight is
   forgotten (their answers may never come; late ones are dropped as unknown);
2. promotes a standby for that host when the plan has one that answers: `set_next` on the
   predecessor (or a new Pipeline into the standby when stage 0 died); the Route switches
   (epoch + 1) and the old stage becomes the standby of the new one;
   without one, waits up to `restart_wait` seconds for the stage to answer again (the
   supervisor restarts it on the same port);
3. resumes the engine: every running sequence is resent from what every stage confirmed; the
   stages that kept their caches (a stage that stalled and came back, its neighbours) go on, a
   stage that lost them (restarted, a promoted standby) answers seq_unknown and just those
   sequences replay their prefix (layerline_replays counts them). Or, when nothing came back in
   time, it fails the affected requests with a 503 error and keeps refusing new ones until the
   stage answers or a route switch leaves it out: the server's --on-stage-lost command
   (drain.yml for that host) is started then, so the survivors are re-planned and the server
   switched to them.

A planned route change (drain.yml, a rejoin) goes through switch(): every stage of the new
route must answer health first (else nothing changes); then, in the engine's thread and so at a
step boundary, a stage that stays but hands its output elsewhere is pointed at its new
successor (`set_next`: a standby promoted in place), the engine fails over (as above), drives a
new pipeline into the new first stage and resumes: stages whose ranges did not change keep their
caches, and each running sequence replays its prefix only where a stage lacks it. The route epoch
goes up and the monitor watches the new stages. One failover or switch runs at a time.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..errors import LayerlineError
from ..pipeline import REFUSED, VERSION
from .route import Route, StageState

log = logging.getLogger("layerline.server")

UP, DOWN, RESTARTED = "up", "down", "restarted"
MISSES = 2   # consecutive missed health deadlines that make a stage down (--health-misses)


def is_down(misses: int, limit: int, error: LayerlineError) -> bool:
    """Whether a stage that has now missed `misses` health checks in a row (the last with
    `error`) is down: `limit` misses, one whose connection was refused (its process is gone), or
    one that runs other code than the server (layerline.version: it cannot be routed through)."""
    return misses >= limit or getattr(error, "code", None) in (REFUSED, VERSION)


@dataclass
class Events:
    """What a failover did, for the tests and the logs: (time, host, what, detail)."""
    items: list = field(default_factory=list)

    def add(self, host: str, what: str, detail: str = "") -> None:
        self.items.append((time.time(), host, what, detail))


class Failover:
    """The health monitor and failover coordinator (threads of their own).

    health(stage, timeout_s) -> the worker's health reply (raises LayerlineError when it does not answer).
    channel(stage), where given, -> a kept connection (pipeline.ControlChannel) the stage's probe thread asks
    `health` on, instead of calling health() (a connection a probe).
    set_next(pred, standby) points the predecessor stage at the standby (control op set_next).
    engine(fn, timeout_s) runs fn(engine) in the engine's thread and returns what it returns.
    open_pipe(stage) -> a Pipeline into that stage (called in the engine's thread).
    on_lost(host) is called (and must not block) when an active stage stayed down past restart_wait:
    the server's --on-stage-lost command, which re-plans around it (drain.yml).
    """

    def __init__(self, stages: list[StageState], *, health: Callable, set_next: Callable, engine: Callable,
                 open_pipe: Callable, metrics=None, interval: float = 0.5, deadline: float = 2.0,
                 restart_wait: float = 30.0, on_lost: Callable | None = None, misses: int = MISSES,
                 channel: Callable | None = None):
        self.stages = stages
        self.route = Route([s for s in stages if s.role == "active"])
        self.health, self.set_next, self.engine, self.open_pipe = health, set_next, engine, open_pipe
        self.channel = channel
        self.metrics = metrics
        self.interval, self.deadline, self.restart_wait = interval, deadline, restart_wait
        if misses < 1:
            raise LayerlineError(f"--health-misses {misses}: must be at least 1")
        self.misses = misses
        self.on_lost = on_lost
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.stop_ev = threading.Event()
        self.threads: list[threading.Thread] = []
        self.history = Events()
        self.unavailable: str | None = None   # the reason new requests are refused, while no route serves
        self.ops = threading.Lock()           # one failover or route switch at a time
        self.switching = threading.Event()    # a route switch waits: a failover stops waiting for a restart
        self._gauges: dict = {}
        for s in stages:
            self._gauge(s, 0)

    # -- lifecycle

    def start(self) -> None:
        for s in self.stages:
            self._watch(s)
        t = threading.Thread(target=self._coordinate, name="layerline-failover", daemon=True)
        t.start()
        self.threads.append(t)

    def _watch(self, s: StageState) -> None:
        t = threading.Thread(target=self._probe_loop, args=(s,), name=f"layerline-health-{s.host}", daemon=True)
        t.start()
        self.threads.append(t)

    def stop(self) -> None:
        self.stop_ev.set()
        self.events.put(None)
        for t in self.threads:
            t.join(self.deadline + 1)

    def reports(self) -> tuple[list[dict], list[dict]]:
        """(the route's active stages in order, the standbys), as /health shows them."""
        with self.lock:
            act = [s.report() for s in self.route.actives]
            sb = [s.report() for s in self.stages if s not in self.route.actives]
        return act, sb

    # -- metrics

    def _gauge(self, s: StageState, value: int) -> None:
        if self.metrics is None:
            return
        key = (s.host, s.role)
        old = self._gauges.get(s.host)
        if old is not None and old != key:
            try:
                self.metrics.stage_up.remove(*old)
            except KeyError:
                pass
        self._gauges[s.host] = key
        self.metrics.stage_up.labels(host=s.host, role=s.role).set(value)

    # -- probes (one thread per stage)

    def _probe_loop(self, s: StageState) -> None:
        misses = 0   # in a row
        ch = None    # the kept connection, where self.channel makes one
        while not self.stop_ev.is_set() and not s.retired:
            t0 = time.monotonic()
            try:
                if self.channel is None:
                    h = self.health(s, self.deadline)
                else:
                    ch = ch or self.channel(s)
                    h = ch.call("health", self.deadline)
                misses = 0
                pid = h.get("pid") if isinstance(h.get("pid"), int) else None
                with self.lock:
                    was_up, old_pid = s.up, s.pid
                    s.up, s.pid, s.uptime_s, s.last_ok, s.error = True, pid, h.get("uptime_s"), time.monotonic(), None
                    self._gauge(s, 1)
                if self.metrics is not None and type(h.get("prefix_bytes")) is int:
                    self.metrics.prefix_bytes.labels(host=s.host).set(h["prefix_bytes"])
                if was_up is False:
                    log.info("stage %s at %s is up again (pid %s)", s.host, s.control, pid)
                    self.events.put((UP, s))
                elif was_up and old_pid is not None and pid is not None and pid != old_pid:
                    log.warning("stage %s at %s restarted between two health checks (pid %s -> %s): its caches "
                                "are gone", s.host, s.control, old_pid, pid)
                    self.events.put((RESTARTED, s))
            except LayerlineError as e:
                misses += 1
                down = is_down(misses, self.misses, e)
                with self.lock:
                    was_up = s.up
                    s.error = str(e)
                    if down:
                        s.up = False
                        self._gauge(s, 0)
                if down and was_up is not False:
                    code = getattr(e, "code", None)
                    why = ("its process is gone (connection refused)" if code == REFUSED else str(e) if code == VERSION
                           else f"no answer to {misses} health checks in a row, {self.deadline:g} s each")
                    log.warning("stage %s (%s) at %s is down: %s", s.host, s.role, s.control, why)
                    self.events.put((DOWN, s))
                elif not down:
                    log.info("stage %s at %s missed a health check (%d of %d in a row before it counts as down): %s",
                             s.host, s.control, misses, self.misses, e)
            except Exception as e:  # noqa: BLE001 - a probe never dies
                log.warning("stage %s at %s: health probe failed: %s", s.host, s.control, e)
            self.stop_ev.wait(max(0.0, self.interval - (time.monotonic() - t0)))
        if ch is not None:
            ch.close()

    # -- the coordinator

    def _coordinate(self) -> None:
        while not self.stop_ev.is_set():
            ev = self.events.get()
            if ev is None:
                return
            kind, s = ev
            try:
                with self.ops:
                    with self.lock:
                        active = s in self.route.actives
                    if not active:
                        continue
                    if kind in (DOWN, RESTARTED):
                        self._failover(s, kind)
                    elif kind == UP and self.unavailable is not None:
                        self._resume(s, None)
            except Exception as e:  # noqa: BLE001 - the monitor outlives any one failover
                log.exception("failover of %s failed: %s", s.host, e)

    def _count(self, s: StageState, how: str) -> None:
        if self.metrics is not None:
            self.metrics.failovers.labels(host=s.host, action=how).inc()

    def _failover(self, dead: StageState, kind: str) -> None:
        t0 = time.monotonic()
        n = self.engine(lambda eng: eng.fail_over(f"stage {dead.host} {kind}"), 10.0)
        self.history.add(dead.host, "paused", f"{n} sequences paused")
        log.warning("failover: stage %s at %s %s; paused %d running sequences (they go on from what every stage "
                    "confirmed; a stage that lost them gets their prefix replayed)", dead.host, dead.control, kind,
                    n or 0)
        if kind == DOWN:
            sb = self._standby_for(dead)
            if sb is not None and self._promote(dead, sb):
                self._count(dead, "promoted")
                log.warning("failover: standby %s at %s promoted for %s (route epoch %d) after %.2f s",
                            sb.host, sb.endpoint, dead.host, self.route.epoch, time.monotonic() - t0)
                return
            # wait for the supervisor's restart on the same port
            until = time.monotonic() + self.restart_wait
            while time.monotonic() < until and not self.stop_ev.is_set() and not self.switching.is_set():
                with self.lock:
                    up = dead.up
                if up:
                    break
                self.stop_ev.wait(0.05)
            with self.lock:
                up = dead.up
            if not up and self.switching.is_set():   # a drain of that host takes over: it resumes
                log.warning("failover: %s is still down; a route switch takes over", dead.host)
                return
            if not up:
                self._count(dead, "failed")
                msg = (f"stage {dead.host} at {dead.endpoint} is down and did not come back within "
                       f"{self.restart_wait:g} s (no standby for it answers); check its worker's log and supervisor")
                self.unavailable = msg
                self.engine(lambda eng: eng.unavailable(msg), 10.0)
                self.history.add(dead.host, "failed", msg)
                log.error("failover: %s", msg)
                if self.on_lost is not None:
                    try:
                        self.on_lost(dead.host)
                    except Exception as e:  # noqa: BLE001 - the server serves on; the log says why
                        log.error("failover: could not start the re-plan around %s: %s", dead.host, e)
                return
        self._count(dead, "waited" if kind == DOWN else "restarted")
        self._resume(dead, t0)

    def _resume(self, s: StageState, t0: float | None) -> None:
        self.unavailable = None
        self.engine(lambda eng: eng.resume(), 10.0)
        self.history.add(s.host, "resumed", "")
        log.warning("failover: stage %s at %s answers again; resumed%s", s.host, s.control,
                    f" after {time.monotonic() - t0:.2f} s" if t0 is not None else "")

    def _standby_for(self, dead: StageState) -> StageState | None:
        with self.lock:
            for s in self.stages:
                if s.role == "standby" and s.standby_for == dead.host and s.up and s not in self.route.actives:
                    return s
        return None

    def _promote(self, dead: StageState, sb: StageState) -> bool:
        with self.lock:
            i = self.route.index(dead.host)
            pred = self.route.actives[i - 1] if i > 0 else None
        try:
            if pred is not None:
                self.set_next(pred, sb)
            else:
                self.engine(lambda eng: eng.replace_pipe(self.open_pipe(sb)), 15.0)
        except Exception as e:  # noqa: BLE001
            log.error("failover: cannot promote standby %s for %s (%s); waiting for %s to come back",
                      sb.host, dead.host, e, dead.host)
            return False
        with self.lock:
            self.route.switch(i, sb)
            sb.role, sb.standby_for = "active", None
            dead.role, dead.standby_for = "standby", sb.host
            self._gauge(sb, 1 if sb.up else 0)
            self._gauge(dead, 1 if dead.up else 0)
            depth = self.route.depth()
        if self.metrics is not None:
            self.metrics.route_epoch.set(self.route.epoch)
        self.history.add(sb.host, "promoted", f"for {dead.host}, epoch {self.route.epoch}")

        def resume(eng):
            if depth is not None:   # the standby may sit on another machine than the stage it replaces
                eng.pipe.depth = depth
            eng.resume()
        self.engine(resume, 10.0)
        return True

    # -- planned route changes

    def switch(self, stages: list[StageState], open_pipe: Callable, timeout_s: float = 30.0) -> dict:
        """Route the engine through `stages` (a new plan's actives and standbys); see the module doc.

        open_pipe() -> a Pipeline into the new first stage (called in the engine's thread).
        Raises LayerlineError, with nothing changed, when a new active stage does not answer."""
        actives = [s for s in stages if s.role == "active"]
        if not actives:
            raise LayerlineError("the new route has no active stage")
        self.switching.set()
        try:
            with self.ops:
                return self._switch(stages, actives, open_pipe, timeout_s)
        finally:
            self.switching.clear()

    def _switch(self, stages: list[StageState], actives: list[StageState], open_pipe: Callable,
                timeout_s: float) -> dict:
        for s in stages:   # the gate: every new stage answers before anything changes
            try:
                h = self.health(s, self.deadline)
            except LayerlineError as e:
                if s.role == "active":
                    raise LayerlineError(f"stage {s.host} at {s.control} does not answer health ({e}); "
                                         "the route is unchanged") from None
                s.up, s.error = False, str(e)
                continue
            s.up, s.pid, s.uptime_s, s.last_ok = True, h.get("pid"), h.get("uptime_s"), time.monotonic()
        t0 = time.monotonic()
        # a stage that serves on in the new route but hands its output to another stage than before
        # (a standby promoted in place after it, or the old route again) is pointed at it; stages
        # started for the new route were launched pointing at their successors
        with self.lock:
            was_next = {a.endpoint: b.endpoint for a, b in zip(self.route.actives, self.route.actives[1:])}
        relink = [(a, b) for a, b in zip(actives, actives[1:])
                  if a.endpoint in was_next and was_next[a.endpoint] != b.endpoint]

        def swap(eng):
            pipe = open_pipe()   # first: a pipeline that cannot open leaves the engine as it was
            for a, b in relink:
                self.set_next(a, b)
            n = eng.fail_over("route switch")
            eng.replace_pipe(pipe)
            eng.resume()
            return n
        n = self.engine(swap, timeout_s)
        with self.lock:
            old = self.stages
            for s in old:
                s.retired = True
                if self.metrics is not None and s.host in self._gauges:
                    try:
                        self.metrics.stage_up.remove(*self._gauges.pop(s.host))
                    except KeyError:
                        pass
            self.stages = list(stages)
            self.route = Route(actives, self.route.epoch + 1)
            self.unavailable = None
            for s in stages:
                self._gauge(s, 1 if s.up else 0)
        for s in stages:
            self._watch(s)
        self.threads = [t for t in self.threads if t.is_alive()]
        took = time.monotonic() - t0
        self.history.add(actives[0].host, "switched", f"epoch {self.route.epoch}, {n} sequences carried over")
        log.warning("route switch: epoch %d over %s; %d running sequences carried over, their prefix replayed only "
                    "on stages that lack it (%.3f s)", self.route.epoch, ", ".join(s.host for s in actives), n or 0,
                    took)
        return {"epoch": self.route.epoch, "carried_over": n or 0, "seconds": round(took, 4),
                "stages": [s.host for s in actives],
                "standbys": [s.host for s in stages if s.role != "active"]}
