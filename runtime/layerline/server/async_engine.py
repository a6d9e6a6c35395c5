"""The engine (layerline.engine.Engine) in a thread of its own, fed from asyncio (vLLM's AsyncLLMEngine).

The engine's thread opens the Pipeline and alone touches its ZeroMQ sockets. Requests go in
through a thread-safe inbox (a byte on a pipe wakes the engine's poll); tokens come out through
loop.call_soon_threadsafe into each request's asyncio.Queue. Requests beyond the KV budget wait
in the engine's queue; beyond `max_queue` waiting, submit refuses (the API answers 429).
"""
from __future__ import annotations

import asyncio
import os
import queue
import secrets
import threading
import time
from typing import Callable

from .. import wire
from ..pipeline import Pipeline
from ..errors import LayerlineError
from ..engine import Engine, Sampling, Sequence
from ..prefill import BUSY_CHUNK, CHUNK
from .metrics import Metrics


class QueueFull(LayerlineError):
    def __init__(self, waiting: int, retry_after: int = 1):
        super().__init__(f"the server is at capacity ({waiting} requests already wait for a slot); retry later")
        self.retry_after = retry_after


class Stream:
    """One request as the asyncio side sees it: its events, and when they came."""

    def __init__(self, sid: str, loop: asyncio.AbstractEventLoop, prompt_tokens: int):
        self.sid = sid
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.arrived = time.perf_counter()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.admitted = False
        self.finished = False

    async def next(self, timeout: float | None = None):
        """("token", id) | ("done", reason) | ("error", message); None after `timeout` seconds."""
        if not self.events.empty():  # the common case under load: no task, no timer
            return self.events.get_nowait()
        try:
            return await asyncio.wait_for(self.events.get(), timeout)
        except asyncio.TimeoutError:
            return None


def _deliver(events: list) -> None:
    for st, ev in events:
        st.events.put_nowait(ev)


class AsyncEngine:
    """The engine's thread and the hand-over to and from it: requests in (`submit`, `cancel`,
    `call`), each request's events out to its asyncio loop, the engine's gauges into metrics."""

    def __init__(self, open_pipe: Callable[[], Pipeline], *, stages: int | None, kv_tokens: int | None,
                 max_running: int, max_queue: int, chunk: int = CHUNK, busy_chunk: int = BUSY_CHUNK,
                 metrics: Metrics | None = None,
                 rows: bool | None = None, prefix: bool = True):
        self.open_pipe = open_pipe
        self.stages = stages
        self.kv_tokens = kv_tokens
        self.max_running = max_running
        self.max_queue = max_queue
        self.chunk = chunk
        self.busy_chunk = busy_chunk
        self.metrics = metrics or Metrics()
        self.rows = rows
        self.prefix = prefix
        self._prefix_seen = (0, 0, 0, 0, 0)   # lookups, hits, reused, lost, looked-up tokens
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._lock = threading.Lock()
        self._waiting = 0
        self._stop = False
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.engine_rows: bool | None = None
        self._out: list = []   # (stream, event) of the engine's current turn
        self._stage_hist: dict = {}
        self.running = 0
        self._replays_seen = 0

    # -- lifecycle

    def start(self, timeout_s: float = 60.0) -> None:
        self._thread = threading.Thread(target=self._main, name="layerline-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise LayerlineError(f"the generation engine did not start within {timeout_s:.0f} s")
        if self._failed is not None:
            raise self._failed

    def _main(self) -> None:
        try:
            pipe = self.open_pipe()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._failed = e
            self._ready.set()
            return
        eng = None
        try:
            # max_replays counts the replays no failover explains (a failover's are free); every replay
            # a stage asks for, after a failover too, goes to layerline_replays
            eng = Engine(pipe, stages=self.stages, chunk=self.chunk, busy_chunk=self.busy_chunk,
                         kv_tokens=self.kv_tokens, max_running=self.max_running, rows=self.rows,
                         on_step=self._on_step, max_replays=4, prefix=self.prefix)
            self._ready.set()
            eng.serve(self.inbox, self._rfd, lambda: self._stop, self._on_turn)
        finally:
            (eng.pipe if eng is not None else pipe).close()

    def stop(self) -> None:
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(10)
        for fd in (self._rfd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[[Engine], object], timeout_s: float = 10.0):
        """fn(engine) in the engine's thread (between two turns); its result, or its exception raised here."""
        if not self.alive:
            raise LayerlineError("the generation engine is not running")
        box: queue.SimpleQueue = queue.SimpleQueue()
        self.inbox.put(("call", (fn, box)))
        self._wake()
        try:
            ok, value = box.get(timeout=timeout_s)
        except queue.Empty:
            raise LayerlineError(f"the generation engine did not take a call within {timeout_s:g} s") from None
        if not ok:
            raise value
        return value

    def _wake(self) -> None:
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe wakes the engine all the same

    # -- engine-thread callbacks

    def _flush(self) -> None:
        """Hand this turn's events to the asyncio loop at once (one wake-up, not one per token)."""
        if not self._out:
            return
        out, self._out = self._out, []
        by_loop: dict = {}
        for st, ev in out:
            by_loop.setdefault(st.loop, []).append((st, ev))
        for loop, evs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, evs)
            except RuntimeError:
                pass  # the loop is gone (shutdown)

    def _on_turn(self, eng: Engine) -> None:
        if eng.replays != self._replays_seen:
            self.metrics.replays.inc(max(0, eng.replays - self._replays_seen))
            self._replays_seen = eng.replays
        if eng.prefix is not None:
            self._prefix_metrics(eng.prefix)
        self._flush()
        self.running = len(eng.running)
        self.engine_rows = eng.rows
        m = self.metrics
        m.running.set(len(eng.running))
        m.kv_tokens.set(eng.kv_used)
        m.v_running.set(len(eng.running))
        if eng.kv_tokens:
            m.v_kv.set(min(1.0, eng.kv_used / eng.kv_tokens))
        m.microbatches.set(eng.depth)
        with self._lock:
            m.queue_depth.set(self._waiting)
            m.v_waiting.set(self._waiting)

    def _prefix_metrics(self, p) -> None:
        now = (p.lookups, p.hits, p.reused, p.lost, p.looked_up_tokens)
        if now != self._prefix_seen:
            m = self.metrics
            d = [a - b for a, b in zip(now, self._prefix_seen)]
            m.prefix_lookups.inc(d[0])
            m.prefix_hits.inc(d[1])
            m.prefix_reused.inc(d[2])
            m.v_prefix_hits.inc(d[2])
            m.prefix_lost.inc(d[3])
            m.v_prefix_queries.inc(d[4])
            m.prefix_hit_ratio.set(p.hits / p.lookups if p.lookups else 0.0)
            self._prefix_seen = now
        self.metrics.prefix_entries.set(len(p))
        self.metrics.prefix_tokens.set(p.tokens)

    def _on_step(self, res, kind: str, n: int) -> None:
        # an answer that carries the steps a stage computed ahead (StepResult.then) timed them all
        steps = 1 + (int(res.then.shape[0]) if res.then is not None else 0)
        for t in res.timings:
            if isinstance(t, dict) and isinstance(t.get("s"), (int, float)):
                name = str(t.get("stage"))
                h = self._stage_hist.get(name)
                if h is None:
                    h = self._stage_hist[name] = self.metrics.stage_step.labels(name)
                for _ in range(steps):
                    h.observe(float(t["s"]) / steps)
        if res.timings:
            self.metrics.step_hop.observe(res.hop_s)

    # -- requests (asyncio side)

    def submit(self, prompt: list[int], max_new: int, sampling: Sampling, eos: frozenset,
               loop: asyncio.AbstractEventLoop, constraint=None, logprobs: int | None = None,
               bias: dict[int, float] | None = None, penalties: tuple[float, float] | None = None) -> Stream:
        """One sequence; its events go to the returned Stream. constraint: a grammar masking its tokens
        (layerline.model.grammar.Constraint); logprobs: report each token's and this many alternatives'."""
        if not self.alive:
            raise LayerlineError("the generation engine is not running")
        with self._lock:
            if self._waiting >= self.max_queue:
                raise QueueFull(self._waiting)
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)
            self.metrics.v_waiting.set(self._waiting)
        sid = wire.new_id("s")   # unguessable: an id names what a message may release or rewind
        st = Stream(sid, loop, len(prompt))
        m = self.metrics

        def sink(kind: str, value) -> None:  # the engine's thread
            now = time.perf_counter()
            if kind == "admitted":
                st.admitted = True
                self._unwait()
                m.prompt_tokens.inc(len(prompt))
                m.v_prompt.inc(len(prompt))
                m.v_queue.observe(now - st.arrived)
                return
            if kind == "logprobs":
                self._out.append((st, (kind, value)))
                return
            if kind == "token":
                if st.first_token is None:
                    st.first_token = now
                    m.ttft.observe(now - st.arrived)
                    m.v_ttft.observe(now - st.arrived)
                else:
                    m.itl.observe(now - st.last_token)
                    m.v_itl.observe(now - st.last_token)
                    m.v_tpot.observe(now - st.last_token)
                st.last_token = now
                st.completion_tokens += 1
                m.generated_tokens.inc()
                m.v_generation.inc()
            else:
                if not st.admitted:
                    self._unwait()
                if kind in ("done", "error", "unavailable"):
                    st.finished = True
            self._out.append((st, (kind, value)))

        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        seq = Sequence(sid, list(prompt), max_new, Sampling(sampling.temperature, sampling.top_p, seed), eos, sink,
                       constraint=constraint, logprobs=logprobs, bias=bias,
                       penalties=penalties)
        self.inbox.put(("add", seq))
        self._wake()
        return st

    def _unwait(self) -> None:
        with self._lock:
            self._waiting = max(0, self._waiting - 1)
            self.metrics.queue_depth.set(self._waiting)
            self.metrics.v_waiting.set(self._waiting)

    def cancel(self, sid: str) -> None:
        """The client went away: the engine frees the sequence's slot at its next turn."""
        self.inbox.put(("cancel", sid))
        self._wake()
