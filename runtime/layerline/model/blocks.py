"""Modules that hold a matrix as its GGUF file stores it (precision gguf) and run it by ggml's kernels.

`BlockLinearModule` is a linear layer over one matrix's blocks (`gguf_blocks.BlockLinear`): its
`weight` is a uint8 buffer of the blocks (in the kernel's layout, `gguf_blocks.LAYOUTS`: Q4_0 / Q4_1
in layerline's int4 rows, Q4_K in ggml's 8-row groups, each without loss; `stored()` gives the file's
bytes back), so state_dict, load_state_dict(assign=True) and moving between CPU tensors see the bytes
the stage holds, and nothing else. Its block type is the file's for that matrix, so a stage's modules are made at load
(`of_blocks`), not by the stage's constructor: a Q4_K_M file mixes Q4_K, Q6_K, Q5_0 and Q8_0.

`BlockEmbedding` looks tokens up in the same blocks (each id's row dequantized alone); a tied LM
head is a `BlockLinearModule` over the embedding's very tensor (`head`), so the blocks are held once.

Output is float32 (ggml's), cast to the input's dtype. CPU only: a CUDA stage at gguf holds its
matrices dequantized to the compute dtype (the loader's choice; ggml's CUDA kernels are not here).
"""
from __future__ import annotations

import torch
from torch import nn

from .gguf_blocks import BlockLinear


class BlockLinearModule(nn.Module):
    """x @ W.T (+ bias) over W's GGUF blocks. state_dict: `weight` (uint8 [out, row_bytes]) and `bias`
    (compute dtype) when it has one."""

    def __init__(self, kernel: BlockLinear, bias: torch.Tensor | None = None):
        super().__init__()
        self.kernel = kernel  # a plain object: the call's function pointers and shapes, not state
        self.in_features, self.out_features = kernel.in_features, kernel.out_features
        self.register_buffer("weight", kernel.raw)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def of_blocks(cls, raw: torch.Tensor, block: str, out_features: int, in_features: int,
                  bias: torch.Tensor | None = None) -> "BlockLinearModule":
        """A module over the file's blocks `raw` (uint8 [out, row_bytes], rows in HF order) of type `block`."""
        return cls(BlockLinear(raw, block, out_features, in_features), bias)

    @property
    def block(self) -> str:
        return self.kernel.type.name

    @property
    def repacked(self) -> bool:
        return self.kernel.repacked

    @property
    def layout(self) -> str:
        return self.kernel.layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.run(x, self.weight, self.bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def stored(self) -> torch.Tensor:
        """The blocks as the file stores them (uint8 [out, row_bytes])."""
        return torch.from_numpy(self.kernel.file_rows(self.weight.numpy(), self.out_features))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.block} blocks"
                f"{f' ({self.layout})' if self.repacked else ''}")


class BlockEmbedding(nn.Module):
    """Token embedding over a matrix's GGUF blocks: each id's row dequantized from its own blocks."""

    def __init__(self, kernel: BlockLinear, dtype: torch.dtype):
        super().__init__()
        self.kernel, self.dtype = kernel, dtype
        self.register_buffer("weight", kernel.raw)

    @classmethod
    def of_blocks(cls, raw: torch.Tensor, block: str, num_embeddings: int, dim: int,
                  dtype: torch.dtype) -> "BlockEmbedding":
        return cls(BlockLinear(raw, block, num_embeddings, dim), dtype)

    def head(self) -> BlockLinearModule:
        """A tied LM head over these very blocks (no second copy)."""
        m = BlockLinearModule(self.kernel)
        m.weight = self.weight
        return m

    # ggml's dequantizer through ctypes stays outside any compiled graph: Stage.compile wraps this
    # in torch.compiler.disable (keep_out_of_graphs), not a decorator here, since the decorator
    # imports torch._dynamo, about 1 s of CPU in every process that imports this module
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        k = self.kernel
        if self.weight is not k.raw:  # the buffer was replaced (assign, or a tie): look up in it
            k.raw = self.weight
        return k.rows(ids).to(self.dtype)

    def extra_repr(self) -> str:
        k = self.kernel
        return f"{k.out_features}, {k.in_features}, {k.type.name} blocks{f' ({k.layout})' if k.repacked else ''}"


def keep_out_of_graphs(model: nn.Module) -> None:
    """Make model's block embeddings run eagerly inside a torch.compile'd forward (call before
    compiling it)."""
    for m in model.modules():
        if isinstance(m, BlockEmbedding) and "forward" not in vars(m):
            m.forward = torch.compiler.disable(m.forward)


def is_block_module(m: nn.Module) -> bool:
    return isinstance(m, (BlockLinearModule, BlockEmbedding))


def fuse_blocks(parts: list[BlockLinearModule]) -> BlockLinear | None:
    """One kernel over the parts' rows concatenated (their weights become views into it), when they
    share a block type and layout (exact: each row's blocks are its own; repacked parts keep whole
    8-row groups), else None. Returns the kernel; its `raw` is the fused weight."""
    first = parts[0]
    if any(m.block != first.block or m.layout != first.layout or m.in_features != first.in_features
           or m.weight.is_meta for m in parts):
        return None
    sizes = [m.out_features for m in parts]
    with torch.no_grad():
        w = torch.cat([m.weight.reshape(m.out_features, -1) for m in parts])
    k = BlockLinear(w, first.block, sum(sizes), first.in_features, layout=first.layout, packed=True)
    for m, wi in zip(parts, k.raw.split(sizes)):
        # views into the fused blocks, in the module and its kernel alike: no part keeps its own copy
        m.weight = m.kernel.raw = wi
    return k
