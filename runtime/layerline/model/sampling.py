"""Choosing the next token from logits: greedy, temperature, nucleus (top-p), seeded, and
constrained (a grammar's mask of allowed tokens, applied here where the token is chosen).

A pure function of its inputs: the same logits, settings and generator state give the same
tokens, so a driver that seeds one `torch.Generator` per sequence reproduces a generation.
"""
from __future__ import annotations

import math

import torch


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token `allowed` [B, V] (bool) leaves out set to -inf (a new tensor).
    A row that allows nothing is a ValueError: its grammar reached a dead end."""
    if allowed.shape != logits.shape:
        raise ValueError(f"mask_logits: mask {tuple(allowed.shape)} does not match logits {tuple(logits.shape)}")
    if not bool(allowed.any(-1).all()):
        raise ValueError("the grammar allows no next token")
    return logits.masked_fill(~allowed, float("-inf"))


def adjust_logits(logits: torch.Tensor, bias: dict[int, float] | None, generated: list[int],
                  presence: float = 0.0, frequency: float = 0.0) -> torch.Tensor:
    """One row's logits [V] with OpenAI's logit_bias added (token id -> bias) and its penalties taken
    off: a token generated c > 0 times so far loses presence + c * frequency. A new tensor."""
    add: dict[int, float] = dict(bias or {})
    if (presence or frequency) and generated:
        ids, counts = torch.unique(torch.tensor(generated, dtype=torch.int64), return_counts=True)
        for t, c in zip(ids.tolist(), counts.tolist()):
            add[t] = add.get(t, 0.0) - presence - frequency * c
    out = logits.clone()
    ids = [t for t in add if 0 <= t < logits.shape[-1]]
    if ids:
        out[ids] += torch.tensor([add[t] for t in ids], dtype=logits.dtype)
    return out


def logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability under logits [V] (the model's own distribution: before
    temperature, top-p and any grammar, as vLLM reports them) and the `top` most likely (id, logprob)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best = [] if top <= 0 else list(zip(*(t.tolist() for t in lp.topk(min(top, lp.shape[-1])))))
    return float(lp[token]), [(int(i), float(v)) for v, i in best]


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Next token ids [B] (int64) from logits [B, V].

    temperature == 0: greedy (argmax; the lowest id among equal maxima). Otherwise softmax of
    logits / temperature in float32, cut to the smallest set of most likely tokens whose
    probability reaches `top_p` (the most likely token is always kept), renormalised, and sampled
    with `generator` (which must live on the logits' device; None uses torch's global RNG).
    allowed [B, V] (bool): only these tokens may be chosen (a grammar's mask; see mask_logits).
    """
    if logits.dim() != 2 or logits.shape[-1] == 0:
        raise ValueError(f"sample: logits must be [batch, vocab], got {tuple(logits.shape)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature {temperature!r}: must be a finite number >= 0 (0 is greedy)")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p {top_p!r}: must lie in (0, 1]")
    if allowed is not None:
        logits = mask_logits(logits, allowed)
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
