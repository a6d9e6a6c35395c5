"""A stage's safetensors file, written from index entries without holding the stage in memory.

The header is laid out from the entries first (8-byte little-endian length, JSON, spaces to an
8-byte boundary), then each tensor's bytes follow, written by the format's own writer (a byte
range copied in `CHUNK`s, or rows dequantized a block at a time). The SHA-1 is computed on the
bytes as they are written, so the file is never read back. The file is byte for byte what
safetensors' save_file writes for the same tensors.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import BinaryIO, Callable

from ..errors import CheckpointError
from .base import DTYPE_BYTES, TensorEntry

CHUNK = 8 * 2**20  # bytes copied at a time from a source file
# safetensors' order of dtypes in a file (its Dtype enum, descending): widest first
SAVE_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")


class HashingWriter:
    """A file being written, its SHA-1 and byte count kept as it goes."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha1, self.n = f, hashlib.sha1(), 0

    def write(self, data) -> None:
        self.sha1.update(data)
        self.f.write(data)
        self.n += memoryview(data).nbytes


def write_safetensors(path: Path, entries: list[TensorEntry],
                      write_one: Callable[[TensorEntry, HashingWriter], None]) -> str:
    """Write a safetensors file of `entries` (name, dtype, shape, nbytes) to `path`; `write_one(entry,
    out)` writes each tensor's bytes. Returns the file's SHA-1.

    The layout is save_file's (safetensors 0.4 to 0.8): the metadata first, then the tensors widest
    dtype first (`SAVE_ORDER`), then by name, so every tensor's data starts aligned to its element
    size; the same tensors give the same bytes as save_file."""
    rank = {d: i for i, d in enumerate(SAVE_ORDER)}
    order = sorted(entries, key=lambda e: (-DTYPE_BYTES[e.dtype], rank.get(e.dtype, len(rank)), e.name))
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for e in order:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        out = HashingWriter(f)
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for e in order:
            before = out.n
            write_one(e, out)
            if out.n - before != e.nbytes:
                raise CheckpointError(f"{e.name}: wrote {out.n - before} bytes where its header says {e.nbytes}")
    return out.sha1.hexdigest()


class ByteRanges:
    """Copies each entry's stored bytes (its `byte_range` in its file) in `CHUNK`s; a context manager
    that keeps the source files open until it ends."""

    def __init__(self, file_path: Callable[[TensorEntry], Path]):
        self.file_path, self.files = file_path, {}
        self.buf = bytearray(CHUNK)

    def __enter__(self) -> "ByteRanges":
        return self

    def __exit__(self, *exc) -> None:
        for f in self.files.values():
            f.close()

    def copy(self, e: TensorEntry, out: HashingWriter) -> None:
        path = self.file_path(e)
        f = self.files.get(path)
        if f is None:
            f = self.files[path] = open(path, "rb")
        begin, end = e.byte_range
        f.seek(begin)
        left, view = end - begin, memoryview(self.buf)
        while left:
            n = f.readinto(view[: min(left, CHUNK)])
            if not n:
                raise CheckpointError(f"{path}: ends inside tensor {e.name}; the file is truncated, "
                                      "copy or download it again")
            out.write(view[:n])
            left -= n


def write_tensor(t, out: HashingWriter) -> None:
    """One tensor's bytes (already at the entry's dtype), as safetensors lays them out (C order)."""
    import torch
    t = t.detach().to("cpu").contiguous().reshape(-1)
    out.write(t.view(torch.uint8).numpy() if t.numel() else b"")
