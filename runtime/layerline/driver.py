"""One drive: a timed forward of the first prompt, generation, the check against one process,
and the report a person reads. The CLI's `layerline drive`, the drive play and Cluster.drive
all run `drive()`; the sockets are layerline.pipeline's, the generation layerline.generate's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .drive_report import drive_report  # noqa: F401 - the CLI and Cluster users import it from here
from .generate import generate
from .pipeline import (Answer, DriveError, Pipeline, StepResult, active_stages, control,  # noqa: F401
                       pipeline_for_plan, reply_host_for)


def tolerance(precision: str, ref: torch.Tensor) -> float:
    """How far a pipelined forward may stray from one process running the same code.

    Stages run the same kernels, but thread counts may differ between processes and change
    reduction order; low precisions amplify that through the layers. gguf computes in float32,
    but ggml quantizes each matrix's input to 8 bits, so a last-bit difference can move a value
    across a rounding step: fp16's margin.
    """
    scale = float(ref.abs().max()) if ref.numel() else 1.0
    rel = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2, "int8": 3e-2, "int4": 3e-2, "gguf": 1e-2}.get(precision, 1e-2)
    return rel * max(scale, 1.0)


def greedy_generate(pipe: Pipeline, prompt: list[int], max_new_tokens: int, seq: str | None = None,
                    eos: int | None = None) -> tuple[list[int], list[StepResult]]:
    """Greedy tokens for one prompt, and every step's result with its logits (prefill first)."""
    g = generate(pipe, [prompt], max_new_tokens, eos=eos, pick=False)
    return g.tokens[0], g.steps


@dataclass
class DriveOptions:
    """What one drive does besides the timed forward of the first prompt."""
    generate: int = 0                      # new tokens per prompt (0: the forward alone)
    sampling: object | None = None         # generate.Sampling; None: greedy
    eos: int | list[int] | None = None     # stop token(s); None: generate every token
    warm: bool = True                      # one short pass first (connections, first allocations)
    reference: str | None = None           # checkpoint to check the forward against in one process
    precision: str = "bf16"                # the plan's precision: the reference's and its tolerance's
    # each active stage's (start, end, precision): the reference runs stage by stage, each at the
    # precision its worker runs (a pinned host may differ from the plan's), one stage in memory at a time
    stages: list[tuple[int, int, str]] | None = None
    tokenizer: object | None = None        # a tokenizers.Tokenizer: the report shows text, not ids
    questions: list[str] | None = None     # the prompts as the user wrote them, for the report


@dataclass
class DriveResult:
    """One drive: the timed forward, the generation, the reference check. One JSON shape (to_dict)."""
    tokens: int                            # prompt tokens in the timed forward
    stages: list[dict]                     # per stage: {"stage", "layers", "s"}
    wall_s: float
    hop_s: float
    logits_shape: list[int]
    next_token: int
    logits: torch.Tensor | None = field(default=None, repr=False)    # not in the JSON
    input_ids: torch.Tensor | None = field(default=None, repr=False)
    generate: dict | None = None           # {new_tokens, seconds, tokens_per_s, decode_tokens_per_s, stage_seconds, text?}
    check: dict | None = None              # {max_abs_diff, tolerance, ok, precision}

    @property
    def ok(self) -> bool:
        return self.check is None or bool(self.check["ok"])

    def to_dict(self) -> dict:
        out = {"tokens": self.tokens, "stages": self.stages, "wall_s": self.wall_s, "hop_s": self.hop_s,
               "logits_shape": self.logits_shape, "next_token": self.next_token}
        if self.generate is not None:
            out["generate"] = self.generate
        if self.check is not None:
            out.update(self.check)
        return out


def drive(pipe: Pipeline, prompts: list[list[int]], options: DriveOptions | None = None) -> DriveResult:
    """The one drive the CLI, the drive play and Cluster.drive share: a timed forward of the first
    prompt, then (options.generate) generation for every prompt, then the one-process check."""
    o = options or DriveOptions()
    if not prompts or not all(prompts):
        raise DriveError("drive: give at least one non-empty prompt")
    ids = torch.tensor([prompts[0]], dtype=torch.int64)
    if o.warm:
        pipe.forward(ids[:, :1])
    r = pipe.forward(ids)
    res = DriveResult(tokens=int(ids.shape[1]), stages=r.timings, wall_s=r.wall_s, hop_s=r.hop_s,
                      logits_shape=list(r.logits.shape), next_token=int(r.logits[0, -1].argmax()),
                      logits=r.logits, input_ids=ids)
    if o.generate:
        g = generate(pipe, prompts, o.generate, o.sampling, eos=o.eos)
        steps = max(1, len(g.steps))
        res.generate = {"new_tokens": g.tokens, "seconds": g.seconds, "tokens_per_s": g.tokens_per_s,
                        "decode_tokens_per_s": g.decode_tokens_per_s(),
                        "stage_seconds": [t / steps for t in g.stage_seconds()]}
        if o.tokenizer is not None:
            res.generate["text"] = [o.tokenizer.decode(t, skip_special_tokens=True).strip() for t in g.tokens]
        if o.questions:
            res.generate["questions"] = list(o.questions)
    if o.reference:
        ref, precisions = reference_forward(o.reference, ids, o.stages, o.precision)
        diff = float((ref.float() - r.logits.float()).abs().max())
        tol = max(tolerance(p, ref) for p in precisions)
        label = "/".join(dict.fromkeys(precisions))
        res.check = {"max_abs_diff": diff, "tolerance": tol, "ok": diff <= tol, "precision": label}
    return res


def reference_forward(checkpoint: str, ids: torch.Tensor, stages: list[tuple[int, int, str]] | None,
                      precision: str) -> tuple[torch.Tensor, list[str]]:
    """The pipeline's logits computed in this process a stage at a time, each stage at its own
    precision and freed before the next loads (so the controller never holds the whole model);
    without stages, the whole model as one stage at `precision`. Returns (logits, the precisions)."""
    from .checkpoint import open_checkpoint
    from .model.loader import load_stage
    layers = open_checkpoint(checkpoint).index.num_layers
    stages = stages or [(0, layers, precision)]
    if stages[0][0] != 0 or stages[-1][1] != layers or any(a[1] != b[0] for a, b in zip(stages, stages[1:])):
        raise DriveError(f"--stage: {stages} must cover layers 0..{layers} in order, each once")
    h = ids
    with torch.no_grad():
        for start, end, prec in stages:
            stage = load_stage(checkpoint, start, end, start == 0, end == layers, precision=prec)
            h = stage(h)
            del stage
    return h, [p for _, _, p in stages]
