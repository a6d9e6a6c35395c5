"""Weight-only int8 with one scale per output channel (row).

A float weight W [N, K] is held as q = round(W / s) in int8 [N, K] and s = max|W[n, :]| / 127 in
float32 [N] (the 1 byte per weight + 4 bytes per row that the precision table,
`layerline.precision`, budgets). The
matmul computes in the stage's activation dtype (bf16): on the CPU through
`torch._weight_int8pack_mm` (int8 weights straight into the kernel, no float copy of W), elsewhere
or when the kernel refuses, by dequantizing the weight for the matmul.

The token embedding is quantized the same way (one scale per vocabulary row), so a tied LM head
shares the int8 tensor and its scales with the embedding.

Weight-only int4 (`Int4Linear`), group-wise asymmetric: each run of `INT4_GROUP` (32) weights along
the input dimension gets a scale s = (max - min) / 15 and a zero z = min + 8 s, and each weight a
code q = round((w - min) / s) in 0..15, so w ≈ (q - 8) s + z (torch's "tinygemm" convention). Two
codes a byte, in one of two layouts, chosen per matrix by `int4_rows` (one place):
- layerline's (`rows`): codes uint8 [N, K / 2] with each 32-weight group's 16 bytes as GGUF's Q4_0 /
  Q4_1 blocks hold them (byte j: code j low, code j + 16 high), regrouped in blocks of 16 groups as
  the kernel reads them (`cpu_kernels.int4_hold`), and each row's (s, z) pairs in bf16
  [N, K / 32, 2], run by `cpu_kernels.linear_int4` (AVX-512 VNNI or AVX2; faster than torch's kernel, see
  docs/kernels.md). Used where that kernel is loaded, for groups of 32 and K a multiple of 64.
- torch's otherwise: packed by `torch._convert_weight_to_int4pack_for_cpu`, (s, z) [K / group, N, 2]
  in the compute dtype, run by `torch._weight_int4pack_mm_for_cpu`. It takes groups of 32, 64, 128
  or 256 and output widths divisible by 16.
Both keep each output row's codes apart, so parts concatenate by rows (`llama.FusedLinears`). A
matrix neither takes is held at int8 instead. An int4 stage keeps its embedding and LM head at int8
(the precision table's `edge`). GGUF Q4_0 / Q4_1 blocks are this layout with 32-weight groups, so
int4 re-quantizes such a file's weights almost exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LayerlineError
from ..precision import INT4_GROUP
from . import cpu_kernels

QMAX = 127
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel takes
INT4_OPS = ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")  # torch 2.6+


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [N, K], scale float32 [N]) with w ≈ q * scale[:, None]."""
    if w.dim() != 2:
        raise ValueError(f"quantize_rows: expected a 2-D weight, got shape {tuple(w.shape)}")
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-12) / QMAX
    q = torch.round(wf / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_row_blocks(blocks, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of an [n, k] matrix given as (first row, float rows) blocks: the same int8 and
    scales, with no float copy of the whole matrix (each row's scale is its own)."""
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    for a, rows in blocks:
        q[a:a + rows.shape[0]], scale[a:a + rows.shape[0]] = quantize_rows(rows)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def _kernel_ok(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")
            and x.dtype in (torch.bfloat16, torch.float32, torch.float16))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (q * scale[:, None]).T (+ bias), result in x's dtype."""
    y = cpu_kernels.linear_int8(x, q, scale, bias)  # a decode step's few rows
    if y is not None:
        return y
    shape = x.shape
    if _kernel_ok(x):
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        try:
            y = torch._weight_int8pack_mm(x2, q, scale.to(x.dtype)).view(*shape[:-1], q.shape[0])
        except (RuntimeError, NotImplementedError):  # an unsupported shape/dtype on this build
            y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    else:
        y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y


class Linear(nn.Linear):
    """nn.Linear whose decode steps (a few bf16 rows on a CPU) go through `cpu_kernels.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """A bias-optional linear layer whose weight is int8 [out, in] with float32 per-row scales.

    state_dict: `weight` (int8), `scale` (float32), and `bias` (compute dtype) when it has one.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> "Int8Linear":
        with torch.device("meta"):
            m = cls(w.shape[1], w.shape[0], bias is not None, dtype)
        m.weight, m.scale = quantize_rows(w)
        if bias is not None:
            m.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Embedding(nn.Module):
    """Token embedding held as int8 rows with a float32 scale per row; looks up and dequantizes."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("weight", torch.zeros(num_embeddings, dim, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(num_embeddings, dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.weight[ids].float() * self.scale[ids].unsqueeze(-1)).to(self.dtype)


# --- int4 -------------------------------------------------------------------------------------------

def int4_kernel_error() -> str | None:
    """Why this torch cannot run int4 (one line), or None when its CPU int4 kernels are there."""
    missing = [o for o in INT4_OPS if not hasattr(torch.ops.aten, o)]
    if missing:
        return (f"--precision int4: this torch {torch.__version__} lacks the CPU int4 kernel "
                f"torch.{missing[0]}; use a torch with it (2.6+) or --precision int8")
    return None


def require_int4(device: torch.device | str = "cpu") -> None:
    """LayerlineError (one line) unless int4 can run on `device` here."""
    err = int4_kernel_error()
    if err:
        raise LayerlineError(err)
    if torch.device(device).type not in ("cpu", "meta"):
        raise LayerlineError(f"--precision int4: runs on the CPU only (layerline's or torch's CPU int4 kernel), not "
                             f"--device {device}; use --precision int8 there")


def int4_rows(in_features: int, group: int = INT4_GROUP) -> bool:
    """Whether an int4 matrix of `in_features` inputs is held in layerline's layout and run by
    `cpu_kernels.linear_int4` (else torch's packing): groups of 32, inputs a multiple of 64, and the
    kernel loaded on this CPU (it loads the kernels once if nothing has)."""
    return group == 32 and in_features % 64 == 0 and cpu_kernels.ready()


def int4_fits(in_features: int, out_features: int, group: int = INT4_GROUP) -> bool:
    """Whether a [out, in] matrix in groups of `group` can be held at int4 here (either layout)."""
    return int4_rows(in_features, group) or (
        group in INT4_GROUPS and in_features % group == 0 and out_features % 16 == 0)


def quantize_groups(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` inputs: (q int32 [N, K] in 0..15, scale_zeros float32
    [K / group, N, 2]) with w[n, k] ≈ (q[n, k] - 8) * s + z, (s, z) = scale_zeros[k // group, n]."""
    if w.dim() != 2 or w.shape[1] % group:
        raise ValueError(f"quantize_groups: expected a 2-D weight with columns divisible by {group}, "
                         f"got shape {tuple(w.shape)}")
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    s = (hi - lo).clamp_min(1e-6) / 15
    q = torch.round((wg - lo) / s).clamp_(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.cat([s, lo + 8 * s], dim=-1).transpose(0, 1).contiguous()
    return q, sz


def _pack_rows(q: torch.Tensor, sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """layerline's int4 layout of codes q [N, K] (0..15) and scale_zeros [K / 32, N, 2]."""
    n, k = q.shape
    g = q.reshape(n, k // 32, 2, 16).to(torch.uint8)  # each group's codes 0..15 and 16..31
    codes = cpu_kernels.int4_hold((g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2))
    return codes, sz.transpose(0, 1).to(torch.bfloat16).contiguous()


def pack_int4(q: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
              group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """`Int4Linear`'s (weight, scale) of codes q int [N, K] in 0..15 and scale_zeros float [K / group,
    N, 2] (`quantize_groups`'s), in the layout `int4_rows` picks for this matrix."""
    if int4_rows(q.shape[1], group):
        return _pack_rows(q, sz)
    require_int4()
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2), sz.to(dtype)


def pack_int4_codes(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """`Int4Linear`'s (weight, scale) of weights already held as 4-bit codes in groups of 32:
    w[n, k] = codes[n, k] * scale[n, g] + offset[n, g], g = k // 32 (GGUF Q4_0 / Q4_1 / Q4_K).
    In the (q - 8) * s + z convention, s = scale and z = offset + 8 * scale."""
    sz = torch.stack([scale.float(), offset.float() + 8 * scale.float()], dim=-1).transpose(0, 1)
    return pack_int4(codes, sz, dtype, 32)


def dequantize_groups(q: torch.Tensor, scale_zeros: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] of `quantize_groups`'s (q, scale_zeros)."""
    n, k = q.shape
    g = k // scale_zeros.shape[0]
    sz = scale_zeros.float().transpose(0, 1)  # [N, K / g, 2]
    w = (q.float().reshape(n, k // g, g) - 8) * sz[..., :1] + sz[..., 1:]
    return w.reshape(n, k).to(dtype)


def dequantize_int4_rows(codes: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] of layerline's int4 layout (codes [N, K / 2], sz [N, K / 32, 2])."""
    n = codes.shape[0]
    c = cpu_kernels.int4_unhold(codes).reshape(n, -1, 16)
    q = torch.cat([c & 15, c >> 4], dim=-1).reshape(n, -1)  # each group's codes in order
    return dequantize_groups(q, sz.transpose(0, 1), dtype)


def int4_linear(x: torch.Tensor, weight: torch.Tensor, group: int, scale: torch.Tensor,
                bias: torch.Tensor | None = None, rows: bool = False) -> torch.Tensor:
    """x [..., in] times the int4 `weight` (Int4Linear's; rows of several such weights concatenate
    into one) -> [..., out] in x's dtype. rows: layerline's layout (else torch's packing)."""
    if rows:
        y = cpu_kernels.linear_int4(x, weight, scale, bias)
        if y is None:  # the kernel turned off since the weight was packed, or not a CPU tensor
            y = F.linear(x, dequantize_int4_rows(weight, scale, x.dtype), bias)
        return y
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(scale.dtype)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if not scale.is_contiguous():  # a fused part's scales (a column view) when it runs alone
        scale = scale.contiguous()
    y = torch._weight_int4pack_mm_for_cpu(x2, weight, group, scale)
    y = y.view(*shape[:-1], weight.shape[0]).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y


class Int4Linear(nn.Module):
    """A bias-optional linear layer with int4 weights in groups (see the module docstring).

    state_dict: `weight` (uint8 [out, in / 2]), `scale` (each group's scale and zero: bf16 [out,
    in / group, 2] in layerline's layout, `rows`; [in / group, out, 2] in the compute dtype in
    torch's) and `bias` (compute dtype) when it has one. The layout is `int4_rows`'s, fixed here.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 group: int = INT4_GROUP):
        super().__init__()
        if not int4_fits(in_features, out_features, group):
            raise ValueError(f"Int4Linear [{out_features}, {in_features}] in groups of {group}: torch's CPU "
                             "kernel wants in % group == 0, out % 16 == 0 and group in 32, 64, 128, 256 "
                             "(layerline's: groups of 32 and in % 64 == 0, where its CPU kernels load)")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.rows = int4_rows(in_features, group)
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        g = in_features // group
        self.register_buffer("scale", torch.zeros(out_features, g, 2, dtype=torch.bfloat16) if self.rows
                             else torch.zeros(g, out_features, 2, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @staticmethod
    def pack(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
             group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, scale) of a float weight, as this module holds them."""
        return pack_int4(*quantize_groups(w, group), dtype, group)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.bfloat16, group: int = INT4_GROUP) -> "Int4Linear":
        with torch.device("meta"):
            m = cls(w.shape[1], w.shape[0], bias is not None, dtype, group)
        m.weight, m.scale = cls.pack(w, dtype, group)
        if bias is not None:
            m.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self.weight, self.group, self.scale, self.bias, self.rows)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 (groups of "
                f"{self.group}, {'layerline' if self.rows else 'torch'}'s layout)")


def quant_name(quant) -> str | None:
    """None, "int8" or "int4" of a stage's quantization flag (True meaning int8, as it used to)."""
    if quant in (None, False):
        return None
    if quant is True:
        return "int8"
    if quant not in ("int8", "int4"):
        raise ValueError(f"quantization {quant!r}: not int8 or int4")
    return quant


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant=None) -> nn.Module:
    """Linear, Int8Linear or Int4Linear by `quant` (None/False, True/"int8", "int4"); an int4 matrix
    the kernel cannot take is int8."""
    quant = quant_name(quant)
    if quant == "int4" and int4_fits(in_features, out_features):
        return Int4Linear(in_features, out_features, bias, dtype)
    if quant:
        return Int8Linear(in_features, out_features, bias, dtype)
    return Linear(in_features, out_features, bias=bias, dtype=dtype)


def is_quantized_weight(module: nn.Module, attr: str) -> bool:
    return isinstance(module, (Int8Linear, Int8Embedding, Int4Linear)) and attr == "weight"
