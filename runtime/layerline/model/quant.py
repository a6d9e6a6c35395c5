"""Weight-only int8 with one scale per output channel (row).

A float weight W [N, K] is held as q = round(W / s) in int8 [N, K] and s = max|W[n, :]| / 127 in
float32 [N] (the 1 byte per weight + 4 bytes per row that the precision table,
`layerline.precision`, budgets). The
matmul computes in the stage's activation dtype (bf16): on the CPU through
`torch._weight_int8pack_mm` (int8 weights straight into the kernel, no float copy of W), elsewhere
or when the kernel refuses, by dequantizing the weight for the matmul.

The token embedding is quantized the same way (one scale per vocabulary row), so a tied LM head
shares the int8 tensor and its scales with the embedding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [N, K], scale float32 [N]) with w ≈ q * scale[:, None]."""
    if w.dim() != 2:
        raise ValueError(f"quantize_rows: expected a 2-D weight, got shape {tuple(w.shape)}")
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-12) / QMAX
    q = torch.round(wf / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def _kernel_ok(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")
            and x.dtype in (torch.bfloat16, torch.float32, torch.float16))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (q * scale[:, None]).T (+ bias), result in x's dtype."""
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


def make_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, int8: bool) -> nn.Module:
    if int8:
        return Int8Linear(in_features, out_features, bias, dtype)
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


def is_quantized_weight(module: nn.Module, attr: str) -> bool:
    return isinstance(module, (Int8Linear, Int8Embedding)) and attr == "weight"
