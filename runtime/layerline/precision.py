"""The one table of precisions a worker may run: compute dtype, weight bytes, quantized or not, KV dtype.

Torch-free (the cost model and the planner read it without loading torch); `torch_dtype` imports
torch when a caller actually wants a dtype object.

    name   compute    weight bytes/param   quantized   KV cache by default
    fp32   float32    4                    no          fp32
    bf16   bfloat16   2                    no          bf16
    fp16   float16    2                    no          fp16
    int8   bfloat16   1 (+ 4 per row)      yes         bf16   (weight-only: activations and KV stay bf16)
    int4   bfloat16   0.625                yes         bf16   (weight-only; embedding and LM head at int8)
    gguf   float32    as the file stores   yes         fp32   (each matrix in its GGUF file's own blocks)

int8 carries one float32 scale per output row of every matrix (`row_bytes`, `QUANT_ROW_BYTES`).
int4 holds two weights a byte plus a bf16 scale and a bf16 zero per group of `INT4_GROUP` (32)
weights along the input dimension: 0.5 + 4/32 = 0.625 bytes a weight, nothing per row. Its token
embedding and LM head stay int8 (`edge`): a lookup wants whole rows, and the head is the layer
most sensitive to rounding. gguf holds every matrix in the blocks its GGUF file stores (Q4_K, Q6_K,
Q8_0, ...; `stored`), run by ggml's kernels as llama.cpp runs them, so its bytes are the file's
(the cost model reads them from the index, not from `weight_bytes`). Its activations are float32, as
llama.cpp's CPU backend keeps them (ggml's kernels take and give float32; bf16 activations decoded no
faster, only adding casts), and so is its KV cache by default: the decode attention kernel wants the
cache in the activations' dtype, and an fp16 cache (llama.cpp's) decoded 13-20% slower at 128 tokens
of context, by casting the cache each step. The KV cache is held in one of `KV_DTYPES` (a plan's `kv_dtype`, the worker's
`--kv-dtype`); without one it follows its precision's `kv` column.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import LayerlineError


@dataclass(frozen=True)
class Precision:
    name: str
    compute: str          # torch dtype name activations, norms and biases compute in
    weight_bytes: float   # bytes per weight parameter
    quantized: bool       # weights held quantized (weight-only: activations stay in `compute`)
    kv: str               # the KV cache's dtype (a KV_DTYPES name) unless a plan says otherwise
    row_bytes: int = 0    # bytes per output row of every matrix on top of `weight_bytes` (int8's scales)
    edge: str = ""        # the precision the embedding and LM head are held at ("": this one)
    stored: bool = False  # weights as the checkpoint stores them (bytes from the index, not weight_bytes)

    @property
    def edge_precision(self) -> str:
        return self.edge or self.name


INT4_GROUP = 32  # int4 weights per (bf16 scale, bf16 zero) pair, along the input dimension

PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", "float32", 4.0, False, "fp32"),
    Precision("bf16", "bfloat16", 2.0, False, "bf16"),
    Precision("fp16", "float16", 2.0, False, "fp16"),
    Precision("int8", "bfloat16", 1.0, True, "bf16", row_bytes=4),  # weight-only: its KV cache is bf16
    Precision("int4", "bfloat16", 0.5 + 4 / INT4_GROUP, True, "bf16", edge="int8"),
    Precision("gguf", "float32", 0.0, True, "fp32", stored=True),
)}
QUANT_ROW_BYTES = 4  # int8's float32 scale per output row

# KV cache dtypes: name -> (torch dtype name, bytes per element)
KV_DTYPES: dict[str, tuple[str, int]] = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}
# other spellings of the float precisions (torch's dtype names, "half")
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
# KV dtype spellings a plan or --kv-dtype may use: the names and torch's dtype names
KV_NAMES = {**{k: k for k in KV_DTYPES}, **{t: k for k, (t, _) in KV_DTYPES.items()}}


def precision(name: str, field: str = "--precision") -> Precision:
    """The table row of a precision name or alias; LayerlineError naming `field` otherwise."""
    p = PRECISIONS.get(ALIASES.get(name, name)) if isinstance(name, str) else None
    if p is None:
        raise LayerlineError(f"{field} {name}: unknown; choose one of {', '.join(PRECISIONS)}")
    return p


def kv_name(precision_name: str, kv_dtype: str | None = None, field: str = "--kv-dtype") -> str:
    """The KV cache dtype name (a KV_DTYPES key) of a stage: `kv_dtype` when given, else its precision's."""
    if kv_dtype is None:
        return precision(precision_name).kv
    k = KV_NAMES.get(kv_dtype) if isinstance(kv_dtype, str) else None
    if k is None:
        raise LayerlineError(f"{field} {kv_dtype}: must be one of {', '.join(KV_DTYPES)}")
    return k


def kv_bytes(name: str) -> int:
    """Bytes per KV element of a KV dtype name or torch spelling."""
    return KV_DTYPES[KV_NAMES[name]][1]


def torch_dtype(name: str):
    """The torch dtype of a torch dtype name ("bfloat16"), a precision ("int8": its compute dtype)
    or a KV dtype name."""
    import torch
    if name in KV_NAMES:
        name = KV_DTYPES[KV_NAMES[name]][0]
    elif name in PRECISIONS or name in ALIASES:
        name = precision(name).compute
    return getattr(torch, name)


def of_dtype(compute: str, quantized: bool = False) -> Precision:
    """The precision that computes in torch dtype name `compute` (int8 when `quantized`; int4 shares
    int8's compute and KV columns)."""
    for p in PRECISIONS.values():
        if p.compute == compute and p.quantized == quantized:
            return p
    raise LayerlineError(f"no precision computes in {compute}{' with quantized weights' if quantized else ''}; "
                         f"choose one of {', '.join(PRECISIONS)}")
