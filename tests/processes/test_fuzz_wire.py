"""Wire fuzzing: mutated messages into live workers' data and control sockets.

A seeded mutator (reproducible: LAYERLINE_FUZZ_SEED, default 14) takes valid messages and
truncates, duplicates, reorders and empties frames, lies about shapes, dtypes and frame
counts, asks for huge sizes, breaks the header's UTF-8 and JSON, swaps ops, names stale or
unknown sequences and wire epochs (stale ones are refused, not computed) and sends oversized
frames. They go to a two-stage pipeline on loopback (every socket CURVE, as between hosts): data
sockets as the controller, control sockets as the controller and as strangers.

Asserted: no worker exits; every message gets an error reply or is dropped, and the socket
answers the next one (a ping after each message; no hang); resident memory grows by less than
50 MB; after every thousand messages (and after the control round) a valid request gives logits
torch.equal to the fresh workers' answer to it.

Default: 1,000 data and 200 control messages per pipeline. LAYERLINE_FUZZ=full (what `make fuzz`
sets) sends 10,000 and 2,000; LAYERLINE_FUZZ=DATA,CONTROL any other count. Each run prints its
figures (messages, crashes, error replies, drops, memory growth, seconds) with -s.
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from types import SimpleNamespace

import torch
import zmq

from layerline import keys, wire
from stage_procs import control, control_socket, start_workers

VOCAB, HIDDEN, KV = 500, 128, 128     # the small_ckpt fixture
SEED = int(os.environ.get("LAYERLINE_FUZZ_SEED", "14"))
MEM_LIMIT = 50 * 2**20
PING_S = (2.0, 10.0, 10.0)  # how long each ping may wait; one lost with a connection zmq dropped (an
                            # oversized frame) or stuck behind a slow legal forward is sent again


def counts() -> tuple[int, int]:
    v = os.environ.get("LAYERLINE_FUZZ", "")
    if v == "full":
        return 10_000, 2_000
    if v:
        d, c = v.split(",")
        return int(d), int(c)
    return 1_000, 200


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


# --- the mutator --------------------------------------------------------------------------------

OPS = sorted(wire.OPS) + ["", "FORWARD", "forward ", "load", "exec", "\u00e9"]
DTYPES = sorted(wire.DTYPES) + ["float64", "complex64", "bool", "", "int64 ", "torch.float32"]
ODD = [None, True, False, -1, 0, 1, 2**31, 2**63, -(2**63), 10**30, 1.5, float("nan"), float("inf"), "",
       "x" * 300, "0", [], [1], {}, {"a": 1}]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice("abc019_.:-/\\\"'\u00e9\u2603 \x00\n") for _ in range(rng.randint(0, 40)))


class Mutator:
    """Valid messages for one stage, and mutations of them (all from one seeded Random)."""

    def __init__(self, rng: random.Random, first: bool, reply_to: str, seqs: list[str]):
        self.rng, self.first, self.reply_to, self.seqs = rng, first, reply_to, seqs
        self.n = 0

    # valid messages
    def tensor(self, b: int, t: int) -> dict:
        if self.first:
            return {"input_ids": torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(self.n))}
        return {"hidden": torch.randn(b, t, HIDDEN, generator=torch.Generator().manual_seed(self.n))}

    def valid(self) -> tuple[dict, dict]:
        r, self.n = self.rng, self.n + 1
        rid = f"f{self.n}"
        kind = r.choice(["plain", "plain", "cached", "cached", "rows", "release"])
        if kind == "release":
            return {"op": "release", "seq": r.choice(self.seqs)}, {}
        base = {"op": "forward", "id": rid, "reply_to": self.reply_to, "deadline": time.time() + 60,
                "timings": [], "logits": r.choice(["last", "all", "argmax"])}
        if r.random() < 0.5:   # a wire epoch: older ones than a sequence's last are refused, not computed
            base["epoch"] = r.randint(0, 3)
        if kind == "plain":
            return base, self.tensor(r.randint(1, 3), r.randint(1, 8))
        if kind == "cached":
            seq = r.choice(self.seqs)
            pos = r.choice([0, 0, r.randint(1, 20)])
            return {**base, "cache": True, "seq": seq, "pos": pos, "reserve": 32}, self.tensor(1, r.randint(1, 4))
        rows = [[q, r.randint(1, 20)] for q in r.sample(self.seqs, r.randint(1, 3))]
        return {**base, "cache": True, "rows": rows, "logits": "last"}, self.tensor(len(rows), 1)

    # mutations of a header dict
    def header(self, h: dict) -> dict:
        r = self.rng
        h = json.loads(json.dumps(h))
        for _ in range(r.randint(1, 3)):
            m = r.randrange(14)
            keys_ = list(h)
            t = h.get("tensors")
            specs = [x for x in t if isinstance(x, dict)] if isinstance(t, list) else []
            if m == 0:                                   # wrong op
                h["op"] = r.choice(OPS)
            elif m == 1 and keys_:                        # a field of the wrong type or range
                h[r.choice(keys_)] = r.choice(ODD)
            elif m == 2 and keys_:                        # a field missing
                h.pop(r.choice(keys_))
            elif m == 3:                                  # stale or unknown sequences
                h["seq"] = r.choice(self.seqs + ["never-seen", "x" * 65, "../etc", ""])
                h["pos"] = r.choice([0, 1, 7, 127, 128, 10**6, -3])
                h["cache"] = r.choice([True, False, "yes"])
            elif m == 4:                                  # rows that lie
                h["rows"] = r.choice([[], [["a", 1]] * 2, [[q, 10**9] for q in self.seqs],
                                      [["never", 1]], [[1, "a"]], "rows", [[q, 0] for q in self.seqs[:2]],
                                      [["s%d" % i, 1] for i in range(70)]])
            elif m == 5 and specs:                        # a lying shape
                s = r.choice(specs)
                shape = s.get("shape") if isinstance(s.get("shape"), list) and s.get("shape") else [1]
                s["shape"] = r.choice([[], [0], [1, 1, 1, 1, 1, 1, 1], [2**31, 2**31], [-1, 4], [1.0, 2],
                                       [r.randint(0, 9) for _ in range(r.randint(1, 4))], "3x4", None,
                                       [shape[0] * 2 if isinstance(shape[0], int) else 2] + shape[1:]])
            elif m == 6 and specs:                        # a lying dtype
                r.choice(specs)["dtype"] = r.choice(DTYPES)
            elif m == 7 and specs:                        # huge counts
                s = r.choice(specs)
                s[r.choice(["frames", "frames", "shape"])] = r.choice([0, 2**20, 2**20 + 1, 2**62, [2**31] * 6])
            elif m == 8:                                  # many or odd tensor specs
                h["tensors"] = r.choice([[{"name": "t%d" % i, "dtype": "int8", "shape": [0], "frames": 1}
                                          for i in range(20)], "x", [1], [{}], None,
                                         (t if isinstance(t, list) else []) * 2])
            elif m == 9:                                  # the protocol version
                h["v"] = r.choice([0, 2, "1", 1.0, None, True])
            elif m == 10:                                 # ids
                h["id"] = r.choice(["", "x" * 65, "a b", 5, None, "\u00e9", "ok-id"])
            elif m == 11:                                 # where to answer
                h["reply_to"] = r.choice(["tcp://127.0.0.1:1", "udp://x:1", "tcp://nonexistent.invalid:5",
                                          "ipc:///tmp/x", "tcp://[::1]:9", "tcp://0.0.0.0:0", "x" * 300, 7])
            elif m == 12:                                 # deadlines and timings
                h[r.choice(["deadline", "timings"])] = r.choice(
                    [0, -1, float("nan"), 1e308, "soon", [{"stage": "x"}],
                     [{"stage": "s", "layers": [0, 1], "s": 1e308}] * 65,
                     [{"stage": "s", "layers": [0, 1], "s": True}]])
            else:                                         # junk fields
                h[_text(r) or "k"] = r.choice(ODD)
        return h

    def frames(self, h: dict, tensors: dict) -> list[bytes]:
        """One mutated message: valid, then broken at the header, frame or byte level."""
        r = self.rng
        frames = [bytes(memoryview(f)) for f in wire.encode(h, tensors)]
        m = r.randrange(16)
        if m <= 5:   # the header's fields
            frames[0] = json.dumps(self.header(json.loads(frames[0]))).encode()
        elif m == 6 and len(frames) > 1:                  # truncated frames
            frames = frames[:r.randint(0, len(frames) - 1)] or [frames[0][:r.randint(0, len(frames[0]))]]
        elif m == 7:                                      # truncated bytes
            i = r.randrange(len(frames))
            frames[i] = frames[i][:r.randint(0, max(0, len(frames[i]) - 1))]
        elif m == 8:                                      # duplicated frames
            i = r.randrange(len(frames))
            frames.insert(i, frames[i])
        elif m == 9:                                      # reordered frames
            r.shuffle(frames)
            if len(frames) > 1 and frames[0].startswith(b"{"):
                frames.reverse()
        elif m == 10:                                     # empty frames
            i = r.randrange(len(frames) + 1)
            frames.insert(i, b"") if r.random() < 0.5 else frames.__setitem__(min(i, len(frames) - 1), b"")
        elif m == 11:                                     # bad UTF-8 in the header
            b = bytearray(frames[0])
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] = r.choice([0xff, 0xc3, 0x80, 0xed, 0xa0, 0x00])
            frames[0] = bytes(b)
        elif m == 12:                                     # bad JSON in the header
            frames[0] = r.choice([frames[0][:-1], frames[0] + b"}", b"[]", b'"op"', b"1", b"null", b"{",
                                  b"[" * 20000 + b"]" * 20000, b'{"v":1,"op":"forward","pos":' + b"9" * 5000 + b"}",
                                  b'{"v":1,"op":"forward","v":1}', frames[0].replace(b":", b"=", 1)])
        elif m == 13:                                     # oversized frames (rarely: they are big)
            if r.random() < 0.05:
                frames.append(b"\0" * (wire.MAX_FRAME_BYTES + 4096 + r.randint(1, 2**20)))
            else:
                frames[0] = frames[0][:-1] + b',"pad":"' + b"p" * (wire.MAX_HEADER_BYTES + 10) + b'"}'
        elif m == 14:                                     # random bytes
            frames = [r.randbytes(r.randint(0, 200)) for _ in range(r.randint(1, 4))]
        else:                                             # valid, unmutated: computed or forwarded
            pass
        return frames

    def control(self, stranger: bool) -> list[bytes]:
        """A mutated control request. As the controller it never is a well-formed shutdown (the
        fuzzed worker must keep serving); strangers send those too."""
        r = self.rng
        self.n += 1
        base = r.choice([{"op": "health"}, {"op": "stats"},
                         {"op": "set_next", "next": self.next, "next_key": self.next_key}] +
                        ([{"op": "shutdown"}, {"op": "set_next", "next": "tcp://127.0.0.1:1"}] if stranger else []))
        base["id"] = f"c{self.n}"
        h, t = base, {}
        if r.random() < 0.3:
            h, t = self.valid()  # data messages at the control socket
        frames = self.frames(h, t)
        if not stranger:
            try:
                got = json.loads(frames[0])
                if isinstance(got, dict) and got.get("op") == "shutdown":
                    frames[0] = json.dumps({**got, "op": "shutdown!"}).encode()
            except (ValueError, UnicodeDecodeError, RecursionError):
                pass
        return frames


# --- the rig ------------------------------------------------------------------------------------

class Asker:
    """A DEALER into one socket as the controller (CURVE), a ping after each message, and the
    tally of what came back."""

    def __init__(self, ctx, endpoint: str, keys_dir: str, name: str, is_control: bool):
        self.endpoint, self.is_control = endpoint, is_control
        self.s = control_socket(endpoint, ctx, keys_dir, name)
        self.pings = 0
        self.errors = self.dropped = self.other = self.lost_pings = 0
        self.raw: dict[str, int] = {}   # error texts that name no field (a Python exception's), by kind

    def ping(self) -> list[dict]:
        """Answers to whatever was sent before the ping, then the ping's own; AssertionError on a hang."""
        got = []
        for wait_s in PING_S:
            self.pings += 1
            pid = f"ping-{self.pings}"
            head = {"op": "stats", "id": pid} if self.is_control else {"op": "forward", "id": pid}
            self.s.send_multipart(wire.encode(head))
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if not self.s.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    break
                try:
                    h, _ = wire.decode(self.s.recv_multipart())
                except wire.WireError as e:
                    raise AssertionError(f"{self.endpoint}: an answer that is not a valid message ({e})") from None
                if h.get("id") == pid:
                    return got
                if isinstance(h.get("id"), str) and h["id"].startswith("ping-"):
                    continue  # a ping sent before, answered late
                got.append(h)
            self.lost_pings += 1
        raise AssertionError(f"{self.endpoint}: no answer to {len(PING_S)} pings in {sum(PING_S):.0f} s")

    def send(self, frames: list[bytes]) -> None:
        self.s.send_multipart(frames)
        got = self.ping()
        if not got:
            self.dropped += 1
        for h in got:
            if h.get("op") == "error":
                assert isinstance(h.get("error"), str) and h["error"], h
                self.errors += 1
                m = re.match(r"^([A-Z][A-Za-z]+(Error|Exception)): ", h["error"])
                if m:
                    self.raw[h["error"][:160]] = self.raw.get(h["error"][:160], 0) + 1
            else:
                self.other += 1

    def close(self):
        self.s.close(0)


def fuzz(w: SimpleNamespace, n_data: int, n_control: int) -> dict:
    rng = random.Random(SEED + 1)
    ctx = zmq.Context()
    results = ctx.socket(zmq.ROUTER)   # where fuzzed forwards answer (reply_to)
    results.setsockopt(zmq.LINGER, 0)
    allow = keys.Allowlist(ctx, keys.load_host_keys(w.keys).allowed)
    keys.serve_curve(results, keys.load_host_keys(w.keys))
    reply_to = f"tcp://127.0.0.1:{results.bind_to_random_port('tcp://127.0.0.1')}"
    seqs = [f"q{i}" for i in range(6)]
    muts = [Mutator(rng, True, reply_to, seqs), Mutator(rng, False, reply_to, seqs)]
    for m, (nxt, key) in zip(muts, [(w.data[1], w.names[1]), (w.data[1], w.names[1])]):
        m.next, m.next_key = nxt, key
    data = [Asker(ctx, w.data[i], w.keys, w.names[i], False) for i in range(2)]
    ctl = [Asker(ctx, w.control[i], w.keys, w.names[i], True) for i in range(2)]
    pids = [p.pid for p in w.procs]
    probe_ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(SEED))

    def check(pipe, what: str):
        for p in w.procs:
            assert p.poll() is None, f"a worker exited ({p.returncode}) {what}"
        got = pipe.forward(probe_ids).logits
        assert torch.equal(got, fresh), f"logits changed {what}"

    t0 = time.perf_counter()
    results_seen = 0
    try:
        with w.pipeline(timeout_s=60) as pipe:
            fresh = pipe.forward(probe_ids).logits          # the fresh workers' answer
            # warm both stages' allocators with valid traffic before the baseline
            for _ in range(20):
                pipe.forward(probe_ids[:1, :3])
            base = [rss(p) for p in pids]
            peak = list(base)
            for i in range(n_data):
                k = i % 2
                frames = muts[k].frames(*muts[k].valid())
                data[k].send(frames)
                while results.poll(0):   # results and errors of fuzzed forwards that got through stage0
                    h, _ = wire.decode(results.recv_multipart()[1:])
                    results_seen += 1
                    if h["op"] == "error" and re.match(r"^[A-Z][A-Za-z]+(Error|Exception): ", h["error"]):
                        data[1].raw[h["error"][:160]] = data[1].raw.get(h["error"][:160], 0) + 1
                for p in w.procs:
                    assert p.poll() is None, f"worker exited ({p.returncode}) after data message {i}"
                if (i + 1) % 1000 == 0 or i + 1 == n_data:
                    check(pipe, f"after {i + 1} data messages")
                    peak = [max(a, rss(p)) for a, p in zip(peak, pids)]
            # control: as the controller (answered, never a shutdown), and strangers (never answered)
            strangers = []
            for i in range(n_control):
                k = i % 2
                ctl[k].send(muts[k].control(stranger=False))
                if i % 10 == 0:
                    kind = rng.choice(["no curve", "unknown key"])
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    if kind == "unknown key":
                        pub, sec = zmq.curve_keypair()
                        keys.connect_curve(s, keys.HostKeys(dir="-", public=pub, secret=sec),
                                           keys.load_host_keys(w.keys).peers[w.names[k]])
                    s.connect(w.control[k])
                    for _ in range(5):
                        try:  # a refused handshake leaves the DEALER no peer: sending would block
                            s.send_multipart(muts[k].control(stranger=True), flags=zmq.NOBLOCK)
                        except zmq.Again:
                            pass
                    strangers.append(s)
                if (i + 1) % 1000 == 0 or i + 1 == n_control:
                    # the controller's set_next may have pointed stage0 elsewhere: point it back
                    control(w.control[0], "set_next", next=w.data[1], next_key=w.names[1])
                    check(pipe, f"after {i + 1} control messages")
            time.sleep(1.0)
            for s in strangers:
                assert not s.poll(0), "a stranger got an answer from a control socket"
                s.close(0)
            control(w.control[0], "set_next", next=w.data[1], next_key=w.names[1])
            check(pipe, "at the end")
            end = [rss(p) for p in pids]
            peak = [max(a, b) for a, b in zip(peak, end)]
    finally:
        for a in data + ctl:
            a.close()
        results.close(0)
        allow.stop()
        ctx.term()
    stats = [control(c, "stats") for c in w.control]
    return {"data_messages": n_data, "control_messages": n_control,
            "stranger_control_messages": len(strangers) * 5,
            "crashes": sum(p.poll() is not None for p in w.procs),
            "data_error_replies": sum(a.errors for a in data), "data_dropped": sum(a.dropped for a in data),
            "control_error_replies": sum(a.errors for a in ctl), "control_ok_replies": sum(a.other for a in ctl),
            "control_dropped": sum(a.dropped for a in ctl),
            "lost_pings": sum(a.lost_pings for a in data + ctl),
            "unnamed_errors": {k: v for a in data + ctl for k, v in a.raw.items()}, "results_at_reply_to": results_seen,
            "worker_rejected": [s["rejected"] for s in stats], "worker_errors": [s["errors"] for s in stats],
            "rss_growth_mb": [round((e - b) / 2**20, 1) for b, e in zip(base, end)],
            "rss_peak_growth_mb": [round((e - b) / 2**20, 1) for b, e in zip(base, peak)],
            "seconds": round(time.perf_counter() - t0, 1)}


def test_fuzzed_messages_never_kill_or_hang_a_worker(small_ckpt):
    n_data, n_control = counts()
    w = start_workers(str(small_ckpt), [(0, 2), (2, 4)], kv_context=KV)
    try:
        report = fuzz(w, n_data, n_control)
    finally:
        codes = w.stop()
    print("\nfuzz " + json.dumps(report), flush=True)
    assert report["crashes"] == 0 and codes == [0, 0], codes   # SIGTERM still ends them cleanly
    assert all(g < MEM_LIMIT / 2**20 for g in report["rss_growth_mb"]), report
    assert not report["unnamed_errors"], report   # every error names the field (or the stage and sequence)
    assert report["data_error_replies"] > n_data // 2 and report["control_error_replies"] > n_control // 4, report
