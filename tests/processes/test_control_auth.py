"""Control ops and the data plane are authenticated on every socket, loopback included: a
worker's control socket runs CURVE and lets in only the controller's key; its data socket and a
pipeline's result socket run CURVE and let in only the deployment's keys (allowed/).

Real worker processes on loopback with the default --curve auto: a stranger without CURVE, one
with a fresh keypair, and a worker's own key (in every allowed/, but not the controller's) each
send shutdown and set_next; the first two also send a forward and a release of a live sequence
to stage 0's data socket and a forged result to the pipeline's result socket. None gets an
answer or an effect, and the pipeline's output still comes from the right stages. The
controller's key works.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from layerline import keys, version, wire
from layerline.driver import DriveError
from layerline.model.loader import load_stage
from layerline.pipeline import control as raw_control
from stage_procs import control, free_port_pairs, start_workers

LAYERS, VOCAB, KV = 4, 500, 128   # the small_ckpt fixture
QUIET_S = 2.0                      # how long a stranger waits for an answer that must never come


@pytest.fixture(scope="module")
def stages(small_ckpt, request):
    """stage0 (0:2) -> stage1 (2:4) and a spare last stage (2:4), --curve auto on loopback."""
    w = start_workers(str(small_ckpt), [(0, 2), (2, 4)], kv_context=KV, more_keys=["spare"])
    request.addfinalizer(w.stop)
    spare = start_workers(str(small_ckpt), [(2, 4)], kv_context=KV, names=["spare"], first=False, keys_root=w.tmp)
    request.addfinalizer(spare.stop)
    w.spare = spare
    return w


@pytest.fixture(scope="module")
def reference(small_ckpt):
    return load_stage(str(small_ckpt), 0, LAYERS, True, True, "fp32")


def ids_(*shape, seed=0):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def stranger(ctx, kind: str, server_public: bytes, worker_keys: str):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if kind == "unknown key":
        pub, sec = zmq.curve_keypair()
        keys.connect_curve(s, keys.HostKeys(dir="-", public=pub, secret=sec), server_public)
    elif kind == "a worker's key":   # in every allowed/ (data sockets let it in), but not the controller's
        keys.connect_curve(s, keys.load_host_keys(worker_keys), server_public)
    else:
        assert kind == "no curve"
    return s, s.get_monitor_socket()


def test_strangers_cannot_shut_down_or_redirect_a_worker(stages, reference):
    ctl0, ctl1 = stages.control
    pids = [control(c, "health")["pid"] for c in (ctl0, ctl1)]
    kd = os.path.dirname(stages.keys)
    public = {n: keys.read_key_file(os.path.join(kd, "store", f"{n}.key"))[0]
              for n in ("stage0", "stage1", "controller")}
    pipe = stages.pipeline(timeout_s=60)
    held = "held-" + wire.new_id("")
    pipe.forward(ids_(1, 4, seed=1), seq=held, cache=True)   # a live sequence a stranger would release
    seqs = [control(c, "stats")["sequences"] for c in (ctl0, ctl1)]
    before = [control(c, "stats") for c in (ctl0, ctl1, stages.spare.control[0])]
    forged = {"op": "result", "id": "r0", "timings": []}
    ctx = zmq.Context()
    socks = []
    try:
        for kind in ("no curve", "unknown key", "a worker's key"):
            targets = [
                (ctl0, "stage0", wire.encode({"op": "set_next", "next": stages.spare.data[0], "next_key": "spare"})),
                (ctl1, "stage1", wire.encode({"op": "shutdown"})),
                (ctl0, "stage0", wire.encode({"op": "health"})),
            ]
            if kind != "a worker's key":   # a worker's key is the deployment's: data sockets let it in
                targets += [
                    (stages.data[0], "stage0", wire.encode({"op": "forward", "id": "x1", "reply_to": pipe.reply_to},
                                                           {"input_ids": ids_(1, 3)})),
                    (stages.data[0], "stage0", wire.encode({"op": "release", "seq": held})),
                    (pipe.reply_to, "controller", wire.encode(forged, {"logits": torch.zeros(1, 1, VOCAB)})),
                ]
            for target, name, frames in targets:
                s, mon = stranger(ctx, kind, public[name], os.path.join(kd, "stage1"))
                s.connect(target)
                s.send_multipart(frames, flags=zmq.NOBLOCK)   # queued: the pipe exists before the handshake
                socks.append((kind, target, s, mon))
        events: dict[int, set] = {i: set() for i in range(len(socks))}
        deadline = time.time() + QUIET_S
        while time.time() < deadline:
            for i, (kind, target, s, mon) in enumerate(socks):
                assert not s.poll(0), f"{kind} got an answer from {target}"
                while mon.poll(0):
                    events[i].add(recv_monitor_message(mon)["event"])
            time.sleep(0.05)
        assert pipe.answers(pipe.results) == [] and pipe.answers(pipe.to_first) == []
        for i, (kind, target, _, _) in enumerate(socks):
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events[i], (kind, target)
            if kind != "no curve":  # refused by the ZAP allow-list, not a protocol mismatch
                assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events[i], (kind, target, events[i])
    finally:
        for _, _, s, mon in socks:
            s.disable_monitor()
            mon.close(0)
            s.close(0)
        ctx.term()
    # no effect: both still run (same pids), stage0 still sends to stage1, the spare saw nothing
    assert all(p.poll() is None for p in stages.procs)
    assert [control(c, "health")["pid"] for c in (ctl0, ctl1)] == pids
    assert control(ctl0, "health")["next"] == stages.data[1]
    after = [control(c, "stats") for c in (ctl0, ctl1, stages.spare.control[0])]
    assert [(a["requests"], a["rejected"]) for a in after] == [(b["requests"], b["rejected"]) for b in before]
    assert [a["sequences"] for a in after[:2]] == seqs, "a stranger's release freed a sequence"
    with pipe:
        ids = ids_(1, 5, seed=3)
        r = pipe.forward(ids)
        pipe.release(held)
    assert [t["stage"] for t in r.timings] == ["stage0", "stage1"]
    assert torch.allclose(r.logits, reference(ids), rtol=0, atol=1e-5)
    assert control(stages.spare.control[0], "stats")["requests"] == before[2]["requests"]
    log = open(os.path.join(stages.tmp, "worker0.log")).read()
    assert "refused a control client whose key" in log and "allowed/controller.key" in log


def test_a_key_other_than_the_controllers_is_refused_in_one_line(stages):
    """pipeline.control with a worker's keys dir (its key is in allowed/, not the controller's) and
    with the controller's keys but the wrong worker named: a clear DriveError, not a timeout."""
    kd = os.path.dirname(stages.keys)
    t0 = time.monotonic()
    with pytest.raises(DriveError, match=r"refused the CURVE handshake"):
        raw_control(stages.control[1], "shutdown", keys_dir=os.path.join(kd, "stage0"), peer="stage1", timeout_s=20)
    with pytest.raises(DriveError, match=r"refused the CURVE handshake"):
        raw_control(stages.control[1], "health", keys_dir=stages.keys, peer="stage0", timeout_s=20)
    assert time.monotonic() - t0 < 15
    assert stages.procs[1].poll() is None
    with pytest.raises(keys.KeysError, match=r"--keys is not set"):
        raw_control(stages.control[0], "health")
    with pytest.raises(keys.KeysError, match=r"name the worker's host"):
        raw_control(stages.control[0], "health", keys_dir=stages.keys)


def test_the_controllers_key_redirects_and_shuts_down(stages, reference):
    ctl0 = stages.control[0]
    spare = stages.spare
    assert control(ctl0, "health")["next_key"] == "stage1"   # what a server follows to find each key
    try:
        r = control(ctl0, "set_next", next=spare.data[0], next_key="spare")
        assert r["op"] == "ok" and r["next"] == spare.data[0]
        with stages.pipeline(timeout_s=60) as pipe:
            ids = ids_(2, 3, seed=4)
            res = pipe.forward(ids)
        assert [t["stage"] for t in res.timings] == ["stage0", "spare"]
        assert torch.allclose(res.logits, reference(ids), rtol=0, atol=1e-5)
    finally:
        control(ctl0, "set_next", next=stages.data[1], next_key="stage1")
    assert control(spare.control[0], "shutdown")["op"] == "ok"
    assert spare.procs[0].wait(15) == 0


def test_a_worker_without_keys_stops_in_one_line_naming_keys(small_ckpt, tmp_path):
    """Loopback and --curve auto: every socket still runs CURVE, so --keys is required."""
    (port,) = free_port_pairs(1)
    base = [sys.executable, "-m", "layerline.worker", "--checkpoint", str(small_ckpt), "--layers", "0:4",
            "--first", "--last", "--bind", f"tcp://127.0.0.1:{port}"]

    def fails(*extra):
        r = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        return lines[0]
    line = fails()
    assert line.startswith("layerline worker: every worker socket runs CURVE, loopback included")
    assert "--keys is not set" in line and "python -m layerline.keys local" in line and "layerline_keys_dir" in line
    # a keys dir whose allowed/ lacks the controller's key cannot let the controller in
    d = keys.local_keys(str(tmp_path / "k"), ["w"])["w"]
    os.unlink(os.path.join(d, "allowed", "controller.key"))
    line = fails("--keys", d)
    assert "has no allowed/controller.key" in line
    # a worker on other code than the controller's plan names refuses to start, naming both
    line = fails("--keys", d, "--layerline-version", "0.0.9+0123456789ab")
    assert line == (f"layerline worker: --layerline-version: the controller runs layerline 0.0.9+0123456789ab, this "
                    f"host's {sys.executable} has {version.full()}; re-run deploy.yml so the runtime role installs the "
                    "controller's version here")
    # the CLI that makes them
    r = subprocess.run([sys.executable, "-m", "layerline.keys", "local", "--dest", str(tmp_path / "cli"), "w1", "w2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name in ("w1", "w2", "controller"):
        hk = keys.load_host_keys(str(tmp_path / "cli" / name))   # modes checked there (0700, 0600)
        assert hk.controller is not None and hk.secret.decode() not in r.stdout


def _conns_to(port: int) -> list:
    """This process's established TCP connections to `port` on loopback."""
    import psutil
    return [c for c in psutil.Process().net_connections("tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED]


def test_a_kept_control_connection_is_one_connection_that_reconnects_and_tells_a_gone_worker(small_ckpt):
    """ControlChannel (the server's health probe): calls go over one connection; a call that times out drops it
    and the next call answers on a new one, with its own answer (not the late one); a worker gone is
    REFUSED, as with control()."""
    from layerline.pipeline import REFUSED, ControlChannel
    w = start_workers(str(small_ckpt), [(0, 4)], kv_context=KV, names=["solo"])
    try:
        pid = w.info[0]["pid"]
        ep = w.control[0]
        port = int(ep.rsplit(":", 1)[1])
        ch = ControlChannel(ep, keys_dir=w.keys, peer="solo")
        ports = []
        for _ in range(3):
            h = ch.call("health", 30)
            assert h["pid"] == pid and h["id"] == str(ch.n)
            ports.append({c.laddr.port for c in _conns_to(port)})
        assert len(ports[0]) == 1 and ports == [ports[0]] * 3, f"three calls, connections {ports}: not one kept"
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(DriveError, match="no answer to health within 1 s"):
                ch.call("health", 1)
            deadline = time.monotonic() + 10   # zmq closes the dropped connection in its own thread
            while {c.laddr.port for c in _conns_to(port)} & ports[0] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not {c.laddr.port for c in _conns_to(port)} & ports[0], "a call that timed out kept its connection"
        finally:
            os.kill(pid, signal.SIGCONT)
        h = ch.call("health", 30)   # the stopped worker now answers the late call too, on the dropped connection
        assert h["pid"] == pid and h["id"] == str(ch.n)
        now = {c.laddr.port for c in _conns_to(port)}
        assert len(now) == 1 and not now & ports[0], f"after the timeout {now}, before {ports[0]}: not a new connection"
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(DriveError) as e:
            ch.call("health", 30)
        assert e.value.code == REFUSED, e.value
        ch.close()
    finally:
        w.stop()
