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
    steps: list[StepResult] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    replays: int = 0


@dataclass
class Generation:
    tokens: list[list[int]]              # new tokens per prompt, in the caller's order
    steps: list[StepResult]              # every step of every batch
    seconds: float
    new_tokens: int
    replays: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def stage_seconds(self) -> list[float]:
        """Compute seconds per stage, summed over every step."""
        n = max((len(s.timings) for s in self.steps), default=0)
        return [sum(s.timings[i]["s"] for s in self.steps if len(s.timings) > i) for i in range(n)]

    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second over the decode steps alone (prefill excluded)."""
        dec = [s for s in self.steps if s.logits.shape[1] == 1]
        if not dec:
            return None
        return sum(s.logits.shape[0] for s in dec) / sum(s.wall_s for s in dec)


def generate(pipe: Pipeline, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling | None = None,
             eos: int | None = None, batch: bool = True, max_replays: int = 2) -> Generation:
    """Generate for every prompt; several batches in flight at once."""
    sampling = sampling or Sampling()
    if not prompts or any(not p for p in prompts):
        raise LayerlineError("input ids: give at least one non-empty prompt")
    if max_new_tokens < 1:
        raise LayerlineError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    gen = torch.Generator().manual_seed(sampling.seed)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p) if batch else -1 - i, []).append(i)
    tag = f"g{os.getpid()}-{next(_counter)}"
    groups = {}
    for k, rows in enumerate(by_len.values()):
        t = torch.tensor([prompts[r] for r in rows], dtype=torch.int64)
        groups[f"{tag}-{k}"] = _Group(f"{tag}-{k}", rows, t, t.shape[1], torch.zeros(len(rows), dtype=torch.bool))
    inflight: dict[str, str] = {}  # request id -> seq
    t0 = time.perf_counter()
    try:
        for g in groups.values():
            inflight[pipe.submit(g.tokens, seq=g.seq, pos=0, cache=True)] = g.seq
        while inflight:
            rid, res = pipe.collect()
            seq = inflight.pop(rid, None)
            if seq is None:
                continue
            g = groups[seq]
            if isinstance(res, DriveError):
                # a stage lost this sequence (restart, promotion): replay its prefix from 0
                if g.replays >= max_replays:
                    raise res
                g.replays += 1
                inflight[pipe.submit(g.tokens, seq=g.seq, pos=0, cache=True)] = g.seq
                continue
            g.steps.append(res)
            nxt = sample(res.logits[:, -1].float(), sampling.temperature, sampling.top_p, gen)
            nxt = torch.where(g.done, torch.zeros_like(nxt), nxt)
            g.tokens = torch.cat([g.tokens, nxt[:, None]], dim=1)
            if eos is not None:
                g.done |= nxt == eos
            if g.tokens.shape[1] - g.prompt_len >= max_new_tokens or bool(g.done.all()):
                continue
            inflight[pipe.submit(nxt[:, None], seq=g.seq, pos=g.tokens.shape[1] - 1, cache=True)] = g.seq
    finally:
        for g in groups.values():
            pipe.release(g.seq)
    out: list[list[int]] = [[] for _ in prompts]
    steps, n = [], 0
    for g in groups.values():
        steps += g.steps
        for j, r in enumerate(g.rows):
            new = g.tokens[j, g.prompt_len:].tolist()
            if eos is not None and eos in new:
                new = new[:new.index(eos) + 1]
            out[r] = new
            n += len(new)
    return Generation(out, steps, time.perf_counter() - t0, n, sum(g.replays for g in groups.values()))


_counter = itertools.count()
