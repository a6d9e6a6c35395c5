"""Weight staging copies each tensor as a byte range of its source file, in bounded chunks: a stage
of about 0.55 GB (2.1 GB with LAYERLINE_BIG_STAGE=1, the README's figure) stages with the staging
process's memory growing by far less than the stage (a whole-tensor copy grows by about the stage).

The big checkpoint is written here a chunk at a time (random bf16 bit patterns, never NaN or inf),
so the test itself never holds it either; staging runs in its own process, whose peak RSS over its
RSS after imports is the figure asserted (and printed: `pytest -s`)."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from layerline.checkpoint import demo_config, demo_tensor_shapes, read_index, write_demo_checkpoint
from layerline.model.loader import load_stage, stage_tensor_names
from layerline.checkpoint.stagefile import CHUNK
from layerline.staging import stage_checkpoint

BIG = os.environ.get("LAYERLINE_BIG_STAGE") == "1"
HIDDEN, MIN_BYTES = (4096, 2 * 10**9) if BIG else (2048, 5 * 10**8)  # ~354 / ~88 MB a layer (bf16)
GROWTH_LIMIT = (200 if BIG else 100) * 2**20
POOL = np.random.default_rng(0).integers(0, 2**16, 24 * 2**20 // 2, dtype=np.uint16) & 0xBFFF  # exponent < 255


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """A bf16 safetensors file of these tensors, written a chunk at a time from slices of POOL taken at
    offsets that depend on the tensor and the chunk (so a byte range copied from the wrong place shows)."""
    header, at = {}, 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, _shape in tensors:
            left = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            while left:
                n = min(left, 4 * 2**20) // 2
                o = int(rng.integers(0, POOL.size - n))
                f.write(POOL[o:o + n].tobytes())
                left -= 2 * n


def _big_checkpoint(root: Path, layers: int, hidden: int, shards: int = 2) -> Path:
    cfg = demo_config("llama", layers=layers, hidden=hidden, vocab=1024)
    cfg["torch_dtype"] = "bfloat16"
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    shapes = demo_tensor_shapes(cfg)
    per = -(-len(shapes) // shards)
    for k in range(shards):
        _write_shard(root / f"model-{k + 1:05d}-of-{shards:05d}.safetensors", shapes[k * per:(k + 1) * per], seed=k)
    return root


_STAGE_AND_MEASURE = r"""
import json, sys, time
import layerline.staging, layerline.model.loader, layerline.checkpoint, safetensors  # the imports staging needs
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
try:  # reset the peak (VmHWM) to the current RSS, so it measures staging alone
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    pass
base = status("VmRSS")
t0 = time.perf_counter()
man = layerline.staging.stage_checkpoint(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), True, False, sys.argv[4])
print(json.dumps({"seconds": time.perf_counter() - t0, "base": base, "peak": status("VmHWM"), "bytes": man["bytes"]}))
"""


def _bytes_of(path: Path, name: str, begin: int, n: int) -> bytes:
    """`n` bytes from offset `begin` of tensor `name`'s data in safetensors file `path`."""
    with open(path, "rb") as f:
        (h,) = struct.unpack("<Q", f.read(8))
        start = json.loads(f.read(h))[name]["data_offsets"][0]
        f.seek(8 + h + start + begin)
        return f.read(n)


@pytest.mark.e2e  # writes and stages ~0.6 GB (~2.5 GB BIG) on disk: slow, not a unit check
def test_a_big_stage_stages_with_bounded_memory(tmp_path):
    t0 = time.perf_counter()
    src = _big_checkpoint(tmp_path / "big", layers=7, hidden=HIDDEN)
    written = time.perf_counter() - t0
    idx = read_index(src)
    names = stage_tensor_names(idx, 0, 6, True, False)
    stage_bytes = sum(idx.tensors[n].nbytes for n in names)
    assert stage_bytes > MIN_BYTES
    out = tmp_path / "stage"
    r = subprocess.run([sys.executable, "-c", _STAGE_AND_MEASURE, str(src), "0", "6", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["base"]
    print(f"\nstaged {stage_bytes / 1e9:.2f} GB (layers 0:6 of 7, {len(names)} tensors) in {m['seconds']:.1f} s; "
          f"the staging process grew by {growth / 2**20:.1f} MiB over {m['base'] / 2**20:.0f} MiB after imports "
          f"(chunk {CHUNK // 2**20} MiB; writing the source took {written:.1f} s)")
    assert growth < GROWTH_LIMIT, f"staging grew by {growth / 2**20:.0f} MiB"

    man = json.loads((out / "layerline-stage.json").read_text())
    staged = out / "model.safetensors"
    assert man["files"]["model.safetensors"]["bytes"] == staged.stat().st_size
    h = hashlib.sha1()
    with open(staged, "rb") as f:
        for block in iter(lambda: f.read(2**24), b""):
            h.update(block)
    assert man["files"]["model.safetensors"]["sha1"] == h.hexdigest()
    staged_idx = read_index(out)  # a complete, untruncated stage checkpoint
    assert sorted(staged_idx.tensors) == sorted(names)
    # every tensor: its first, middle and last bytes are the source's; a sample whole, through safe_open
    for n in names:
        e = idx.tensors[n]
        for begin in (0, e.nbytes // 2 - 4096, e.nbytes - 4096):
            begin = max(0, begin)
            assert _bytes_of(staged, n, begin, 4096) == _bytes_of(src / e.file, n, begin, 4096), n
    sample = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
              "model.layers.3.self_attn.k_proj.weight", "model.layers.5.mlp.down_proj.weight"]
    with safe_open(str(staged), "pt") as got:
        for n in sample:
            with safe_open(str(src / idx.tensors[n].file), "pt") as want:
                assert torch.equal(got.get_tensor(n).view(torch.int16), want.get_tensor(n).view(torch.int16)), n


def test_staged_file_is_the_source_bytes_and_loads_the_same(tmp_path):
    """A small two-shard checkpoint: the stage file is a valid safetensors file (aligned, readable by
    safe_open and the loader), each tensor equal to the source's, its SHA-1 in the manifest."""
    src = write_demo_checkpoint(tmp_path / "ckpt", layers=4, hidden=128, vocab=500, dtype="bfloat16", seed=0)
    from safetensors.torch import load_file, save_file
    full = {}
    for f in sorted(src.glob("*.safetensors")):
        full.update(load_file(str(f)))
        f.unlink()
    (src / "model.safetensors.index.json").unlink(missing_ok=True)
    keys = sorted(full)
    full["model.norm.weight"] = full["model.norm.weight"].float()  # a second dtype: alignment across dtypes
    save_file({k: full[k] for k in keys[::2]}, str(src / "a.safetensors"))
    save_file({k: full[k] for k in keys[1::2]}, str(src / "b.safetensors"))
    out = tmp_path / "stage"
    man = stage_checkpoint(str(src), 2, 4, False, True, str(out))
    assert man["changed"] and man["files"]["model.safetensors"]["sha1"] == \
        hashlib.sha1((out / "model.safetensors").read_bytes()).hexdigest()
    assert not list(tmp_path.glob("stage.tmp-*"))
    names = stage_tensor_names(read_index(src), 2, 4, False, True)
    save_file({n: full[n] for n in names}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()  # save_file's bytes
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(stage_tensor_names(read_index(src), 2, 4, False, True))
        for n in f.keys():
            assert torch.equal(f.get_tensor(n), full[n]), n
    h = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(load_stage(str(out), 2, 4, False, True, "fp32")(h),
                               load_stage(str(src), 2, 4, False, True, "fp32")(h), rtol=0, atol=0)
    assert stage_checkpoint(str(src), 2, 4, False, True, str(out))["changed"] is False
