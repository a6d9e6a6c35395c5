"""Generation across the pipeline: every prompt through the engine (layerline.engine) until done."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import wire
from .engine import Engine, Sampling, Sequence
from .errors import LayerlineError
from .pipeline import Pipeline, StepResult

__all__ = ["Generation", "Sampling", "generate"]


@dataclass
class Generation:
    tokens: list[list[int]]              # new tokens per prompt, in the caller's order
    steps: list[StepResult]              # every step that gave tokens (prefill ends, decode steps)
    seconds: float
    new_tokens: int
    replays: int = 0
    decode: list[StepResult] = field(default_factory=list)  # the one-token steps
    # decode tokens that came back after the last prompt's prefill, and the seconds from that
    # prefill's answer to the last of them: decode alone, with nothing else in the stages
    decode_window: tuple[int, float] = (0, 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def stage_seconds(self) -> list[float]:
        """Compute seconds per stage, summed over every step."""
        n = max((len(s.timings) for s in self.steps), default=0)
        return [sum(s.timings[i]["s"] for s in self.steps if len(s.timings) > i) for i in range(n)]

    def decode_tokens_per_s(self) -> float | None:
        """Tokens per second once every prompt is in: the decode window (prefill, and decode steps
        that queued behind it, excluded; steps in flight together counted once)."""
        tokens, seconds = self.decode_window
        if not tokens or seconds <= 0:
            return None
        return tokens / seconds


def generate(pipe: Pipeline, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling | None = None,
             eos: int | list[int] | None = None, batch: bool = True, max_replays: int = 2,
             pick: bool = True) -> Generation:
    """Generate for every prompt, all in flight at once through the engine.

    batch=False steps every sequence in a message of its own (no rows micro-batches). pick=False:
    every step's result carries its logits, greedy ones too (Engine's pick).
    """
    sampling = sampling or Sampling()
    if not prompts or any(not p for p in prompts):
        raise LayerlineError("input ids: give at least one non-empty prompt")
    if max_new_tokens < 1:
        raise LayerlineError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    tag = wire.new_id("g")
    eng = Engine(pipe, max_replays=max_replays, record=True, raise_errors=True, rows=None if batch else False,
                 pick=pick)
    stops = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
    seqs = [Sequence(f"{tag}-{i}", list(p), max_new_tokens, sampling, stops,
                     gen=torch.Generator().manual_seed(sampling.seed * 1_000_003 + i))
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for s in seqs:
        eng.add(s)
    # the driver's tensor work is sampling a few logits rows: on one thread, as the server's. With
    # OpenMP's, one was left spinning after each step on a core the stages decode on (one local
    # eager worker of the demo, libgomp's default spin: 32 -> 41-46 tokens/s on 2 cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng.run()
    finally:
        torch.set_num_threads(threads)
        eng.close()
    out = [s.generated for s in seqs]
    return Generation(out, eng.steps, time.perf_counter() - t0, sum(len(t) for t in out), eng.replays,
                      eng.decode_steps, eng.decode_window())
