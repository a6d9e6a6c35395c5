"""The engine: continuous batching across the pipeline, the one that both `generate()` and the server drive.

Every sequence is one row with its own KV cache at each stage (its own `seq` id on the wire)
and its own sampling state (a seeded torch.Generator). The engine keeps each sequence's
token history and what the stages hold of it; every step it

- feeds waiting prompts in chunks (at most `chunk` tokens per message, so a long prompt never
  stalls running streams for long; while others decode, as many such chunks in flight as the
  pipeline's depth, so prompts pipeline across the stages as the rows do),
- steps the decoding sequences as micro-batches of rows (`rows` messages: each row its own
  sequence at its own position), with as many micro-batches in flight as the pipeline's depth
  (the plan's core groups: stages sharing a machine's cores take turns anyway), so no machine
  idles while another computes; sequences join and leave at every step,
- replays a sequence's history from position 0 when a stage lost its cache (restart,
  promotion, eviction: error code "seq_unknown") through the very computations that made it:
  the prompt in the chunks it first went in (`Sequence.bounds`), then each generated token as a
  one-token row step, so the logits, and a greedy stream's tokens, are those of the undisturbed
  run (one batched prefill of the whole history gives other last bits at bf16 and at a file's
  own bits, and greedy text that changes after a failover),
- fails over when told a stage is gone or the route changes (`fail_over`): the wire epoch goes
  up (every forward carries it; a stage drops one of an older epoch than the last that wrote its
  sequence there), every request in flight is forgotten (late answers are dropped as unknown),
  and nothing is dispatched until `resume` (after `replace_pipe` when stage 0 changed); then each
  running sequence is resent from what every stage confirmed (`held`): stages that kept its cache
  rewind to there and go on, a stage that lost it (restarted, promoted, newly planned) answers
  seq_unknown and just that sequence replays from 0, a replay that does not count toward
  max_replays. Or it fails them all with `unavailable` (a "stage_down" error, HTTP 503) when
  nothing came back.

With `prefix` on (the server's default), it keeps a prefix cache (layerline.prefix): a sequence
that ends normally (or is cancelled) leaves its prompt's KV at every stage as an entry (`release`
with `keep`); a new prompt that starts with an entry's tokens up to one of its chunk bounds starts
there (`held`), with that entry's bounds as its first chunks, and its first message tells each stage
to copy the entry's KV (`fork`). So a replay from 0 cuts its prompt as the cached computation did,
and its greedy tokens are those of a run without the cache at the same bounds. A stage that lacks
the entry (evicted, restarted, promoted, a new route) answers seq_unknown: the entry is forgotten and
the sequence replays from 0, uncounted toward max_replays.

Stages that do not speak `rows` yet get one message per sequence per step (all in flight).
`layerline.generate.generate()` is a thin wrapper: add every prompt, run until all are done. The
server runs the same Engine in its own thread (`Engine.serve`, through
layerline.server.async_engine), the ZeroMQ sockets owned by that thread.
"""
from __future__ import annotations

import math
import os
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
import zmq

from . import wire
from .errors import LayerlineError
from .model.sampling import adjust_logits, logprobs, mask_logits, sample
from .pipeline import Answer, DriveError, Pipeline, StepResult
from .prefix import PrefixIndex
from .prefill import BUSY_CHUNK, CHUNK
from .wire import MAX_BATCH, MAX_SEQS


@dataclass
class Sampling:
    temperature: float = 0.0   # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise LayerlineError(f"--temperature {self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise LayerlineError(f"--top-p {self.top_p}: must be in (0, 1]")


# --- one sequence ---------------------------------------------------------------------------------

WAITING, READY, INFLIGHT, DONE = "waiting", "ready", "inflight", "done"


@dataclass(eq=False)
class Sequence:
    """One generation: its history, what the stages hold of it, and where its tokens go.

    sink(kind, value) is called from the engine's thread: ("admitted", None), ("token", id),
    ("done", "stop"|"length"|"cancelled"), ("error", message), ("unavailable", message) (a stage
    is down and nothing took its place in time); with `logprobs` set, ("logprobs", (logprob,
    [(id, logprob), ...])) just before each ("token", id). It must not block.

    constraint: a grammar (layerline.model.grammar.Constraint: allowed(vocab), accept(token),
    finished) that masks every token this sequence samples; the sequence stops when it is complete.
    logprobs: report each chosen token's log-probability and this many most likely alternatives.
    bias: added to the logits of these token ids before the token is chosen (OpenAI's logit_bias).
    penalties: (presence, frequency) as OpenAI defines them: each token already generated c times
    loses presence + c * frequency from its logit.
    """
    sid: str
    prompt: list[int]
    max_new: int
    sampling: Sampling = field(default_factory=Sampling)
    eos: frozenset = frozenset()
    sink: Callable[[str, object], None] | None = None
    gen: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)   # prompt + generated
    held: int = 0                  # tokens every stage holds in its cache
    state: str = WAITING
    replays: int = 0               # replays that count toward the engine's max_replays
    failed_over: bool = False      # a failover since its last answer: a replay it causes is not counted
    bounds: list[int] = field(default_factory=list)   # where the prompt's prefill chunks ended, in order
    finish: str | None = None
    error: str | None = None
    constraint: object | None = None
    logprobs: int | None = None
    bias: dict[int, float] | None = None   # logit_bias: token id -> added to its logit before choosing
    penalties: tuple[float, float] | None = None   # (presence, frequency), over the generated tokens
    fork: tuple[str, int] | None = None   # (prefix entry, N): its first message copies the entry's N tokens

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)
        if self.gen is None:
            self.gen = torch.Generator().manual_seed(int(self.sampling.seed) & 0x7FFF_FFFF_FFFF_FFFF)

    @property
    def reserve(self) -> int:
        """Tokens this sequence may reach: each stage sizes its KV cache (and the engine its budget) by it."""
        return len(self.prompt) + self.max_new

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs its logits here (logprobs, bias, penalties, a grammar): the
        last stage can pick its tokens."""
        return (self.sampling.temperature == 0 and self.logprobs is None and not self.bias and not self.penalties
                and self.constraint is None)

    def prefill_chunk(self, chunk: int) -> int:
        """Tokens the next prefill message carries: inside the prompt, up to the next boundary it
        was first sent with (decided once, so a replay or a resend after a failover cuts the prompt
        as the first run did), else one (a replay's generated tokens, or a pipeline without rows)."""
        if self.held >= len(self.prompt):
            return 1
        for end in self.bounds:
            if end > self.held:
                return end - self.held
        n = min(chunk, len(self.prompt) - self.held)
        self.bounds.append(self.held + n)
        return n

    @property
    def prefilling(self) -> bool:
        """Its next message is a prompt chunk (the stages do not hold the whole prompt yet)."""
        return self.held < len(self.prompt)

    def emit(self, kind: str, value=None) -> None:
        if self.sink is not None:
            self.sink(kind, value)


# --- rows: many sequences, one token each, in one message ------------------------------------------

def rows_supported(pipe: Pipeline, timeout_s: float = 30.0) -> bool:
    """Whether the stages take `rows` messages, learnt from a probe that leaves no error behind:
    a one-token sequence, then one rows step of it. Remembered on the pipeline."""
    known = getattr(pipe, "_layerline_rows", None)
    if known is not None:
        return known
    probe = wire.new_id("rowsprobe-")
    poller = zmq.Poller()
    poller.register(pipe.to_first, zmq.POLLIN)
    poller.register(pipe.results, zmq.POLLIN)

    def answer(rid: str) -> Answer:
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            for sock, _ in poller.poll(max(1, int((deadline - time.perf_counter()) * 1000))):
                for a in pipe.answers(sock):
                    if a.rid == rid:
                        return a
        pipe.forget([rid])
        raise DriveError(f"no answer from the pipeline at {pipe.first} within {timeout_s:.0f} s; "
                         "are the workers running? (check each worker's health)")
    try:
        a = answer(pipe.submit(torch.zeros(1, 1, dtype=torch.int64), seq=probe, pos=0, cache=True,
                               last_only=True, reserve=2))
        if a.error is not None:
            raise a.error
        a = answer(pipe.submit_rows([(probe, 1)], torch.zeros(1, 1, dtype=torch.int64)))
        ok = a.result is not None or a.error.code == "seq_unknown"
    finally:
        pipe.release(probe)
    pipe._layerline_rows = ok
    return ok


# --- the engine -----------------------------------------------------------------------------------

class Engine:
    """Continuous batching over one Pipeline. Owns sequences, sampling, replays, micro-batches.

    Not thread-safe: one thread calls everything (generate() runs it to completion; the server
    runs `serve` in a thread of its own and talks to it through `inbox`).

    stages: micro-batches kept in flight (default: the pipeline's depth, which a plan gives as its
    core groups; else one per stage, learnt from the results' timings). chunk: prompt tokens per
    message; busy_chunk: the same while other sequences decode (smaller, so a prompt delays their
    steps less). kv_tokens: KV tokens every stage can hold across sequences: a sequence is
    admitted when its reserve (prompt + max_new) fits beside the running ones.
    max_running: sequences admitted at once (a stage keeps at most MAX_SEQS caches).
    prefix: keep a prefix cache (layerline.prefix), within kv_tokens beside the running sequences
    (prefix_tokens when kv_tokens is None).
    pick: a step whose every sequence is plain greedy asks the last stage for each row's token, not
    its logits (the same token: the first largest logit); False: logits always.
    """

    def __init__(self, pipe: Pipeline, *, stages: int | None = None, chunk: int = CHUNK,
                 busy_chunk: int = BUSY_CHUNK, kv_tokens: int | None = None, max_running: int = MAX_SEQS, max_replays: int = 2,
                 rows: bool | None = None, record: bool = False, raise_errors: bool = False,
                 on_step: Callable[[StepResult, str, int], None] | None = None, prefix: bool = False,
                 prefix_tokens: int = 1 << 16, pick: bool = True):
        if chunk < 1:
            raise LayerlineError(f"chunk {chunk}: must be at least 1")
        self.pipe = pipe
        self.stages = stages
        self._stages_seen = 0     # stages in the last result (the depth when neither stages nor the pipe say)
        self.chunk = chunk
        self.busy_chunk = max(1, busy_chunk)
        self.kv_tokens = kv_tokens
        self.max_running = max(1, min(max_running, MAX_SEQS))
        self.max_replays = max_replays
        self.rows = rows
        self.record = record
        self.raise_errors = raise_errors
        self.on_step = on_step
        self.pick = pick
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.kv_used = 0
        self.prefix = PrefixIndex(kv_tokens or prefix_tokens) if prefix else None
        self.inflight: dict[str, tuple[str, list[Sequence], list[int]]] = {}  # rid -> (kind, seqs, positions)
        self.steps: list[StepResult] = []
        self.decode_steps: list[StepResult] = []
        self._decode_marks: list[tuple[float, int]] = []   # (when, tokens) of each decode step (record)
        self._prefill_done = 0.0                           # when the last prefill answer came (record)
        self.replays = 0
        self.paused: str | None = None   # why nothing is dispatched (a failover in progress)
        self.down: str | None = None     # why requests are refused (no route serves)
        self.failovers = 0
        # the wire epoch, stamped on every forward, is held by the pipeline alone (Engine.epoch reads it)
        pipe.epoch = 0
        self.poller = zmq.Poller()
        self.poller.register(pipe.to_first, zmq.POLLIN)
        self.poller.register(pipe.results, zmq.POLLIN)

    # -- requests in

    def add(self, s: Sequence) -> None:
        if not s.prompt:
            raise LayerlineError("input ids: give at least one non-empty prompt")
        if s.max_new < 1:
            raise LayerlineError(f"max new tokens {s.max_new}: must be at least 1")
        if self.kv_tokens is not None and s.reserve > self.kv_tokens:
            raise LayerlineError(f"sequence {s.sid}: prompt {len(s.prompt)} + max new tokens {s.max_new} = "
                                 f"{s.reserve} tokens is over the stages' KV budget of {self.kv_tokens}")
        s.state = WAITING
        self.waiting.append(s)

    def cancel(self, sid: str) -> None:
        """Drop a sequence at once (its client went away): its slot and KV are free for the next."""
        for s in self.waiting:
            if s.sid == sid:
                self.waiting.remove(s)
                self._finish(s, "cancelled", release=False)
                return
        s = self.running.get(sid)
        if s is not None:
            self._finish(s, "cancelled")

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one turn: admit, dispatch, wait for answers

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            s = self.waiting[0]
            if self.kv_tokens is not None and self.kv_used + s.reserve > self.kv_tokens and self.running:
                return  # first come, first served: later requests do not overtake it
            self.waiting.popleft()
            self.kv_used += s.reserve
            self.running[s.sid] = s
            s.state = READY
            if self.prefix is not None:
                self._reuse(s)
            s.emit("admitted")

    def _reuse(self, s: Sequence) -> None:
        """Entries beyond what the running sequences leave of kv_tokens go (the stages would evict
        them for those anyway); then s starts at the longest prefix an entry holds, if any."""
        if self.kv_tokens is not None:
            self._drop(self.prefix.trim(max(0, self.kv_tokens - self.kv_used)))
        if s.held or s.bounds:
            return
        hit = self.prefix.lookup(s.prompt)
        if hit is not None:
            s.held, s.bounds, s.fork = hit.length, list(hit.bounds), (hit.entry, hit.length)

    def _drop(self, entries: list[str]) -> None:
        """Every stage frees these prefix entries."""
        for e in entries:
            try:
                self.pipe.release(e)
            except zmq.ZMQError:
                pass

    @property
    def depth(self) -> int:
        """Micro-batches kept in flight: `stages`, else the pipeline's depth, else the stages seen."""
        return max(1, self.stages or self.pipe.depth or self._stages_seen or 1)

    def _dispatch(self) -> None:
        if self.paused is not None:
            return
        ready = [s for s in self.running.values() if s.state == READY]
        if not ready:
            return
        if self.rows is None:
            self.rows = rows_supported(self.pipe)
        # a replay's generated tokens go as row steps, one a step, as they first went (catching up)
        prefill = [s for s in ready if s.prefilling or not self.rows]
        prefill.sort(key=lambda s: len(s.tokens) == len(s.prompt))  # replays (they have tokens) go out first
        decode = [s for s in ready if not (s.prefilling or not self.rows)]
        kinds = [k for k, _, _ in self.inflight.values()]
        decoding = len(decode) + sum(len(seqs) for k, seqs, _ in self.inflight.values() if k == "rows")
        # prompts keep a chunk in flight for each micro-batch of the pipeline's depth, beside the
        # decoding rows: one chunk at a time crosses the stages one after another while waiting
        # requests queue for it, and the rows batch only the sequences already prefilled
        # (docs/serving.md); without rows every sequence steps alone, all in flight
        cap = len(prefill) if not self.rows else self.depth
        n_pre = sum(k == "seq" for k in kinds) if self.rows else 0
        # while others decode, prompts go in smaller chunks: a chunk delays every decode step queued behind it
        chunk = min(self.chunk, self.busy_chunk) if (self.rows and decoding) else self.chunk
        for s in prefill:
            if n_pre >= cap:
                break
            self._submit_seq(s, chunk)
            n_pre += 1
        if decode:
            per = min(MAX_BATCH, math.ceil(decoding / self.depth))
            n_rows = sum(k == "rows" for k in kinds)
            while decode and n_rows < self.depth:
                batch, decode = decode[:per], decode[per:]
                self._submit_rows(batch)
                n_rows += 1

    def _submit_seq(self, s: Sequence, chunk: int) -> None:
        n = s.prefill_chunk(chunk)
        ids = torch.tensor([s.tokens[s.held:s.held + n]], dtype=torch.int64)
        fork = s.fork if s.fork is not None and s.held == s.fork[1] else None
        rid = self.pipe.submit(ids, seq=s.sid, pos=s.held, cache=True, last_only=True,
                               reserve=s.reserve if s.held == 0 or fork else None, fork=fork,
                               pick=self.pick and s.plain_greedy)
        s.state = INFLIGHT
        self.inflight[rid] = ("seq", [s], [n])

    def _submit_rows(self, batch: list[Sequence]) -> None:
        ids = torch.tensor([[s.tokens[s.held]] for s in batch], dtype=torch.int64)  # the last, unless catching up
        pick = self.pick and all(s.plain_greedy for s in batch)
        rid = self.pipe.submit_rows([(s.sid, s.held) for s in batch], ids, pick=pick, more=wire.AHEAD if pick else 0)
        for s in batch:
            s.state = INFLIGHT
        self.inflight[rid] = ("rows", batch, [1] * len(batch))

    def _wait(self, timeout_ms: int | None, wake=None) -> bool:
        """Handle every answer that arrives within timeout_ms; True when `wake` (an fd) fired."""
        woke = False
        if self.inflight:
            oldest = min(self.pipe._pending.get(r, time.perf_counter()) for r in self.inflight)
            left_ms = int(max(0.0, self.pipe.timeout_s - (time.perf_counter() - oldest)) * 1000) + 1
            timeout_ms = left_ms if timeout_ms is None else min(timeout_ms, left_ms)
        for sock, _ in self.poller.poll(timeout_ms):
            if sock is self.pipe.to_first or sock is self.pipe.results:
                for a in self.pipe.answers(sock):
                    self._answer(a)
            elif sock == wake:
                woke = True
        self._expire()
        return woke

    def _expire(self) -> None:
        now = time.perf_counter()
        for rid in list(self.inflight):
            sent = self.pipe._pending.get(rid)
            if sent is not None and now - sent <= self.pipe.timeout_s:
                continue
            _, seqs, _ = self.inflight.pop(rid)
            self.pipe.forget([rid])
            err = DriveError(f"request {rid}: no result within {self.pipe.timeout_s:.0f} s; a stage after "
                             f"{self.pipe.first} is down or slow (check each worker's log and health)")
            self._fail([s for s in seqs if s.state == INFLIGHT], err)

    def _fail(self, seqs: list[Sequence], err: DriveError) -> None:
        if self.raise_errors:
            raise err
        for s in seqs:
            s.error = str(err)
            self._finish(s, "error")

    def _answer(self, a: Answer) -> None:
        got = self.inflight.pop(a.rid, None)
        if got is None:
            return
        kind, seqs, fed = got
        live = [s for s in seqs if s.state == INFLIGHT]  # cancelled ones are gone already
        if a.error is not None:
            if a.error.code != "seq_unknown":
                self._fail(live, a.error)
                return
            lost = set(a.error.seqs) if kind == "rows" and a.error.seqs is not None else {s.sid for s in seqs}
            for s in live:
                if s.sid not in lost:
                    s.state = READY  # nothing was applied: step it again
                    continue
                if s.fork is not None:  # a stage lacks the prefix entry it forked from: compute it all
                    self.prefix.forget(s.fork[0], lost=True)
                    self._drop([s.fork[0]])
                    s.fork = None
                    s.held = 0
                    s.state = READY
                    continue
                if s.failed_over:  # the failover's stage lost it: not this sequence's fault
                    s.failed_over = False
                elif s.replays >= self.max_replays:
                    self._fail([s], a.error)
                    continue
                else:
                    s.replays += 1
                self.replays += 1
                s.held = 0  # replay its whole history from position 0 (writes are idempotent by position)
                s.state = READY
            return
        res = a.result
        if self.on_step is not None:
            self.on_step(res, kind, len(seqs))
        sampled: list[tuple[int, Sequence]] = []
        for i, (s, n) in enumerate(zip(seqs, fed)):
            if s.state != INFLIGHT:
                continue
            s.held += n
            s.state = READY
            s.failed_over = False
            s.fork = None
            if s.held == len(s.tokens):
                sampled.append((i, s))
        if not sampled:
            return
        # the tokens of steps a stage holding the whole model computed ahead (a rows step asked for them)
        then = res.then.tolist() if res.then is not None and kind == "rows" and res.logits is None else []
        if self.record:
            self.steps.append(res)
            now = time.perf_counter()
            if kind == "rows" or (fed[0] == 1 and len(seqs[0].tokens) > len(seqs[0].prompt)):
                self.decode_steps.append(res)
                self._decode_marks.append((now, len(sampled)))
            elif len(seqs[0].tokens) == len(seqs[0].prompt):  # a prompt's prefill (a replay moves nothing)
                self._prefill_done = now
        if res.logits is None:  # each row's greedy token, picked at the last stage (every row plain greedy)
            if res.argmax.shape[0] != len(seqs):
                self._fail([s for _, s in sampled], DriveError(f"a stage answered {res.argmax.shape[0]} tokens for "
                                                               f"a step of {len(seqs)} rows", "bad_result"))
                return
            logits = raw = None
            finite, top = res.finite.tolist(), res.argmax.tolist()
        else:
            logits = raw = res.logits[:, -1].float()
            # a row whose logits are NaN or Inf (a bad weight or host for that sequence) fails alone: argmax
            # would pick a token from garbage, and sampling would raise for every row of the step
            # (a row's largest |logit| is finite iff every one is, NaN included: one pass, where
            # isfinite().all() took 0.65 ms over Gemma 3's 262k logits, 12x as long)
            finite = torch.isfinite(logits.abs().amax(-1)).tolist()
        finite = [finite[i] for i, _ in sampled]
        bad = [s for (_, s), ok in zip(sampled, finite) if not ok]
        if bad:
            self._fail(bad, DriveError("the model's logits for this sequence are not finite (NaN or Inf): a stage's "
                                       "weights or arithmetic failed on it; other requests go on", "non_finite"))
            sampled = [(i, s) for (i, s), ok in zip(sampled, finite) if ok]
        if logits is not None:
            # logit_bias and penalties, then a grammar's mask: where the token is chosen, each row its own
            adjust = [(i, s) for i, s in sampled if s.bias or (s.penalties and s.generated) or s.constraint is not None]
            if adjust:
                logits = logits.clone()
                for i, s in adjust:
                    if s.bias or (s.penalties and s.generated):
                        logits[i] = adjust_logits(logits[i], s.bias, s.generated, *(s.penalties or (0.0, 0.0)))
                    if s.constraint is not None:
                        try:
                            logits[i] = mask_logits(logits[i:i + 1], s.constraint.allowed(logits.shape[-1])[None])[0]
                        except ValueError as e:
                            why = s.constraint.error or e
                            self._fail([s], DriveError(f"the output grammar allows no next token ({why})", "grammar"))
            greedy = [i for i, s in sampled if s.sampling.temperature == 0 and s.state != DONE]
            # max's indices are argmax's (the first largest, documented), at a third of its time on a 262k vocabulary
            top = logits.max(-1).indices.tolist() if greedy else []
            picks = {i: top[i] for i in greedy}
        else:
            picks = {i: top[i] for i, _ in sampled}
        for i, s in sampled:
            if s.state == DONE:
                continue
            try:
                tok = picks[i] if i in picks else int(sample(logits[i:i + 1], s.sampling.temperature,
                                                             s.sampling.top_p, s.gen)[0])
            except (ValueError, RuntimeError) as e:  # this row's settings or numbers: its own failure
                self._fail([s], DriveError(f"sampling failed: {e}", "sampling"))
                continue
            if s.constraint is not None and not s.constraint.accept(tok):
                self._fail([s], DriveError(f"the output grammar refused token {tok}: {s.constraint.error}", "grammar"))
                continue
            s.tokens.append(tok)
            if s.logprobs is not None:
                s.emit("logprobs", logprobs(raw[i], tok, s.logprobs))
            self._took(s, tok)
        taken = 0
        for picks_ahead in then:   # plain greedy rows only: each fed its last token, which the stage now holds
            for i, s in sampled:
                if s.state != DONE:
                    s.held += 1
                    s.tokens.append(picks_ahead[i])
                    taken += 1
                    self._took(s, picks_ahead[i])
        if taken and self.record:   # then is only taken for rows steps: the last mark is this step's
            when, n = self._decode_marks[-1]
            self._decode_marks[-1] = (when, n + taken)
        if res.timings:
            self._stages_seen = len(res.timings)

    def _took(self, s: Sequence, tok: int) -> None:
        """s has just taken tok: it goes to the sink, and s stops at a stop token, a finished grammar or
        its length."""
        s.emit("token", tok)
        if tok in s.eos or (s.constraint is not None and s.constraint.finished):
            self._finish(s, "stop")
        elif len(s.tokens) - len(s.prompt) >= s.max_new:
            self._finish(s, "length")

    def _finish(self, s: Sequence, reason: str, release: bool = True) -> None:
        if s.state == DONE:
            return
        was_running = self.running.pop(s.sid, None) is not None
        if was_running:
            self.kv_used -= s.reserve
        s.state, s.finish = DONE, reason
        if release and was_running:
            keep = self._keep(s) if reason in ("stop", "length", "cancelled") else None
            try:
                self.pipe.release(s.sid, keep)
            except zmq.ZMQError:
                pass
        if reason == "unavailable":
            s.emit("unavailable", s.error)
        elif reason == "error":
            s.emit("error", s.error)
        else:
            s.emit("done", reason)

    def _keep(self, s: Sequence) -> tuple[str, int] | None:
        """The prefix entry (id, tokens) the stages keep of an ending sequence: its prompt up to the
        last chunk bound every stage confirmed; None when nothing is worth keeping."""
        if self.prefix is None or s.fork is not None:   # a fork not confirmed: the stages may lack it
            return None
        done = [b for b in s.bounds if b <= min(s.held, len(s.prompt))]
        if not done:
            return None
        eid = wire.new_id("p")
        dropped = self.prefix.add(eid, s.prompt, done)
        self._drop([d for d in dropped if d != eid])
        return None if eid in dropped else (eid, done[-1])

    # -- failover (the server's monitor calls these in the engine's thread)

    @property
    def epoch(self) -> int:
        """The wire epoch: up at every fail_over (a waited-for stage too, so it is not the server's
        Route.epoch, which counts promotions and switches)."""
        return self.pipe.epoch

    def fail_over(self, reason: str) -> int:
        """A stage is gone or the route changes: a new epoch, everything in flight forgotten, nothing
        dispatched until resume(). Then every running sequence is resent from what every stage
        confirmed (held); a stage that lost it answers seq_unknown and it replays from 0, uncounted
        toward max_replays. Returns how many running sequences the stages had confirmed a part of
        (held, not a fork still unconfirmed): only those can replay; one whose first message was in
        flight is simply sent again."""
        self.paused = reason
        self.failovers += 1
        self.pipe.epoch += 1   # what is still on its way at a stage is dropped once this one passed
        self.pipe.forget(list(self.inflight))  # late answers to these are dropped as unknown
        self.inflight.clear()
        n = 0
        for s in self.running.values():
            if s.state in (READY, INFLIGHT):
                n += bool(s.held and s.fork is None)
                s.state = READY   # resent at held: whatever of its in-flight step a stage applied is rewound
                s.failed_over = True
        return n

    def resume(self) -> None:
        """Dispatch again (the replays go out first)."""
        self.paused = None
        self.down = None

    def unavailable(self, message: str) -> int:
        """Nothing took the lost stage's place: fail every request (HTTP 503) and refuse new ones
        until resume(). Returns how many failed."""
        self.paused = self.down = message
        self.pipe.forget(list(self.inflight))
        self.inflight.clear()
        seqs = list(self.running.values()) + list(self.waiting)
        self.waiting.clear()
        for s in seqs:
            s.error = message
            self._finish(s, "unavailable", release=False)
        return len(seqs)

    def decode_window(self) -> tuple[int, float]:
        """(tokens, seconds) decoded after the last prefill answer (Generation.decode_window)."""
        after = [(t, n) for t, n in self._decode_marks if t > self._prefill_done]
        if not after:
            return 0, 0.0
        return sum(n for _, n in after), after[-1][0] - self._prefill_done

    def replace_pipe(self, pipe: Pipeline) -> None:
        """Drive a new stage 0 (a promoted standby): the old pipeline's sockets close, answers still
        on their way to it are lost with them (fail_over has forgotten their requests)."""
        old = self.pipe
        for sock in (old.to_first, old.results):
            if sock is not None:
                try:
                    self.poller.unregister(sock)
                except KeyError:
                    pass
        self.pipe = pipe
        pipe.epoch = old.epoch
        self.poller.register(pipe.to_first, zmq.POLLIN)
        self.poller.register(pipe.results, zmq.POLLIN)
        if getattr(old, "_layerline_rows", None) is not None:
            pipe._layerline_rows = old._layerline_rows
        old.close()

    # -- drivers

    def run(self) -> None:
        """Until every sequence added so far is done (generate())."""
        while self.busy:
            self._admit()
            self._dispatch()
            if self.inflight:
                self._wait(None)

    def close(self) -> None:
        """Stop waiting for anything in flight; release every live sequence's caches."""
        self.pipe.forget(list(self.inflight))
        self.inflight.clear()
        prefix, self.prefix = self.prefix, None   # nothing more is kept
        for s in list(self.running.values()):
            self._finish(s, "cancelled")
        while self.waiting:
            self._finish(self.waiting.popleft(), "cancelled", release=False)
        if prefix is not None:   # nobody else knows these entries: the stages free them
            self._drop(prefix.ids())

    def serve(self, inbox: "queue.SimpleQueue", wake_fd: int, stopped: Callable[[], bool],
              on_turn: Callable[["Engine"], None] | None = None) -> None:
        """The server's loop: take ("add", Sequence) / ("cancel", sid) from inbox (a byte on
        wake_fd says there is something), step everything, until stopped()."""
        self.poller.register(wake_fd, zmq.POLLIN)
        try:
            while not stopped():
                while True:
                    try:
                        op, arg = inbox.get_nowait()
                    except queue.Empty:
                        break
                    if op == "add":
                        if self.down is not None:
                            arg.error = self.down
                            arg.state = DONE
                            arg.emit("unavailable", self.down)
                            continue
                        try:
                            self.add(arg)
                        except LayerlineError as e:
                            arg.error = str(e)
                            arg.state = DONE
                            arg.emit("error", str(e))
                    elif op == "cancel":
                        self.cancel(arg)
                    elif op == "call":  # (fn, box): fn(engine) in this thread, its result or error in box
                        fn, box = arg
                        try:
                            box.put((True, fn(self)))
                        except Exception as e:  # noqa: BLE001 - handed to the caller
                            box.put((False, e))
                woke = False
                try:
                    self._admit()
                    self._dispatch()
                    if on_turn is not None:
                        on_turn(self)
                    woke = self._wait(1000, wake_fd)
                except Exception as e:  # noqa: BLE001 - no request takes the engine down: it fails them
                    self.pipe.forget(list(self.inflight))
                    self.inflight.clear()
                    err = e if isinstance(e, DriveError) else DriveError(f"{e.__class__.__name__}: {e}")
                    self._fail(list(self.running.values()), err)
                    if on_turn is not None:
                        on_turn(self)
                if woke:
                    try:
                        os.read(wake_fd, 4096)
                    except BlockingIOError:
                        pass
        finally:
            self.poller.unregister(wake_fd)
            self.close()
