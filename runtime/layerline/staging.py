"""Weight staging: a checkpoint dir holding only one stage's tensors, for hosts that do not
share the model's filesystem.

The stage checkpoint keeps the full config.json (the model's shape is the model's), and one
`model.safetensors` with the tensors of layers [start, end) plus the embedding on the first
stage and the final norm and head on the last. A manifest records where it came from and the
file's SHA-1 (what Ansible's copy checks after transfer); a stage already made from the same
source and range is reused.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .checkpoint import STAGE_MANIFEST as MANIFEST
from .checkpoint import read_index
from .errors import LayerlineError
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
    from safetensors.torch import save_file

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
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(idx.tensors[n].file, []).append(n)
    tensors = {}
    for fname, group in by_file.items():
        with open_tensors(ckpt, fname) as f:  # safe_open, or a .gguf's tensors dequantized (bf16 if quantized)
            for n in group:
                tensors[n] = f.get_tensor(n)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if is_gguf(ckpt):  # a GGUF stage is an HF dir: its config, tokenizer and chat template as files
        write_hf_side_files(ckpt, tmp)
    for side in SIDE_FILES:
        if (ckpt / side).exists():
            shutil.copy2(ckpt / side, tmp / side)
    files = sorted(p.name for p in tmp.iterdir())
    man = {**want, "tensors": len(names), "files": {f: {"bytes": (tmp / f).stat().st_size, "sha1": _sha1(tmp / f)}
                                                     for f in files},
           "bytes": sum((tmp / f).stat().st_size for f in files), "model_bytes": idx.total_bytes}
    (tmp / MANIFEST).write_text(json.dumps(man, indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return {**man, "changed": True}


def parse_range(value: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in value.split(":"))
        assert 0 <= a < b
    except (ValueError, AssertionError):
        raise LayerlineError(f"--layers {value!r}: must be A:B with 0 <= A < B") from None
    return a, b
