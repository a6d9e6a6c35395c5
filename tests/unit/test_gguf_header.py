"""checkpoint.gguf_header: the lean GGUF header reader against gguf's GGUFReader (the reference).

For SmolLM2's file and a small written file (scalars of every type, string and numeric arrays, a
custom alignment, F32/F16/BF16 and quantized tensors), every metadata key's value, type and raw byte
range, and every tensor's info, byte range and data view equal GGUFReader's. A truncated file and
headers claiming huge lengths fail as one CheckpointError line. `test_open_cost` prints (pytest -s) what opening
SmolLM2's file (index and tokenizer) costs in anonymous memory and time.
"""
from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from layerline.checkpoint import open_checkpoint  # noqa: E402
from layerline.checkpoint.gguf_header import GGUFHeader, GGUFHeaderError  # noqa: E402
from layerline.errors import CheckpointError  # noqa: E402

T = gguf.GGMLQuantizationType


def _smol() -> str:
    from layerline.cli import packaged_smollm2
    try:
        return packaged_smollm2()
    except Exception as e:  # noqa: BLE001 - the package is optional
        pytest.skip(str(e))


def _write(path: Path, endianess=gguf.GGUFEndian.LITTLE) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -2**40)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ wörld")
    w.add_string("t.empty", "")
    w.add_token_list(["<s>", "", "▁a", "é", " ", "z" * 300])
    w.add_token_scores([0.0, -1.5, 2.25, -3.0, 4.0, 1e9])
    w.add_token_types([3, 1, 1, 4, 1, 6])
    w.add_array("t.empty_arr", [])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.bools", [True, False, True])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    a = rng.standard_normal((4, 64)).astype(np.float32)
    for t in (T.Q4_0, T.Q8_0, T.Q4_1, T.BF16):
        w.add_tensor(t.name.lower(), gguf.quants.quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("hdr") / "small.gguf")


def _same_as_reader(path) -> None:
    r, h = gguf.GGUFReader(str(path)), GGUFHeader(str(path))
    assert (h.version, h.alignment, h.data_offset, h.byte_order) == (
        int(r.fields["GGUF.version"].parts[0][0]), int(r.alignment), int(r.data_offset), r.byte_order)
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert list(h.fields) == keys
    for k in keys:
        rf, hf = r.fields[k], h.get_field(k)
        assert ([int(t) for t in rf.types], hf.offset, hf.nbytes) == (
            hf.types, rf.offset, sum(int(p.nbytes) for p in rf.parts)), k
        assert hf.contents() == rf.contents(), k
        if rf.types[0] == gguf.GGUFValueType.ARRAY:
            assert len(hf) == len(rf.data), k
            for i in {0, len(rf.data) // 2, len(rf.data) - 1} if len(rf.data) else ():
                assert hf.contents(i) == rf.contents(i), (k, i)
    assert len(h.tensors) == len(r.tensors)
    for rt, ht in zip(r.tensors, h.tensors):
        assert (ht.name, ht.tensor_type, ht.n_elements, ht.n_bytes, ht.data_offset) == (
            rt.name, rt.tensor_type, rt.n_elements, rt.n_bytes, rt.data_offset)
        assert ht.shape.tolist() == rt.shape.tolist()
        assert (ht.data.shape, ht.data.dtype, ht.data.flags.writeable) == (rt.data.shape, rt.data.dtype, False)
        assert np.array_equal(ht.data, rt.data, equal_nan=True), ht.name


def test_small_file_same_as_gguf_reader(small):
    _same_as_reader(small)
    h = GGUFHeader(str(small))
    assert h.get_field("tokenizer.ggml.tokens").contents(5) == "z" * 300
    assert h.alignment == 64 and {t.tensor_type for t in h.tensors} >= {T.Q4_0, T.Q8_0, T.Q4_1, T.BF16, T.F16}


def test_big_endian_same_as_gguf_reader(tmp_path):
    path = _write(tmp_path / "big.gguf", gguf.GGUFEndian.BIG)
    _same_as_reader(path)
    assert GGUFHeader(str(path)).byte_order == "S"


def test_smollm2_same_as_gguf_reader():
    _same_as_reader(_smol())


def _one_line_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path).index
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "re-download it" in msg, msg
    return msg


def test_truncated_file_is_one_line(small, tmp_path):
    raw = small.read_bytes()
    h = GGUFHeader(str(small))
    cuts = [4, 10, 30, h.get_field("tokenizer.ggml.tokens").offset + 40, h.data_offset - 20,
            h.tensors[-1].data_offset + 1, len(raw) - 1]
    for cut in cuts:
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(raw[:cut])
        msg = _one_line_error(p)
        assert "not a readable GGUF file" in msg, msg


def _kv_file(path: Path, kv: bytes, n_kv: int = 1, n_tensors: int = 0) -> Path:
    path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, n_tensors, n_kv) + kv + bytes(64))
    return path


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_huge_lengths_fail_cleanly(tmp_path):
    cases = {
        "strings": _key("a") + struct.pack("<IIQ", 9, 8, 2**60),  # array of 2**60 strings
        "floats": _key("a") + struct.pack("<IIQ", 9, 6, 2**61),  # array of 2**61 float32
        "string": _key("a") + struct.pack("<IQ", 8, 2**62) + b"xx",  # one 2**62-byte string
        "key": struct.pack("<Q", 2**63) + b"a",
        "item": _key("a") + struct.pack("<IIQ", 9, 8, 3) + struct.pack("<Q", 2**40),  # one long item
        "type": _key("a") + struct.pack("<I", 77),
    }
    for name, kv in cases.items():
        t0 = time.perf_counter()
        _one_line_error(_kv_file(tmp_path / f"{name}.gguf", kv))
        assert time.perf_counter() - t0 < 1.0, name
    _one_line_error(_kv_file(tmp_path / "counts.gguf", b"", n_kv=2**62, n_tensors=2**62))
    info = _key("w") + struct.pack("<I2QIQ", 2, 2**32, 2**32, 0, 0)  # a 2**64-element F32 tensor
    p = tmp_path / "tensor.gguf"
    p.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 1, 0) + info + bytes(64))
    with pytest.raises(GGUFHeaderError, match="runs past the end of the file"):
        GGUFHeader(str(p))


_COST = """
import sys, time
def anon():
    return next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("RssAnon"))
import numpy, tokenizers, gguf
from layerline.checkpoint import open_checkpoint
a, t0 = anon(), time.perf_counter()
ck = open_checkpoint(sys.argv[1]); ck.index
t1, b = time.perf_counter(), anon()
ck.tokenizer
print(t1 - t0, b - a, time.perf_counter() - t1, anon() - b)
"""


def test_open_cost():
    """Opening SmolLM2's file costs a few MB and milliseconds (GGUFReader: ~155 MB, seconds), in a fresh
    process so the figures are this file's alone."""
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _COST, _smol()], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    t_index, mib_index, t_tok, mib_tok = map(float, out.stdout.split())
    print(f"SmolLM2 GGUF: index {t_index:.3f} s +{mib_index:.0f} MiB anon; tokenizer {t_tok:.2f} s "
          f"+{mib_tok:.0f} MiB anon")
    assert mib_index < 40, "opening the GGUF header should not cost tens of MB"
