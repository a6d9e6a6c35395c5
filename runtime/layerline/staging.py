"""Weight staging: a checkpoint dir holding only one stage's tensors, for hosts that do not
share the model's filesystem.

The stage checkpoint keeps the full config.json (the model's shape is the model's), and one
`model.safetensors` with the tensors of layers [start, end) plus the embedding on the first
stage and the final norm and head on the last. A manifest records where it came from and the
file's SHA-1 (what Ansible's copy checks after transfer); a stage already made from the same
source and range is reused.

The stage file is written here, not by safetensors' save_file: its header is laid out from the
index first (a safetensors header: 8-byte little-endian length, JSON, spaces to an 8-byte
boundary), then each tensor's bytes follow, copied from the source file as a byte range in
bounded chunks (`CHUNK`), never read whole into memory. A GGUF source is dequantized a block of
rows at a time (gguf_checkpoint.read_row_blocks), each written as soon as it is made. The SHA-1
is computed on the bytes as they are written, so the file is not read back. The controller's
memory grows by a chunk, not by the stage. The file is byte for byte what save_file wrote.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

from .checkpoint import DTYPE_BYTES, CheckpointError, _header_end, read_safetensors_header
from .checkpoint import STAGE_MANIFEST as MANIFEST
from .checkpoint import read_index
from .errors import LayerlineError

CHUNK = 8 * 2**20  # bytes copied at a time from a source safetensors file
# safetensors' order of dtypes in a file (its Dtype enum, descending): widest first
SAVE_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json")


def _source_stamp(ckpt: Path) -> list:
    """What the source is: each safetensors file's name, size and mtime (a .gguf: the file's)."""
    if ckpt.is_file():
        return [[ckpt.name, ckpt.stat().st_size, int(ckpt.stat().st_mtime)]]
    return [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in sorted(ckpt.glob("*.safetensors"))]


def _sha1(path: Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def stage_checkpoint(src: str, start: int, end: int, first: bool, last: bool, out: str) -> dict:
    """Make (or reuse) the stage checkpoint; returns its manifest plus "changed"."""
    from .gguf_checkpoint import is_gguf, open_tensors, write_hf_side_files

    from .model.loader import stage_tensor_names

    ckpt, dest = Path(src), Path(out)
    idx = read_index(ckpt)
    want = {"source": str(ckpt.resolve()), "stamp": _source_stamp(ckpt), "layers": [start, end],
            "first": first, "last": last}
    man_path = dest / MANIFEST
    if man_path.exists():
        try:
            man = json.loads(man_path.read_text())
            if {k: man.get(k) for k in want} == want and (dest / "model.safetensors").exists():
                return {**man, "changed": False}
        except ValueError:
            pass
    names = stage_tensor_names(idx, start, end, first, last)
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        entries = [idx.tensors[n] for n in names]
        if is_gguf(ckpt):
            with open_tensors(ckpt, ckpt.name) as f:  # dequantized, at the index's (planned) dtype
                model = _write_stage_file(tmp / "model.safetensors", entries,
                                          lambda e, out: _write_gguf_tensor(ckpt, f, e, out))
        else:  # each tensor's bytes copied as a byte range of its source file
            with _ByteRanges(ckpt) as src:
                model = _write_stage_file(tmp / "model.safetensors", entries, src.copy)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if is_gguf(ckpt):  # a GGUF stage is an HF dir: its config, tokenizer and chat template as files
        write_hf_side_files(ckpt, tmp)
    for side in SIDE_FILES:
        if (ckpt / side).exists():
            shutil.copy2(ckpt / side, tmp / side)
    files = sorted(p.name for p in tmp.iterdir())
    sums = {"model.safetensors": model}
    man = {**want, "tensors": len(names),
           "files": {f: {"bytes": (tmp / f).stat().st_size, "sha1": sums.get(f) or _sha1(tmp / f)} for f in files},
           "bytes": sum((tmp / f).stat().st_size for f in files), "model_bytes": idx.total_bytes}
    (tmp / MANIFEST).write_text(json.dumps(man, indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return {**man, "changed": True}


class _HashingWriter:
    """A file being written, its SHA-1 and byte count kept as it goes."""

    def __init__(self, f):
        self.f, self.sha1, self.n = f, hashlib.sha1(), 0

    def write(self, data) -> None:
        self.sha1.update(data)
        self.f.write(data)
        self.n += memoryview(data).nbytes


def _write_stage_file(path: Path, entries: list, write_one) -> str:
    """Write a safetensors file of `entries` (TensorEntry: name, dtype, shape, nbytes) to `path`;
    `write_one(entry, out)` writes each tensor's bytes to `out`. Returns the file's SHA-1.

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
        out = _HashingWriter(f)
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for e in order:
            before = out.n
            write_one(e, out)
            if out.n - before != e.nbytes:
                raise CheckpointError(f"{e.name}: wrote {out.n - before} bytes where its header says {e.nbytes}")
    return out.sha1.hexdigest()


class _ByteRanges:
    """Each tensor's bytes in a checkpoint dir's safetensors files, copied in `CHUNK`s."""

    def __init__(self, root: Path):
        self.root, self.files, self.offsets = root, {}, {}
        self.buf = bytearray(CHUNK)

    def __enter__(self) -> "_ByteRanges":
        return self

    def __exit__(self, *exc) -> None:
        for f in self.files.values():
            f.close()

    def _open(self, fname: str):
        if fname not in self.files:
            path = self.root / fname
            self.offsets[fname] = (_header_end(path), {n: m["data_offsets"] for n, m in
                                                       read_safetensors_header(path).items() if n != "__metadata__"})
            self.files[fname] = open(path, "rb")
        return self.files[fname]

    def copy(self, e, out: _HashingWriter) -> None:
        f = self._open(e.file)
        base, spans = self.offsets[e.file]
        begin, end = (int(x) for x in spans[e.name])
        f.seek(base + begin)
        left, view = end - begin, memoryview(self.buf)
        while left:
            n = f.readinto(view[: min(left, CHUNK)])
            if not n:
                raise CheckpointError(f"{self.root / e.file}: ends inside tensor {e.name}; the file is truncated, "
                                      "copy or download it again")
            out.write(view[:n])
            left -= n


def _write_tensor(t, out: _HashingWriter) -> None:
    """One tensor's bytes (already at the entry's dtype), as safetensors lays them out (C order)."""
    import torch
    t = t.detach().to("cpu").contiguous().reshape(-1)
    out.write(t.view(torch.uint8).numpy() if t.numel() else b"")


def _write_gguf_tensor(ckpt: Path, f, e, out: _HashingWriter) -> None:
    """A GGUF tensor dequantized to its planned dtype: a matrix a block of rows at a time, anything
    else whole (a norm's vector)."""
    import torch

    from .gguf_checkpoint import read_row_blocks
    if len(e.shape) != 2:
        _write_tensor(f.get_tensor(e.name), out)
        return
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[e.dtype]
    for _a, rows in read_row_blocks(ckpt, e.name):
        _write_tensor(rows.to(dtype), out)


def parse_range(value: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in value.split(":"))
        assert 0 <= a < b
    except (ValueError, AssertionError):
        raise LayerlineError(f"--layers {value!r}: must be A:B with 0 <= A < B") from None
    return a, b
