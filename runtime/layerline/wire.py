"""The wire: one JSON header + raw tensor frames over ZeroMQ. Never pickle.

A message is [header, frame, frame, ...]. The header names each tensor's dtype and shape and
how many frames carry it (tensors over 16 MB are split: zmq slows on single huge frames).
Op-specific fields are checked by whoever reads them (`require`, `rows`: the [[seq, pos], ...]
of a step over rows of different sequences, `epoch`: the driver's wire epoch; see layerline.worker).
decode() validates every field against bounds before touching a byte of tensor data, so a
bad message raises WireError (which names the field) and never crashes the receiver.
"""
from __future__ import annotations

import math
import re
import secrets
import warnings
from dataclasses import dataclass

import orjson
import torch

from .errors import LayerlineError
from .version import PROTOCOL  # noqa: F401 - decided with the package version (layerline.version)

# zmq frames are read-only; tensors built over them are never written in place
warnings.filterwarnings("ignore", message="The given buffer is not writable")

CHUNK_BYTES = 16 * 2**20
MAX_HEADER_BYTES = 64 * 1024
MAX_FRAME_BYTES = max(CHUNK_BYTES, MAX_HEADER_BYTES)  # no sender needs a larger frame (receivers' MAXMSGSIZE)
MAX_TENSORS = 16
MAX_DIMS = 6
ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")
# protocol limits every side agrees on (the driver sizes its batches by them, a stage enforces them)
MAX_BATCH = 64         # rows in one forward message
MAX_SEQS = 64          # live sequences whose KV cache a stage keeps (LRU beyond)
MAX_REPLY_PEERS = 16   # distinct drivers a last stage keeps sockets to
# steps a stage holding the whole model computes ahead of the messages asking for them, and so the
# most a rows answer carries beyond its own (header "more", tensor "then": layerline.worker.stage)
AHEAD = 4
MAX_INFLIGHT = 1024  # header.inflight: the driver's messages out, this one included
ENDPOINT_RE = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]{1,200}:\d{1,5}$")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
# numpy has no bfloat16: 2-byte floats travel through a same-size integer view
_BYTES_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}

# A hop's cost is mostly this module's Python (a decode step moves a few KiB), and each torch
# call costs several microseconds when a process wakes with cold caches, far more than in a
# warm loop. So the hot paths make as few torch calls as they can: no checks that .numpy()
# makes anyway, no copies of CPU-contiguous tensors; orjson for the header (a few
# microseconds less each way than the json module, and stricter: no NaN, no integer past 64
# bits, no invalid UTF-8).

# Data ops travel the pipeline; control ops go to a worker's control socket.
DATA_OPS = {"forward", "result", "error", "release"}
CONTROL_OPS = {"health", "stats", "set_next", "shutdown"}
OPS = DATA_OPS | CONTROL_OPS | {"ok"}


class WireError(LayerlineError):
    """A message that fails validation; the text names the offending field."""


@dataclass(frozen=True)
class Limits:
    max_bytes: int = 2 * 2**30      # all tensor bytes of one message
    max_elements_dim: int = 2**31   # any one dimension


def encode(header: dict, tensors: dict[str, torch.Tensor] | None = None) -> list:
    """Frames for one message. Tensor frames are zero-copy views of contiguous CPU memory."""
    h = dict(header)
    if "v" not in h:
        h["v"] = PROTOCOL
    specs: list = []
    frames: list = [None]
    for name, t in (tensors or {}).items():
        dt = t.dtype
        dname = DTYPE_NAMES.get(dt)
        if dname is None:
            raise WireError(f"tensor {name}: dtype {dt} is not sendable; use one of {sorted(DTYPES)}")
        buf = _bytes_of(t, dt)
        nbytes = buf.nbytes
        if nbytes <= CHUNK_BYTES:
            chunks = 1
            frames.append(buf)
        else:
            chunks = math.ceil(nbytes / CHUNK_BYTES)
            frames.extend(buf[c * CHUNK_BYTES:(c + 1) * CHUNK_BYTES] for c in range(chunks))
        specs.append({"name": name, "dtype": dname, "shape": list(t.shape), "frames": chunks})
    h["tensors"] = specs
    try:
        head = orjson.dumps(h)
    except TypeError as e:
        raise WireError(f"header: {e}") from None
    if len(head) > MAX_HEADER_BYTES:
        raise WireError(f"header: {len(head)} bytes is over the {MAX_HEADER_BYTES} limit")
    frames[0] = head
    return frames


def _bytes_of(t: torch.Tensor, dt: torch.dtype) -> memoryview:
    """The tensor's bytes as a flat view: no copy for a contiguous CPU tensor."""
    v = _BYTES_VIEW.get(dt)
    try:  # .numpy() refuses GPU and grad tensors; cast() refuses non-contiguous memory
        return memoryview((t.view(v) if v is not None else t).numpy()).cast("B")
    except (TypeError, RuntimeError, ValueError):
        if t.numel() == 0:
            return memoryview(b"")
        t = t.detach().to("cpu").contiguous()
        return memoryview((t.view(v) if v is not None else t).numpy()).cast("B")


def _buf(frame) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def decode_header(frame) -> dict:
    raw = _buf(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"header: {len(raw)} bytes is over the {MAX_HEADER_BYTES} limit")
    try:
        h = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise WireError(f"header: not valid UTF-8 JSON ({e.__class__.__name__})") from None
    if not isinstance(h, dict):
        raise WireError("header: must be a JSON object")
    if type(h.get("v")) is not int or h["v"] != PROTOCOL:
        raise WireError(f"header.v: protocol {h.get('v')!r} is not supported; this side speaks {PROTOCOL}")
    if not isinstance(h.get("op"), str) or h["op"] not in OPS:
        raise WireError(f"header.op: {str(h.get('op'))[:40]!r} is not a known op")
    for key in ("id", "seq"):
        if key in h and not (isinstance(h[key], str) and ID_RE.match(h[key])):
            raise WireError(f"header.{key}: must be 1-64 characters of [A-Za-z0-9_.:-]")
    return h


def rows(header: dict, max_pos: int | None = None) -> list[tuple[str, int]]:
    """header.rows of a batched step over rows of different sequences: [[seq, pos], ...], one
    pair per row of the message's tensor (batch B = len(rows) <= MAX_BATCH), each seq a wire id
    at most once, each pos an integer in [1, max_pos]: the position of the row's one new token,
    which is also how many tokens that sequence's KV cache must already hold (at least: a stage
    that holds more rewinds to pos).

    Checked by the op that reads it (a stage's forward), not by decode_header, so its error
    reply also reaches the message's reply_to."""
    v = header.get("rows")
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_BATCH:
        raise WireError(f"header.rows: must be a list of 1..{MAX_BATCH} [seq, pos] pairs, one per row")
    hi = "" if max_pos is None else f", {max_pos}"
    out: list[tuple[str, int]] = []
    seen: set = set()
    for i, r in enumerate(v):
        if not (isinstance(r, list) and len(r) == 2 and isinstance(r[0], str) and ID_RE.match(r[0])
                and type(r[1]) is int and r[1] >= 1 and (max_pos is None or r[1] <= max_pos)):
            raise WireError(f"header.rows[{i}]: must be [seq, pos]: seq 1-64 characters of [A-Za-z0-9_.:-], "
                            f"pos an integer in [1{hi}]")
        if r[0] in seen:
            raise WireError(f"header.rows[{i}]: seq {r[0]} appears twice; step each sequence once per message")
        seen.add(r[0])
        out.append((r[0], r[1]))
    return out


def epoch(header: dict) -> int | None:
    """header.epoch of a forward: the wire epoch its driver was in when it sent it (an integer
    >= 0), or None when it names none. A stage drops a forward of an older epoch than the last one
    that wrote any of its sequences there (layerline.worker); forwards without one are never dropped.

    Checked by the op that reads it (a stage's forward), so its error reply also reaches reply_to."""
    if "epoch" not in header:
        return None
    v = header["epoch"]
    if type(v) is not int or v < 0:
        raise WireError(f"header.epoch: {str(v)[:40]!r} is not an integer >= 0; send the driver's wire epoch, "
                        "or no epoch (never dropped)")
    return v


def fork(header: dict, pos: int, max_pos: int) -> tuple[str, int] | None:
    """header.fork of a one-sequence forward: {"from": ENTRY, "len": N}, the prefix entry (a wire id
    the stages kept at a `release` with `keep`) whose first N tokens the new sequence starts with, a
    copy: N in [1, max_pos] and equal to the message's pos (its tokens follow them). None when absent.

    Checked by the op that reads it (a stage's forward), so its error reply also reaches reply_to."""
    if "fork" not in header:
        return None
    v = header["fork"]
    if not (isinstance(v, dict) and set(v) == {"from", "len"} and isinstance(v["from"], str)
            and ID_RE.match(v["from"]) and type(v["len"]) is int and 1 <= v["len"] <= max_pos):
        raise WireError(f"header.fork: must be {{\"from\": ENTRY, \"len\": N}}: ENTRY 1-64 characters of "
                        f"[A-Za-z0-9_.:-], N an integer in [1, {max_pos}]")
    if v["len"] != pos:
        raise WireError(f"header.fork.len: {v['len']} must equal header.pos {pos} (the new tokens follow the "
                        "forked ones)")
    return v["from"], v["len"]


def keep(header: dict, max_len: int) -> tuple[str, int] | None:
    """header.keep and header.len of a `release`: keep the sequence's first len tokens as the prefix
    entry named keep (a wire id; layerline.prefix), len in [1, max_len]. None when absent."""
    if "keep" not in header:
        if "len" in header:
            raise WireError("header.len: only with header.keep (the prefix entry to keep)")
        return None
    k, n = header["keep"], header.get("len")
    if not (isinstance(k, str) and ID_RE.match(k)):
        raise WireError("header.keep: must be 1-64 characters of [A-Za-z0-9_.:-] (the prefix entry's id)")
    if type(n) is not int or not 1 <= n <= max_len:
        raise WireError(f"header.len: must be an integer in [1, {max_len}] (tokens the prefix entry keeps)")
    return k, n


def decode(frames: list, limits: Limits = Limits()) -> tuple[dict, dict[str, torch.Tensor]]:
    """Validated header and tensors (zero-copy over the frames' buffers)."""
    # every hop of every token runs this: plain loops, no generators, error text built only on error
    if not frames:
        raise WireError("message: empty")
    h = decode_header(frames[0])
    specs = h.get("tensors", [])
    if not isinstance(specs, list) or len(specs) > MAX_TENSORS:
        raise WireError(f"header.tensors: must be a list of at most {MAX_TENSORS} tensor specs")
    want = 0
    for i, s in enumerate(specs):
        if not isinstance(s, dict):
            raise WireError(f"header.tensors[{i}]: must be an object")
        nf = s.get("frames")
        if type(nf) is not int or not 1 <= nf <= 2**20:
            raise WireError(f"header.tensors[{i}].frames: must be a positive integer")
        want += nf
    if want != len(frames) - 1:
        raise WireError(f"header.tensors: describes {want} frames but the message has {len(frames) - 1}")
    out: dict[str, torch.Tensor] = {}
    pos, total = 1, 0
    for i, s in enumerate(specs):
        name, dtype, shape, nf = s.get("name"), s.get("dtype"), s.get("shape"), s["frames"]
        if not (isinstance(name, str) and NAME_RE.match(name)) or name in out:
            raise WireError(f"header.tensors[{i}].name: must be a unique identifier of at most 64 characters")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WireError(f"header.tensors[{i}].dtype: {str(dtype)[:20]!r} is not one of {sorted(DTYPES)}")
        numel = 1
        if isinstance(shape, list) and len(shape) <= MAX_DIMS:
            for d in shape:
                if type(d) is not int or not 0 <= d <= limits.max_elements_dim:
                    numel = -1
                    break
                numel *= d
        else:
            numel = -1
        if numel < 0:
            raise WireError(f"header.tensors[{i}].shape: must be at most {MAX_DIMS} non-negative integers")
        itemsize = ITEMSIZE[dtype]
        nbytes = numel * itemsize
        # an empty tensor's other dims still make its strides (torch refuses past int64): bound them too
        if nbytes == 0 and math.prod(max(d, 1) for d in shape) * itemsize > limits.max_bytes:
            raise WireError(f"header.tensors[{i}].shape: {shape} spans more than the {limits.max_bytes}-byte limit")
        total += nbytes
        if total > limits.max_bytes:
            raise WireError(f"header.tensors[{i}]: message tensors exceed the {limits.max_bytes}-byte limit")
        if nf != max(1, math.ceil(nbytes / CHUNK_BYTES)):
            raise WireError(f"header.tensors[{i}].frames: {nf!r} does not match {nbytes} bytes in "
                            f"{CHUNK_BYTES}-byte chunks")
        if nf == 1:
            buf = _buf(frames[pos])
            got = len(buf)
        else:
            bufs = [_buf(f) for f in frames[pos:pos + nf]]
            got = sum(len(b) for b in bufs)
        pos += nf
        if got != nbytes:
            raise WireError(f"header.tensors[{i}]: shape {shape} x {itemsize} bytes = {nbytes}, but its frames "
                            f"hold {got}")
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=DTYPES[dtype])
        elif nf == 1:
            out[name] = torch.frombuffer(buf, dtype=DTYPES[dtype]).view(shape)
        else:  # split tensors are joined once; the price of not sending one huge frame
            flat = torch.cat([torch.frombuffer(b, dtype=torch.uint8) for b in bufs])
            out[name] = flat.view(DTYPES[dtype]).view(shape)
    return h, out


def new_id(prefix: str) -> str:
    """A fresh request or sequence id: `prefix` and 128 random bits in hex. Ids name what a message
    may release, rewind or answer, so no other client may be able to guess one (a counter after a
    pid could be); the prefix says what kind of id it is in logs."""
    if not ID_RE.match(prefix + "0" * 32):
        raise WireError(f"id prefix: {prefix[:40]!r} must be at most 32 characters of [A-Za-z0-9_.:-]")
    return prefix + secrets.token_hex(16)


def require(header: dict, key: str, kind: type, lo: int | None = None, hi: int | None = None):
    """One op-specific header field, type- and range-checked."""
    v = header.get(key)
    if kind is int:
        if type(v) is not int or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise WireError(f"header.{key}: must be an integer in [{lo}, {hi}]")
    elif kind is str:
        if not isinstance(v, str) or len(v) > 256:
            raise WireError(f"header.{key}: must be a string of at most 256 characters")
    elif not isinstance(v, kind):
        raise WireError(f"header.{key}: must be a {kind.__name__}")
    return v


def endpoint(value: str, field: str = "endpoint") -> str:
    if not isinstance(value, str) or not ENDPOINT_RE.fullmatch(value):
        raise WireError(f"{field}: {str(value)[:60]!r} is not a tcp://HOST:PORT address")
    return value
