"""Checkpoints, opened in one place: `open_checkpoint(path)` decides the format once and returns a
`Checkpoint` with `config`, `index`, `tensors(names)`, `tokenizer`, `chat_template`,
`special_tokens` and `write_stage` (what weight staging ships: an HF dir's stage as an HF dir, a
GGUF file's stage as a GGUF file of its own blocks). Nothing else asks which format a
path is.

- hf: a Hugging Face model dir (config.json + *.safetensors, sharded or not).
- gguf: a .gguf file (llama.cpp's format), read with the `gguf` package.
- demo: deterministic random-init demo checkpoints (Hugging Face layout).
- stagefile: a stage's file written from index entries, streamed: safetensors (an HF source) or
  GGUF (a GGUF source's own blocks, copied as byte ranges).
A new format is a module here with a `Checkpoint` subclass and a branch in `open_checkpoint`; the
text side of every format lives in layerline.text.
"""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from ..errors import CheckpointError
from .base import (DTYPE_BYTES, LAYER_RE, ROW_CHUNK_BYTES, STAGE_MANIFEST, SUPPORTED_MODEL_TYPES, Checkpoint,
                   CheckpointIndex, TensorEntry)
from .demo import DEMO_ARCHS, DEMO_DEFAULTS, demo_config, demo_tensor_shapes, write_demo_checkpoint

# the formats' modules load when first named: the GGUF reader brings numpy, the HF one safetensors
# (about 0.15 s), and the Ansible modules on a host that import the package for its constants
# (staging's manifest name, cost's dtype sizes) open no checkpoint
_LAZY = {"GGUFCheckpoint": "gguf", "has_gguf_magic": "gguf", "MAX_HEADER_BYTES": "hf", "HFCheckpoint": "hf",
         "check_index": "hf", "read_safetensors_header": "hf"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_checkpoint(path: str | os.PathLike, *, check: bool = True) -> Checkpoint:
    """The checkpoint at `path`: a stage dir (its layerline-stage.json names the format and the files:
    a GGUF stage's model.gguf or a Hugging Face stage, whatever else the dir holds), a Hugging Face
    model dir, a GGUF file (known by its magic bytes), or a dir without config.json holding one GGUF
    file (a GGUF stage staged without its manifest).
    Nothing is read beyond that until asked for. check (a dir): its index also refuses files cut
    short and a config that disagrees with the weights."""
    from .gguf import GGUFCheckpoint, has_gguf_magic
    from .hf import HFCheckpoint
    p = Path(path)
    if p.is_dir():
        staged = _staged_files(p)
        if staged is not None:  # a stage dir: its manifest names the format and the files, nothing else counts
            fmt, files = staged
            if fmt == "gguf":
                return GGUFCheckpoint(p / next(f for f in files if f.endswith(".gguf")))
            return HFCheckpoint(p, check, only=files)
        if not (p / "config.json").exists():  # a staged GGUF stage: its one .gguf file
            ggufs = sorted(f for f in p.glob("*.gguf") if f.is_file())
            if len(ggufs) == 1 and has_gguf_magic(ggufs[0]):
                return GGUFCheckpoint(ggufs[0])
        return HFCheckpoint(p, check)
    if p.is_file():
        if has_gguf_magic(p):
            return GGUFCheckpoint(p)
        if p.suffix.lower() == ".safetensors":
            raise CheckpointError(f"{p}: one file of a Hugging Face checkpoint; set layerline_checkpoint to the dir "
                                  "that holds it with its config.json")
        raise CheckpointError(f"{p}: not a checkpoint: a file that is not GGUF (it does not start with b'GGUF'); "
                              "set layerline_checkpoint to a .gguf file or to a Hugging Face model dir "
                              "(config.json and *.safetensors)")
    if p.suffix.lower() == ".gguf":
        raise CheckpointError(f"{p}: no such GGUF file; set layerline_checkpoint to a .gguf file or "
                              "a Hugging Face model dir")
    raise CheckpointError(f"{p}: no such checkpoint directory; set layerline_checkpoint to a model dir "
                          "or a .gguf file, or make one with `layerline demo-checkpoint DIR`")


def _staged_files(p: Path) -> tuple[str, list[str]] | None:
    """(format, files) of the stage manifest in dir p (layerline.staging), None when p has none. A
    manifest whose files are not all there is an unfinished staging: refused, not guessed around."""
    try:
        man = json.loads((p / STAGE_MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p / STAGE_MANIFEST}: not a stage manifest ({e}); stage the checkpoint again "
                              "(playbooks/stage.yml)") from None
    files = man.get("files") if isinstance(man, dict) else None
    fmt = man.get("format", "safetensors") if isinstance(man, dict) else None
    if not isinstance(files, dict) or fmt not in ("gguf", "safetensors") or \
            (fmt == "gguf" and not any(str(f).endswith(".gguf") for f in files)):
        raise CheckpointError(f"{p / STAGE_MANIFEST}: not a stage manifest (format {fmt!r}, files "
                              f"{sorted(files) if isinstance(files, dict) else files!r}); stage the checkpoint again "
                              "(playbooks/stage.yml)")
    missing = sorted(str(f) for f in files if not (p / str(f)).is_file())
    if missing:
        raise CheckpointError(f"{p}: staged checkpoint lacks {', '.join(missing)} that its {STAGE_MANIFEST} lists "
                              "(a staging that did not finish); stage it again (playbooks/stage.yml)")
    return fmt, sorted(str(f) for f in files)


def read_index(ckpt: str | os.PathLike, check: bool = True) -> CheckpointIndex:
    """`open_checkpoint(ckpt).index`: the tensor index, from headers only."""
    return open_checkpoint(ckpt, check=check).index


def read_config(ckpt: str | os.PathLike) -> dict:
    """`open_checkpoint(ckpt).config`: the model's config.json keys (a GGUF: derived from its metadata)."""
    return open_checkpoint(ckpt).config


__all__ = [
    "open_checkpoint", "read_index", "read_config", "Checkpoint", "HFCheckpoint", "GGUFCheckpoint",
    "CheckpointError", "CheckpointIndex", "TensorEntry", "check_index", "read_safetensors_header",
    "DTYPE_BYTES", "LAYER_RE", "MAX_HEADER_BYTES", "ROW_CHUNK_BYTES", "STAGE_MANIFEST", "SUPPORTED_MODEL_TYPES",
    "DEMO_ARCHS", "DEMO_DEFAULTS", "demo_config", "demo_tensor_shapes", "write_demo_checkpoint",
]
