"""What every checkpoint format offers: the tensor index's types and the `Checkpoint` interface.

Tensors are keyed by their Hugging Face names whatever the format, with torch-order shapes.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from ..errors import CheckpointError

if TYPE_CHECKING:
    import torch

# Bytes per element of every safetensors dtype we may meet in a header.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
LAYER_RE = re.compile(r"^(?:model\.layers|blk|transformer\.h|model\.decoder\.layers)\.(\d+)\.")
# a staged checkpoint (layerline.staging) holds one stage's tensors; this file says which
STAGE_MANIFEST = "layerline-stage.json"
# the families layerline's model code runs (config.json model_type)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "gemma2", "gemma3_text", "phi3")
# GGUF block types a matrix may be held and run in as stored (model.gguf_blocks.BLOCK_TYPES's names)
STORED_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
ROW_CHUNK_BYTES = 8 * 2**20  # float32 bytes decoded at a time when a matrix is read a block of rows at a time


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the index. `dtype` / `nbytes` are what it is planned at (a quantized GGUF
    tensor: bf16, its dequantized size); `stored_type` / `stored_bytes` what the file holds (the
    safetensors dtype, or the GGUF block type such as Q4_1), at byte `offset` of `file`."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # file name relative to the checkpoint dir (a GGUF: the file's own name)
    nbytes: int
    stored_type: str | None = None
    stored_bytes: int | None = None
    offset: int | None = None  # where its stored bytes start in `file` (from the file's start)

    @property
    def layer(self) -> int | None:
        m = LAYER_RE.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def byte_range(self) -> tuple[int, int]:
        """[start, end) of its stored bytes in `file`."""
        if self.offset is None or self.stored_bytes is None:
            raise CheckpointError(f"tensor {self.name}: its index entry has no byte range")
        return self.offset, self.offset + self.stored_bytes


@dataclass
class CheckpointIndex:
    path: str
    config: dict
    tensors: dict[str, TensorEntry] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        layers = {t.layer for t in self.tensors.values() if t.layer is not None}
        return max(layers) + 1 if layers else 0

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def stored_bytes(self) -> int:
        """The bytes the file(s) hold for these tensors."""
        return sum(t.stored_bytes if t.stored_bytes is not None else t.nbytes for t in self.tensors.values())


class Checkpoint(ABC):
    """A model checkpoint, whatever its format; made by `open_checkpoint`, which alone decides the
    format. Everything is read lazily and kept: the config and index from headers only, tensors
    when asked for, the text side when asked for."""

    def __init__(self, path: Path):
        self.path = path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    # --- the model ---------------------------------------------------------------------------------

    @cached_property
    def config(self) -> dict:
        """The model's config in Hugging Face's config.json keys."""
        return self._read_config()

    @cached_property
    def index(self) -> CheckpointIndex:
        """Every tensor's entry (HF names), from the headers alone."""
        return self._read_index()

    @abstractmethod
    def _read_config(self) -> dict: ...

    @abstractmethod
    def _read_index(self) -> CheckpointIndex: ...

    def entry(self, name: str) -> TensorEntry:
        e = self.index.tensors.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: tensor {name} is not in this checkpoint")
        return e

    def file_path(self, entry: TensorEntry) -> Path:
        """The file holding `entry`'s bytes."""
        return self.path / entry.file

    @abstractmethod
    def source_files(self) -> list[Path]:
        """The files whose bytes make up the weights (what a stage's source stamp and a disk probe read)."""

    # --- tensors -----------------------------------------------------------------------------------

    @abstractmethod
    def tensors(self, names: Iterable[str], device: str = "cpu",
                planned: bool = False) -> Iterator[tuple[str, "torch.Tensor"]]:
        """(name, tensor) for each of `names`, in that order, reading only their bytes: a safetensors
        tensor as stored, a GGUF one dequantized to float32 in Hugging Face layout. planned: cast
        each to its index dtype (what staging writes)."""

    def tensor(self, name: str, device: str = "cpu") -> "torch.Tensor":
        return next(iter(self.tensors([name], device)))[1]

    def close(self) -> None:  # noqa: B027 (a no-op by default: a checkpoint that holds no files need not define it)
        """Let go of the files held open for reading tensors (they reopen when asked again)."""

    @abstractmethod
    def row_blocks(self, name: str, max_bytes: int = ROW_CHUNK_BYTES) -> Iterator[tuple[int, "torch.Tensor"]]:
        """(first row, float32 rows [r, K]) of matrix `name` in Hugging Face layout, at most `max_bytes`
        of float32 at a time (at least one row), so no float copy of the whole matrix is made."""

    def int4_codes(self, name: str) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"] | None:
        """(codes int32 [N, K] in 0..15, scale, offset float32 [N, K / 32]) when the file stores matrix
        `name` as 4-bit codes in groups of 32 (weight = code * scale + offset), else None."""
        return None

    def stored_blocks(self, name: str) -> tuple["torch.Tensor", str] | None:
        """(uint8 [N, row_bytes] of the file's own quantized blocks, rows in Hugging Face order; the
        block type's name, e.g. "Q4_K") when matrix `name` is stored in one of `STORED_BLOCK_TYPES`,
        else None (a float tensor, another format, a block type without kernels here)."""
        return None

    # --- staging -----------------------------------------------------------------------------------

    @abstractmethod
    def write_stage(self, names: list[str], out: Path) -> dict[str, str]:
        """Write a stage checkpoint of tensors `names` into dir `out`: a Hugging Face dir (config.json,
        model.safetensors, the text files) that `open_checkpoint` reads back. Returns {file name:
        SHA-1} of the files hashed while written (the rest the caller hashes)."""

    # --- the text side -----------------------------------------------------------------------------

    @cached_property
    def tokenizer(self):
        """The `tokenizers.Tokenizer`, None when the checkpoint has none; CheckpointError when it has
        one layerline cannot build."""
        return self._read_tokenizer()

    @cached_property
    def chat_template(self) -> str | None:
        """The chat template's jinja source, None when there is none."""
        return self._read_chat_template()

    @cached_property
    def special_tokens(self) -> dict:
        """{"bos", "eos", "pad", "unk"} -> {"id": int | None, "text": str | None}, plus "eos_ids" (every
        stop id) and "add_bos" (whether prompts start with BOS)."""
        return self._read_special_tokens()

    @abstractmethod
    def _read_tokenizer(self): ...

    @abstractmethod
    def _read_chat_template(self) -> str | None: ...

    @abstractmethod
    def _read_special_tokens(self) -> dict: ...

    def require_tokenizer(self):
        """The tokenizer, or one clear error saying there is none."""
        tok = self.tokenizer
        if tok is None:
            raise CheckpointError(f"{self.path}: has no tokenizer (a Hugging Face dir needs tokenizer.json, a GGUF "
                                  "tokenizer.ggml.* metadata); give token ids instead")
        return tok


__all__ = ["DTYPE_BYTES", "LAYER_RE", "STAGE_MANIFEST", "SUPPORTED_MODEL_TYPES", "ROW_CHUNK_BYTES", "STORED_BLOCK_TYPES",
           "TensorEntry", "CheckpointIndex", "Checkpoint", "CheckpointError"]
