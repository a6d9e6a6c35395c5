"""The stage process: holds a layer range, takes activations in, sends activations on.

    python -m layerline.worker --checkpoint DIR --layers A:B --device D --precision P
        --kv-context N --kv-dtype T --rng-seed S --bind ADDR --next ADDR [--first] [--last]
        --keys DIR [--next-key HOST] [--curve auto|on] [--name HOST] [--ready-file PATH]
        [--control ADDR] [--threads N] [--spin N] [--awake-ms MS] [--compile off|default|max-autotune]
        [--compile-cache DIR]
    python -m layerline.worker --probe [--checkpoint DIR] [--device D]

Two ROUTER sockets: data at --bind (pipeline traffic, an error reply to a bad message) and
control at --control (default: the bind port + 1; health, stats, set_next, shutdown), so
routing can change without a restart. Every message is validated; any failure becomes an
error message, never a dead worker.

Data messages (op forward; tensor `input_ids` [B, T] int64 at the first stage, `hidden`
[B, T, hidden] after it; the last stage sends op result with `logits` to `reply_to`):
- no cache: pos 0 (or none), the whole input at once;
- one sequence: `cache: true`, `seq`, `pos` (where the T new tokens start: 0 starts it anew),
  `reserve` (tokens to size its cache for), T tokens, B rows of that one sequence;
- rows of different sequences (continuous batching): `cache: true`, `rows: [[seq, pos], ...]`
  (no top-level seq or pos), one new token per row ([B, 1] ids / [B, 1, hidden], B = len(rows)),
  row i at position pos of its own sequence (prefilled by one-sequence messages with batch 1);
  `logits: "last"` gives [B, 1, vocab].
A cached sequence must hold at least pos tokens here; one that holds more is rewound to pos and
written from there (writes are idempotent by position: a driver resends from what every stage
confirmed after a failover, and the stages that kept their caches go on). Every row is checked
before any is computed: rows whose sequence this stage lacks or holds fewer than pos tokens of
fail the whole message with code "seq_unknown" and `seqs` (those ids) in the error header, so the
sender replays just them from 0 and resends.
`epoch` (optional, an integer >= 0): the driver's wire epoch, passed on to the next stage. A
forward of an older epoch than the last one that wrote any of its sequences here is dropped
unanswered (its driver forgot it; computing it could rewind what the newer one wrote), counted in
`stats` as stale_dropped. Forwards without an epoch are never dropped.
`op: release, seq` frees a sequence's KV cache here and on every later stage. A stage keeps at
most MAX_SEQS sequences within its --kv-bytes budget, the least recently used going first.

CURVE (layerline.keys), with this host's keys from --keys DIR (required): the control socket
runs it always, loopback included, and lets in only the controller's key (DIR/allowed/
controller.key), so no other process can stop, redirect or even probe a worker. Every other
socket runs it when its address is not loopback (--curve auto), or always (--curve on); the
data socket lets in only clients whose public key is in DIR/allowed/; the DEALER
to --next trusts only the key DIR/peers/NEXT.key (--next-key NEXT: a host name, a .key file
or the z85 key); results go to a driver's reply_to only as the holder of
DIR/peers/controller.key, never to a key a message names.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import json
import os
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

IDLE_CAP_S = 0.05  # the longest idle measure_step waits before a timed step


def openmp_env(argv: list[str]) -> None:
    """Put the plan's OpenMP spin (--spin N, GOMP_SPINCOUNT) in the environment, else a short
    one: idle stages that share a machine's cores must sleep, not spin on cores a busy one needs.
    libgomp reads the variable once, when `import torch` loads it, so `python -m layerline.worker`
    calls this before its first torch import (below); set later, it has no effect. Only a
    well-formed value is taken here; parse_args rejects the others."""
    spin = None
    for i, a in enumerate(argv):
        if a == "--spin" and i + 1 < len(argv):
            spin = argv[i + 1]
        elif a.startswith("--spin="):
            spin = a.split("=", 1)[1]
    if spin is not None and spin.isdigit():
        os.environ["GOMP_SPINCOUNT"] = spin
    else:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


if __name__ == "__main__":
    openmp_env(sys.argv[1:])

from . import awake, timing_lock  # noqa: E402
from .errors import LayerlineError  # noqa: E402 - after openmp_env: .wire imports torch
from .model import COMPILE_MODES, cpu_kernels  # noqa: E402
from .wire import MAX_BATCH, MAX_REPLY_PEERS, MAX_SEQS  # noqa: E402


class SeqUnknown(LayerlineError):
    """Sequences this stage lacks (or holds fewer tokens of than asked): the sender replays them.
    The error reply carries code "seq_unknown" and their ids in `seqs`."""

    def __init__(self, message: str, seqs: list[str]):
        super().__init__(message, "seq_unknown")
        self.header = {"seqs": list(seqs)}


class Stale(Exception):
    """A forward of an older wire epoch than the last one that wrote one of its sequences here:
    dropped without an answer (its driver forgot the request)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m layerline.worker", description=__doc__.split("\n")[0])
    p.add_argument("--probe", action="store_true", help="print this host's NodeCaps as JSON and exit")
    p.add_argument("--checkpoint")
    p.add_argument("--layers", help="A:B, half-open")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--kv-context", type=int, default=4096)
    p.add_argument("--kv-dtype", default=None)
    p.add_argument("--rng-seed", type=int, default=0)
    p.add_argument("--bind")
    p.add_argument("--next", default=None)
    p.add_argument("--first", action="store_true")
    p.add_argument("--last", action="store_true")
    p.add_argument("--keys", default=None,
                   help="dir with this host's CURVE keys (required: the control socket always runs CURVE)")
    p.add_argument("--next-key", default=None,
                   help="the next stage's public key: its host name in KEYS/peers/, a .key file or z85 text")
    p.add_argument("--curve", default="auto", choices=["auto", "on"],
                   help="auto: CURVE on every socket whose address is not loopback; on: on every socket")
    p.add_argument("--name", default=None, help="name reported in timings and errors")
    p.add_argument("--ready-file", default=None)
    p.add_argument("--control", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (the plan's stage threads)")
    p.add_argument("--spin", type=int, default=None,
                   help="OpenMP spin count before an idle thread sleeps (GOMP_SPINCOUNT); low when stages "
                        "share a machine's cores")
    p.add_argument("--awake-ms", type=int, default=None,
                   help="after each message, keep this worker's CPUs from idling this long with idle-priority "
                        "spinners (layerline.awake; 0: off; default 50)")
    p.add_argument("--time-alone", default=None, metavar="LOCK",
                   help="this stage shares the machine's cores with other stages: load and compile holding "
                        "the lock LOCK shared, time the step holding it alone (layerline.timing_lock; a bare "
                        "file name is in /dev/shm; the plan names one per deployment)")
    p.add_argument("--nice", type=int, default=None,
                   help="yield the CPU to the machine's other work: nice value 1-19 for this worker and its "
                        "session's scheduling group (layerline_nice)")
    p.add_argument("--compile", default="off", choices=COMPILE_MODES,
                   help="torch.compile the decode step (warm-up before ready: about half a minute for "
                        "default, minutes for max-autotune; cached under --compile-cache)")
    p.add_argument("--compile-cache", default=None, help="inductor's cache dir (TORCHINDUCTOR_CACHE_DIR)")
    p.add_argument("--kv-bytes", type=int, default=None,
                   help="KV bytes this stage may hold across sequences (the plan's kv_bytes)")
    p.add_argument("--expert-cache-bytes", type=int, default=None,
                   help="page routed experts from disk through an LRU cache of this many bytes")
    a = p.parse_args(argv)
    if a.probe:
        return a
    missing = [f"--{k}" for k in ("checkpoint", "layers", "bind") if not getattr(a, k)]
    if missing:
        p.error(f"missing {', '.join(missing)}")
    if not a.last and not a.next:
        p.error("--next is required unless --last")
    try:
        s, e = (int(x) for x in a.layers.split(":"))
        assert 0 <= s < e
    except (ValueError, AssertionError):
        p.error(f"--layers {a.layers!r}: must be A:B with 0 <= A < B")
    a.start, a.end = s, e
    if a.kv_context < 1:
        p.error("--kv-context must be positive")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be at least 1")
    if a.spin is not None and a.spin < 0:
        p.error("--spin must not be negative")
    if a.awake_ms is not None and not 0 <= a.awake_ms <= 1000:
        p.error("--awake-ms must be 0-1000")
    if a.time_alone is not None and not a.time_alone.strip("/"):
        p.error("--time-alone needs a lock file name or path")
    if a.nice is not None and not 0 <= a.nice <= 19:
        p.error("--nice must be 0-19 (a worker may only lower its priority)")
    for flag in ("kv_bytes", "expert_cache_bytes"):
        if getattr(a, flag) is not None and getattr(a, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must not be negative")
    from .wire import WireError, endpoint
    try:
        endpoint(a.bind.replace("tcp://*:", "tcp://0.0.0.0:"), "--bind")
        if a.next:
            endpoint(a.next, "--next")
        if a.control:
            endpoint(a.control, "--control")
    except WireError as e:
        p.error(str(e))
    return a


def control_endpoint(bind: str) -> str:
    host, port = bind.rsplit(":", 1)
    return f"{host}:{int(port) + 1}"


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    requests: int = 0
    errors: int = 0
    rejected: int = 0
    stale_dropped: int = 0
    compute_s: float = 0.0


class Worker:
    def __init__(self, args: argparse.Namespace):
        import torch
        import zmq

        from . import keys, precision, wire
        from .model.loader import load_stage

        self.torch, self.zmq, self.wire, self.keymod = torch, zmq, wire, keys
        self.args = args
        self.name = args.name or f"stage{args.start}-{args.end}"
        # keys first: a host that cannot speak CURVE fails before it loads any layer. The control
        # socket runs CURVE always (loopback included) and lets in only the controller's key, so
        # every worker needs --keys; the data socket runs it off loopback (or with --curve on).
        control_addr = args.control or control_endpoint(args.bind)
        self.curve_bind = keys.curve_on(args.curve, args.bind)
        self.curve_control = True
        if args.curve == "on":
            why = "--curve on"
        elif self.curve_bind:
            why = f"--bind {args.bind} is not loopback, so CURVE is on for it"
        else:
            why = (f"the control socket {control_addr} runs CURVE always (only the controller's key may stop or "
                   "redirect a worker)")
        self.keys = keys.load_host_keys(args.keys, "--keys", why, hint=keys.LOCAL_HINT)
        if self.keys.controller is None:
            raise keys.KeysError(f"--keys {args.keys}: has no allowed/{keys.CONTROLLER}.key, the one key the control "
                                 "socket lets in; re-run playbooks/keys.yml (or `python -m layerline.keys local`)")
        if args.next and keys.curve_on(args.curve, args.next):
            self.keys.server_key(args.next_key, "--next-key")
        if args.threads:
            torch.set_num_threads(args.threads)
        torch.manual_seed(args.rng_seed)
        with self._timing_lock(exclusive=False):  # no co-located stage times its step meanwhile
            self.stage = load_stage(args.checkpoint, args.start, args.end, args.first, args.last,
                                    precision=args.precision, device=args.device,
                                    expert_cache_bytes=args.expert_cache_bytes)
        self.margs = self.stage.args
        self.compile_s = None
        # KV: the plan's dtype (else the precision table's rule) and budget (bytes this stage may
        # hold across sequences)
        kv = precision.kv_name(args.precision, args.kv_dtype)
        self.kv_dtype = precision.torch_dtype(kv)
        self.kv_bytes_per_token = (2 * self.margs.num_kv_heads * self.margs.head_dim * precision.kv_bytes(kv)
                                   * (args.end - args.start))
        self.kv_budget = args.kv_bytes if args.kv_bytes else args.kv_context * self.kv_bytes_per_token
        # seq -> its StageCache (which keeps the sequence's length and batch), least recently used first
        self.caches: OrderedDict[str, object] = OrderedDict()
        self.stats = Stats()
        self.ctx = zmq.Context()
        # the ZAP handler must run before a CURVE server binds: without one, any key gets in
        self.auth = keys.Allowlist(self.ctx, self.keys.allowed, on_deny=self._denied, control=self.keys.controller)
        self.data = self._bound(zmq.ROUTER, args.bind, self.curve_bind)
        self.control = self._bound(zmq.ROUTER, control_addr, True, control=True)
        self.next = None
        self.next_addr = None
        self.next_key = None
        if args.next:
            self.set_next(args.next, args.next_key)
        self.peers: OrderedDict[str, object] = OrderedDict()
        self.running = True
        # spinners as many as the threads a step runs on; they spin only after a message
        ms = awake.WINDOW_S * 1000 if args.awake_ms is None else args.awake_ms
        self.awake = awake.Awake(torch.get_num_threads(), ms / 1000)
        if args.compile != "off":
            with self._timing_lock(exclusive=False):
                self.warm_up(args.compile)
        with self._timing_lock(exclusive=True) as alone:
            if alone is False:
                print(f"layerline worker {self.name}: timing the decode step without --time-alone's lock "
                      f"{timing_lock.lock_path(self.args.time_alone)} (another stage kept it over "
                      f"{timing_lock.WAIT_S:.0f} s, or it cannot be opened): the time may include that "
                      "stage's work", file=sys.stderr, flush=True)
            # LAYERLINE_STEP_TIMING=off (the process tests, which start hundreds of workers): no warm-up
            # timing; step_s is null as when a stage cannot time itself, so no step factor is kept
            self.step_s = None if os.environ.get("LAYERLINE_STEP_TIMING") == "off" else self.measure_step()

    def _timing_lock(self, exclusive: bool):
        """--time-alone's lock (timing_lock.held), or nothing (None) without it."""
        if self.args.time_alone is None:
            return contextlib.nullcontext()
        return timing_lock.held(exclusive, timing_lock.lock_path(self.args.time_alone))

    def warm_up(self, mode: str) -> None:
        """Compile the decode step before serving, so no request waits minutes for it: one graph per
        ROWS_BUCKETS (a sequence's rows, or rows of several sequences: the engine's micro-batches);
        attention runs outside the graphs, so any cache length reuses them."""
        self.stage.compile(mode)
        if not self.stage.compiled:
            print(f"layerline worker {self.name}: --compile {mode}: MoE stages decode eagerly "
                  "(expert routing is data-dependent)", flush=True)
            return
        print(f"layerline worker {self.name}: compiling the decode step (--compile {mode}); "
              "this takes a while the first time", flush=True)
        from .model.llama import ROWS_BUCKETS
        t0 = time.perf_counter()
        caches = [self.stage.new_cache(1, 8, dtype=self.kv_dtype) for _ in range(ROWS_BUCKETS[-1])]
        for b in ROWS_BUCKETS:
            self.stage.forward_rows(self._zeros_input(b, 1), [0] * b, caches[:b])
            if not self.stage.compiled:
                print(f"layerline worker {self.name}: --compile {mode} failed, decoding eagerly: "
                      f"{self.stage.compile_error} (install a C++ compiler on this host, or set "
                      "layerline_compile: off)", file=sys.stderr, flush=True)
                return
            print(f"layerline worker {self.name}: steps of {b} row{'s' if b > 1 else ''} compiled "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        self.compile_s = time.perf_counter() - t0

    def _zeros_input(self, b: int, t: int):
        """A stand-in input of b rows of t tokens for this stage (ids, or hidden states), on its device."""
        shape = (b, t) if self.args.first else (b, t, self.margs.hidden_size)
        return self.torch.zeros(shape, dtype=self.torch.int64 if self.args.first else self.stage.dtype,
                                device=self.args.device)

    def measure_step(self, prefix: int = 32, budget_s: float = 1.0, steps: int = 12) -> float | None:
        """Seconds of one decode step of one sequence, as serving runs it (compiled when compiled),
        after a `prefix`-token prompt: what the plan's predicted_s predicts. Reported in the ready
        file and `stats`; the launch keeps measured / predicted in the probe cache per precision
        and compile mode (cost.step_factor) for the next plan. The median of up to `steps` steps
        within about `budget_s` (the first warms caches and is left out): the planner predicts
        what serving will see, and on a shared machine the fastest step says too little.

        Each timed step follows an idle wait as long as the model's other layers take at this
        stage's speed (at most IDLE_CAP_S), as a pipeline stage waits for its input: on the VMs
        measured, a step after 8 ms idle took 1.3-1.7x one run back to back (int8 3.1 -> 5.2 ms),
        and back-to-back timing predicted pipelined int8 stages 28-43% fast."""
        torch = self.torch
        try:
            cache = self.stage.new_cache(1, prefix + 1, dtype=self.kv_dtype)
            self.stage(self._zeros_input(1, prefix), start_pos=0, cache=cache)
            x = self._zeros_input(1, 1)
            own = max(1, self.args.end - self.args.start)
            rest = max(0, self.margs.num_layers - own) / own
            times, deadline, idle = [], time.perf_counter() + budget_s, 0.0
            for i in range(steps):
                if idle:
                    self.awake.poke()  # as serving keeps the CPUs between messages
                    time.sleep(idle)
                t0 = time.perf_counter()
                self.stage(x, start_pos=prefix, cache=cache)  # the same position again: its KV is overwritten
                if self.args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                idle = min(IDLE_CAP_S, times[-1] * rest)
                if i >= 4 and time.perf_counter() > deadline:
                    break
            return sorted(times[1:])[len(times[1:]) // 2]
        except Exception as e:  # noqa: BLE001 - a worker that cannot time itself still serves
            print(f"layerline worker {self.name}: could not time a decode step: {e}", file=sys.stderr, flush=True)
            return None

    def _denied(self, public: str, domain: str = "") -> None:
        if domain == self.keymod.CONTROL_DOMAIN:
            where = f"the controller's ({os.path.join(self.keys.dir, 'allowed', self.keymod.CONTROLLER + '.key')})"
            print(f"layerline worker {self.name}: refused a control client whose key {public} is not {where}",
                  file=sys.stderr, flush=True)
            return
        print(f"layerline worker {self.name}: refused a CURVE client whose key {public} is not in "
              f"{os.path.join(self.keys.dir, 'allowed')}", file=sys.stderr, flush=True)

    def _client_keys(self, field: str):
        """This host's keys for a CURVE client socket (loaded on first use when only a client needs them)."""
        if self.keys is None:
            self.keys = self.keymod.load_host_keys(self.args.keys, "--keys",
                                                   f"{field} is not loopback, so CURVE is on for it")
        return self.keys

    def _bound(self, kind, addr, curve: bool, control: bool = False):
        s = self.ctx.socket(kind)
        s.setsockopt(self.zmq.LINGER, 1000)
        s.setsockopt(self.zmq.ROUTER_HANDOVER, 1)
        # no frame a sender may send is larger than a tensor chunk (or, on control, a header), plus
        # room for CURVE's per-frame box: zmq drops a peer that announces more before it allocates
        # a byte, so a lying sender cannot make this process hold gigabytes
        limit = self.wire.MAX_HEADER_BYTES if control else self.wire.MAX_FRAME_BYTES
        s.setsockopt(self.zmq.MAXMSGSIZE, limit + 4096)
        if control:
            self.keymod.serve_control(s, self.keys)
        elif curve:
            self.keymod.serve_curve(s, self.keys)
        try:
            s.bind(addr)
        except self.zmq.ZMQError as e:
            raise LayerlineError(f"{self.name}: cannot bind {addr} ({e}); is another worker on this port? "
                                 "set layerline_port") from None
        return s

    def set_next(self, addr: str, key: str | None = None, names_only: bool = False) -> None:
        """Point the DEALER to the next stage at `addr`; with CURVE, `key` names its host (peers/)."""
        addr = self.wire.endpoint(addr, "next")
        server = None
        if self.keymod.curve_on(self.args.curve, addr):
            server = self._client_keys("next").server_key(key, "next_key" if names_only else "--next-key",
                                                          names_only=names_only)
        s = self.ctx.socket(self.zmq.DEALER)
        s.setsockopt(self.zmq.LINGER, 1000)
        try:
            if server is not None:
                self.keymod.connect_curve(s, self.keys, server)
            s.connect(addr)
        except self.zmq.ZMQError as e:  # keep the old route
            s.close(linger=0)
            raise self.wire.WireError(f"next: cannot connect to {addr} ({e})") from None
        if self.next is not None:
            self.next.close(linger=1000)
        # the next hop's host name is reported (health) even without CURVE on this link: the
        # server follows it to find each stage's key for the control socket
        self.next, self.next_addr, self.next_key = s, addr, key

    def _peer(self, addr: str):
        """A DEALER to a driver's result socket (reply_to), kept for reuse. Under CURVE it only
        talks to the controller's key (peers/controller.key): whoever else listens at reply_to
        completes no handshake and reads nothing."""
        addr = self.wire.endpoint(addr, "header.reply_to")
        s = self.peers.pop(addr, None)
        if s is None:
            server = None
            if self.keymod.curve_on(self.args.curve, addr):
                server = self._client_keys("header.reply_to").server_key(self.keymod.CONTROLLER, "header.reply_to",
                                                                         names_only=True)
            s = self.ctx.socket(self.zmq.DEALER)
            s.setsockopt(self.zmq.LINGER, 1000)
            try:
                if server is not None:
                    self.keymod.connect_curve(s, self.keys, server)
                s.connect(addr)
            except self.zmq.ZMQError as e:  # close it, or every such request leaks a socket
                s.close(linger=0)
                raise self.wire.WireError(f"header.reply_to: cannot connect to {addr} ({e})") from None
            while len(self.peers) >= MAX_REPLY_PEERS:
                self.peers.popitem(last=False)[1].close(linger=0)
        self.peers[addr] = s
        return s

    def write_ready(self) -> None:
        if not self.args.ready_file:
            return
        info = {"pid": os.getpid(), "name": self.name, "bind": self.args.bind,
                "control": self.args.control or control_endpoint(self.args.bind),
                "layers": [self.args.start, self.args.end], "precision": self.args.precision,
                "device": self.args.device, "curve": self.curve_bind, "compile": self.args.compile,
                "compiled": self.stage.compiled, "compile_s": self.compile_s,
                "compile_error": self.stage.compile_error, "kernels": cpu_kernels.status(),
                "step_s": self.step_s, "time": time.time()}
        tmp = self.args.ready_file + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(tmp)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, self.args.ready_file)

    # --- data path ---------------------------------------------------------------------------

    def _validate_input(self, h: dict, tensors: dict):
        wire, torch = self.wire, self.torch
        key = "input_ids" if self.args.first else "hidden"
        if set(tensors) != {key}:
            raise wire.WireError(f"tensors: stage {self.name} takes exactly one tensor named {key!r}")
        x = tensors[key]
        if self.args.first:
            if x.dtype != torch.int64 or x.dim() != 2:
                raise wire.WireError("input_ids: must be int64 of shape [batch, tokens]")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.margs.vocab_size):
                raise wire.WireError(f"input_ids: token ids must be in [0, {self.margs.vocab_size})")
        else:
            if x.dim() != 3 or x.shape[2] != self.margs.hidden_size or not x.dtype.is_floating_point:
                raise wire.WireError(f"hidden: must be float of shape [batch, tokens, {self.margs.hidden_size}]")
        b, t = x.shape[0], x.shape[1]
        if not 1 <= b <= MAX_BATCH or not 1 <= t <= self.args.kv_context:
            raise wire.WireError(f"shape: batch must be 1..{MAX_BATCH} and tokens 1..{self.args.kv_context}")
        return x

    def _timings(self, h: dict) -> list:
        t = h.get("timings", [])
        ok = isinstance(t, list) and len(t) <= 64 and all(
            isinstance(e, dict) and isinstance(e.get("stage"), str) and len(e["stage"]) <= 64
            and isinstance(e.get("s"), (int, float)) and not isinstance(e.get("s"), bool)
            and isinstance(e.get("layers"), list) and len(e["layers"]) == 2
            and all(type(v) is int for v in e["layers"]) for e in t)
        if not ok:
            raise self.wire.WireError("header.timings: must be a list of at most 64 {stage, layers: [A, B], s}")
        return [{"stage": e["stage"], "layers": e["layers"], "s": float(e["s"])} for e in t]

    def _kv_held(self) -> int:
        return sum(c.nbytes for c in self.caches.values())

    def _new_cache(self, seq: str, batch: int, reserve: int):
        """A cache for `reserve` tokens, within the stage's KV budget (oldest sequences go first)."""
        need = batch * reserve * self.kv_bytes_per_token
        if need > self.kv_budget:
            raise LayerlineError(f"stage {self.name}: seq {seq} needs {need} KV bytes ({batch} x {reserve} tokens) "
                                 f"but the stage's KV budget is {self.kv_budget}; shorten it or raise the plan's "
                                 "layerline_objective.context / batch")
        while self.caches and (len(self.caches) >= MAX_SEQS or self._kv_held() + need > self.kv_budget):
            self.caches.popitem(last=False)  # evicted sequences are replayed by the driver
        cache = self.stage.new_cache(batch, reserve, dtype=self.kv_dtype)
        self.caches[seq] = cache
        return cache

    def _checked(self, h: dict) -> tuple[list, bool, int | None]:
        """The fields every forward has: (timings so far, whether only the last logits are asked, its
        wire epoch)."""
        wire = self.wire
        epoch = wire.epoch(h)
        deadline = h.get("deadline")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not math.isfinite(deadline)):
            raise wire.WireError("header.deadline: must be a finite number of seconds since the epoch")
        if deadline is not None and time.time() > deadline:
            raise LayerlineError(f"stage {self.name}: request {h.get('id')} missed its deadline before compute")
        if "logits" in h and h["logits"] not in ("last", "all"):
            raise wire.WireError("header.logits: must be \"last\" or \"all\"")
        return self._timings(h), h.get("logits") == "last", epoch

    @staticmethod
    def _fresh(epoch: int | None, caches: list) -> None:
        """Raise Stale for a forward of an older epoch than the last one that wrote any of these
        caches (None: a sequence this stage lacks)."""
        if epoch is not None and any(c is not None and c.epoch > epoch for c in caches):
            raise Stale()

    def forward(self, h: dict, tensors: dict) -> tuple[dict, dict]:
        if "rows" in h:
            return self.forward_rows(h, tensors)
        wire = self.wire
        pos = wire.require(h, "pos", int, 0, self.args.kv_context - 1) if "pos" in h else 0
        use_cache = h.get("cache", False)
        if not isinstance(use_cache, bool):
            raise wire.WireError("header.cache: must be true or false")
        timings, last_only, epoch = self._checked(h)
        x = self._validate_input(h, tensors)
        cache = None
        if use_cache:
            seq = wire.require(h, "seq", str)
            reserve = wire.require(h, "reserve", int, 1, self.args.kv_context) if "reserve" in h \
                else self.args.kv_context
            cache = self.caches.get(seq)
            self._fresh(epoch, [cache])
            if pos == 0 or cache is None:
                if pos != 0:
                    raise SeqUnknown(f"stage {self.name}: seq {seq} is unknown at position {pos}; "
                                     "replay its prefix from 0", [seq])
                self.caches.pop(seq, None)
                cache = self._new_cache(seq, x.shape[0], max(reserve, x.shape[1]))
            elif cache.length < pos:
                raise SeqUnknown(f"stage {self.name}: seq {seq} holds {cache.length} tokens, got position {pos}; "
                                 "replay its prefix from 0", [seq])
            elif cache.batch != x.shape[0]:
                raise wire.WireError(f"input: seq {seq} has batch {cache.batch}, this step has {x.shape[0]}")
            if pos + x.shape[1] > cache.max_len:
                raise LayerlineError(f"stage {self.name}: seq {seq} would exceed --kv-context {self.args.kv_context} "
                                     f"(it reserved {cache.max_len} tokens)")
            self.caches.move_to_end(seq)
            if epoch is not None:
                cache.epoch = epoch
        elif pos != 0:
            raise wire.WireError("header.pos: must be 0 without cache")
        elif x.shape[0] * x.shape[1] > self.args.kv_context:
            raise wire.WireError(f"shape: batch x tokens must be at most {self.args.kv_context} without cache")
        t0 = time.perf_counter()
        if self.args.last:
            out = self.stage(x.to(self.args.device), start_pos=pos, cache=cache, last_only=last_only)
        else:
            out = self.stage(x.to(self.args.device), start_pos=pos, cache=cache)
        return self._reply(h, ("id", "seq", "pos", "cache", "reply_to", "deadline", "logits", "reserve", "epoch"),
                           timings, out, t0)

    def forward_rows(self, h: dict, tensors: dict) -> tuple[dict, dict]:
        """One new token for each row's own sequence (header.rows), weights read once for all rows."""
        wire = self.wire
        rows = wire.rows(h, self.args.kv_context - 1)
        extra = [k for k in ("seq", "pos") if k in h]
        if extra:
            raise wire.WireError(f"header.rows: a rows message names its sequences in rows only; drop header."
                                 f"{' and header.'.join(extra)}")
        if h.get("cache") is not True:
            raise wire.WireError("header.cache: must be true with rows (each row steps a cached sequence)")
        if "reserve" in h:
            wire.require(h, "reserve", int, 1, self.args.kv_context)
        timings, _, epoch = self._checked(h)
        x = self._validate_input(h, tensors)
        if x.shape[1] != 1:
            raise wire.WireError(f"header.rows: one new token per row, but the tensor holds {x.shape[1]} per row")
        if x.shape[0] != len(rows):
            raise wire.WireError(f"header.rows: {len(rows)} rows but the tensor's batch is {x.shape[0]}")
        self._fresh(epoch, [self.caches.get(seq) for seq, _ in rows])
        bad = []
        for seq, pos in rows:
            c = self.caches.get(seq)
            if c is None:
                bad.append((seq, "unknown"))
            elif c.length < pos:
                bad.append((seq, f"holds {c.length} tokens, row pos {pos}"))
        if bad:
            raise SeqUnknown(f"stage {self.name}: rows name sequences this stage lacks or holds fewer tokens of: "
                             f"{', '.join(f'{s} ({why})' for s, why in bad)}; replay them from 0 and resend",
                             [s for s, _ in bad])
        caches = []
        for i, (seq, pos) in enumerate(rows):
            c = self.caches[seq]
            if c.batch != 1:
                raise wire.WireError(f"header.rows[{i}]: seq {seq} has batch {c.batch}; a row steps a sequence of "
                                     "batch 1")
            if pos + 1 > c.max_len:
                raise LayerlineError(f"stage {self.name}: seq {seq} would exceed --kv-context {self.args.kv_context} "
                                     f"(it reserved {c.max_len} tokens)")
            caches.append(c)
        for (seq, _), c in zip(rows, caches):
            self.caches.move_to_end(seq)
            if epoch is not None:
                c.epoch = epoch
        t0 = time.perf_counter()
        out = self.stage.forward_rows(x.to(self.args.device), [p for _, p in rows], caches)
        return self._reply(h, ("id", "rows", "cache", "reply_to", "deadline", "logits", "reserve", "epoch"), timings,
                           out, t0)

    def _reply(self, h: dict, keep: tuple, timings: list, out, t0: float) -> tuple[dict, dict]:
        if self.args.device != "cpu":
            self.torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.stats.compute_s += dt
        head = {k: h[k] for k in keep if k in h}
        head["timings"] = timings + [{"stage": self.name, "layers": [self.args.start, self.args.end], "s": dt}]
        if self.args.last:
            return {**head, "op": "result"}, {"logits": out.to("cpu")}
        return {**head, "op": "forward"}, {"hidden": out.to("cpu")}

    def handle_data(self, frames: list) -> None:
        wire = self.wire
        ident, body = frames[0], frames[1:]
        h = None
        try:
            h, tensors = wire.decode(body)
            if h["op"] == "release":
                seq = wire.require(h, "seq", str)
                self.caches.pop(seq, None)
                if self.next is not None:
                    self._send(self.next, wire.encode({"op": "release", "seq": seq}), self.next_addr)
                return
            if h["op"] != "forward":
                raise wire.WireError(f"header.op: {h['op']!r} is not a data op here (forward, release)")
            if "reply_to" in h:
                wire.endpoint(h["reply_to"], "header.reply_to")
            elif self.args.last:
                raise wire.WireError("header.reply_to: required, the last stage sends results there")
            self.stats.requests += 1
            out_h, out_t = self.forward(h, tensors)
            msg = wire.encode(out_h, out_t)
            if self.args.last:
                self._send(self._peer(h["reply_to"]), msg, h["reply_to"])
            else:
                self._send(self.next, msg, self.next_addr)
        except Stale:
            self.stats.stale_dropped += 1
        except wire.WireError as e:
            self.stats.rejected += 1
            self._error(ident, h, str(e))
        except Exception as e:  # noqa: BLE001 - the worker never dies of one request
            self.stats.errors += 1
            text = str(e) if isinstance(e, LayerlineError) else f"{e.__class__.__name__}: {e}"
            self._error(ident, h, text, getattr(e, "code", None), getattr(e, "header", None))

    def _send(self, sock, msg: list, where: str | None) -> None:
        """Never block the loop on a peer that is gone or full: the control socket must stay live."""
        try:
            sock.send_multipart(msg, copy=False, flags=self.zmq.NOBLOCK)
        except self.zmq.Again:
            raise LayerlineError(f"stage {self.name}: {where} is not taking messages (down, or its queue is "
                                 "full); check that worker's health") from None

    def _error(self, ident, h: dict | None, text: str, code: str | None = None, extra: dict | None = None) -> None:
        reply = {"op": "error", "stage": self.name, "error": text[:2000]}
        if code:
            reply["code"] = code
        if extra:
            reply.update(extra)
        if h and isinstance(h.get("id"), str):
            reply["id"] = h["id"]
        msg = self.wire.encode(reply)
        # the sender hears it; the driver waits on its result socket (reply_to), so it hears there too
        try:
            self.data.send_multipart([ident, *msg], flags=self.zmq.NOBLOCK)
            if h and "reply_to" in h:
                self._peer(h["reply_to"]).send_multipart(msg, flags=self.zmq.NOBLOCK)
        except Exception:  # noqa: BLE001 - an unreachable asker is not a reason to die
            pass

    # --- control path --------------------------------------------------------------------------

    def handle_control(self, frames: list) -> None:
        wire = self.wire
        ident, body = frames[0], frames[1:]
        h = None
        try:
            h, _ = wire.decode(body)
            op = h["op"]
            if op == "health":
                reply = {"op": "ok", "name": self.name, "pid": os.getpid(), "layers": [self.args.start, self.args.end],
                         "next": self.next_addr, "uptime_s": time.time() - self.stats.started,
                         "curve": self.curve_bind, "next_key": self.next_key}
            elif op == "stats":
                s = self.stats
                reply = {"op": "ok", "name": self.name, "requests": s.requests, "errors": s.errors,
                         "rejected": s.rejected, "stale_dropped": s.stale_dropped, "compute_s": s.compute_s,
                         "sequences": len(self.caches),
                         "compile": self.args.compile, "compile_s": self.compile_s,
                         "compiled": self.stage.compiled, "compile_error": self.stage.compile_error,
                         "kernels": cpu_kernels.status(), "step_s": self.step_s}
                if self.args.compile != "off":  # graphs compiled so far: serving should add none
                    from torch._dynamo.utils import counters
                    reply["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
                store = getattr(self.stage, "expert_store", None)
                if store is not None and hasattr(store, "stats"):  # paged experts: hits, misses, bytes read
                    reply["experts"] = dataclasses.asdict(store.stats)
            elif op == "set_next":
                key = h.get("next_key")
                if key is not None and not (isinstance(key, str) and self.keymod.NAME_RE.match(key)):
                    raise wire.WireError("header.next_key: must be a host name (its key is in the keys dir's peers/)")
                self.set_next(wire.require(h, "next", str), key, names_only=True)
                reply = {"op": "ok", "name": self.name, "next": self.next_addr}
            elif op == "shutdown":
                self.running = False
                reply = {"op": "ok", "name": self.name}
            else:
                raise wire.WireError(f"header.op: {op!r} is not a control op (health, stats, set_next, shutdown)")
        except Exception as e:  # noqa: BLE001
            self.stats.rejected += 1
            reply = {"op": "error", "stage": self.name, "error": str(e)[:2000]}
        if h and isinstance(h.get("id"), str):  # decode checked it: the asker can match the answer
            reply["id"] = h["id"]
        try:
            self.control.send_multipart([ident, *wire.encode(reply)], flags=self.zmq.NOBLOCK)
        except self.zmq.ZMQError:  # an asker that is gone or not reading is not a reason to stall
            pass

    def serve(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.data, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        self.write_ready()
        while self.running:
            for sock, _ in poller.poll(500):
                frames = sock.recv_multipart(copy=False)
                if len(frames) < 2:
                    continue
                if sock is self.data:
                    self.handle_data(frames)
                    self.awake.poke()  # the next message is due within a pipeline's step
                else:
                    self.handle_control(frames)
        self.close()

    def close(self) -> None:
        self.awake.close()
        for s in [self.data, self.control, self.next, *self.peers.values()]:
            if s is not None:
                s.close(linger=1000)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        if self.args.ready_file:
            try:
                os.unlink(self.args.ready_file)
            except FileNotFoundError:
                pass


def lower_priority(nice: int) -> None:
    """--nice: this process's nice value and, where the kernel groups processes by session
    (autogroup, on by default in most distributions), its session's: there a nice value ranks a
    process only within its session, and each session (the supervisor gives the worker its own)
    gets an equal share against every other. Linux keeps a nice value per thread (new threads
    inherit it), so every thread torch's import started gets it too. A priority that cannot be
    set is a warning in the worker's log, not a reason to stop serving."""
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except FileNotFoundError:  # a kernel without autogroup: the nice value is all there is
        pass
    except OSError as e:  # e.g. a higher nice value inherited (lowering it needs privilege), a read-only /proc
        print(f"layerline worker: --nice {nice} not fully applied ({e}); the worker runs at nice "
              f"{os.getpriority(os.PRIO_PROCESS, 0)}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)   # --spin took effect before torch loaded (openmp_env)
    if args.nice:
        lower_priority(args.nice)
    if getattr(args, "compile_cache", None):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.compile_cache
    try:
        if args.probe:
            from .probe import probe
            print(json.dumps(probe(args.checkpoint, device=args.device)))
            return 0
        w = Worker(args)

        def stop(signum, frame):
            w.running = False
        signal.signal(signal.SIGTERM, stop)
        print(f"layerline worker {w.name}: layers {args.start}:{args.end} {args.precision} on {args.device}, "
              f"decode kernels {cpu_kernels.status()}, serving {args.bind}{' (CURVE)' if w.curve_bind else ''}",
              flush=True)
        w.serve()
        return 0
    except LayerlineError as e:
        print(f"layerline worker: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
