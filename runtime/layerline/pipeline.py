"""The pipeline's sockets: push token ids into stage 0, take logits back from the last stage.

The Pipeline binds one result socket (reply_to) and names it in every request, so the last
stage answers whoever asked. Each request carries an id and a deadline; stages append their
compute time to the header, so one result tells where the time went. With `epoch` set (the
generation engine's wire epoch, which every failover and route switch raises) every forward
carries it, and a stage drops one of an older epoch than a newer forward of the same sequence
it has seen (layerline.model.kv.KVPool).

Both of its sockets run CURVE with the controller's keys dir (keys_dir; `layerline drive --keys
DIR`), loopback included: the DEALER to stage 0 trusts only the first stage's public key
(first_key: its host name in DIR/peers/), and the result socket lets in only the public keys in
DIR/allowed/ (the workers'), so no other local process can send it results. Request ids are
random (wire.new_id), as the engine's sequence ids are.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from . import keys as keymod
from . import version, wire
from .endpoints import LOOPBACK, endpoint_host, is_loopback
from .errors import LayerlineError
from .planner import pipeline_depth


class DriveError(LayerlineError):
    """A forward that did not come back: names the stage that failed or went quiet.

    seqs: for a `rows` message, the sequences the stage lost (replay those, resend the rest)."""

    def __init__(self, message: str = "", code: str | None = None, seqs: list[str] | None = None):
        super().__init__(message, code)
        self.seqs = seqs


@dataclass
class StepResult:
    logits: torch.Tensor | None   # [B, T, vocab]; None where the step asked for argmax
    timings: list[dict]           # per stage: {"stage", "layers", "s"}
    wall_s: float
    argmax: torch.Tensor | None = None  # int64 [B]: each row's greedy token (a step submitted with pick)
    finite: torch.Tensor | None = None  # bool [B]: whether that row's logits were all finite
    # int64 [K, B]: each row's greedy tokens of the K steps after this one, which a stage holding the
    # whole model computed ahead (each fed the token before it; all finite) and now holds (submit_rows' more)
    then: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """Rows the step carried (each one token's answer)."""
        return int((self.argmax if self.logits is None else self.logits).shape[0])

    @property
    def hop_s(self) -> float:
        """Wall time not spent computing: framing, copies and the links between stages."""
        return max(0.0, self.wall_s - sum(t["s"] for t in self.timings))


@dataclass
class Answer:
    """What came back for one request in flight: a result or the error a stage sent."""
    rid: str
    result: StepResult | None
    error: DriveError | None = None


@dataclass
class Pipeline:
    first: str                     # stage 0's data endpoint
    reply_host: str = LOOPBACK     # an address of this machine the last stage can reach
    timeout_s: float = 120.0
    ctx: zmq.Context | None = None   # None: the pipeline makes (and terminates) its own
    keys_dir: str | None = None    # the controller's keys dir (required: every socket runs CURVE)
    first_key: str | None = None   # stage 0's host name in keys_dir/peers/ (or a .key file, or z85)
    curve: str = "auto"            # auto or on: both CURVE on every socket, loopback included (keys.curve_on)
    epoch: int | None = None       # stamped on every forward (None: none, never refused as stale)
    depth: int | None = None       # micro-batches worth keeping in flight (the plan's; None: one per stage)

    def __post_init__(self):
        wire.endpoint(self.first, "first stage endpoint")
        self._own_ctx = self.ctx is None
        if self._own_ctx:
            self.ctx = zmq.Context()
        self.auth = None
        self.to_first = self.results = None
        to_curve = keymod.curve_on(self.curve, self.first)
        res_curve = keymod.curve_on(self.curve, f"tcp://{self.reply_host}:0")
        self.keys = None
        if to_curve or res_curve:
            why = "every pipeline socket runs CURVE, loopback included"
            self.keys = keymod.load_host_keys(self.keys_dir, "--keys", why, hint=keymod.PIPELINE_HINT)
        try:
            self.to_first = self.ctx.socket(zmq.DEALER)
            self.to_first.setsockopt(zmq.LINGER, 0)
            if to_curve:
                keymod.connect_curve(self.to_first, self.keys, self.keys.server_key(self.first_key, "--first-key"))
            self.to_first.connect(self.first)
            if res_curve:  # the ZAP handler before the CURVE server binds
                self.auth = keymod.Allowlist(self.ctx, self.keys.allowed)
            self.results = self.ctx.socket(zmq.ROUTER)
            self.results.setsockopt(zmq.LINGER, 0)
            if res_curve:
                keymod.serve_curve(self.results, self.keys)
            port = self.results.bind_to_random_port(f"tcp://{self.reply_host}")
        except zmq.ZMQError as e:
            self.close()
            raise DriveError(f"--reply-host {self.reply_host}: cannot open the result socket there ({e}); give an "
                             "IP address of this machine the last stage can reach (layerline_driver_addr)") from None
        except BaseException:
            self.close()
            raise
        self.reply_to = f"tcp://{self.reply_host}:{port}"
        self.curve_sockets = (to_curve, res_curve)  # (to stage 0, result socket)
        self._pending: dict[str, float] = {}  # request id -> send time
        self._ready: list[Answer] = []        # answers read but not yet handed out
        self.poller = zmq.Poller()
        self.poller.register(self.to_first, zmq.POLLIN)
        self.poller.register(self.results, zmq.POLLIN)

    def close(self) -> None:
        for s in (self.to_first, self.results):
            if s is not None:
                s.close(0)
        self.to_first = self.results = None
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if self._own_ctx and self.ctx is not None:
            self.ctx.term()
            self.ctx = None

    def forget(self, rids) -> None:
        """Stop waiting for these requests (their caller gave up on them)."""
        for rid in rids:
            self._pending.pop(rid, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _send(self, head: dict, input_ids: torch.Tensor) -> str:
        rid = wire.new_id("r")   # unguessable, as sequence ids are
        # inflight: stages that share a machine's cores split them among the messages out (planner.message_threads)
        head.update(op="forward", id=rid, reply_to=self.reply_to, deadline=time.time() + self.timeout_s, timings=[],
                    inflight=min(len(self._pending) + 1, wire.MAX_INFLIGHT))
        if self.epoch is not None:
            head["epoch"] = self.epoch
        self._pending[rid] = time.perf_counter()
        self.to_first.send_multipart(wire.encode(head, {"input_ids": input_ids.to(torch.int64)}), copy=False)
        return rid

    def submit(self, input_ids: torch.Tensor, seq: str | None = None, pos: int = 0, cache: bool = False,
               last_only: bool = False, reserve: int | None = None, fork: tuple[str, int] | None = None,
               pick: bool = False) -> str:
        """Send one pass of [batch, tokens] ids into stage 0 without waiting; returns its request id.
        fork: (prefix entry, N): the sequence starts with a copy of the entry's first N tokens (pos N).
        pick: the last stage answers each row's greedy token (StepResult.argmax), not its logits."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        head = {"pos": pos, "cache": cache}
        if seq is not None:
            head["seq"] = seq
        if pick or last_only:
            head["logits"] = "argmax" if pick else "last"
        if reserve is not None:  # tokens this sequence may reach: each stage sizes its KV cache to it
            head["reserve"] = int(reserve)
        if fork is not None:
            head["fork"] = {"from": fork[0], "len": int(fork[1])}
        return self._send(head, input_ids)

    def submit_rows(self, rows: list[tuple[str, int]], input_ids: torch.Tensor, pick: bool = False,
                    more: int = 0) -> str:
        """One step of B sequences, one token each, in one message: rows [(seq, pos), ...], ids [B].

        Each row's sequence must already hold at least pos tokens at every stage (one holding more
        is rewound to pos); the logits come back [B, 1, vocab] (pick: each row's greedy token instead).
        more (with pick, up to wire.AHEAD): a stage holding the whole model may answer the picks of
        up to this many steps it computed ahead as well (StepResult.then); the sequences then hold
        those tokens too. A stage that lost some of them answers seq_unknown with their ids
        (DriveError.seqs) and applies nothing."""
        head = {"cache": True, "logits": "argmax" if pick else "last", "rows": [[str(q), int(p)] for q, p in rows]}
        if pick and more > 0:
            head["more"] = min(int(more), wire.AHEAD)
        return self._send(head, input_ids.reshape(-1, 1))

    def answers(self, sock) -> list[Answer]:
        """Every message waiting on one of this pipeline's sockets (non-blocking), as answers to
        requests in flight; late, repeated and malformed messages are dropped."""
        out = []
        while True:
            try:
                frames = sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return out
            if sock is self.results:
                frames = frames[1:]  # the sender's identity
            try:
                h, tensors = wire.decode(frames)
            except wire.WireError:
                continue
            rid = h.get("id")
            if rid not in self._pending:
                continue  # a late or repeated answer (a stage's error comes on both sockets)
            bad = version.mismatch(frames[0], f"stage {h.get('stage', '?')}", "this driver")
            if bad:
                self._pending.pop(rid)
                out.append(Answer(rid, None, DriveError(bad, VERSION)))
            elif h["op"] == "error":
                self._pending.pop(rid)
                code = h.get("code") if isinstance(h.get("code"), str) else None
                seqs = h.get("seqs") if isinstance(h.get("seqs"), list) else None
                out.append(Answer(rid, None, DriveError(f"stage {h.get('stage', '?')}: {h.get('error')}", code,
                                                        [q for q in seqs if isinstance(q, str)] if seqs else None)))
            elif h["op"] == "result" and "logits" in tensors:
                wall = time.perf_counter() - self._pending.pop(rid)
                out.append(Answer(rid, StepResult(tensors["logits"].clone(), h.get("timings", []), wall)))
            elif h["op"] == "result" and "argmax" in tensors:
                wall = time.perf_counter() - self._pending.pop(rid)
                ids, finite, then = tensors["argmax"], tensors.get("finite"), tensors.get("then")
                if (ids.dtype != torch.int64 or ids.dim() != 1 or finite is None or finite.dtype != torch.uint8
                        or finite.shape != ids.shape or (then is not None and (
                            then.dtype != torch.int64 or then.dim() != 2 or not 1 <= then.shape[0] <= wire.AHEAD
                            or then.shape[1] != ids.shape[0]))):
                    out.append(Answer(rid, None, DriveError(f"stage {h.get('stage', '?')}: a result's argmax / "
                                                            f"finite / then tensors are malformed", "bad_result")))
                    continue
                out.append(Answer(rid, StepResult(None, h.get("timings", []), wall, ids.clone(), finite.bool(),
                                                  None if then is None else then.clone())))

    def collect(self) -> tuple[str, StepResult | DriveError]:
        """The next answer to any request in flight: a result, or the error a stage sent for it."""
        while True:
            if self._ready:
                a = self._ready.pop(0)
                return a.rid, a.result if a.error is None else a.error
            if not self._pending:
                raise DriveError("collect: no request in flight")
            oldest = min(self._pending.values())
            left = self.timeout_s - (time.perf_counter() - oldest)
            if left <= 0:
                rid = min(self._pending, key=self._pending.get)
                self._pending.pop(rid)
                raise DriveError(f"request {rid}: no result within {self.timeout_s:.0f} s; a stage after "
                                 f"{self.first} is down or slow (check each worker's log and health)")
            for sock, _ in self.poller.poll(min(left, 1.0) * 1000):
                self._ready += self.answers(sock)

    def forward(self, input_ids: torch.Tensor, seq: str | None = None, pos: int = 0,
                cache: bool = False, last_only: bool = False) -> StepResult:
        """One pass of [batch, tokens] ids through every stage; logits [batch, tokens, vocab]."""
        rid = self.submit(input_ids, seq, pos, cache, last_only)
        while True:
            got, res = self.collect()
            if got == rid:
                if isinstance(res, DriveError):
                    raise res
                return res

    def release(self, seq: str, keep: tuple[str, int] | None = None) -> None:
        """Every stage frees this sequence's KV cache (or this prefix entry's); keep: (entry, N): its
        first N tokens stay as that prefix entry."""
        head = {"op": "release", "seq": seq}
        if keep is not None:
            head.update(keep=keep[0], len=int(keep[1]))
        self.to_first.send_multipart(wire.encode(head))


def reply_host_for(endpoint: str) -> str:
    """An address of this machine that the endpoint's host can reach (no packets sent)."""
    import socket
    host = endpoint_host(endpoint)
    if is_loopback(host):
        return LOOPBACK
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect only picks the route
            return s.getsockname()[0]
    except OSError:
        return LOOPBACK


def active_stages(plan) -> list:
    """The plan's active stages in pipeline order (a plan dict or a typed Plan)."""
    stages = plan["stages"] if isinstance(plan, dict) else plan.stages
    role = (lambda s: s["role"]) if isinstance(plan, dict) else (lambda s: s.role)
    out = [s for s in stages if role(s) == "active"]
    if not out:
        raise DriveError("plan: no active stage to drive; plan first (playbooks/plan.yml or `layerline plan`)")
    return out


def pipeline_for_plan(plan, *, keys_dir: str | None = None, reply_host: str | None = None, curve: str = "auto",
                      timeout_s: float = 120.0, ctx: zmq.Context | None = None) -> Pipeline:
    """The Pipeline into a planned, running set of workers: stage 0's endpoint, its key name, a reply address.

    keys_dir: the controller's keys dir (required: every socket runs CURVE).
    reply_host: an address of this machine the last stage can reach (default: the route to it).
    """
    stages = active_stages(plan)
    get = (lambda s, k: s[k]) if isinstance(plan, dict) else getattr
    first, last = stages[0], stages[-1]
    endpoint = str(get(first, "endpoint"))
    return Pipeline(endpoint, reply_host=reply_host or reply_host_for(str(get(last, "endpoint"))),
                    timeout_s=timeout_s, ctx=ctx, keys_dir=keys_dir, first_key=str(get(first, "host")), curve=curve,
                    depth=pipeline_depth(stages))


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
REFUSED = "refused"   # DriveError.code of a control request to a port nothing listens on: the process is gone
VERSION = "version"   # DriveError.code of an answer from a peer on other code (layerline.version)


def _accepts(endpoint: str, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to tcp://HOST:PORT is accepted (a listening port; a busy process's too)."""
    rest = endpoint.split("://", 1)[-1]
    port = int(rest.rsplit(":", 1)[1])
    try:
        with socket.create_connection((endpoint_host(endpoint), port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:   # unreachable or slow: not known to be gone
        return True


def _control_keys(endpoint: str, keys_dir: str | None, peer: str | None, curve: str):
    """(the controller's keys, the worker's public key) for a control request to `endpoint`."""
    wire.endpoint(endpoint, "control endpoint")
    if curve not in keymod.CURVE_MODES:
        keymod.curve_on(curve, endpoint)  # raises the one-line error
    why = f"control endpoint {endpoint} runs CURVE always (only the controller may stop or redirect a worker)"
    hk = keymod.load_host_keys(keys_dir, "--keys", why,
                               hint="pass the controller's keys dir (LAYERLINE_HOME/keys/controller; "
                                    "`layerline drive --keys DIR`), made by playbooks/keys.yml")
    if not peer:
        raise keymod.KeysError(f"control {endpoint}: name the worker's host (its public key is "
                               f"{os.path.join(hk.dir, 'peers', 'HOST.key')})")
    return hk, hk.server_key(peer, "peer")


def _control_socket(ctx: zmq.Context, hk, server: bytes, endpoint: str):
    """A DEALER connecting to a control socket over CURVE, and its monitor (refused, handshake failed)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    keymod.connect_curve(s, hk, server)
    mon = s.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_CONNECT_RETRIED)
    s.connect(endpoint)
    return s, mon


def _close_control(s, mon) -> None:
    s.disable_monitor()
    mon.close(0)
    s.close(0)


def _exchange(s, mon, endpoint: str, hk, peer: str, header: dict, timeout_s: float) -> dict:
    """Send one control request on `s` and wait for its answer (the one whose id is header's, where it
    has one), or for the monitor to say the worker is gone or refused the handshake."""
    op = header["op"]
    s.send_multipart(wire.encode(header))
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    poller.register(mon, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        ready = dict(poller.poll(max(0.0, left) * 1000)) if left > 0 else {}
        if s in ready:
            frames = s.recv_multipart(copy=False)
            h, _ = wire.decode(frames)
            if "id" in header and h.get("id") != header["id"]:
                continue   # the answer to an earlier request of a kept connection: not this one's
            break
        if mon in ready:
            ev = recv_monitor_message(mon)["event"]
            if ev & _HANDSHAKE_FAILED and not _accepts(endpoint):
                # a process killed mid-handshake also fails it: its port, refused now, tells it apart
                raise DriveError(f"control {endpoint}: nothing listens there any more (the connection closed "
                                 "during the CURVE handshake and is refused now): the worker's process is gone",
                                 REFUSED)
            if ev & _HANDSHAKE_FAILED:
                raise DriveError(f"control {endpoint}: the worker refused the CURVE handshake (its "
                                 f"allowed/controller.key is not {hk.dir}/self.key, or {peer!r} is not that "
                                 "worker's key); use the controller's keys dir from playbooks/keys.yml")
            if ev == zmq.EVENT_CONNECT_RETRIED:   # a connect failed (refused): nothing listens there
                raise DriveError(f"control {endpoint}: nothing listens there (connection refused): the "
                                 f"worker's process is gone", REFUSED)
            continue
        if left <= 0:
            raise DriveError(f"control {endpoint}: no answer to {op} within {timeout_s:.0f} s")
    bad = version.mismatch(frames[0], f"the worker at {endpoint} ({peer})", "the controller")
    if bad:
        raise DriveError(f"control {endpoint}: {bad}", VERSION)
    if h["op"] == "error":
        raise DriveError(f"control {endpoint}: {h.get('error')}")
    return h


def control(endpoint: str, op: str, timeout_s: float = 5.0, ctx: zmq.Context | None = None, *,
            keys_dir: str | None = None, peer: str | None = None, curve: str = "auto", **fields) -> dict:
    """One request to a worker's control socket (health, stats, set_next, shutdown).

    A control socket runs CURVE always, loopback included, and lets in only the controller's
    key: this speaks as the holder of keys_dir's keypair (the controller's keys dir) to the
    worker whose host name `peer` is (keys_dir/peers/PEER.key; or a .key file, or the z85 key).
    `curve` is accepted for symmetry with Pipeline; control is CURVE whatever it says.
    A refused handshake (a key the worker does not let in, or the wrong peer) is a DriveError
    that says so, not a timeout; so is a refused connection (nothing listens there: the worker's
    process is gone), with code REFUSED, at once: a busy worker's port still accepts, so only a
    dead one is told apart this fast (the health monitor fails it over without waiting for misses).
    """
    hk, server = _control_keys(endpoint, keys_dir, peer, curve)
    s, mon = _control_socket(ctx or zmq.Context.instance(), hk, server, endpoint)
    try:
        return _exchange(s, mon, endpoint, hk, peer, {"op": op, **fields}, timeout_s)
    finally:
        _close_control(s, mon)


class ControlChannel:
    """A kept connection to one worker's control socket, for a caller that asks it again and again:
    the server's health probe asks each stage every 0.5 s, and a connection a request cost a TCP
    connect, a CURVE handshake and the worker's ZAP check each time (most of an idle deployment's
    CPU). Answers and errors are control()'s. After any error the connection is dropped, so an answer
    that came too late is never taken for a later request's (each request carries an id too), and the
    next call makes a new one with the keys read again (a host whose keys changed). One thread's: zmq
    sockets are not thread-safe."""

    def __init__(self, endpoint: str, *, keys_dir: str | None, peer: str | None, curve: str = "auto",
                 ctx: zmq.Context | None = None):
        self.endpoint, self.keys_dir, self.peer, self.curve = endpoint, keys_dir, peer, curve
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.mon = self.hk = None
        self.n = 0

    def call(self, op: str, timeout_s: float, **fields) -> dict:
        if self.sock is None:
            self.hk, server = _control_keys(self.endpoint, self.keys_dir, self.peer, self.curve)
            self.sock, self.mon = _control_socket(self.ctx, self.hk, server, self.endpoint)
        else:
            # what the monitor saw between two calls (a retry of a worker since restarted) says nothing of now:
            # a worker gone now is refused again within the reconnect interval, while this call waits
            while self.mon.poll(0):
                self.mon.recv_multipart()
        self.n += 1
        try:
            return _exchange(self.sock, self.mon, self.endpoint, self.hk, self.peer,
                             {"op": op, **fields, "id": str(self.n)}, timeout_s)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.sock is not None:
            _close_control(self.sock, self.mon)
            self.sock = self.mon = None
