"""Load one pipeline stage from a Hugging Face checkpoint: only the tensors that stage needs.

The stage is built on the meta device (no memory), its tensors are read file by file with
safetensors.safe_open, cast to the precision's dtype one at a time, and assigned in place
(load_state_dict(assign=True)), so peak memory is the stage's weights plus one tensor.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoint import CheckpointError, CheckpointIndex, read_index
from ..errors import LayerlineError
from .llama import PRECISIONS, ModelArgs, Stage, hf_name

_PRECISION_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def resolve_precision(precision: str) -> torch.dtype:
    p = _PRECISION_ALIASES.get(precision, precision)
    if p not in PRECISIONS:
        raise LayerlineError(f"--precision {precision}: unknown; choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[p]


def _check_range(args: ModelArgs, start: int, end: int, first: bool, last: bool) -> None:
    n = args.num_layers
    if start >= end:
        raise CheckpointError(f"--layers {start}:{end}: empty range; give A:B with A < B (half-open, layers A..B-1)")
    if start < 0 or end > n:
        raise CheckpointError(f"--layers {start}:{end}: outside the model's layers 0:{n} "
                              f"(config.json num_hidden_layers={n}); choose A:B with 0 <= A < B <= {n}")
    if first and start != 0:
        raise CheckpointError(f"--first with --layers {start}:{end}: the first stage must start at layer 0; "
                              "drop --first or start the range at 0")
    if last and end != n:
        raise CheckpointError(f"--last with --layers {start}:{end}: the last stage must end at layer {n}; "
                              f"drop --last or end the range at {n}")


def _expected(args: ModelArgs, start: int, end: int, first: bool, last: bool) -> dict[str, tuple[str, tuple]]:
    """Stage state_dict key -> (checkpoint tensor name, shape), from a meta-device stage."""
    with torch.device("meta"):
        stage = Stage(args, start, end, first, last, torch.float32)
    return {k: (hf_name(k, args), tuple(t.shape)) for k, t in stage.state_dict(keep_vars=True).items()}


def stage_tensor_names(index: CheckpointIndex, start: int, end: int, first: bool, last: bool) -> list[str]:
    """The checkpoint tensors a stage reads: layers [start, end), the embedding if first, the final
    norm and LM head if last (the embedding again when embeddings are tied). Raises CheckpointError
    for a bad range or a tensor the checkpoint lacks."""
    args = ModelArgs.from_config(index.config)
    _check_range(args, start, end, first, last)
    names: list[str] = []
    for name, _shape in _expected(args, start, end, first, last).values():
        if name not in index.tensors:
            raise CheckpointError(f"{index.path}: tensor {name} is missing from the *.safetensors files; "
                                  "the checkpoint is incomplete or not a Llama-family model, re-download it")
        if name not in names:
            names.append(name)
    return names


def load_stage(ckpt_dir: str, start: int, end: int, first: bool, last: bool,
               precision: str = "fp32", device: str = "cpu") -> Stage:
    """Build the stage for layers [start, end) from `ckpt_dir`, reading only its tensors."""
    dtype = resolve_precision(precision)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise LayerlineError(f"--device {device}: not a device name; use cpu or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LayerlineError(f"--device {device}: CUDA is not available on this host; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise LayerlineError(f"--device {device}: this host has {torch.cuda.device_count()} CUDA device(s); "
                             "use one of them or cpu")

    index = read_index(ckpt_dir)
    args = ModelArgs.from_config(index.config)
    _check_range(args, start, end, first, last)
    expected = _expected(args, start, end, first, last)

    by_file: dict[str, list[str]] = defaultdict(list)
    for key, (name, shape) in expected.items():
        entry = index.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{ckpt_dir}: tensor {name} is missing from the *.safetensors files; "
                                  "the checkpoint is incomplete or not a Llama-family model, re-download it")
        if entry.shape != shape:
            raise CheckpointError(f"{ckpt_dir}: tensor {name} has shape {list(entry.shape)} but config.json "
                                  f"implies {list(shape)}; config.json does not belong to these weights")
        if entry.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{ckpt_dir}: tensor {name} is {entry.dtype}; quantized checkpoints are not "
                                  "supported, use a float (bf16/fp16/fp32) checkpoint")
        if name not in by_file[entry.file]:
            by_file[entry.file].append(name)

    loaded: dict[str, torch.Tensor] = {}
    load_dev = "cpu" if dev.type == "cpu" else str(dev)
    for fname, names in by_file.items():
        path = Path(ckpt_dir) / fname
        try:
            with safe_open(str(path), framework="pt", device=load_dev) as f:
                for name in names:
                    loaded[name] = f.get_tensor(name).to(dtype)
        except (OSError, RuntimeError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{path}: cannot read tensors ({msg}); the file may be truncated, "
                                  "re-download it") from e

    with torch.device("meta"):
        stage = Stage(args, start, end, first, last, dtype)
    state = {key: loaded[name] for key, (name, _shape) in expected.items()}
    stage.load_state_dict(state, strict=True, assign=True)
    if first and last and args.tie_word_embeddings:
        stage.lm_head.weight = stage.embed_tokens.weight
    stage.inv_freq = stage.inv_freq.to(dev)
    return stage.eval()
