"""Weight staging: a checkpoint dir holding only one stage's tensors, for hosts that do not
share the model's filesystem.

The stage holds the tensors of layers [start, end) plus the embedding on the first stage and the
final norm and head on the last, written by the source checkpoint itself (`Checkpoint.write_stage`,
streamed; layerline.checkpoint.stagefile): from a Hugging Face dir, the full config.json, the text
files and one `model.safetensors` of byte ranges of its files; from a GGUF file, one `model.gguf`
of the file's own blocks copied as byte ranges, with all its metadata and the model's config. A
manifest records where it came from and each file's SHA-1 (what Ansible's copy checks after
transfer); a stage already made from the same source and range is reused. The controller's
memory grows by a chunk, not by the stage.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .checkpoint import STAGE_MANIFEST as MANIFEST
from .checkpoint import open_checkpoint
from .checkpoint.stagefile import CHUNK  # noqa: F401  (the copy chunk; tests report it)
from .errors import LayerlineError


def _sha1(path: Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _reusable(dest: Path, want: dict) -> dict | None:
    """The manifest of a stage already at `dest` made from the same source and range, else None."""
    try:
        man = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = man.get("files") if isinstance(man, dict) else None
    if {k: man.get(k) for k in want} != want or not isinstance(files, dict) or not files:
        return None
    return man if all((dest / f).exists() for f in files) else None


def stage_checkpoint(src: str, start: int, end: int, first: bool, last: bool, out: str) -> dict:
    """Make (or reuse) the stage checkpoint; returns its manifest plus "changed"."""
    ck, dest = open_checkpoint(src), Path(out)
    idx = ck.index
    stamp = [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in ck.source_files()]
    # the stage's format too: a stage written in another format by an older layerline is made again
    want = {"source": str(Path(src).resolve()), "stamp": stamp, "layers": [start, end],
            "first": first, "last": last, "format": getattr(ck, "stage_format", "safetensors")}
    man = _reusable(dest, want)
    if man is not None:
        return {**man, "changed": False}
    # torch comes with the loader (seconds of CPU): a stage that is already there does without it,
    # as every deploy after the first one does on each host
    from .model.loader import stage_tensor_names
    names = stage_tensor_names(idx, start, end, first, last)
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        sums = ck.write_stage(names, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p.name for p in tmp.iterdir())
    man = {**want, "tensors": len(names),
           "files": {f: {"bytes": (tmp / f).stat().st_size, "sha1": sums.get(f) or _sha1(tmp / f)} for f in files},
           "bytes": sum((tmp / f).stat().st_size for f in files), "model_bytes": idx.total_bytes,
           "stored_bytes": idx.stored_bytes}
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
