"""Load one pipeline stage from a checkpoint (layerline.checkpoint, any format): only the tensors
that stage needs.

The stage is built on the meta device (no memory), its tensors are read one at a time through
the checkpoint object (`Checkpoint.tensor`), cast to the precision's dtype, and assigned in place
(load_state_dict(assign=True)), so peak memory is the stage's weights plus one tensor.

Precision int8 quantizes each Linear weight (and the embedding / LM head) a block of rows at a
time as it is read (`Checkpoint.row_blocks`), so no float copy of a whole matrix is made; int4
quantizes into the int4 layers' packed weights and group scales (embedding and LM head int8),
taking 4-bit codes as the file stores them where it does (`Checkpoint.int4_codes`: a GGUF's
Q4_0 / Q4_1 / Q4_K blocks). Precision gguf (a GGUF file only) holds each Linear weight and the
embedding as the file's own blocks (`Checkpoint.stored_blocks`; `blocks.BlockLinearModule`,
`blocks.BlockEmbedding`, run by ggml's CPU kernels), a tied head sharing the embedding's; the
modules are made at load, since the block type is the file's, matrix by matrix. A block type
without a kernel here, and every matrix on a CUDA device, is read as floats at the compute dtype
a block of rows at a time. Mixtral's experts are
either loaded with the stage (default) or, given `expert_cache_bytes`, left on disk and served by an
`LRUExpertStore` that reads them when routed to.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from ..checkpoint import Checkpoint, CheckpointError, CheckpointIndex, open_checkpoint
from ..errors import LayerlineError
from ..precision import precision as precision_row
from ..precision import INT4_GROUP, torch_dtype
from ..checkpoint.gguf import GGUFCheckpoint
from . import cpu_kernels, gguf_blocks
from .blocks import BlockEmbedding, BlockLinearModule
from .llama import ModelArgs, Stage, hf_name
from .moe import LRUExpertStore
from .quant import Int4Linear, pack_int4_codes, quantize_row_blocks, require_int4

_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def precision_name(precision: str) -> str:
    """The canonical precision name (fp32 | bf16 | fp16 | int8 | int4 | gguf) of a name or alias."""
    return precision_row(precision).name


def resolve_precision(precision: str) -> torch.dtype:
    """The dtype a stage of this precision computes in (bf16 for int8 and int4: weight-only)."""
    return torch_dtype(precision_row(precision).compute)


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


def _expected(args: ModelArgs, start: int, end: int, first: bool, last: bool,
              resident_experts: bool = True) -> dict[str, tuple[str, tuple]]:
    """Stage state_dict key -> (checkpoint tensor name, shape), from a float meta-device stage."""
    with torch.device("meta"):
        stage = Stage(args, start, end, first, last, torch.float32, resident_experts=resident_experts)
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


def _int8(ck: Checkpoint, name: str, shape: tuple, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of a matrix, made a block of rows at a time (each row's scale is its own)."""
    q, scale = quantize_row_blocks(ck.row_blocks(name), *shape)
    return q.to(device), scale.to(device)


def _int4(ck: Checkpoint, name: str, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Linear's weight and group scales of a matrix: 4-bit codes as the file stores them where it
    does, anything else quantized from its float values."""
    codes = ck.int4_codes(name) if INT4_GROUP == 32 else None
    if codes is None:
        return Int4Linear.pack(ck.tensor(name, device), dtype)
    return pack_int4_codes(*codes, dtype)


def _float_matrix(ck: Checkpoint, name: str, shape: tuple, device: str, dtype: torch.dtype) -> torch.Tensor:
    """A matrix's floats at `dtype` on `device`, dequantized a block of rows at a time."""
    out = torch.empty(shape, dtype=dtype, device=device)
    for a, rows in ck.row_blocks(name):
        out[a:a + rows.shape[0]] = rows.to(device=device, dtype=dtype)
    return out


def _hold_blocks(stage: Stage, ck: Checkpoint, expected: dict[str, tuple[str, tuple]], dtype: torch.dtype,
                 dev: torch.device) -> dict[str, torch.Tensor]:
    """Precision gguf: put a `blocks` module in `stage` for each Linear / embedding whose matrix the
    file stores in blocks ggml's kernels take; {checkpoint name: the module's weight} for those.
    On a CUDA device, or where the kernels cannot load, none (the loader reads floats); matrices
    of other block types stay floats, said once on stderr."""
    if dev.type != "cpu":  # ggml's CPU kernels only: the loader dequantizes rows to the compute dtype
        return {}
    if not gguf_blocks.load():
        print(f"layerline: --precision gguf: ggml's block kernels are {gguf_blocks.status()}; every matrix "
              f"is held dequantized at {str(dtype).removeprefix('torch.')}", file=sys.stderr, flush=True)
        return {}
    made: dict[str, nn.Module] = {}
    floats: dict[str, int] = {}
    modules = dict(stage.named_modules())
    for key, (name, shape) in expected.items():
        path = key.removesuffix(".weight")
        mod = modules.get(path)
        if len(shape) != 2 or not key.endswith(".weight") or not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue
        if name in made:  # a tied head in the embedding's stage: the very same blocks
            if isinstance(made[name], BlockEmbedding) and isinstance(mod, nn.Linear):
                stage.replace(path, made[name].head())
            continue
        blocks = ck.stored_blocks(name)
        if blocks is None:
            floats[ck.entry(name).stored_type or "float"] = floats.get(ck.entry(name).stored_type or "float", 0) + 1
            continue
        raw, block = blocks
        if shape[1] % gguf_blocks.block_type(block).block:
            floats[block] = floats.get(block, 0) + 1
            continue
        if isinstance(mod, nn.Embedding):
            new = BlockEmbedding.of_blocks(raw, block, shape[0], shape[1], dtype)
        else:
            new = BlockLinearModule.of_blocks(raw, block, shape[0], shape[1])
            if mod.bias is not None:  # loaded with the floats (assign replaces this placeholder)
                new.bias = nn.Parameter(torch.empty(shape[0], dtype=dtype, device="meta"), requires_grad=False)
        stage.replace(path, new)
        made[name] = new
    quantized = {k: n for k, n in floats.items() if k not in ("F32", "F16", "BF16", "F64", "float")}
    if quantized:
        print("layerline: --precision gguf: no block kernel for " + ", ".join(f"{n} {k}" for k, n in quantized.items())
              + f" matrices; they are held dequantized at {str(dtype).removeprefix('torch.')}",
              file=sys.stderr, flush=True)
    return {name: m.weight for name, m in made.items()}


def load_stage(ckpt_dir: str, start: int, end: int, first: bool, last: bool,
               precision: str = "fp32", device: str = "cpu", *,
               expert_cache_bytes: int | None = None) -> Stage:
    """Build the stage for layers [start, end) from `ckpt_dir`, reading only its tensors.

    precision: fp32 | bf16 | fp16 | int8 (weight-only int8, per-row scales, bf16 compute) | int4
    (weight-only int4 in groups of 32, CPU only; embedding and LM head int8) | gguf (a GGUF file's
    matrices as its own blocks, float32 compute; on CUDA dequantized to float32 instead).
    expert_cache_bytes (MoE models only): None loads every expert of the stage's layers; a number
    leaves experts on disk and serves them through an LRUExpertStore holding at most that many
    bytes (`stage.expert_store`, with hit/miss/bytes_read counters in `.stats`).
    """
    prec = precision_row(precision)
    dtype = torch_dtype(prec.compute)
    quant = prec.name if prec.quantized and not prec.stored else None
    if expert_cache_bytes is not None and (isinstance(expert_cache_bytes, bool) or expert_cache_bytes < 0):
        raise LayerlineError(f"expert cache of {expert_cache_bytes!r} bytes: give a non-negative byte count")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise LayerlineError(f"--device {device}: not a device name; use cpu or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LayerlineError(f"--device {device}: CUDA is not available on this host; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise LayerlineError(f"--device {device}: this host has {torch.cuda.device_count()} CUDA device(s); "
                             "use one of them or cpu")
    if quant == "int4":
        require_int4(dev)

    ck = open_checkpoint(ckpt_dir, check=False)  # this stage's tensors are checked below, one by one
    if prec.stored and not isinstance(ck, GGUFCheckpoint):
        raise LayerlineError(f"--precision {prec.name}: {ckpt_dir} is not a GGUF file, so it stores no blocks to "
                             "run as stored; give a .gguf checkpoint or choose --precision fp32, bf16, int8 or int4")
    index = ck.index
    args = ModelArgs.from_config(index.config)
    _check_range(args, start, end, first, last)
    paged = expert_cache_bytes is not None and args.num_experts > 0
    expected = _expected(args, start, end, first, last, resident_experts=not paged)
    if dev.type == "cpu" and (quant or dtype == torch.bfloat16):
        cpu_kernels.load()  # decode's few-row bf16 / int8 matmuls and attention (torch's when it cannot build them)
    with torch.device("meta"):
        stage = Stage(args, start, end, first, last, dtype, quant=quant, resident_experts=not paged)
    meta_state = stage.state_dict(keep_vars=True)
    # checkpoint tensors held as int8 (+ scale): those whose stage tensor is int8; as int4 (packed
    # uint8 + group scales): those whose stage tensor is uint8
    quantized = {expected[k][0] for k, t in meta_state.items() if t.dtype == torch.int8}
    int4 = {expected[k][0] for k, t in meta_state.items() if t.dtype == torch.uint8}

    names: list[str] = []
    for _key, (name, shape) in expected.items():
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
        if name not in names:
            names.append(name)

    loaded: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    load_dev = "cpu" if dev.type == "cpu" else str(dev)
    # gguf: matrices the file stores in blocks the kernels take are held as those blocks (CPU), the
    # rest as floats at the compute dtype, a block of rows at a time
    held = _hold_blocks(stage, ck, expected, dtype, dev) if prec.stored else {}
    matrices = {name for key, (name, shape) in expected.items() if len(shape) == 2} if prec.stored else set()
    for name in names:
        entry = index.tensors[name]
        try:
            if name in held:
                loaded[name] = held[name]
            elif name in matrices:
                loaded[name] = _float_matrix(ck, name, entry.shape, load_dev, dtype)
            elif name in quantized:
                loaded[name], scales[name] = _int8(ck, name, entry.shape, load_dev)
            elif name in int4:
                loaded[name], scales[name] = _int4(ck, name, load_dev, dtype)
            else:
                loaded[name] = ck.tensor(name, load_dev).to(dtype)
        except (OSError, RuntimeError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{ck.file_path(entry)}: cannot read tensors ({msg}); the file may be truncated, "
                                  "re-download it") from e

    state = {}
    for key, (name, _shape) in expected.items():
        state[key] = loaded[name]
        if name in quantized or name in int4:
            state[key[: -len("weight")] + "scale"] = scales[name]
    stage.load_state_dict(state, strict=True, assign=True)
    if first and last and args.tie_word_embeddings:
        if isinstance(stage.embed_tokens, BlockEmbedding):
            stage.replace("lm_head", stage.embed_tokens.head())
        else:
            stage.tie_head()
    if prec.stored:
        stage.kv_dtype = torch_dtype(prec.kv)
    stage.inv_freq = stage.inv_freq.to(dev)
    if paged:
        stage.expert_store = LRUExpertStore(ck, index, dtype, quant, expert_cache_bytes, dev,
                                            layers=range(start, end), num_experts=args.num_experts)
        stage.set_expert_store(stage.expert_store)
    return stage.eval()
