"""CURVE on the wire: keys made by the keys role's command line, workers and a driver that use
them, and peers without an allowed key that can neither inject into nor read from a worker.

Everything runs on loopback, where CURVE runs as between real hosts (every socket, whatever
--curve says; these workers also say --curve on, the value an inventory may pin). Attackers are
plain zmq sockets: one without CURVE, one with a fresh keypair nobody allowed, one claiming an
allowed public key without its secret, and servers impersonating a driver's result socket.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from helpers import wait_ready
from layerline import keys, wire
from layerline.cli import _free_ports, stop_local
from layerline.driver import DriveError, Pipeline, control
from layerline.model.loader import load_stage

LAYERS, VOCAB, HIDDEN, KV = 4, 500, 128, 128   # the small_ckpt fixture
ATOL = 1e-5
QUIET_S = 2.0   # how long an attacker waits for a reply that must never come


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def keys_cli(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "layerline.keys", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# --- when CURVE is on ---------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint, want", [
    ("tcp://127.0.0.1:9100", False), ("tcp://127.3.2.1:1", False), ("tcp://localhost:9100", False),
    ("tcp://[::1]:9100", False), ("tcp://[::ffff:127.0.0.1]:9100", False),
    ("tcp://10.77.0.2:9100", True), ("tcp://0.0.0.0:9100", True), ("tcp://*:9100", True),
    ("tcp://[::]:9100", True), ("tcp://w2.example:9100", True), ("tcp://192.168.1.5:9100", True),
])
def test_curve_runs_on_every_socket_loopback_included(endpoint, want):
    assert keys.needs_curve(endpoint) is want   # where traffic can be read off the wire
    assert keys.curve_on("auto", endpoint) is True
    assert keys.curve_on("on", endpoint) is True


def test_curve_cannot_be_switched_off():
    with pytest.raises(keys.KeysError, match=r"curve: 'off' is not one of auto, on"):
        keys.curve_on("off", "tcp://10.0.0.1:1")


# --- keys: made once, private, laid out as the worker reads them --------------------------------

@pytest.fixture(scope="module")
def keyset(tmp_path_factory):
    """Keys for stage0, stage1 and the controller, made and laid out with `python -m layerline.keys`."""
    root = tmp_path_factory.mktemp("curve")
    store, ctl = root / "keys" / "store", root / "keys" / "controller"
    made = keys_cli("make", "--store", str(store), "--controller-dir", str(ctl), "stage0", "stage1")
    dirs = {}
    for name in ("stage0", "stage1"):
        dirs[name] = root / "keys" / name
        keys_cli("install", "--store", str(store), "--name", name, "--dest", str(dirs[name]))
    return SimpleNamespace(root=root, store=store, controller=ctl, dirs=dirs, made=made)


def test_keys_are_made_once_and_kept_private(keyset):
    assert keyset.made["changed"] is True and sorted(keyset.made["made"]) == ["controller", "stage0", "stage1"]
    again = keys_cli("make", "--store", str(keyset.store), "--controller-dir", str(keyset.controller),
                     "stage0", "stage1")
    assert again["changed"] is False and again["made"] == [] and again["public"] == keyset.made["public"]
    for d in (keyset.store, keyset.controller, *keyset.dirs.values()):
        assert mode(d) == 0o700, d
    for name in ("stage0", "stage1", "controller"):
        assert mode(keyset.store / f"{name}.key_secret") == 0o600
        assert mode(keyset.store / f"{name}.key") == 0o644
    for name, d in [*keyset.dirs.items(), ("controller", keyset.controller)]:
        assert mode(d / "self.key_secret") == 0o600 and mode(d / "self.key") == 0o644
        assert mode(d / "allowed") == mode(d / "peers") == 0o700
        for sub in ("allowed", "peers"):
            assert sorted(p.name for p in (d / sub).iterdir()) == ["controller.key", "stage0.key", "stage1.key"]
        hk = keys.load_host_keys(str(d))
        assert hk.public.decode() == keyset.made["public"][name]
        assert hk.allowed == {v.encode() for v in keyset.made["public"].values()}
        assert hk.server_key("controller") == keyset.made["public"]["controller"].encode()
        # public files hold no secret; the pyzmq certificate loader reads both kinds
        assert b"secret-key" not in (d / "self.key").read_bytes()
        pub, sec = zmq.auth.load_certificate(str(d / "self.key_secret"))
        assert pub == hk.public and sec == hk.secret


def test_place_removes_keys_of_hosts_that_left(tmp_path):
    a, b = zmq.curve_keypair()[0], zmq.curve_keypair()[0]
    d = tmp_path / "k"
    assert keys.place(str(d), "w1", {"w1": a, "w2": b}) is True
    assert keys.place(str(d), "w1", {"w1": a, "w2": b}) is False
    assert keys.place(str(d), "w1", {"w1": a}) is True
    assert sorted(p.name for p in (d / "allowed").iterdir()) == ["w1.key"]
    assert sorted(p.name for p in (d / "peers").iterdir()) == ["w1.key"]
    with pytest.raises(keys.KeysError, match=r"public\['w2'\]: not a 40-character z85 public key"):
        keys.place(str(d), "w1", {"w1": a, "w2": "nope"})
    with pytest.raises(keys.KeysError, match=r"'controller' is the controller's key name"):
        keys.make_store(str(tmp_path / "store"), ["controller"])


def test_keys_readable_by_others_or_tampered_are_refused(keyset, tmp_path):
    d = tmp_path / "stage0"
    shutil.copytree(keyset.dirs["stage0"], d)
    os.chmod(d, 0o700)
    keys.load_host_keys(str(d))
    os.chmod(d / "self.key_secret", 0o644)
    with pytest.raises(keys.KeysError, match=r"self.key_secret: mode 0644 lets other users read this secret key; "
                                             r"it must be 0600 \(chmod 600 .*\)$"):
        keys.load_host_keys(str(d))
    os.chmod(d / "self.key_secret", 0o600)
    os.chmod(d, 0o755)
    with pytest.raises(keys.KeysError, match=r"--keys .*: mode 0755 lets other users in; it must be 0700"):
        keys.load_host_keys(str(d))
    os.chmod(d, 0o700)
    # a secret file whose public key was swapped for another host's
    text = (d / "self.key_secret").read_bytes()
    other = keyset.made["public"]["stage1"].encode()
    (d / "self.key_secret").write_bytes(text.replace(keys.read_key_file(str(d / "self.key_secret"))[0], other))
    with pytest.raises(keys.KeysError, match=r"public and secret keys do not belong together"):
        keys.load_host_keys(str(d))


# --- a CURVE pipeline ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stages(small_ckpt, keyset, request):
    """stage0 (layers 0:2, first) -> stage1 (2:4, last), every socket CURVE, keys from keyset."""
    ports = _free_ports(2)
    data = [f"tcp://127.0.0.1:{p}" for p in ports]
    procs, logs = [], []
    for i in range(2):
        argv = [sys.executable, "-m", "layerline.worker", "--checkpoint", str(small_ckpt),
                "--layers", f"{2 * i}:{2 * i + 2}", "--precision", "fp32", "--kv-context", str(KV),
                "--bind", data[i], "--name", f"stage{i}", "--threads", "1",
                "--ready-file", str(keyset.root / f"ready{i}.json"),
                "--keys", str(keyset.dirs[f"stage{i}"]), "--curve", "on"]
        argv += ["--first", "--next", data[1], "--next-key", "stage1"] if i == 0 else ["--last"]
        logs.append(keyset.root / f"worker{i}.log")
        procs.append(subprocess.Popen(argv, stdout=open(logs[i], "w"), stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL))
    request.addfinalizer(lambda: stop_local(procs))
    for i in range(2):
        wait_ready(str(keyset.root / f"ready{i}.json"), procs[i], logs[i])
    return SimpleNamespace(procs=procs, data=data, logs=logs,
                           control=[f"tcp://127.0.0.1:{p + 1}" for p in ports],
                           ready=[json.loads((keyset.root / f"ready{i}.json").read_text()) for i in range(2)])


@pytest.fixture(scope="module")
def ctl(stages, keyset):
    """ctl(i, op, **fields): a control request to stage i, as the controller."""
    def send(i, op, **fields):
        return control(stages.control[i], op, keys_dir=str(keyset.controller), peer=f"stage{i}", curve="on", **fields)
    return send


@pytest.fixture(scope="module")
def pipe(stages, keyset, request):
    p = Pipeline(stages.data[0], timeout_s=30.0, keys_dir=str(keyset.controller), first_key="stage0", curve="on")
    request.addfinalizer(p.close)
    return p


@pytest.fixture(scope="module")
def reference(small_ckpt):
    return load_stage(str(small_ckpt), 0, LAYERS, True, True, "fp32")


def ids_(*shape, seed=0):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_forward_over_curve_equals_one_process_forward(stages, pipe, reference, ctl):
    assert pipe.curve_sockets == (True, True)
    for i in range(2):
        assert stages.ready[i]["curve"] is True
        h = ctl(i, "health")
        assert h["op"] == "ok" and h["name"] == f"stage{i}" and h["curve"] is True
    ids = ids_(2, 5, seed=1)
    r = pipe.forward(ids)
    assert torch.allclose(r.logits, reference(ids), rtol=0, atol=ATOL)
    assert [t["stage"] for t in r.timings] == ["stage0", "stage1"]
    assert "(CURVE)" in stages.logs[0].read_text()


def counters(ctl) -> list[tuple]:
    return [tuple(ctl(i, "stats")[k] for k in ("requests", "rejected", "errors")) for i in range(2)]


def attacker(ctx, kind: str, server_public: bytes, allowed_public: bytes):
    """A DEALER that is not allowed in, with a monitor on its handshakes."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if kind == "unknown key":      # a fresh keypair nobody allowed
        pub, sec = zmq.curve_keypair()
        keys.connect_curve(s, keys.HostKeys(dir="-", public=pub, secret=sec), server_public)
    elif kind == "stolen public key":  # claims the controller's public key without its secret
        _, sec = zmq.curve_keypair()
        keys.connect_curve(s, keys.HostKeys(dir="-", public=allowed_public, secret=sec), server_public)
    else:
        assert kind == "no curve"
    return s, s.get_monitor_socket()


def test_peers_without_an_allowed_key_cannot_inject_or_read(stages, keyset, pipe, ctl, reference):
    """Forwards, a shutdown and a re-route from three kinds of strangers: none gets through, none gets
    an answer, and the handshake of each fails (the unknown key's by the ZAP allow-list)."""
    before = counters(ctl)
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)   # where a stranger would like results to go
    sink.setsockopt(zmq.LINGER, 0)
    sink_ep = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    public = {k: v.encode() for k, v in keyset.made["public"].items()}
    socks = []
    try:
        for kind in ("no curve", "unknown key", "stolen public key"):
            for target, server, frames in [
                (stages.data[0], public["stage0"],
                 wire.encode({"op": "forward", "id": "evil-0", "reply_to": sink_ep}, {"input_ids": ids_(1, 3)})),
                (stages.data[1], public["stage1"],
                 wire.encode({"op": "forward", "id": "evil-1", "reply_to": sink_ep},
                             {"hidden": torch.zeros(1, 3, HIDDEN)})),
                (stages.control[0], public["stage0"], wire.encode({"op": "set_next", "next": sink_ep})),
                (stages.control[1], public["stage1"], wire.encode({"op": "shutdown"})),
            ]:
                s, mon = attacker(ctx, kind, server, public["controller"])
                s.connect(target)
                s.send_multipart(frames)
                socks.append((kind, target, s, mon))
        deadline = time.time() + QUIET_S
        events: dict[int, set] = {i: set() for i in range(len(socks))}
        while time.time() < deadline:
            for i, (kind, target, s, mon) in enumerate(socks):
                assert not s.poll(0), f"{kind} got an answer from {target}"
                while mon.poll(0):
                    events[i].add(recv_monitor_message(mon)["event"])
            assert not sink.poll(0), "results reached a stranger's socket"
            time.sleep(0.05)
        for i, (kind, target, _, _) in enumerate(socks):
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events[i], (kind, target)
            failed = events[i] & {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                  zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
            assert failed, (kind, target, events[i])
            if kind == "unknown key":
                assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events[i], (target, events[i])
    finally:
        for _, _, s, mon in socks:
            s.disable_monitor()
            mon.close(0)
            s.close(0)
        sink.close(0)
        ctx.term()
    # nothing reached the workers: no request, no rejection, no error; both still serve, unrouted
    assert all(p.poll() is None for p in stages.procs)
    assert counters(ctl) == before
    assert ctl(0, "health")["next"] == stages.data[1]
    ids = ids_(1, 4, seed=2)
    assert torch.allclose(pipe.forward(ids).logits, reference(ids), rtol=0, atol=ATOL)
    # and the worker's log names the key it refused
    assert "refused a CURVE client whose key" in stages.logs[0].read_text()


def test_results_never_reach_a_socket_impersonating_the_driver(stages, keyset, ctl):
    """The controller asks the last stage to answer at sockets that are not the controller's: one
    without CURVE, one a CURVE server with its own keypair that lets anyone in. The stage computes
    (its request count grows), but neither socket completes a handshake or gets a frame."""
    ctx = zmq.Context()
    plain = ctx.socket(zmq.ROUTER)
    fake = ctx.socket(zmq.ROUTER)
    pub, sec = zmq.curve_keypair()
    keys.serve_curve(fake, keys.HostKeys(dir="-", public=pub, secret=sec))  # no ZAP handler: any client
    mons = [plain.get_monitor_socket(), fake.get_monitor_socket()]
    eps = [f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (plain, fake)]
    hk = keys.load_host_keys(str(keyset.controller))
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    keys.connect_curve(client, hk, hk.server_key("stage1"))
    client.connect(stages.data[1])
    before = ctl(1, "stats")["requests"]
    try:
        for k, ep in enumerate(eps):
            client.send_multipart(wire.encode({"op": "forward", "id": f"imp-{k}", "reply_to": ep},
                                              {"hidden": torch.randn(1, 3, HIDDEN)}))
        deadline = time.time() + 30
        while ctl(1, "stats")["requests"] < before + 2:
            assert time.time() < deadline, "the last stage did not take the requests"
            time.sleep(0.05)
        events = [set(), set()]
        t_end = time.time() + QUIET_S
        while time.time() < t_end:
            for i, s in enumerate((plain, fake)):
                assert not s.poll(0), f"a result reached {eps[i]}"
                while mons[i].poll(0):
                    events[i].add(recv_monitor_message(mons[i])["event"])
            assert not client.poll(0), "the request got an error instead of being computed"
            time.sleep(0.05)
        for i in range(2):
            assert zmq.EVENT_ACCEPTED in events[i], events[i]           # the stage did try to deliver
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events[i], events[i]
    finally:
        for s, m in zip((plain, fake), mons):
            s.disable_monitor()
            m.close(0)
            s.close(0)
        client.close(0)
        ctx.term()
    assert ctl(1, "health")["op"] == "ok"   # an undeliverable result leaves the stage serving


def test_set_next_under_curve_names_a_known_peer(stages, ctl, pipe):
    rejected = ctl(0, "stats")["rejected"]
    with pytest.raises(DriveError, match=r"next_key: CURVE is on, so name the server's host"):
        ctl(0, "set_next", next=stages.data[1])
    with pytest.raises(DriveError, match=r"next_key: no public key for 'nobody'"):
        ctl(0, "set_next", next=stages.data[1], next_key="nobody")
    with pytest.raises(DriveError, match=r"header.next_key: must be a host name"):
        ctl(0, "set_next", next=stages.data[1], next_key="../../etc/passwd")
    assert ctl(0, "stats")["rejected"] == rejected + 3
    assert ctl(0, "health")["next"] == stages.data[1]   # the old route stays
    assert ctl(0, "set_next", next=stages.data[1], next_key="stage1")["next"] == stages.data[1]
    assert [t["stage"] for t in pipe.forward(ids_(1, 2)).timings] == ["stage0", "stage1"]


# --- one clear line instead of an open socket ---------------------------------------------------

def worker_fails(small_ckpt, *extra: str) -> str:
    """Start a worker that must refuse to run; its one stderr line."""
    (port,) = _free_ports(1)
    argv = [sys.executable, "-m", "layerline.worker", "--checkpoint", str(small_ckpt), "--layers", "0:2",
            "--first", "--next", f"tcp://127.0.0.1:{port}", "--next-key", "stage1", *extra]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_off_loopback_without_keys_is_one_line_naming_keys(small_ckpt):
    # nothing binds: the worker checks its keys before it opens a socket (10.77.0.1 is never reached)
    line = worker_fails(small_ckpt, "--bind", "tcp://10.77.0.1:29999")
    assert line.startswith("layerline worker: every worker socket runs CURVE, loopback included")
    assert "--keys is not set" in line and "layerline_keys_dir" in line


def test_missing_keys_dir_and_readable_secret_are_refused_by_the_worker(small_ckpt, keyset, tmp_path):
    line = worker_fails(small_ckpt, "--bind", "tcp://127.0.0.1:29998", "--curve", "on",
                        "--keys", str(tmp_path / "nothing"))
    assert "--keys" in line and "is not a directory" in line and "layerline_keys_dir" in line
    d = tmp_path / "loose"
    shutil.copytree(keyset.dirs["stage0"], d)
    os.chmod(d, 0o700)
    os.chmod(d / "self.key_secret", 0o640)
    line = worker_fails(small_ckpt, "--bind", "tcp://127.0.0.1:29998", "--curve", "on", "--keys", str(d))
    assert line == (f"layerline worker: {d}/self.key_secret: mode 0640 lets other users read this secret key; "
                    f"it must be 0600 (chmod 600 {d}/self.key_secret, or re-run playbooks/keys.yml)")


def test_driver_off_loopback_without_keys_is_one_line(small_ckpt, keyset):
    for first in ("tcp://10.77.0.1:9100", "tcp://127.0.0.1:9100"):   # loopback as well
        with pytest.raises(keys.KeysError, match=r"every pipeline socket runs CURVE, loopback included, so it needs "
                                                 r"this host's keys, but --keys is not set; run playbooks/keys.yml and pass the "
                                                 r"controller's keys dir"):
            Pipeline(first)
    with pytest.raises(keys.KeysError, match=r"--first-key: CURVE is on, so name the server's host"):
        Pipeline("tcp://10.77.0.1:9100", keys_dir=str(keyset.controller))
    r = subprocess.run([sys.executable, "-m", "layerline.cli", "drive", "--first", "tcp://10.77.0.1:9100",
                        "--checkpoint", str(small_ckpt)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--keys is not set" in r.stderr and "layerline_keys_dir" in r.stderr


def test_worker_argv_names_the_next_hop_key():
    from layerline.planner import Plan
    from layerline.spec import worker_spec

    def worker_argv(plan, host, hv):
        return list(worker_spec(Plan.from_dict(plan), host, hv).argv)

    sizes = {"weight_bytes": 1, "kv_bytes": 0, "kv_dtype": "fp32", "mem_budget_bytes": 10, "predicted_s": 0.1}
    plan = {"num_layers": 4, "kv": {"context": 64, "dtype": "fp32", "bytes_per_token": 8}, "precision": "fp32",
            "objective": "throughput", "predicted_token_s": 0.2, "bottleneck_s": 0.1, "stages": [
                {"host": "a", "role": "active", "layers": [0, 2], "device": "cpu", "precision": "fp32",
                 "endpoint": "tcp://10.0.0.1:9100", **sizes},
                {"host": "b", "role": "active", "layers": [2, 4], "device": "cpu", "precision": "fp32",
                 "endpoint": "tcp://10.0.0.2:9100", **sizes}]}
    hv = {"layerline_checkpoint": "/c", "layerline_state_dir": "/s", "ansible_host": "10.0.0.1"}
    a = worker_argv(plan, "a", hv)
    assert a[a.index("--next-key") + 1] == "b" and a[a.index("--keys") + 1] == "/s/keys"
    assert "--curve" not in a
    b = worker_argv(plan, "b", {**hv, "layerline_curve": "on", "layerline_keys_dir": "/k"})
    assert "--next-key" not in b and b[b.index("--curve") + 1] == "on" and b[b.index("--keys") + 1] == "/k"


# --- the keys role ------------------------------------------------------------------------------

@pytest.mark.e2e
def test_keys_playbook_lays_out_private_keys_and_is_idempotent(tmp_path):
    from helpers import playbook, recap
    extra = json.dumps({"layerline_home": str(tmp_path)})
    first = playbook("playbooks/keys.yml", "-v", "-e", extra)
    store = tmp_path / "keys" / "store"
    hosts = ["w1", "w2", "w3"]
    for h in hosts:
        d = tmp_path / "state" / h / "keys"
        hk = keys.load_host_keys(str(d))       # modes and pairing are checked there
        assert mode(d) == 0o700 and mode(d / "self.key_secret") == 0o600
        assert keys.read_key_file(str(store / f"{h}.key_secret")) == (hk.public, hk.secret)
        for sub in ("allowed", "peers"):
            assert sorted(p.name for p in (d / sub).iterdir()) == sorted(f"{n}.key" for n in [*hosts, "controller"])
        assert hk.secret.decode() not in first.stdout and hk.secret.decode() not in first.stderr
    ctl = keys.load_host_keys(str(tmp_path / "keys" / "controller"))
    assert ctl.secret.decode() not in first.stdout
    assert mode(store) == 0o700
    made = {h: keys.load_host_keys(str(tmp_path / "state" / h / "keys")).public for h in hosts}
    second = playbook("playbooks/keys.yml", "-e", extra)
    counts = recap(second.stdout)
    assert set(counts) == set(hosts) and all(c["changed"] == 0 and c["failed"] == 0 for c in counts.values())
    assert {h: keys.load_host_keys(str(tmp_path / "state" / h / "keys")).public for h in hosts} == made
