"""A stage's file, written from index entries without holding the stage in memory: a safetensors
file (`write_safetensors`), or a GGUF file of a GGUF source's own blocks (`write_gguf`).

The header is laid out from the entries first (8-byte little-endian length, JSON, spaces to an
8-byte boundary), then each tensor's bytes follow, written by the format's own writer (a byte
range copied in `CHUNK`s, or rows dequantized a block at a time). The SHA-1 is computed on the
bytes as they are written, so the file is never read back. The file is byte for byte what
safetensors' save_file writes for the same tensors.

A GGUF stage is the source's header cut down: its metadata key/values as raw bytes (tokenizer
included), the stage's tensor infos (GGUF names, shapes, block types, offsets laid out anew at the
source's alignment), then each tensor's stored bytes copied from the source: never dequantized.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from dataclasses import dataclass
from typing import BinaryIO, Callable, Sequence

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


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF stage: its index entry (stored bytes and byte range in the source) and
    its GGUF name, dimensions (innermost first, as GGUF stores them) and block type id."""
    entry: TensorEntry
    name: str
    dims: tuple[int, ...]
    type_id: int


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def gguf_kv_string(key: str, value: str) -> bytes:
    """One GGUF metadata key/value of type string, as GGUF lays it out."""
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", GGUF_STRING, len(v)) + v


GGUF_STRING = 8  # GGUFValueType.STRING


def write_gguf(path: Path, version: int, kv: Sequence[bytes | memoryview], tensors: Sequence[GGUFTensorInfo],
               alignment: int, copy: Callable[[TensorEntry, HashingWriter], None]) -> str:
    """Write a GGUF file: header, the metadata key/values `kv` (each already laid out), `tensors`' infos,
    then each one's bytes by `copy(entry, out)`, every tensor's data aligned to `alignment`. Returns its SHA-1."""
    with open(path, "wb") as f:
        out = HashingWriter(f)
        out.write(struct.pack("<4sIQQ", b"GGUF", version, len(tensors), len(kv)))
        for raw in kv:
            out.write(raw)
        at = 0
        for t in tensors:
            name = t.name.encode()
            out.write(struct.pack("<Q", len(name)) + name + struct.pack(f"<I{len(t.dims)}Q", len(t.dims), *t.dims)
                      + struct.pack("<IQ", t.type_id, at))
            at += _pad(t.entry.stored_bytes or 0, alignment)
        out.write(bytes(_pad(out.n, alignment) - out.n))
        for t in tensors:
            before = out.n
            copy(t.entry, out)
            n = out.n - before
            if n != t.entry.stored_bytes:
                raise CheckpointError(f"{t.name}: wrote {n} bytes where its tensor info says {t.entry.stored_bytes}")
            out.write(bytes(_pad(n, alignment) - n))
    return out.sha1.hexdigest()


def write_tensor(t, out: HashingWriter) -> None:
    """One tensor's bytes (already at the entry's dtype), as safetensors lays them out (C order)."""
    import torch
    t = t.detach().to("cpu").contiguous().reshape(-1)
    out.write(t.view(torch.uint8).numpy() if t.numel() else b"")
