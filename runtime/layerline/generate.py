"""Generation across the pipeline: prefill, then decode, several sequences in flight.

Prompts of equal length travel together as one batch (one message per step, one KV cache
per stage with a row per sequence), so each stage reads its weights once for all of them.
Batches of different lengths are in flight at the same time, so the stages work at once.
The driver keeps every sequence's tokens: a stage that lost its cache is rebuilt by
replaying the prefix.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

import torch

from .driver import DriveError, Pipeline, StepResult
from .errors import LayerlineError
from .model.sampling import sample
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


@dataclass
class _Group:
    seq: str
    rows: list[int]                      # indices into the caller's prompts
    tokens: torch.Tensor                 # [B, T] everything so far (prompt + generated)
    prompt_len: int
    done: torch.Tensor                   # [B] bool
    gen: torch.Generator                 # sampling draws of this group alone: reproducible by seed
    steps: list[StepResult] = field(default_factory=list)
    decode: list[StepResult] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    replays: int = 0


@dataclass
class Generation:
    tokens: list[list[int]]              # new tokens per prompt, in the caller's order
    steps: list[StepResult]              # every step of every batch
    seconds: float
    new_tokens: int
    replays: int = 0
    decode: list[StepResult] = field(default_factory=list)  # the one-token steps

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def stage_seconds(self) -> list[float]:
        """Compute seconds per stage, summed over every step."""
        n = max((len(s.timings) for s in self.steps), default=0)
        return [sum(s.timings[i]["s"] for s in self.steps if len(s.timings) > i) for i in range(n)]

    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second over the decode steps alone (prefill excluded)."""
        if not self.decode:
            return None
        return sum(s.logits.shape[0] for s in self.decode) / sum(s.wall_s for s in self.decode)


def generate(pipe: Pipeline, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling | None = None,
             eos: int | None = None, batch: bool = True, max_replays: int = 2) -> Generation:
    """Generate for every prompt; several batches in flight at once."""
    sampling = sampling or Sampling()
    if not prompts or any(not p for p in prompts):
        raise LayerlineError("input ids: give at least one non-empty prompt")
    if max_new_tokens < 1:
        raise LayerlineError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p) if batch else -1 - i, []).append(i)
    # a batch is at most what a stage takes in one message
    chunks = [rows[j:j + MAX_BATCH] for rows in by_len.values() for j in range(0, len(rows), MAX_BATCH)]
    tag = f"g{os.getpid()}-{next(_counter)}"
    groups = {}
    for k, rows in enumerate(chunks):
        t = torch.tensor([prompts[r] for r in rows], dtype=torch.int64)
        groups[f"{tag}-{k}"] = _Group(f"{tag}-{k}", rows, t, t.shape[1], torch.zeros(len(rows), dtype=torch.bool),
                                      torch.Generator().manual_seed(sampling.seed * 1_000_003 + k))
    waiting = list(groups.values())
    inflight: dict[str, tuple[str, bool]] = {}  # request id -> (seq, is a decode step)

    def prefill(g: _Group) -> None:  # also the replay of a lost cache: the whole history from 0
        rid = pipe.submit(g.tokens, seq=g.seq, pos=0, cache=True, last_only=True,
                          reserve=g.prompt_len + max_new_tokens)
        inflight[rid] = (g.seq, False)

    t0 = time.perf_counter()
    try:
        while waiting or inflight:
            # stages keep at most MAX_SEQS sequences: more in flight would evict each other
            while waiting and len({q for q, _ in inflight.values()}) < MAX_SEQS:
                prefill(waiting.pop(0))
            rid, res = pipe.collect()
            if rid not in inflight:
                continue
            seq, is_decode = inflight.pop(rid)
            g = groups[seq]
            if isinstance(res, DriveError):
                # a stage lost this sequence (restart, promotion, eviction): replay its prefix
                if res.code != "seq_unknown" or g.replays >= max_replays:
                    raise res
                g.replays += 1
                prefill(g)
                continue
            g.steps.append(res)
            if is_decode:
                g.decode.append(res)
            nxt = sample(res.logits[:, -1].float(), sampling.temperature, sampling.top_p, g.gen)
            nxt = torch.where(g.done, torch.zeros_like(nxt), nxt)
            g.tokens = torch.cat([g.tokens, nxt[:, None]], dim=1)
            if eos is not None:
                g.done |= nxt == eos
            if g.tokens.shape[1] - g.prompt_len >= max_new_tokens or bool(g.done.all()):
                continue
            rid = pipe.submit(nxt[:, None], seq=g.seq, pos=g.tokens.shape[1] - 1, cache=True, last_only=True)
            inflight[rid] = (g.seq, True)
    finally:
        pipe.forget(inflight)
        for g in groups.values():
            pipe.release(g.seq)
    out: list[list[int]] = [[] for _ in prompts]
    steps, decode, n = [], [], 0
    for g in groups.values():
        steps += g.steps
        decode += g.decode
        for j, r in enumerate(g.rows):
            new = g.tokens[j, g.prompt_len:].tolist()
            if eos is not None and eos in new:
                new = new[:new.index(eos) + 1]
            out[r] = new
            n += len(new)
    return Generation(out, steps, time.perf_counter() - t0, n, sum(g.replays for g in groups.values()), decode)


_counter = itertools.count()
