"""layerline.checkpoint: the header-only tensor index, and deterministic demo checkpoints.

Expectations come from the config (shapes), from safetensors' own reader (dtypes, shapes,
which file) and from bytes on disk, never from the module under test.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

from layerline.checkpoint import (MAX_HEADER_BYTES, CheckpointError, CheckpointIndex, read_index,
                                  write_demo_checkpoint)
from layerline.errors import LayerlineError

SMALL = dict(layers=3, hidden=128, vocab=500, dtype="float32")
ST_DTYPE = {"F32": 4, "BF16": 2, "F16": 2, "I8": 1}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", **SMALL)


def _write_st(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file written by hand: 8-byte little-endian length, header, data."""
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb) if length is None else length) + hb + data)
    return path


def _header_len(path: Path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint, derived from config.json alone."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    return out


def _one_line_error(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, f"error is not one line: {msg!r}"
    for n in needles:
        assert n in msg, f"{n!r} not named in {msg!r}"
    return msg


# --- the index of a demo checkpoint ------------------------------------------------------------

def test_demo_index_matches_config_and_safetensors(demo):
    cfg = json.loads((demo / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["hidden_size"] == 128 and cfg["vocab_size"] == 500
    idx = read_index(demo)
    assert isinstance(idx, CheckpointIndex)
    assert idx.config == cfg
    expected = _expected_shapes(cfg)
    assert set(idx.tensors) == set(expected)

    # what safetensors itself reads from each file
    seen = {}
    for f in demo.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                seen[k] = (f.name, sl.get_dtype(), tuple(sl.get_shape()))
    assert set(seen) == set(expected)
    for name, e in idx.tensors.items():
        fname, dtype, shape = seen[name]
        assert e.name == name
        assert e.shape == expected[name] == shape
        assert e.dtype == dtype == "F32"
        assert e.file == fname
        assert e.nbytes == math.prod(shape) * ST_DTYPE[dtype]
        m = re.match(r"model\.layers\.(\d+)\.", name)
        assert e.layer == (int(m.group(1)) if m else None)
    assert idx.num_layers == 3
    assert idx.total_bytes == sum(math.prod(s) * 4 for s in expected.values())


def test_index_matches_hf_weight_map_when_sharded(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "sharded", shard_bytes=300_000, **SMALL)
    files = sorted(ckpt.glob("*.safetensors"))
    assert len(files) > 1, "shard_bytes should have split the checkpoint"
    wm = json.loads((ckpt / "model.safetensors.index.json").read_text())
    idx = read_index(ckpt)
    assert {n: e.file for n, e in idx.tensors.items()} == wm["weight_map"]
    assert idx.total_bytes == wm["metadata"]["total_size"]


def test_index_reads_headers_only_truncated_data(demo, tmp_path):
    """Zero every file's data after its header (a sparse file: nothing written): the index is unchanged."""
    full = read_index(demo)
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in demo.iterdir():
        raw = f.read_bytes()
        if f.suffix == ".safetensors":
            raw = raw[: 8 + _header_len(f)]
        (cut / f.name).write_bytes(raw)
        os.truncate(cut / f.name, f.stat().st_size)
    idx = read_index(cut)
    assert idx.tensors == full.tensors
    assert idx.num_layers == full.num_layers


def test_index_reads_headers_only_garbage_data(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    header = {"__metadata__": {"format": "pt"},
              "model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [1000, 1000], "data_offsets": [0, 2_000_000]},
              "model.layers.1.mlp.up_proj.weight": {"dtype": "F32", "shape": [10], "data_offsets": [2_000_000, 2_000_040]}}
    _write_st(tmp_path / "m.safetensors", header, data=os.urandom(37))  # 37 random bytes, not 2 MB
    idx = read_index(tmp_path, check=False)   # the header alone: no config, the data cut short
    assert set(idx.tensors) == {"model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    e = idx.tensors["model.layers.0.mlp.up_proj.weight"]
    assert (e.dtype, e.shape, e.nbytes, e.layer, e.file) == ("BF16", (1000, 1000), 2_000_000, 0, "m.safetensors")
    assert idx.num_layers == 2


# --- demo checkpoints: deterministic, reused ---------------------------------------------------

def test_demo_same_seed_identical_bytes(demo, tmp_path):
    again = write_demo_checkpoint(tmp_path / "again", **SMALL)
    assert _tree_bytes(again) == _tree_bytes(demo)


def test_demo_different_seed_differs(demo, tmp_path):
    other = write_demo_checkpoint(tmp_path / "other", seed=1, **SMALL)
    a, b = _tree_bytes(demo), _tree_bytes(other)
    assert set(a) == set(b)
    assert a["config.json"] == b["config.json"]
    shards = [n for n in a if n.endswith(".safetensors")]
    assert shards and all(a[n] != b[n] for n in shards)
    # same layout, different values
    assert read_index(demo).tensors == read_index(other).tensors


def test_demo_reused_when_stamp_matches(tmp_path):
    out = tmp_path / "reuse"
    write_demo_checkpoint(out, **SMALL)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    assert "layerline-demo.json" in before
    write_demo_checkpoint(out, **SMALL)
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    assert after == before, "same arguments must reuse the existing checkpoint untouched"
    # different arguments: rewritten in place
    old = _tree_bytes(out)
    write_demo_checkpoint(out, seed=5, **SMALL)
    assert json.loads((out / "layerline-demo.json").read_text())["seed"] == 5
    assert _tree_bytes(out) != old
    assert not list(tmp_path.glob("reuse.tmp-*")), "temp dir left behind"


def test_demo_refuses_foreign_nonempty_dir(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError) as ei:
        write_demo_checkpoint(out, **SMALL)
    _one_line_error(ei, str(out))
    assert (out / "precious.txt").read_text() == "keep me"


# --- bad inputs: one line naming the file / tensor ---------------------------------------------

def test_missing_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError) as ei:
        read_index(missing)
    _one_line_error(ei, str(missing))


def test_missing_config(tmp_path):
    _write_st(tmp_path / "m.safetensors", {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, "config.json")


def test_no_safetensors_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, str(tmp_path))


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]"])
def test_corrupt_header_json(tmp_path, raw):
    (tmp_path / "config.json").write_text("{}")
    f = _write_st(tmp_path / "model-00001-of-00001.safetensors", raw)
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, f.name)


def test_header_shorter_than_claimed(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    f = _write_st(tmp_path / "short.safetensors", b'{"x": {"dtype": "F32"', length=4096)
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, f.name)


def test_file_shorter_than_length_prefix(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, "tiny.safetensors")


def test_header_length_over_limit(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    f = _write_st(tmp_path / "huge.safetensors", b"{}", length=MAX_HEADER_BYTES + 1)
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, f.name, str(MAX_HEADER_BYTES + 1))


@pytest.mark.parametrize("offsets", [[0, 20], [0, 28], [8, 16]])
def test_data_offsets_not_matching_shape(tmp_path, offsets):
    (tmp_path / "config.json").write_text("{}")
    f = _write_st(tmp_path / "m.safetensors",
                  {"ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "model.layers.0.bad": {"dtype": "F32", "shape": [2, 3], "data_offsets": offsets}}, b"\0" * 64)
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, f.name, "model.layers.0.bad", "24")


@pytest.mark.parametrize("meta", [{"dtype": "F32", "shape": [2]},                       # no offsets
                                  {"dtype": "F32", "shape": "2x2", "data_offsets": [0, 16]},
                                  {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 1]}])
def test_malformed_tensor_entry(tmp_path, meta):
    (tmp_path / "config.json").write_text("{}")
    f = _write_st(tmp_path / "m.safetensors", {"model.layers.0.w": meta}, b"\0" * 16)
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, f.name, "model.layers.0.w")


def test_duplicate_tensor_across_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    t = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    _write_st(tmp_path / "model-00001-of-00002.safetensors", {"model.layers.0.w": t, "a": t}, b"\0" * 8)
    _write_st(tmp_path / "model-00002-of-00002.safetensors", {"model.layers.0.w": t}, b"\0" * 8)
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, "model.layers.0.w", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.mark.parametrize("text", ["{broken", "[1, 2]"])
def test_bad_config_json(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    _write_st(tmp_path / "m.safetensors", {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(CheckpointError) as ei:
        read_index(tmp_path)
    _one_line_error(ei, "config.json")


def test_checkpoint_error_is_a_layerline_error():
    assert issubclass(CheckpointError, LayerlineError)
