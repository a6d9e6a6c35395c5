"""layerline.worker as real processes: the pipeline's numbers, its control socket, and its
refusal to die of bad input.

A two-stage pipeline of the small demo checkpoint is started once for the module (plus one
spare last stage for re-routing, shutdown and dead-stage tests); raw messages go to the data
sockets through a zmq DEALER, the way a misbehaving peer would send them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest
import torch
import zmq

from helpers import wait_ready
from layerline import keys, version, wire
from stage_procs import (control, control_socket, curve_dealer, curve_results, free_port_pairs, register, start_workers,
                         stop_workers, worker_keys)
from layerline.driver import DriveError, greedy_generate
from layerline.model.loader import load_stage

KV = 128        # --kv-context: small caches, quick to allocate
LAYERS = 4      # the small_ckpt fixture's layers
VOCAB = 500
HIDDEN = 128
ATOL = 1e-5
# the pid a worker reports is checked against the one its starter holds (a warm start answers from a
# fork of the template, its starter holding a stand-in)
pytestmark = pytest.mark.cold_starts


def control_of(endpoint: str) -> str:
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + 1}"


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stages(small_ckpt, request):
    """Two local workers: stage0 = layers 0:2 (first), stage1 = layers 2:4 (last)."""
    w = start_workers(str(small_ckpt), [(0, 2), (2, 4)], "fp32", kv_context=KV, threads=1, more_keys=["spare"])
    tmp = tempfile.mkdtemp(prefix="layerline-worker-test-")

    def stop():
        # SIGTERM (what stop_workers sends) is a clean stop: exit status 0, not a kill
        assert w.stop() == [0, 0]
        shutil.rmtree(tmp, ignore_errors=True)
    request.addfinalizer(stop)
    info = w.info
    assert info[0]["bind"] == w.first
    return SimpleNamespace(procs=w.procs, first=w.first, tmp=tmp, info=info, workers=w,
                           data=[i["bind"] for i in info], control=[control_of(i["bind"]) for i in info])


@pytest.fixture(scope="module")
def pipe(stages, request):
    p = stages.workers.pipeline(timeout_s=30.0)
    request.addfinalizer(p.close)
    return p


@pytest.fixture(scope="module")
def reference(small_ckpt):
    """The whole model in this process: the numbers the pipeline must reproduce."""
    return load_stage(str(small_ckpt), 0, LAYERS, True, True, "fp32")


@pytest.fixture(scope="module")
def spare(small_ckpt, stages, request):
    """A third worker equal to stage1 (layers 2:4, last), for set_next, shutdown and dead-stage tests."""
    (port,) = free_port_pairs(1)
    bind = f"tcp://127.0.0.1:{port}"
    ready = os.path.join(stages.tmp, "ready-spare.json")
    log = open(os.path.join(stages.tmp, "spare.log"), "w")
    kd = worker_keys(stages.workers.tmp, [*stages.workers.names, "spare"])
    proc = subprocess.Popen([sys.executable, "-m", "layerline.worker", "--checkpoint", str(small_ckpt),
                             "--layers", f"2:{LAYERS}", "--precision", "fp32", "--kv-context", str(KV),
                             "--bind", bind, "--name", "spare", "--ready-file", ready, "--last",
                             "--threads", "1", "--keys", kd["spare"]],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    request.addfinalizer(lambda: (stop_workers([proc]), log.close()))
    wait_ready(ready, proc, timeout=120.0)
    register(control_of(bind), kd["controller"], "spare")
    return SimpleNamespace(proc=proc, data=bind, control=control_of(bind), ready=ready)


@pytest.fixture
def restore_routing(stages):
    """Whatever a test does to stage0's next hop, point it back at stage1 afterwards."""
    yield
    control(stages.control[0], "set_next", next=stages.data[1], next_key="stage1")


@pytest.fixture
def dealer(stages):
    """send(endpoint, frames) -> the decoded reply header (and tensors), over a fresh DEALER to a
    stage's data socket, as the controller (CURVE)."""
    ctx = zmq.Context()
    socks = []
    names = dict(zip(stages.data, stages.workers.names))

    def send(endpoint, frames, timeout_s=10.0):
        s = curve_dealer(endpoint, stages.workers.keys, names[endpoint], ctx)
        socks.append(s)
        s.send_multipart(frames)
        assert s.poll(timeout_s * 1000), f"no reply from {endpoint} within {timeout_s} s"
        return wire.decode(s.recv_multipart())

    yield send
    for s in socks:
        s.close(0)
    ctx.term()


def ids_(*shape, seed=0):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def stats(endpoint):
    return control(endpoint, "stats")


# --- numbers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (3, 5)])
def test_pipeline_forward_equals_one_process_forward(pipe, reference, stages, shape):
    ids = ids_(*shape, seed=sum(shape))
    r = pipe.forward(ids)
    ref = reference(ids)
    assert r.logits.shape == (*shape, VOCAB) and r.logits.dtype == torch.float32
    assert torch.allclose(r.logits, ref, rtol=0, atol=ATOL), float((r.logits - ref).abs().max())
    assert [t["stage"] for t in r.timings] == ["stage0", "stage1"]
    assert [t["layers"] for t in r.timings] == [[0, 2], [2, 4]]
    assert all(isinstance(t["s"], float) and t["s"] >= 0 for t in r.timings)
    assert r.wall_s >= sum(t["s"] for t in r.timings) and r.hop_s >= 0


def test_one_dimensional_ids_are_one_batch(pipe, reference):
    ids = ids_(6, seed=3)
    r = pipe.forward(ids)
    assert torch.allclose(r.logits, reference(ids[None]), rtol=0, atol=ATOL)


def in_process_greedy(stage, prompt, n):
    cache = stage.new_cache(1, KV)
    logits = stage(torch.tensor([prompt]), 0, cache)
    out, steps, pos = [], [logits], len(prompt)
    for _ in range(n):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if len(out) == n:
            break
        logits = stage(torch.tensor([[tok]]), pos, cache)
        steps.append(logits)
        pos += 1
    return out, steps


def test_greedy_generate_equals_in_process_kv_cache_decoding(pipe, reference, stages):
    prompt = [3, 17, 42, 99, 7, 250, 1]
    before = [stats(c)["sequences"] for c in stages.control]
    toks, steps = greedy_generate(pipe, prompt, 8, seq="greedy-1")
    want, ref_steps = in_process_greedy(reference, prompt, 8)
    assert toks == want
    assert len(steps) == len(ref_steps) == 8
    for got, ref in zip(steps, ref_steps):  # generation asks only for each step's last logits
        assert got.logits.shape[1] == 1
        assert torch.allclose(got.logits[:, -1], ref[:, -1], rtol=0, atol=ATOL)
        assert [t["stage"] for t in got.timings] == ["stage0", "stage1"]
    # the cache path is also equal to a full recompute of prompt + generated tokens
    full = reference(torch.tensor([prompt + toks[:-1]]))
    assert torch.allclose(steps[-1].logits[0, -1], full[0, -1], rtol=0, atol=1e-4)
    # greedy_generate releases the sequence on every stage (release is fire-and-forget)
    deadline = time.time() + 5
    while [stats(c)["sequences"] for c in stages.control] != before:
        assert time.time() < deadline, "release did not free the sequence's KV caches"
        time.sleep(0.05)


def test_kv_cache_positions_are_enforced(pipe, stages):
    seq = "pos-check"
    try:
        pipe.forward(ids_(1, 4), seq=seq, pos=0, cache=True)
        with pytest.raises(DriveError, match=r"stage stage0: seq pos-check holds 4 tokens, got position 6"):
            pipe.forward(ids_(1, 1), seq=seq, pos=6, cache=True)
        pipe.forward(ids_(1, 1), seq=seq, pos=4, cache=True)  # the sequence is still usable
        with pytest.raises(DriveError, match=r"would exceed --kv-context"):
            pipe.forward(ids_(1, KV - 4), seq=seq, pos=5, cache=True)
    finally:
        pipe.release(seq)


def test_error_at_a_later_stage_reaches_the_driver_by_name(pipe, stages):
    """stage1 alone forgets the sequence: the driver hears it from stage1 through reply_to."""
    seq = "forgotten"
    try:
        pipe.forward(ids_(1, 3), seq=seq, pos=0, cache=True)
        dealer_sock = stages.workers.dealer(1)
        dealer_sock.setsockopt(zmq.LINGER, 1000)
        dealer_sock.send_multipart(wire.encode({"op": "release", "seq": seq}))
        dealer_sock.close()
        deadline = time.time() + 5
        while stats(stages.control[1])["sequences"]:
            assert time.time() < deadline
            time.sleep(0.05)
        with pytest.raises(DriveError, match=r"^stage stage1: stage stage1: seq forgotten is unknown at position 3"):
            pipe.forward(ids_(1, 1), seq=seq, pos=3, cache=True)
    finally:
        pipe.release(seq)


# --- bad input never kills a worker -------------------------------------------------------------

def H(**fields) -> dict:
    return {"op": "forward", "id": "bad-1", **fields}


def raw_header(h: dict, *frames) -> list:
    return [json.dumps({"v": wire.PROTOCOL, **h}).encode(), *frames]


GOOD_IDS = {"input_ids": torch.tensor([[1, 2, 3]])}

def bad_inputs(reply_to: str) -> dict:
    """case -> (stage index, frames, text the error must contain, counter it goes to)."""
    return {
        "garbage frames": (0, [b"\x00\xffnot json at all", b"\x01\x02"], "header: not valid", "rejected"),
        "empty header": (0, [b""], "header", "rejected"),
        "pickle": (0, [b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94."], "header", "rejected"),
        "json array header": (0, [b"[]"], "header: must be a JSON object", "rejected"),
        "wrong protocol": (0, raw_header({"v": 99, "op": "forward"}), "header.v", "rejected"),
        "bad dtype": (0, raw_header(H(tensors=[{"name": "input_ids", "dtype": "complex128", "shape": [1, 3],
                                                "frames": 1}]), b"\0" * 48), "header.tensors[0].dtype", "rejected"),
        "bytes do not match shape": (0, raw_header(H(tensors=[{"name": "input_ids", "dtype": "int64",
                                                               "shape": [1, 3], "frames": 1}]), b"\0" * 23),
                                     "header.tensors[0]", "rejected"),
        "huge declared shape": (0, raw_header(H(tensors=[{"name": "input_ids", "dtype": "int64",
                                                          "shape": [2**31, 2**31], "frames": 1}]), b"\0" * 8),
                                "header.tensors[0]", "rejected"),
        "huge shape with matching frame count": (0, raw_header(H(tensors=[{"name": "input_ids", "dtype": "int64",
                                                                           "shape": [64, 2**20], "frames": 32}]),
                                                               *[b""] * 32), "header.tensors[0]", "rejected"),
        "too many dims": (0, raw_header(H(tensors=[{"name": "input_ids", "dtype": "int64",
                                                    "shape": [1] * 7, "frames": 1}]), b"\0" * 8),
                          "header.tensors[0].shape", "rejected"),
        "wrong tensor name": (0, wire.encode(H(), {"hidden": torch.zeros(1, 3, HIDDEN)}),
                              "stage stage0 takes exactly one tensor named 'input_ids'", "rejected"),
        "two tensors": (0, wire.encode(H(), {**GOOD_IDS, "extra": torch.zeros(1)}), "tensors: stage stage0", "rejected"),
        "no tensors": (0, wire.encode(H()), "tensors: stage stage0", "rejected"),
        "float ids": (0, wire.encode(H(), {"input_ids": torch.zeros(1, 3)}), "input_ids: must be int64", "rejected"),
        "ids of 3 dims": (0, wire.encode(H(), {"input_ids": torch.zeros(1, 3, 1, dtype=torch.int64)}),
                          "input_ids: must be int64 of shape [batch, tokens]", "rejected"),
        "ids of 0 dims": (0, wire.encode(H(), {"input_ids": torch.tensor(5)}), "input_ids", "rejected"),
        "token id = vocab": (0, wire.encode(H(), {"input_ids": torch.tensor([[1, VOCAB]])}),
                             f"input_ids: token ids must be in [0, {VOCAB})", "rejected"),
        "negative token id": (0, wire.encode(H(), {"input_ids": torch.tensor([[-1, 2]])}),
                              f"input_ids: token ids must be in [0, {VOCAB})", "rejected"),
        "no tokens": (0, wire.encode(H(), {"input_ids": torch.zeros(1, 0, dtype=torch.int64)}), "shape: batch",
                      "rejected"),
        "batch too large": (0, wire.encode(H(), {"input_ids": torch.zeros(65, 1, dtype=torch.int64)}),
                            "shape: batch must be 1..64", "rejected"),
        "tokens over kv context": (0, wire.encode(H(), {"input_ids": torch.zeros(1, KV + 1, dtype=torch.int64)}),
                                   f"tokens 1..{KV}", "rejected"),
        "pos > 0 for an unknown seq": (0, wire.encode(H(pos=3, cache=True, seq="ghost"), GOOD_IDS),
                                       "stage stage0: seq ghost is unknown at position 3", "errors"),
        "pos > 0 without cache": (0, wire.encode(H(pos=2), GOOD_IDS), "header.pos: must be 0 without cache",
                                  "rejected"),
        "pos beyond kv context": (0, wire.encode(H(pos=KV, cache=True, seq="s"), GOOD_IDS), "header.pos", "rejected"),
        "pos not an int": (0, wire.encode(H(pos="0"), GOOD_IDS), "header.pos", "rejected"),
        "cache without seq": (0, wire.encode(H(cache=True), GOOD_IDS), "header.seq", "rejected"),
        "bad seq": (0, wire.encode(H(cache=True, seq="a/b"), GOOD_IDS), "header.seq", "rejected"),
        "bad reply_to": (0, wire.encode(H(reply_to="http://evil.example/x"), GOOD_IDS), "header.reply_to", "rejected"),
        "reply_to not a string": (0, wire.encode(H(reply_to=["tcp://127.0.0.1:1"]), GOOD_IDS), "header.reply_to",
                                  "rejected"),
        "bad deadline": (0, wire.encode(H(deadline="tomorrow"), GOOD_IDS), "header.deadline", "rejected"),
        "negative epoch": (0, wire.encode(H(epoch=-1, cache=True, seq="s"), GOOD_IDS), "header.epoch", "rejected"),
        "epoch a float": (0, wire.encode(H(epoch=1.5), GOOD_IDS), "header.epoch", "rejected"),
        "inflight zero": (0, wire.encode(H(inflight=0), GOOD_IDS), "header.inflight", "rejected"),
        "inflight a string": (0, wire.encode(H(inflight="2"), GOOD_IDS), "header.inflight", "rejected"),
        "inflight huge": (0, wire.encode(H(inflight=10**12), GOOD_IDS), "header.inflight", "rejected"),
        "control op on the data socket": (0, wire.encode({"op": "shutdown", "id": "bad-1"}), "header.op", "rejected"),
        "result op on the data socket": (0, wire.encode({"op": "result", "id": "bad-1"}), "header.op", "rejected"),
        "release without seq": (0, wire.encode({"op": "release", "id": "bad-1"}), "header.seq", "rejected"),
        "hidden of the wrong width": (1, wire.encode(H(reply_to=reply_to),
                                                     {"hidden": torch.zeros(1, 3, HIDDEN // 2)}),
                                      f"hidden: must be float of shape [batch, tokens, {HIDDEN}]", "rejected"),
        "integer hidden": (1, wire.encode(H(reply_to=reply_to),
                                          {"hidden": torch.zeros(1, 3, HIDDEN, dtype=torch.int32)}),
                           "hidden: must be float", "rejected"),
        "token ids to a middle stage": (1, wire.encode(H(reply_to=reply_to), GOOD_IDS),
                                        "stage stage1 takes exactly one tensor named 'hidden'", "rejected"),
        "last stage without reply_to": (1, wire.encode(H(), {"hidden": torch.zeros(1, 3, HIDDEN)}),
                                        "header.reply_to: required", "rejected"),
    }


def test_bad_input_gets_error_replies_and_never_kills_a_worker(stages, pipe, reference, dealer):
    before = [stats(c) for c in stages.control]
    expected = [{"rejected": 0, "errors": 0} for _ in stages.control]
    # the last stage also sends its errors to reply_to: the pipeline's socket, which drops unknown ids
    for case, (i, frames, text, counter) in bad_inputs(pipe.reply_to).items():
        h, tensors = dealer(stages.data[i], frames)
        assert h["op"] == "error", case
        assert h["stage"] == f"stage{i}", case
        assert text in h["error"], f"{case}: {h['error']!r} lacks {text!r}"
        assert len(h["error"]) <= 2000 and tensors == {}, case
        if h.get("id") is not None:
            assert h["id"] == "bad-1", case
        expected[i][counter] += 1
        assert all(p.poll() is None for p in stages.procs), f"{case} killed a worker"
    for i, c in enumerate(stages.control):
        health = control(c, "health", timeout_s=5)
        assert health["op"] == "ok" and health["name"] == f"stage{i}" and health["pid"] == stages.procs[i].pid
        after = stats(c)
        for counter in ("rejected", "errors"):
            assert after[counter] - before[i][counter] == expected[i][counter], (i, counter)
        assert after["requests"] >= before[i]["requests"]
    # and a good forward still goes through, with the right numbers
    ids = ids_(2, 4, seed=11)
    assert torch.allclose(pipe.forward(ids).logits, reference(ids), rtol=0, atol=ATOL)


def test_driver_hears_a_rejection_by_stage_name(pipe):
    with pytest.raises(DriveError, match=rf"^stage stage0: input_ids: token ids must be in \[0, {VOCAB}\)"):
        pipe.forward(torch.tensor([[1, VOCAB + 7]]))
    with pytest.raises(DriveError, match=r"^stage stage0: stage stage0: seq nothing is unknown at position 5"):
        pipe.forward(ids_(1, 1), seq="nothing", pos=5, cache=True)
    assert pipe.forward(ids_(1, 2)).logits.shape == (1, 2, VOCAB)


def test_a_flood_of_garbage_is_survived(stages, pipe):
    s = stages.workers.dealer(0)
    try:
        for k in range(300):
            s.send_multipart([os.urandom(k % 50), os.urandom(k % 7)][: 1 + k % 2])
        got = 0
        while got < 300 and s.poll(5000):
            h, _ = wire.decode(s.recv_multipart())
            assert h["op"] == "error" and h["stage"] == "stage0"
            got += 1
        assert got == 300
    finally:
        s.close(0)
    assert control(stages.control[0], "health")["op"] == "ok"
    assert pipe.forward(ids_(1, 2)).logits.shape == (1, 2, VOCAB)


def test_unhashable_op_is_rejected_naming_the_field(stages, dealer):
    before = stats(stages.control[0])
    h, _ = dealer(stages.data[0], raw_header({"op": ["forward"], "id": "bad-1"}))
    assert h["op"] == "error" and h["stage"] == "stage0"
    assert control(stages.control[0], "health")["op"] == "ok"
    assert "header.op" in h["error"]
    assert stats(stages.control[0])["rejected"] == before["rejected"] + 1


# --- deadlines ----------------------------------------------------------------------------------

def test_a_request_past_its_deadline_is_reported_by_stage_name(stages, dealer):
    past = time.time() - 1
    h, _ = dealer(stages.data[0], wire.encode(H(id="late-0", deadline=past), GOOD_IDS))
    assert h["op"] == "error" and h["stage"] == "stage0" and h["id"] == "late-0"
    assert h["error"] == "stage stage0: request late-0 missed its deadline before compute"

    # at the last stage, the error also goes to the driver's reply_to socket
    results, reply_to = curve_results(stages.workers.keys)
    try:
        h, _ = dealer(stages.data[1], wire.encode(H(id="late-1", deadline=past, reply_to=reply_to),
                                                  {"hidden": torch.zeros(1, 2, HIDDEN)}))
        assert h["op"] == "error" and h["stage"] == "stage1" and "late-1 missed its deadline" in h["error"]
        assert results.poll(5000), "no error at reply_to"
        h2, _ = wire.decode(results.recv_multipart()[1:])
        assert h2["op"] == "error" and h2["stage"] == "stage1" and h2["id"] == "late-1"
    finally:
        results.close(0)


# --- control ------------------------------------------------------------------------------------

def test_a_peer_on_other_code_is_refused_naming_both_versions(stages, dealer):
    """Every connection carries its side's layerline version (ZMTP metadata): a sender on other code
    gets one line naming both, and its message changes nothing."""
    for i in range(2):   # the ready file and health name the version each worker runs
        assert stages.info[i]["version"] == version.full() and stages.info[i]["protocol"] == wire.PROTOCOL
        assert control(stages.control[i], "health")["version"] == version.full()
    ck = keys.load_host_keys(stages.workers.keys)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.METADATA, f"{version.PROP_VERSION}:0.0.9+0123456789ab".encode())
    s.setsockopt(zmq.METADATA, f"{version.PROP_PROTOCOL}:1".encode())
    s.setsockopt(zmq.CURVE_SECRETKEY, ck.secret)
    s.setsockopt(zmq.CURVE_PUBLICKEY, ck.public)
    s.setsockopt(zmq.CURVE_SERVERKEY, ck.peers["stage0"])
    s.connect(stages.data[0])
    before = stats(stages.control[0])["requests"]
    try:
        s.send_multipart(wire.encode(H(id="old-1"), GOOD_IDS))
        assert s.poll(10_000), "no answer"
        h, _ = wire.decode(s.recv_multipart())
    finally:
        s.close(0)
        ctx.term()
    assert h["op"] == "error" and h["id"] == "old-1" and h["error"] == (
        f"version mismatch: the sender runs layerline 0.0.9+0123456789ab (wire protocol 1), stage stage0 runs "
        f"layerline {version.full()} (wire protocol 1); re-run deploy.yml so every host gets the controller's "
        "layerline (the runtime role reinstalls and restarts the hosts that differ)")
    assert stats(stages.control[0])["requests"] == before


def test_health_and_stats(stages, pipe):
    for i, c in enumerate(stages.control):
        h = control(c, "health")
        assert h["op"] == "ok" and h["name"] == f"stage{i}"
        assert h["pid"] == stages.procs[i].pid == stages.info[i]["pid"]
        assert h["layers"] == [2 * i, 2 * i + 2] and h["uptime_s"] > 0
        assert h["next"] == (stages.data[1] if i == 0 else None)
    before = [stats(c) for c in stages.control]
    pipe.forward(ids_(1, 3))
    for i, c in enumerate(stages.control):
        s = stats(c)
        assert set(s) >= {"requests", "errors", "rejected", "compute_s", "sequences"}
        assert s["requests"] == before[i]["requests"] + 1
        assert s["compute_s"] > before[i]["compute_s"]


def test_bad_control_requests_get_error_replies(stages):
    c = stages.control[0]
    rejected = stats(c)["rejected"]
    with pytest.raises(DriveError, match=r"header\.op: 'forward' is not a control op"):
        control(c, "forward")
    with pytest.raises(DriveError, match=r"header\.next: must be a string"):
        control(c, "set_next")
    with pytest.raises(DriveError, match=r"next: 'udp://127.0.0.1:1' is not a tcp://HOST:PORT"):
        control(c, "set_next", next="udp://127.0.0.1:1")
    s = control_socket(c)   # as the controller: nobody else gets through to be answered
    try:
        s.send_multipart([b"\xff garbage"])
        assert s.poll(5000)
        h, _ = wire.decode(s.recv_multipart())
        assert h["op"] == "error" and h["stage"] == "stage0" and "header" in h["error"]
    finally:
        s.close(0)
    assert stats(c)["rejected"] == rejected + 4
    assert control(c, "health")["next"] == stages.data[1]


def test_set_next_reroutes_traffic(stages, pipe, reference, spare, restore_routing):
    r = control(stages.control[0], "set_next", next=spare.data, next_key="spare")
    assert r["op"] == "ok" and r["next"] == spare.data
    assert control(stages.control[0], "health")["next"] == spare.data
    s1, sp = stats(stages.control[1])["requests"], stats(spare.control)["requests"]
    ids = ids_(2, 3, seed=5)
    res = pipe.forward(ids)
    assert [t["stage"] for t in res.timings] == ["stage0", "spare"]
    assert torch.allclose(res.logits, reference(ids), rtol=0, atol=ATOL)
    assert stats(spare.control)["requests"] == sp + 1
    assert stats(stages.control[1])["requests"] == s1
    # and back
    control(stages.control[0], "set_next", next=stages.data[1], next_key="stage1")
    assert [t["stage"] for t in pipe.forward(ids).timings] == ["stage0", "stage1"]
    assert stats(spare.control)["requests"] == sp + 1


def test_failed_set_next_keeps_the_old_route(stages, pipe, restore_routing):
    with pytest.raises(DriveError):
        control(stages.control[0], "set_next", next="tcp://-:5")
    assert control(stages.control[0], "health")["next"] == stages.data[1]
    pipe.forward(ids_(1, 2))


def test_shutdown_exits_zero_and_removes_the_ready_file(spare):
    if spare.proc.poll() is not None:
        pytest.skip("the spare worker is already gone")
    assert os.path.exists(spare.ready)
    r = control(spare.control, "shutdown")
    assert r["op"] == "ok" and r["name"] == "spare"
    assert spare.proc.wait(15) == 0
    assert not os.path.exists(spare.ready)


def test_dead_last_stage_makes_forward_raise_within_its_timeout(stages, spare, restore_routing):
    if spare.proc.poll() is None:
        spare.proc.send_signal(signal.SIGKILL)
        spare.proc.wait(10)
    control(stages.control[0], "set_next", next=spare.data, next_key="spare")
    with stages.workers.pipeline(timeout_s=1.5) as p:
        t0 = time.perf_counter()
        with pytest.raises(DriveError, match=r"no result within"):
            p.forward(ids_(1, 2))
        assert time.perf_counter() - t0 < 1.5 + 2.0
    # stage0 itself stayed up and, re-pointed, serves again
    assert control(stages.control[0], "health")["op"] == "ok"
    control(stages.control[0], "set_next", next=stages.data[1], next_key="stage1")
    with stages.workers.pipeline(timeout_s=30) as p:
        assert [t["stage"] for t in p.forward(ids_(1, 2)).timings] == ["stage0", "stage1"]
    assert p.ctx is None, "a pipeline terminates the context it made"


# what the worker process's environment says when `import torch` first runs (libgomp reads
# GOMP_SPINCOUNT then, once), for `python -m layerline.worker ARGV` with --help (it stops in parse_args)
_SPIN_AT_TORCH_IMPORT = """
import os, runpy, sys
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("GOMP_SPINCOUNT"))
sys.meta_path.insert(0, Spy())
sys.argv = ["layerline.worker", *sys.argv[1:], "--help"]
try:
    runpy.run_module("layerline.worker", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print(seen[0] if seen else "torch never imported")
"""


@pytest.mark.parametrize("argv,inherited,want", [(["--spin", "7"], None, "7"), (["--spin=0"], "300000", "0"),
                                                 ([], None, "10000"), ([], "5", "5"),
                                                 (["--spin", "-3"], None, "10000")])
def test_the_plans_spin_is_set_before_torch_loads_openmp(argv, inherited, want):
    """The plan's --spin reaches libgomp only if it is in the environment before torch is imported:
    stages that share a machine sleep at once when idle instead of spinning on the busy one's cores."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if inherited is not None:
        env["GOMP_SPINCOUNT"] = inherited
    r = subprocess.run([sys.executable, "-c", _SPIN_AT_TORCH_IMPORT, *argv], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.strip().splitlines()[-1] == want, r.stdout + r.stderr


_NICE = """
import os, threading
import torch  # noqa: F401 - starts a thread of its own
from layerline.worker import lower_priority
lower_priority(int(os.environ["NICE"]))
t = threading.Thread(target=lambda: None)     # and one started after
t.start()
t.join()

def prio(tid):
    try:
        return os.getpriority(os.PRIO_PROCESS, int(tid))
    except ProcessLookupError:  # a thread that ended while listed (a joined one can linger a moment)
        return None

print(sorted({p for p in map(prio, os.listdir("/proc/self/task")) if p is not None}))
print(open("/proc/self/autogroup").read().strip() if os.path.exists("/proc/self/autogroup") else "no autogroup")
"""


def test_nice_lowers_every_thread_and_the_sessions_group():
    """--nice (layerline_nice): under autogroup a process's nice value counts only within its
    session, so the worker sets its session's group too (the supervisor gives it a session of its
    own; here start_new_session does, so this test's session keeps its priority)."""
    r = subprocess.run([sys.executable, "-c", _NICE], env={**os.environ, "NICE": "7"}, capture_output=True,
                       text=True, timeout=120, start_new_session=True)
    assert r.returncode == 0, r.stderr
    threads, group = r.stdout.strip().splitlines()[-2:]
    assert threads == "[7]", r.stdout
    assert group == "no autogroup" or group.endswith(" nice 7"), group


@pytest.mark.parametrize("value", ["-1", "20"])
def test_nice_out_of_range_is_refused_before_anything_starts(value):
    r = subprocess.run([sys.executable, "-m", "layerline.worker", "--checkpoint", "x", "--layers", "0:1", "--last",
                        "--bind", "tcp://127.0.0.1:1", "--nice", value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--nice must be 0-19" in r.stderr, r.stderr


def test_stages_that_share_cores_split_them_among_the_messages_in_flight(small_ckpt, reference, stages, pipe):
    """Stages that share a machine's cores (--cores, --sharing, as the plan gives them) compute a
    message that is alone in flight on all their threads, and one sent while another is out on
    their share of the cores (planner.message_threads); the numbers stay the one-process forward's.
    A stage that shares nothing keeps its threads whatever is in flight."""
    before = [stats(c)["threads"] for c in stages.control]
    w = start_workers(str(small_ckpt), [(0, 2), (2, 4)], "fp32", kv_context=KV, threads=2,
                      extra=["--cores", "2", "--sharing", "2"])
    try:
        ids = [ids_(1, 5, seed=3), ids_(2, 4, seed=4), ids_(1, 6, seed=5)]
        with w.pipeline(timeout_s=60) as shared_pipe:
            alone = shared_pipe.forward(ids[0])
            rids = [shared_pipe.submit(ids[1]), shared_pipe.submit(ids[2])]   # the second goes out beside the first
            got = dict(shared_pipe.collect() for _ in rids)
        shared = [stats(c)["threads"] for c in w.control]
    finally:
        w.stop()
    assert shared == [{"1": 1, "2": 2}] * 2, shared
    for x, res in zip(ids, [alone, *(got[r] for r in rids)]):
        assert torch.allclose(res.logits, reference(x), rtol=0, atol=ATOL)
    # the module's stages (--threads 1, sharing nothing): two out at once, each on its one thread
    rids = [pipe.submit(ids[1]), pipe.submit(ids[2])]
    assert sorted(r for r, _ in (pipe.collect() for _ in rids)) == sorted(rids)
    after = [stats(c)["threads"] for c in stages.control]
    assert [set(a) for a in after] == [{"1"}] * 2 and all(a["1"] >= b.get("1", 0) + 2 for a, b in zip(after, before))


def test_step_timing_waits_as_a_pipeline_stage_waits(small_ckpt, monkeypatch):
    """measure_step times each step after an idle as long as the model's other layers take at
    this stage's speed (here 3 of 4 layers: 3x its last step), as a stage waits for its input
    in a pipeline (a step after idling is slower on VMs); none before the first step, and never
    longer than IDLE_CAP_S, its idle-priority spinners woken as serving wakes them. What it
    returns is the median of the steps after the first. The worker's clock is a fake one that
    each step moves by a set time, so nothing here leans on how fast this machine is."""
    from layerline.worker import stage as wmod
    clock, sleeps, steps, pokes = [0.0], [], [], []

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock[0]

        @staticmethod
        def sleep(s):
            sleeps.append((s, len(steps)))

    def timed(stage, step_s):
        real = stage.forward

        def forward(*a, **k):
            steps.append(clock[0])
            clock[0] += step_s if len(steps) > 1 else 0.5  # the prefix takes its own time
            return real(*a, **k)
        monkeypatch.setattr(stage, "forward", forward)
        return stage

    monkeypatch.setattr(wmod, "time", FakeTime)

    def worker_of(stage, start, end):
        w = SimpleNamespace(stage=stage, torch=torch, kv_dtype=None, margs=stage.args, name="w",
                            args=SimpleNamespace(start=start, end=end, first=start == 0, device="cpu"),
                            awake=SimpleNamespace(poke=lambda: pokes.append(len(steps))))
        w._zeros_input = lambda b, t: wmod.StageCompute._zeros_input(w, b, t)
        return w

    one = worker_of(timed(load_stage(str(small_ckpt), 1, 2, False, False, precision="fp32"), 0.002), 1, 2)
    assert wmod.StageCompute.measure_step(one, steps=8) == pytest.approx(0.002)
    assert len(steps) == 1 + 8, "the prefix, then the timed steps"
    assert [after for _, after in sleeps] == list(range(2, 9)), "an idle before every timed step but the first"
    assert [s for s, _ in sleeps] == pytest.approx([0.006] * 7), "the 3 other layers at this stage's 2 ms a layer"
    assert pokes == [after for _, after in sleeps], "the CPUs kept awake through each idle, as serving keeps them"
    steps.clear()
    sleeps.clear()
    whole = worker_of(timed(load_stage(str(small_ckpt), 0, 4, True, True, precision="fp32"), 0.002), 0, 4)
    assert wmod.StageCompute.measure_step(whole, steps=3) == pytest.approx(0.002)
    assert sleeps == [], "one stage of every layer never waits"
    monkeypatch.setattr(wmod, "IDLE_CAP_S", 0.001)
    steps.clear()
    sleeps.clear()
    wmod.StageCompute.measure_step(one, steps=3)
    assert [s for s, _ in sleeps] == [0.001, 0.001]
