"""Choosing the next token from logits: greedy, temperature, nucleus (top-p), seeded.

A pure function of its inputs: the same logits, settings and generator state give the same
tokens, so a driver that seeds one `torch.Generator` per sequence reproduces a generation.
"""
from __future__ import annotations

import math

import torch


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] (int64) from logits [B, V].

    temperature == 0: greedy (argmax; the lowest id among equal maxima). Otherwise softmax of
    logits / temperature in float32, cut to the smallest set of most likely tokens whose
    probability reaches `top_p` (the most likely token is always kept), renormalised, and sampled
    with `generator` (which must live on the logits' device; None uses torch's global RNG).
    """
    if logits.dim() != 2 or logits.shape[-1] == 0:
        raise ValueError(f"sample: logits must be [batch, vocab], got {tuple(logits.shape)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature {temperature!r}: must be a finite number >= 0 (0 is greedy)")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p {top_p!r}: must lie in (0, 1]")
    if temperature == 0:
        return logits.argmax(dim=-1)
    x = logits.float() / temperature
    if top_p < 1:
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
        sorted_x = sorted_x.masked_fill(before >= top_p, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
