"""layerline.wire: JSON header + raw frames, validated field by field, never pickle.

Property tests (hypothesis) for the round trip and chunking, and a fuzzer that mutates valid
messages and checks that decode() raises nothing but WireError, whose text names the field.
"""
from __future__ import annotations

import json
import math
import pickle
import re
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from layerline import wire
from layerline.errors import LayerlineError
from layerline.wire import DTYPES, WireError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- helpers ------------------------------------------------------------------------------------

def itemsize(name: str) -> int:
    return torch.empty((), dtype=DTYPES[name]).element_size()


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in C order, through numpy (bfloat16/float16 via a same-size int view)."""
    t = t.detach().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (NaN-safe: random bytes make NaNs)."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and raw_bytes(a) == raw_bytes(b)


def header(**fields) -> bytes:
    return json.dumps({"v": wire.PROTOCOL, "op": "forward", **fields}).encode()


def spec(name="x", dtype="float32", shape=(2, 3), frames=1) -> dict:
    return {"name": name, "dtype": dtype, "shape": list(shape), "frames": frames}


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@st.composite
def tensors(draw, max_bytes: int = 512):
    """A tensor of any wire dtype and shape (0-d, empty, multi-dim) filled with arbitrary bits."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(shapes)
    n = math.prod(shape) * itemsize(dtype)
    if n > max_bytes:
        shape = [min(d, 2) for d in shape]
        n = math.prod(shape) * itemsize(dtype)
    data = draw(st.binary(min_size=n, max_size=n))
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    t = flat.view(DTYPES[dtype]).reshape(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # non-contiguous input must be sent in its logical (C) order
    return t


names = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_.]{0,10}\Z")
tensor_dicts = st.dictionaries(names, tensors(), max_size=4)


# --- round trip ---------------------------------------------------------------------------------

@SETTINGS
@given(tensor_dicts, st.sampled_from(sorted(wire.OPS)))
def test_round_trip_keeps_values_dtypes_and_shapes(ts, op):
    frames = wire.encode({"op": op, "id": "r-1", "seq": "s.0"}, ts)
    h, out = wire.decode(frames)
    assert h["op"] == op and h["id"] == "r-1" and h["seq"] == "s.0" and h["v"] == wire.PROTOCOL
    assert list(out) == list(ts)
    for name, t in ts.items():
        assert same(out[name], t), name


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_round_trip_each_dtype_0d_empty_and_multidim(dtype):
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(2, 3, 4, generator=gen) * 50).to(dt)
    ts = {"scalar": torch.tensor(7, dtype=dt), "empty": torch.empty(0, 3, dtype=dt),
          "full": full, "strided": full.transpose(0, 2)}
    frames = wire.encode({"op": "result"}, ts)
    _, out = wire.decode(frames)
    for name, t in ts.items():
        assert out[name].dtype == dt and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_an_empty_tensor_with_huge_other_dims_is_a_wire_error():
    """Zero elements, but dims whose strides overflow int64: refused by name, not a torch error
    (found by the JSON-mutation fuzz below)."""
    head = json.dumps({"op": "forward", "v": 1, "tensors": [{"name": "A", "dtype": "bfloat16", "frames": 1,
                                                     "shape": [0, 140, 32906, 1414014, 1415901]}]})
    with pytest.raises(wire.WireError, match=r"header.tensors\[0\].shape: .* spans more than"):
        wire.decode([head.encode(), b""])
    _, out = wire.decode([json.dumps({"op": "forward", "v": 1, "tensors": [{"name": "A", "dtype": "bfloat16", "frames": 1,
                                                                    "shape": [0, 4096, 8]}]}).encode(), b""])
    assert out["A"].shape == (0, 4096, 8)


def test_bfloat16_values_survive_exactly():
    t = torch.tensor([1.0, -2.5, 3.140625, float("inf"), -0.0, 1e-38], dtype=torch.bfloat16)
    _, out = wire.decode(wire.encode({"op": "result"}, {"h": t}))
    assert out["h"].dtype == torch.bfloat16 and torch.equal(out["h"], t)
    assert str(out["h"][4].item()) == "-0.0"


def test_decode_accepts_zmq_frames():
    zmq = pytest.importorskip("zmq")
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    frames = [zmq.Frame(bytes(f)) for f in wire.encode({"op": "forward"}, {"input_ids": t})]
    _, out = wire.decode(frames)
    assert torch.equal(out["input_ids"], t)


# --- chunking -----------------------------------------------------------------------------------

def test_chunk_size_is_read_at_call_time():
    """So the tests below can shrink it (a 16 MiB tensor per example would be slow)."""
    t = torch.zeros(40, dtype=torch.uint8)
    with mock.patch.object(wire, "CHUNK_BYTES", 16):
        assert len(wire.encode({"op": "ok"}, {"t": t})) == 1 + 3
    assert len(wire.encode({"op": "ok"}, {"t": t})) == 1 + 1


@SETTINGS
@given(st.lists(tensors(max_bytes=400), min_size=1, max_size=3), st.integers(1, 64))
def test_tensors_over_chunk_bytes_are_split_and_rebuilt(ts, chunk):
    ts = {f"t{i}": t for i, t in enumerate(ts)}
    with mock.patch.object(wire, "CHUNK_BYTES", chunk):
        frames = wire.encode({"op": "forward"}, ts)
        h = json.loads(bytes(frames[0]))
        expect = [max(1, math.ceil(t.numel() * t.element_size() / chunk)) for t in ts.values()]
        assert [s["frames"] for s in h["tensors"]] == expect
        assert len(frames) == 1 + sum(expect)
        assert all(len(memoryview(f)) <= chunk for f in frames[1:])
        # the chunks, joined, are exactly the tensor's bytes
        pos = 1
        for t, nf in zip(ts.values(), expect):
            assert b"".join(bytes(f) for f in frames[pos:pos + nf]) == raw_bytes(t)
            pos += nf
        _, out = wire.decode(frames)
    for name, t in ts.items():
        assert same(out[name], t), name


def test_real_chunk_size_split_of_a_large_tensor():
    t = torch.arange(wire.CHUNK_BYTES // 4 + 10, dtype=torch.float32)  # just over 16 MiB
    frames = wire.encode({"op": "forward"}, {"hidden": t})
    assert len(frames) == 3 and len(memoryview(frames[1])) == wire.CHUNK_BYTES
    _, out = wire.decode(frames)
    assert torch.equal(out["hidden"], t)


def test_split_frames_must_match_chunking():
    with mock.patch.object(wire, "CHUNK_BYTES", 8):
        frames = wire.encode({"op": "forward"}, {"t": torch.zeros(4, dtype=torch.int64)})  # 32 B, 4 frames
        h = json.loads(bytes(frames[0]))
        h["tensors"][0]["frames"] = 2
        with pytest.raises(WireError, match=r"header\.tensors"):
            wire.decode([json.dumps(h).encode(), bytes(frames[1]) + bytes(frames[2]),
                         bytes(frames[3]) + bytes(frames[4])])


# --- no pickle ----------------------------------------------------------------------------------

@SETTINGS
@given(tensor_dicts)
def test_header_is_json_and_frames_are_raw_tensor_bytes(ts):
    frames = wire.encode({"op": "forward", "id": "a"}, ts)
    h = json.loads(bytes(frames[0]).decode("utf-8"))  # plain UTF-8 JSON, nothing else
    assert isinstance(h, dict) and [s["name"] for s in h["tensors"]] == list(ts)
    for f, (name, t) in zip(frames[1:], ts.items()):  # default chunk: one frame each here
        assert isinstance(f, (bytes, memoryview))
        assert bytes(f) == raw_bytes(t), name
        if t.dtype not in (torch.bfloat16, torch.float16):
            assert bytes(f) == t.contiguous().numpy().tobytes()


def test_no_pickle_is_used_on_either_side():
    def boom(*a, **k):
        raise AssertionError("pickle used")

    ts = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2).to(torch.bfloat16)}
    with mock.patch.object(pickle, "dumps", boom), mock.patch.object(pickle, "loads", boom), \
            mock.patch.object(pickle, "Pickler", boom), mock.patch.object(pickle, "Unpickler", boom), \
            mock.patch.object(torch, "save", boom), mock.patch.object(torch, "load", boom):
        _, out = wire.decode(wire.encode({"op": "forward"}, ts))
    assert all(torch.equal(out[k], ts[k]) for k in ts)
    src = open(wire.__file__).read()
    assert "pickle" not in src.replace("Never pickle", "")


def test_a_pickled_message_is_rejected():
    with pytest.raises(WireError, match="header"):
        wire.decode([pickle.dumps({"v": 1, "op": "forward"})])


def test_encode_refuses_unsendable_dtypes():
    for t in (torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.complex64),
              torch.zeros(2, dtype=torch.float64)):
        with pytest.raises(WireError, match="dtype"):
            wire.encode({"op": "forward"}, {"t": t})


def test_encode_refuses_a_header_over_the_limit():
    with pytest.raises(WireError, match="header"):
        wire.encode({"op": "forward", "pad": "x" * wire.MAX_HEADER_BYTES})


# --- validation: each bad field is named --------------------------------------------------------

X = b"\0" * 24  # the bytes of a float32 [2, 3]

BAD = {
    "empty message": ([], "message"),
    "not json": ([b"\x80\x81 not json"], "header"),
    "not an object": ([b"[1, 2]"], "header"),
    "missing v": ([json.dumps({"op": "forward"}).encode()], "header.v"),
    "wrong v": ([header(v=2)], "header.v"),
    "string v": ([header(v="1")], "header.v"),
    "unknown op": ([header(op="exec")], "header.op"),
    "missing op": ([json.dumps({"v": 1}).encode()], "header.op"),
    "null op": ([header(op=None)], "header.op"),
    "bad id chars": ([header(id="a b/c")], "header.id"),
    "id too long": ([header(id="a" * 65)], "header.id"),
    "empty id": ([header(id="")], "header.id"),
    "int id": ([header(id=7)], "header.id"),
    "bad seq": ([header(seq="../etc")], "header.seq"),
    "tensors not a list": ([header(tensors={"x": 1})], "header.tensors"),
    "too many tensors": ([header(tensors=[spec(name=f"t{i}", shape=[0]) for i in range(wire.MAX_TENSORS + 1)]),
                          *[b""] * (wire.MAX_TENSORS + 1)], "header.tensors"),
    "spec not an object": ([header(tensors=[5])], "header.tensors[0]"),
    "missing name": ([header(tensors=[{k: v for k, v in spec().items() if k != "name"}]), X],
                     "header.tensors[0].name"),
    "bad name": ([header(tensors=[spec(name="1x")]), X], "header.tensors[0].name"),
    "int name": ([header(tensors=[spec(name=3)]), X], "header.tensors[0].name"),
    "duplicate names": ([header(tensors=[spec(), spec()]), X, X], "header.tensors[1].name"),
    "dtype not allowed": ([header(tensors=[spec(dtype="complex64")]), X], "header.tensors[0].dtype"),
    "dtype object": ([header(tensors=[spec(dtype="object")]), X], "header.tensors[0].dtype"),
    "dtype null": ([header(tensors=[spec(dtype=None)]), X], "header.tensors[0].dtype"),
    "negative shape": ([header(tensors=[spec(shape=[-2, -3])]), X], "header.tensors[0].shape"),
    "float shape": ([header(tensors=[spec(shape=[2.0, 3])]), X], "header.tensors[0].shape"),
    "bool shape": ([header(tensors=[spec(shape=[True, 24], dtype="uint8")]), X], "header.tensors[0].shape"),
    "string shape": ([header(tensors=[spec(shape="2,3")]), X], "header.tensors[0].shape"),
    "null dim": ([header(tensors=[spec(shape=[None])]), X], "header.tensors[0].shape"),
    "too many dims": ([header(tensors=[spec(shape=[1] * (wire.MAX_DIMS + 1), dtype="uint8")]), b"\0"],
                      "header.tensors[0].shape"),
    "dim over limit": ([header(tensors=[spec(shape=[2**31 + 1])]), X], "header.tensors[0].shape"),
    "huge shape": ([header(tensors=[spec(shape=[2**31, 2**31, 2**31])]), X], "header.tensors[0]"),
    "frames count mismatch (too few)": ([header(tensors=[spec()])], "header.tensors"),
    "frames count mismatch (too many)": ([header(tensors=[spec()]), X, X], "header.tensors"),
    "frames field wrong": ([header(tensors=[spec(frames=2)]), X[:12], X[12:]], "header.tensors[0].frames"),
    "frames field bool": ([header(tensors=[spec(frames=True)]), X], "header.tensors[0].frames"),
    "frames field float": ([header(tensors=[spec(frames=1.0)]), X], "header.tensors[0].frames"),
    "frames negative": ([header(tensors=[spec(name="a", frames=-1), spec(name="b", frames=2)]), X],
                        "header.tensors[0].frames"),
    "bytes short": ([header(tensors=[spec()]), X[:-1]], "header.tensors[0]"),
    "bytes long": ([header(tensors=[spec()]), X + b"\0\0\0\0"], "header.tensors[0]"),
    "itemsize wrong": ([header(tensors=[spec(dtype="int64")]), X], "header.tensors[0]"),
    "empty tensor with bytes": ([header(tensors=[spec(shape=[0, 3])]), b"\0"], "header.tensors[0]"),
    "header over 64 KiB": ([header(pad="x" * wire.MAX_HEADER_BYTES)], "header"),
}

BUGS = {
    "op is a list": ([header(op=["forward"])], "header.op",
                     "BUG wire.py decode_header: `h.get('op') not in OPS` raises TypeError for an unhashable op"),
    "op is an object": ([header(op={"a": 1})], "header.op",
                        "BUG wire.py decode_header: `h.get('op') not in OPS` raises TypeError for an unhashable op"),
    "dtype is a list": ([header(tensors=[spec(dtype=["float32"])]), X], "header.tensors[0].dtype",
                        "BUG wire.py decode: `dtype not in DTYPES` raises TypeError for an unhashable dtype"),
    "frames is a string": ([header(tensors=[spec(frames="1")]), X], "header.tensors[0].frames",
                           "BUG wire.py decode: sum() of spec 'frames' raises TypeError for a non-number"),
    "frames is null": ([header(tensors=[spec(frames=None)]), X], "header.tensors[0].frames",
                       "BUG wire.py decode: sum() of spec 'frames' raises TypeError for null"),
    "deeply nested header": ([b"[" * 50000], "header",
                              "BUG wire.py decode_header: json.loads raises RecursionError (not caught) "
                              "on deeply nested JSON under 64 KiB"),
    "v is true": ([header(v=True)], "header.v",
                  "BUG (minor) wire.py decode_header: `h.get('v') != PROTOCOL` accepts true (and 1.0) as version 1"),
}

CASES = [pytest.param(f, field, id=k) for k, (f, field) in BAD.items()] + [
    pytest.param(f, field, id=k) for k, (f, field, why) in BUGS.items()]  # once bugs, now fixed


@pytest.mark.parametrize("frames,field", CASES)
def test_bad_message_raises_wire_error_naming_the_field(frames, field):
    try:
        wire.decode(frames)
    except WireError as e:
        assert str(e).startswith(field), f"{e!s} does not name {field}"
        assert isinstance(e, LayerlineError) and "\n" not in str(e)
    else:
        pytest.fail("decode accepted a bad message")


def test_message_byte_limit_counts_all_tensors():
    frames = [header(tensors=[spec(name="a"), spec(name="b", dtype="uint8", shape=[80])]), X, b"\1" * 80]
    h, out = wire.decode(frames, wire.Limits(max_bytes=104))
    assert out["b"].shape == (80,)
    with pytest.raises(WireError, match=r"^header\.tensors\[1\]: message tensors exceed the 103-byte limit"):
        wire.decode(frames, wire.Limits(max_bytes=103))
    with pytest.raises(WireError, match=r"^header\.tensors\[0\]\.shape"):
        wire.decode(frames, wire.Limits(max_elements_dim=1))


def test_wire_error_message_is_bounded():
    """A huge bad value is not echoed back whole (replies go into a 64 KiB header)."""
    with pytest.raises(WireError) as e:
        wire.decode([header(op="x" * 60000)])
    assert len(str(e.value)) < 200
    with pytest.raises(WireError) as e:
        wire.decode([header(tensors=[spec(dtype="y" * 60000)]), X])
    assert len(str(e.value)) < 400


# --- fuzz: mutate valid messages ----------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                        st.dictionaries(st.text(max_size=5), c, max_size=4)),
                           max_leaves=10)
HEADER_KEYS = ["v", "op", "id", "seq", "tensors", "pos", "reply_to"]
SPEC_KEYS = ["name", "dtype", "shape", "frames"]


@st.composite
def mutated(draw, values, frames_values):
    """A valid message with one or more of its fields, frames or bytes mutated."""
    ts = draw(st.dictionaries(names, tensors(max_bytes=64), min_size=0, max_size=3))
    chunk = draw(st.sampled_from([8, 16, wire.CHUNK_BYTES]))
    with mock.patch.object(wire, "CHUNK_BYTES", chunk):
        frames = [bytes(f) for f in wire.encode({"op": "forward", "id": "r1", "seq": "s1"}, ts)]
    h = json.loads(frames[0])
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["header", "spec", "shape", "frames", "raw", "delete"]))
        if kind == "header":
            h[draw(st.sampled_from(HEADER_KEYS))] = draw(values)
        elif kind == "spec" and isinstance(h.get("tensors"), list) and h["tensors"]:
            i = draw(st.integers(0, len(h["tensors"]) - 1))
            key = draw(st.sampled_from(SPEC_KEYS))
            if isinstance(h["tensors"][i], dict):  # an earlier mutation may have put any value there
                h["tensors"][i][key] = draw(frames_values if key == "frames" else values)
        elif kind == "shape" and isinstance(h.get("tensors"), list) and h["tensors"]:
            i = draw(st.integers(0, len(h["tensors"]) - 1))
            if not isinstance(h["tensors"][i], dict):
                continue
            h["tensors"][i]["shape"] = draw(st.lists(st.one_of(st.integers(-5, 2**40), st.booleans(),
                                                               st.floats()), max_size=8))
        elif kind == "frames":
            op = draw(st.sampled_from(["drop", "add", "cut", "grow"]))
            if op == "drop" and len(frames) > 1:
                del frames[draw(st.integers(1, len(frames) - 1))]
            elif op == "add":
                frames.append(draw(st.binary(max_size=32)))
            elif op in ("cut", "grow") and len(frames) > 1:
                i = draw(st.integers(1, len(frames) - 1))
                frames[i] = frames[i][:-1] if op == "cut" else frames[i] + b"\0"
        elif kind == "raw":
            return [draw(st.binary(max_size=200)), *frames[1:]], chunk
        elif kind == "delete":
            key = draw(st.sampled_from(HEADER_KEYS))
            h.pop(key, None)
    frames[0] = json.dumps(h).encode()
    return frames, chunk


def decode_only_wire_errors(frames, chunk):
    with mock.patch.object(wire, "CHUNK_BYTES", chunk):
        try:
            h, out = wire.decode(frames)
        except WireError as e:
            assert str(e).split(":")[0].startswith(("header", "message")), str(e)
            return
    # accepted: then it must be self-consistent
    assert h["v"] == wire.PROTOCOL and h["op"] in wire.OPS
    for s in h.get("tensors", []):
        t = out[s["name"]]
        assert list(t.shape) == s["shape"] and t.dtype == DTYPES[s["dtype"]]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(scalars, st.one_of(st.integers(-3, 2**40), st.booleans(), st.floats())))
def test_decode_of_mutated_messages_raises_only_wire_error(msg):
    """Scalar mutations (numbers for 'frames'): the part of the input space decode handles today."""
    decode_only_wire_errors(*msg)


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@example(([header(op=[]), ], 16))
@given(mutated(json_values, json_values))
def test_decode_of_arbitrary_json_mutations_raises_only_wire_error(msg):
    decode_only_wire_errors(*msg)


@SETTINGS
@given(st.lists(st.binary(max_size=100), min_size=1, max_size=4))
def test_decode_of_random_bytes_raises_only_wire_error(frames):
    decode_only_wire_errors(frames, wire.CHUNK_BYTES)


def test_decoded_tensors_are_zero_copy_views_of_the_frames():
    frame = bytearray(torch.arange(6, dtype=torch.float32).numpy().tobytes())
    _, out = wire.decode([header(tensors=[spec()]), frame])
    frame[0:4] = torch.tensor([42.0]).numpy().tobytes()
    assert out["x"][0, 0].item() == 42.0


# --- op-specific fields and endpoints -----------------------------------------------------------

def test_require_int_bounds_and_type():
    h = {"pos": 5, "flag": True, "f": 5.0, "neg": -1}
    assert wire.require(h, "pos", int, 0, 10) == 5
    assert wire.require(h, "pos", int) == 5
    for key, lo, hi in [("pos", 6, 10), ("pos", 0, 4), ("flag", 0, 10), ("f", 0, 10), ("neg", 0, None),
                        ("missing", None, None)]:
        with pytest.raises(WireError, match=rf"^header\.{key}: must be an integer in \[{lo}, {hi}\]"):
            wire.require(h, key, int, lo, hi)


def test_require_str_and_other_kinds():
    h = {"seq": "s1", "long": "x" * 257, "n": 3, "lst": [1], "d": {}}
    assert wire.require(h, "seq", str) == "s1"
    assert wire.require({"s": "x" * 256}, "s", str) == "x" * 256
    for key in ("long", "n", "missing"):
        with pytest.raises(WireError, match=rf"^header\.{key}: must be a string"):
            wire.require(h, key, str)
    assert wire.require(h, "lst", list) == [1]
    with pytest.raises(WireError, match=r"^header\.d: must be a list"):
        wire.require(h, "d", list)


@pytest.mark.parametrize("ep", ["tcp://127.0.0.1:9100", "tcp://[::1]:9100", "tcp://node-1.example.org:1",
                                "tcp://localhost:65535", "tcp://h:0"])
def test_endpoint_accepts_tcp_host_port(ep):
    assert wire.endpoint(ep) == ep


@pytest.mark.parametrize("ep", ["udp://127.0.0.1:9100", "tcp://127.0.0.1", "tcp://127.0.0.1:123456",
                                "ipc:///tmp/sock", "inproc://x", "tcp://a b:1", "tcp://h:1/x",
                                "tcp://h:port", "tcp://" + "a" * 201 + ":1", "tcp://h;rm -rf:1", "",
                                None, 9100, b"tcp://h:1", ["tcp://h:1"],
                                "tcp://127.0.0.1:9100\n"])
def test_endpoint_rejects_and_names_the_field(ep):
    with pytest.raises(WireError) as e:
        wire.endpoint(ep, "header.reply_to")
    msg = str(e.value)
    assert msg.startswith("header.reply_to: ") and "tcp://HOST:PORT" in msg and len(msg) < 200
    with pytest.raises(WireError, match="^endpoint: "):
        wire.endpoint(ep)


# --- rows: a step over rows of different sequences ----------------------------------------------

def test_rows_are_seq_pos_pairs_each_seq_once():
    assert wire.rows({"rows": [["a", 1], ["b.2", 7]]}, 7) == [("a", 1), ("b.2", 7)]
    bad = {
        "header.rows: must be a list": [None, "a", [], [["s", 1]] * 0, [[f"s{i}", 1] for i in range(wire.MAX_BATCH + 1)]],
        "header.rows[0]: must be [seq, pos]": [[["a"]], [["a", 1, 2]], [["a", 0]], [["a", -1]], [["a", "1"]],
                                               [["a", True]], [["a", 1.0]], [["a/b", 1]], [["", 1]], [[1, 1]],
                                               [{"seq": "a", "pos": 1}], [["a", 8]]],
        "header.rows[1]: seq a appears twice": [[["a", 1], ["a", 2]]],
    }
    for text, cases in bad.items():
        for v in cases:
            with pytest.raises(WireError, match=re.escape(text)):
                wire.rows({"rows": v} if v is not None else {}, 7)


@given(st.lists(st.tuples(st.from_regex(wire.ID_RE, fullmatch=True), st.integers(1, 10**6)), min_size=1,
                max_size=wire.MAX_BATCH, unique_by=lambda r: r[0]))
@SETTINGS
def test_rows_round_trip_through_a_header(rows):
    frames = wire.encode({"op": "forward", "rows": [list(r) for r in rows], "cache": True})
    h, _ = wire.decode(frames)
    assert wire.rows(h) == rows


@pytest.mark.parametrize("fork, pos, text", [
    ("e1", 4, "header.fork: must be"),
    ({"from": "e1"}, 4, "header.fork: must be"),
    ({"from": "e/1", "len": 4}, 4, "header.fork: must be"),
    ({"from": "e1", "len": 0}, 0, "header.fork: must be"),
    ({"from": "e1", "len": True}, 1, "header.fork: must be"),
    ({"from": "e1", "len": 99}, 99, "N an integer in [1, 63]"),
    ({"from": "e1", "len": 4, "x": 1}, 4, "header.fork: must be"),
    ({"from": "e1", "len": 4}, 5, "header.fork.len: 4 must equal header.pos 5"),
])
def test_a_bad_fork_names_the_field(fork, pos, text):
    with pytest.raises(WireError) as e:
        wire.fork({"fork": fork}, pos, 63)
    assert text in str(e.value)


def test_fork_and_keep_read_their_fields():
    assert wire.fork({}, 0, 63) is None and wire.keep({}, 64) is None
    assert wire.fork({"fork": {"from": "p1", "len": 7}}, 7, 63) == ("p1", 7)
    assert wire.keep({"keep": "p1", "len": 64}, 64) == ("p1", 64)
    for h, text in (({"len": 3}, "header.len: only with header.keep"), ({"keep": "p/1", "len": 3}, "header.keep"),
                    ({"keep": "p1"}, "header.len"), ({"keep": "p1", "len": 65}, "header.len")):
        with pytest.raises(WireError, match=re.escape(text)):
            wire.keep(h, 64)
