"""The worker's compute: its layers, their KV pool, the warm-up and step timing, and the forward
of one data message (checked, computed, answered as a header and tensors).

Data messages (op forward; tensor `input_ids` [B, T] int64 at the first stage, `hidden`
[B, T, hidden] after it; the last stage sends op result with `logits` to `reply_to`):
- no cache: pos 0 (or none), the whole input at once;
- one sequence: `cache: true`, `seq`, `pos` (where the T new tokens start: 0 starts it anew),
  `reserve` (tokens to size its cache for), T tokens, B rows of that one sequence;
- rows of different sequences (continuous batching): `cache: true`, `rows: [[seq, pos], ...]`
  (no top-level seq or pos), one new token per row ([B, 1] ids / [B, 1, hidden], B = len(rows)),
  row i at position pos of its own sequence (prefilled by one-sequence messages with batch 1);
  `logits: "last"` gives [B, 1, vocab].
- `logits: "argmax"` (either kind): the last stage answers with `argmax` (int64 [B], each row's
  greedy token at its last position: the first largest logit) and `finite` (uint8 [B], 0 where that
  row's logits hold NaN or Inf) in place of the logits, for a step whose every row is greedy without
  logprobs, bias or grammar: a token id crosses the wire instead of a vocabulary of floats (1 MiB
  a Gemma 3 token), and the driver has no vocabulary-wide work left.
- a prefix hit (layerline.prefix): a one-sequence message at `pos` N with `fork: {from: ENTRY, len: N}`
  starts `seq` anew with a copy of prefix entry ENTRY's first N tokens (kept by an earlier
  `release` with `keep`), then writes its T tokens after them; a stage that lacks the entry answers
  seq_unknown naming `seq`, which the sender replays from 0.
What a cached sequence must hold, and what happens when it holds more, is the KV pool's contract
(layerline.model.kv.KVPool): a sequence this stage lacks or holds fewer than pos tokens of fails
the message with code "seq_unknown" and `seqs` in the error header, so the sender replays just
those from 0; one it holds more of is rewound to pos.
Running ahead (a stage that is both first and last, so it holds the whole model): after answering a
cached step with `logits: "argmax"`, while no message waits, it computes the steps the driver will
send next for those rows (each row fed its greedy token at the next position), up to AHEAD steps,
and keeps their answers. When the expected step arrives (same rows and positions, the same tokens,
the same epoch, caches untouched since) it is answered at once; any other message drops them all,
and the KV rows they wrote are rewound by the next write there as any held-past-pos cache is. The
driver's round trip (its wake-up, its sampling, the two hops) then runs beside the stage's compute
instead of between its steps; the answers' bits are the same, because the steps are the same
computation. A guess never passes the reserve a sequence was admitted with (the tokens its request
may reach), so at most AHEAD steps are spent on a sequence that stops early (an eos).
`more: N` (0..wire.AHEAD) on a rows step: when it is the expected step, its answer also carries the
steps computed after it, up to N: `then` (int64 [K, B]) holds each row's pick of those K steps in
order (each fed the pick before it; only steps whose every row's logits are finite), and its
timing's `s` is the compute of all 1 + K steps. The stage then holds those K tokens, and the driver
sends its next step K positions further on: one round trip carries up to AHEAD tokens a row. Such a
step is parked until N steps after it are computed, the chain can grow no more, or another message
comes (the parked step is answered first, with what there is): a driver that waits on every answer
would otherwise always find just one step computed.
`epoch` (optional, an integer >= 0): the driver's wire epoch, passed on to the next stage. A
forward of an older epoch than the last one that wrote any of its sequences here is not computed
(it could rewind what the newer one wrote) and is answered as seq_unknown naming those sequences
(a driver that failed over forgot the request and drops the answer; otherwise only they fail, after
their replays, and the step's other rows are resent rather than stalled), counted in `stats` as
stale_dropped. Forwards without an epoch are never stale.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from .. import precision, timing_lock, wire
from ..errors import LayerlineError
from ..model import cpu_kernels
from ..model.kv import KVPool
from ..planner import message_threads
from ..prefix import MAX_ENTRIES
from ..wire import AHEAD, MAX_BATCH, MAX_SEQS

LOGITS = ("last", "all", "argmax")  # header.logits: what a forward asks the last stage to answer with
# the header fields a rows step's answer keeps
ROWS_KEEP = ("id", "rows", "cache", "reply_to", "deadline", "logits", "reserve", "epoch", "inflight")

IDLE_CAP_S = 0.05  # the longest idle measure_step waits before a timed step


@dataclass
class Stats:
    started: float = field(default_factory=time.time)
    requests: int = 0
    errors: int = 0
    rejected: int = 0
    stale_dropped: int = 0
    compute_s: float = 0.0
    ahead_used: int = 0      # steps answered from a step computed ahead
    ahead_dropped: int = 0   # steps computed ahead that the next message did not ask for
    threads: dict[int, int] = field(default_factory=dict)   # forwards computed, by the threads each ran on


@dataclass
class Ahead:
    """A step a first-and-last stage expects (rows at their next positions, each fed the token it
    picked), and once computed, its answer and each cache's length after it."""
    rows: list[tuple[str, int]]
    ids: torch.Tensor                 # [B, 1] int64: each row's picked token
    epoch: int | None
    caches: list | None = None
    picked: tuple | None = None       # (argmax [B], finite [B]) on the CPU
    s: float = 0.0                    # its compute seconds
    last: bool = False                # no step follows it (a reserve reached, logits not finite)

    def answers(self, rows: list[tuple[str, int]], x: torch.Tensor, epoch: int | None, caches: list,
                lengths: list[int]) -> bool:
        """Whether this computed step is the one asked: the same rows, tokens and epoch, and every
        cache the same object holding `lengths` (what the last step computed ahead left: nothing
        wrote it since)."""
        return (self.picked is not None and rows == self.rows and epoch == self.epoch
                and x.shape == self.ids.shape and bool(torch.equal(x, self.ids))
                and all(c is d and c.length == n for c, d, n in zip(caches, self.caches, lengths)))

    def next(self) -> "Ahead | None":
        """The step after this computed one (None where a row's logits were not finite)."""
        return following([(q, p + 1) for q, p in self.rows],
                         {"argmax": self.picked[0], "finite": self.picked[1]}, self.epoch)


@dataclass
class Parked:
    """A rows step that asked for `more` and is answered from the chain once that many steps after it
    are computed: what its answer's header is made of."""
    h: dict
    timings: list
    more: int


def following(rows: list[tuple[str, int]], answer: dict, epoch: int | None) -> Ahead | None:
    """The step that follows a greedy answer's tensors: `rows` (the next positions) fed its picks;
    None where the answer holds no pick or a row's logits were not finite."""
    if "argmax" not in answer or not bool(answer["finite"].all()):
        return None
    return Ahead(rows, answer["argmax"].to(torch.int64).view(-1, 1).clone(), epoch)


class StageCompute:
    """One stage's layers and KV pool, loaded when made; `prepare` compiles and times it."""

    def __init__(self, args: argparse.Namespace, name: str):
        from ..model.loader import load_stage

        self.torch = torch
        self.args, self.name = args, name
        self.awake = None  # the process's spinners (layerline.awake), given to prepare
        if args.threads:
            torch.set_num_threads(args.threads)
        self.threads = torch.get_num_threads()   # its threads alone; a message may take fewer (_share)
        torch.manual_seed(args.rng_seed)
        with self._timing_lock(exclusive=False):  # no co-located stage times its step meanwhile
            self.stage = load_stage(args.checkpoint, args.start, args.end, args.first, args.last,
                                    precision=args.precision, device=args.device,
                                    expert_cache_bytes=args.expert_cache_bytes)
        self.margs = self.stage.args
        self.compile_s: float | None = None
        self.step_s: float | None = None
        # KV: the plan's dtype (else the precision table's rule) and budget (bytes this stage may
        # hold across sequences)
        kv = precision.kv_name(args.precision, args.kv_dtype)
        self.kv_dtype = precision.torch_dtype(kv)
        per_token = (2 * self.margs.num_kv_heads * self.margs.head_dim * precision.kv_bytes(kv)
                     * (args.end - args.start))
        self.kv = KVPool(lambda batch, tokens: self.stage.new_cache(batch, tokens, dtype=self.kv_dtype),
                         bytes_per_token=per_token,
                         budget=args.kv_bytes if args.kv_bytes else args.kv_context * per_token,
                         max_seqs=MAX_SEQS, context=args.kv_context, name=name, max_entries=MAX_ENTRIES)
        self.stats = Stats()
        self.ahead: list[Ahead] = []   # the steps expected next, in order (first-and-last stages only)
        self.parked: Parked | None = None   # the expected step that came, waiting for the steps after it

    def prepare(self, awake) -> None:
        """Compile (when asked) and time the decode step: before the worker says it is ready.
        awake: the process's spinners, poked while timing as serving pokes them."""
        self.awake = awake
        if self.args.compile != "off":
            with self._timing_lock(exclusive=False):
                self.warm_up(self.args.compile)
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
        from ..model.llama import ROWS_BUCKETS
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
        stage's speed (at most IDLE_CAP_S), as a pipeline stage waits for its input: a step after
        an idle runs slower on VMs than one run back to back, and back-to-back timing predicted
        pipelined stages too fast."""
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

    # --- one data message ------------------------------------------------------------------------

    def _validate_input(self, h: dict, tensors: dict):
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

    @staticmethod
    def _timings(h: dict) -> list:
        t = h.get("timings", [])
        ok = isinstance(t, list) and len(t) <= 64 and all(
            isinstance(e, dict) and isinstance(e.get("stage"), str) and len(e["stage"]) <= 64
            and isinstance(e.get("s"), (int, float)) and not isinstance(e.get("s"), bool)
            and isinstance(e.get("layers"), list) and len(e["layers"]) == 2
            and all(type(v) is int for v in e["layers"]) for e in t)
        if not ok:
            raise wire.WireError("header.timings: must be a list of at most 64 {stage, layers: [A, B], s}")
        return [{"stage": e["stage"], "layers": e["layers"], "s": float(e["s"])} for e in t]

    def _checked(self, h: dict) -> tuple[list, bool, int | None, int]:
        """The fields every forward has: (timings so far, whether only the last position's logits
        are asked, its wire epoch, the driver's messages in flight)."""
        epoch = wire.epoch(h)
        deadline = h.get("deadline")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not math.isfinite(deadline)):
            raise wire.WireError("header.deadline: must be a finite number of seconds since the epoch")
        if deadline is not None and time.time() > deadline:
            raise LayerlineError(f"stage {self.name}: request {h.get('id')} missed its deadline before compute")
        if "logits" in h and h["logits"] not in LOGITS:
            raise wire.WireError("header.logits: must be \"last\", \"all\" or \"argmax\"")
        inflight = wire.require(h, "inflight", int, 1, wire.MAX_INFLIGHT) if "inflight" in h else 1
        return self._timings(h), h.get("logits") in ("last", "argmax"), epoch, inflight

    def _share(self, inflight: int) -> None:
        """Compute the message on this stage's share of its machine's cores while `inflight` messages
        are out (--cores, --sharing; planner.message_threads); alone, on all its threads."""
        want = self.threads
        if self.args.cores is not None:
            want = message_threads(self.threads, self.args.cores, self.args.sharing, inflight)
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
        self.stats.threads[want] = self.stats.threads.get(want, 0) + 1

    def forward(self, h: dict, tensors: dict) -> tuple[dict, dict] | None:
        """A forward message's answer (header, tensors): a forward to the next stage, or the last
        stage's result; None where a rows step is parked (unpark answers it). Raises WireError (a bad
        message), KVRows, SeqUnknown, Stale, LayerlineError."""
        if "rows" in h:
            return self.forward_rows(h, tensors)
        self.drop_ahead()
        pos = wire.require(h, "pos", int, 0, self.args.kv_context - 1) if "pos" in h else 0
        use_cache = h.get("cache", False)
        if not isinstance(use_cache, bool):
            raise wire.WireError("header.cache: must be true or false")
        timings, last_only, epoch, inflight = self._checked(h)
        x = self._validate_input(h, tensors)
        cache = None
        if use_cache:
            seq = wire.require(h, "seq", str)
            reserve = wire.require(h, "reserve", int, 1, self.args.kv_context) if "reserve" in h \
                else self.args.kv_context
            forked = wire.fork(h, pos, self.args.kv_context - 1)
            if forked is not None:
                if x.shape[0] != 1:
                    raise wire.WireError("header.fork: a forked sequence has one row (batch 1)")
                cache = self.kv.fork(seq, forked[0], forked[1], x.shape[1], reserve, epoch)
            else:
                cache = self.kv.step(seq, pos, x.shape[0], x.shape[1], reserve, epoch)
        elif "fork" in h:
            raise wire.WireError("header.fork: only with cache true (it starts a cached sequence)")
        elif pos != 0:
            raise wire.WireError("header.pos: must be 0 without cache")
        elif x.shape[0] * x.shape[1] > self.args.kv_context:
            raise wire.WireError(f"shape: batch x tokens must be at most {self.args.kv_context} without cache")
        self._share(inflight)
        t0 = time.perf_counter()
        if self.args.last:
            out = self.stage(x.to(self.args.device), start_pos=pos, cache=cache, last_only=last_only)
        else:
            out = self.stage(x.to(self.args.device), start_pos=pos, cache=cache)
        head, answer = self._reply(h, ("id", "seq", "pos", "cache", "reply_to", "deadline", "logits", "reserve",
                                       "epoch", "fork", "inflight"), timings, out, t0)
        if use_cache and x.shape[0] == 1:
            self._expect(following([(seq, pos + x.shape[1])], answer, epoch))
        return head, answer

    def forward_rows(self, h: dict, tensors: dict) -> tuple[dict, dict] | None:
        """One new token for each row's own sequence (header.rows), weights read once for all rows.
        None: the step is the one expected and parked until `more` steps after it are computed (unpark)."""
        rows = wire.rows(h, self.args.kv_context - 1)
        extra = [k for k in ("seq", "pos") if k in h]
        if extra:
            raise wire.WireError(f"header.rows: a rows message names its sequences in rows only; drop header."
                                 f"{' and header.'.join(extra)}")
        if h.get("cache") is not True:
            raise wire.WireError("header.cache: must be true with rows (each row steps a cached sequence)")
        if "reserve" in h:
            wire.require(h, "reserve", int, 1, self.args.kv_context)
        more = wire.require(h, "more", int, 0, AHEAD) if "more" in h else 0
        timings, _, epoch, inflight = self._checked(h)
        x = self._validate_input(h, tensors)
        if x.shape[1] != 1:
            raise wire.WireError(f"header.rows: one new token per row, but the tensor holds {x.shape[1]} per row")
        if x.shape[0] != len(rows):
            raise wire.WireError(f"header.rows: {len(rows)} rows but the tensor's batch is {x.shape[0]}")
        caches = self.kv.rows(rows, epoch)
        ahead = self.ahead   # run_ahead computes each step it appends, or takes it out again
        if ahead and ahead[-1].picked is not None and h.get("logits") == "argmax" and \
                ahead[0].answers(rows, x, epoch, caches, [c.length for c in ahead[-1].caches]):
            self.parked = Parked(h, timings, more)
            return self.unpark(force=False)
        else:
            self.drop_ahead()
            self._share(inflight)
            t0 = time.perf_counter()
            out = self.stage.forward_rows(x.to(self.args.device), [p for _, p in rows], caches)
            head, answer = self._reply(h, ROWS_KEEP, timings, out, t0)
            self._expect(following([(q, p + 1) for q, p in rows], answer, epoch))
        return head, answer

    # --- running ahead (first-and-last stages) -----------------------------------------------------

    def unpark(self, force: bool) -> tuple[dict, dict] | None:
        """The parked step's answer (header, tensors), from the chain: its first step and up to `more`
        computed steps after it. It waits (None) while fewer are computed and the chain can still grow,
        unless `force` (another message arrived: the parked one goes first, with what there is)."""
        p, ahead = self.parked, self.ahead
        if p is None or (not force and len(ahead) <= p.more and self.can_run_ahead()):
            return None
        self.parked = None
        done = [ahead.pop(0)]
        while len(done) <= p.more and ahead and ahead[0].picked is not None and bool(ahead[0].picked[1].all()):
            done.append(ahead.pop(0))
        self.stats.ahead_used += len(done)
        head, answer = self._answer(p.h, ROWS_KEEP, p.timings, sum(a.s for a in done), None, done[0].picked)
        if len(done) > 1:
            answer["then"] = torch.stack([a.picked[0].to(torch.int64) for a in done[1:]])
        if not ahead:
            self._expect(done[-1].next())
        return head, answer

    def _expect(self, step: Ahead | None) -> None:
        """After a greedy answer (`following` gives a step only for one) of a stage holding the whole
        model: the driver's next step for these rows is, unless it stops them, each fed its pick at
        the next position. A step past a sequence's reserve (which --kv-context caps) fails in
        run_ahead, and nothing is guessed."""
        if step is not None and self.args.first and self.args.last:
            self.ahead = [step]

    def abandon_parked(self) -> None:
        """The parked step's answer could not be made or sent: forget it and the chain it waited on."""
        self.parked = None
        self.drop_ahead()

    def drop_ahead(self) -> None:
        """Any message but the expected step ends the expectation (the worker calls it for releases)."""
        self.stats.ahead_dropped += sum(a.picked is not None for a in self.ahead)
        self.ahead = []

    def can_run_ahead(self) -> bool:
        """Whether a step is expected that is not computed yet, or the chain may grow by one."""
        tail = self.ahead[-1] if self.ahead else None
        return tail is not None and (tail.picked is None or (len(self.ahead) < AHEAD and not tail.last))

    def run_ahead(self) -> None:
        """Compute the next expected step (the worker calls it while no message waits). Whatever stops
        it (a cache at its reserve, a sequence evicted, a row's logits not finite) ends the chain there:
        the step, if it comes, is computed as any other and fails or succeeds as it would have."""
        if not self.can_run_ahead():
            return
        a = self.ahead[-1]
        if a.picked is not None:
            nxt = a.next()
            if nxt is None:
                a.last = True
                return
            self.ahead.append(nxt)
            a = nxt
        try:
            caches = self.kv.rows(a.rows, a.epoch)   # past a sequence's reserve: LayerlineError
            t0 = time.perf_counter()
            out = self.stage.forward_rows(a.ids.to(self.args.device), [p for _, p in a.rows], caches)
            a.picked = self._pick(out)
            a.s = time.perf_counter() - t0
            a.caches = caches
        except Exception:  # noqa: BLE001 - a guess that cannot be computed is no guess
            self.ahead.pop()
            if self.ahead:
                self.ahead[-1].last = True

    # --- answers ---------------------------------------------------------------------------------

    @staticmethod
    def _pick(out) -> tuple:
        """Each row's greedy token at its last position and whether its logits are all finite (CPU)."""
        last = out[:, -1]
        picked = cpu_kernels.argmax_rows(last)
        if picked is None:
            # a row's largest |logit| is finite iff all are (NaN included); max's indices are argmax's
            picked = last.max(-1).indices, torch.isfinite(last.abs().amax(-1)).to(torch.uint8)
        return picked[0].to("cpu"), picked[1].to("cpu")

    def _reply(self, h: dict, keep: tuple, timings: list, out, t0: float) -> tuple[dict, dict]:
        if self.args.device != "cpu":
            self.torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        picked = self._pick(out) if self.args.last and h.get("logits") == "argmax" else None
        return self._answer(h, keep, timings, dt, out, picked)

    def _answer(self, h: dict, keep: tuple, timings: list, dt: float, out, picked: tuple | None) -> tuple[dict, dict]:
        self.stats.compute_s += dt
        head = {k: h[k] for k in keep if k in h}
        head["timings"] = timings + [{"stage": self.name, "layers": [self.args.start, self.args.end], "s": dt}]
        if not self.args.last:
            return {**head, "op": "forward"}, {"hidden": out.to("cpu")}
        if picked is not None:
            return {**head, "op": "result"}, {"argmax": picked[0], "finite": picked[1]}
        return {**head, "op": "result"}, {"logits": out.to("cpu")}
