"""The `python -m layerline.supervise start|stop|status` contract, with real processes.

Fake workers are small Python scripts in tmp_path (so every process a test starts names
tmp_path on its command line, and the fixture can kill leftovers); one test runs a real
layerline worker on the small demo checkpoint.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import alive, kill_leftovers, processes_mentioning, wait_for

REPO = Path(__file__).resolve().parents[2]
VENV_PY = REPO / ".venv" / "bin" / "python"
PY = str(VENV_PY if VENV_PY.exists() else Path(sys.executable))

# cold_starts: the pid a worker reports is checked against the one its supervisor started (a warm start
# answers from a fork of the template, its starter holding a stand-in)
pytestmark = [pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc"),
              pytest.mark.cold_starts]

# Writes its ready file (argv[1]) atomically, then serves until SIGTERM; exits 0 on its own
# when the file argv[1] + ".quit" appears (removing it first).
FAKE_WORKER = """\
import json, os, signal, sys, time
ready = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with open(ready + ".tmp", "w") as fh:
    json.dump({"pid": os.getpid(), "args": sys.argv[2:]}, fh)
os.replace(ready + ".tmp", ready)
print("fake worker %d serving" % os.getpid(), flush=True)
while True:
    if os.path.exists(ready + ".quit"):
        os.unlink(ready + ".quit")
        print("fake worker %d done, exiting 0" % os.getpid(), flush=True)
        sys.exit(0)
    time.sleep(0.05)
"""

FAKE_CRASH = """\
import sys
print("fake worker: cannot open checkpoint /nonexistent: no such directory", file=sys.stderr)
sys.exit(1)
"""

# Prints argv[2] numbered lines of 40 bytes (its output goes through the supervisor's rotating log), then serves
FAKE_CHATTY = """\
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
for i in range(int(sys.argv[2])):
    sys.stdout.write("chatty line %06d %s\\n" % (i, "x" * 21))
sys.stdout.flush()
with open(sys.argv[1] + ".tmp", "w") as fh:
    json.dump({"pid": os.getpid()}, fh)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(1)
"""

FAKE_SLOW = """\
import time
while True:
    time.sleep(1)
"""


class Rig:
    def __init__(self, root: Path):
        self.root = root
        self.state_dir = root / "state"
        self.ready = self.state_dir / "ready.json"
        self.log = self.state_dir / "worker.log"
        for name, text in (("worker", FAKE_WORKER), ("crash", FAKE_CRASH), ("slow", FAKE_SLOW),
                           ("chatty", FAKE_CHATTY)):
            (root / f"fake_{name}.py").write_text(text)

    def argv(self, *extra: str, kind: str = "worker") -> list[str]:
        return [PY, str(self.root / f"fake_{kind}.py"), str(self.ready), *extra]

    def sv(self, command: str, *args: str, argv: list[str] | None = None, timeout: float = 60) -> tuple[int, dict]:
        cmd = [PY, "-m", "layerline.supervise", command, "--state-dir", str(self.state_dir), *args]
        if argv is not None:
            cmd += ["--", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        lines = proc.stdout.splitlines()
        assert len(lines) == 1, f"not one line of JSON (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        return proc.returncode, json.loads(lines[0])

    def start(self, *extra: str, args=("--name", "stage0", "--ready-timeout", "20"), **kw):
        return self.sv("start", *args, argv=self.argv(*extra, **kw))

    def state(self) -> dict:
        return json.loads((self.state_dir / "supervisor.json").read_text())


@pytest.fixture
def rig(tmp_path):
    rig = Rig(tmp_path)
    yield rig
    kill_leftovers(tmp_path)  # whatever a failed test left


def test_start_is_idempotent_on_argv_and_restarts_on_change(rig):
    rc, first = rig.start("--layers", "0:2")
    assert rc == 0, first
    assert first["changed"] is True and first["state"] == "started" and first["msg"] == "started stage0"
    sup, worker = first["supervisor_pid"], first["worker_pid"]
    assert alive(sup) and alive(worker) and first["ready"]["pid"] == worker
    assert first["argv"] == rig.argv("--layers", "0:2") and first["log"] == str(rig.log)
    assert isinstance(first["log_tail"], list)
    rec = rig.state()
    assert (rec["pid"], rec["worker_pid"], rec["argv"], rec["name"]) == (sup, worker, first["argv"], "stage0")
    assert rec["restarts"] == 0 and rec["started_at"] <= time.time()

    # start made the state dir private (the role has no task of its own for it) and keeps it so
    assert stat.S_IMODE(rig.state_dir.stat().st_mode) == 0o700
    rig.state_dir.chmod(0o755)
    rc, again = rig.start("--layers", "0:2")
    assert rc == 0 and again["changed"] is False, again
    assert (again["supervisor_pid"], again["worker_pid"], again["ready"]["pid"]) == (sup, worker, worker)
    assert stat.S_IMODE(rig.state_dir.stat().st_mode) == 0o700

    rc, status = rig.sv("status")
    assert rc == 0 and status["running"] is True, status
    assert (status["supervisor_pid"], status["worker_pid"], status["restarts"]) == (sup, worker, 0)
    assert status["argv"] == first["argv"] and status["ready"]["pid"] == worker and status["log"] == str(rig.log)

    rc, moved = rig.start("--layers", "2:4")
    assert rc == 0 and moved["changed"] is True and moved["msg"] == "restarted stage0", moved
    assert moved["ready"]["args"] == ["--layers", "2:4"] and alive(moved["worker_pid"])
    assert not alive(sup) and not alive(worker)

    rc, forced = rig.sv("start", "--restart", "--ready-timeout", "20", argv=rig.argv("--layers", "2:4"))
    assert rc == 0 and forced["changed"] is True and forced["worker_pid"] != moved["worker_pid"], forced

    rc, stopped = rig.sv("stop")
    assert rc == 0 and stopped == {**stopped, "changed": True, "state": "stopped",
                                   "supervisor_pid": forced["supervisor_pid"]}, stopped
    assert not alive(forced["supervisor_pid"]) and not alive(forced["worker_pid"])
    for name in ("worker.pid", "ready.json", "supervisor.json"):
        assert not (rig.state_dir / name).exists(), name
    assert not processes_mentioning(str(rig.root))
    rc, again = rig.sv("stop")
    assert rc == 0 and again["changed"] is False and again["supervisor_pid"] is None, again
    rc, status = rig.sv("status")
    assert rc == 0 and status["running"] is False and status["supervisor_pid"] is None, status


def test_the_log_rotates_at_its_size_and_keeps_the_newest_lines(rig):
    """The worker's output goes through the supervisor, which moves worker.log to worker.log.1 (.1 to .2, ...)
    before a write would take it past --log-max-bytes, keeping --log-keep old files: here 4,000 lines of 40 bytes
    into 4 KiB files, 2 kept. The kept files hold the newest lines in order, none lost; older ones are gone."""
    rc, out = rig.sv("start", "--name", "stage0", "--ready-timeout", "20", "--log-max-bytes", "4096",
                     "--log-keep", "2", argv=rig.argv("4000", kind="chatty"))
    assert rc == 0, out
    # the worker is ready once it wrote its lines into the pipe; the supervisor may still be copying the last
    # ones (up to a pipe's 64 KiB) into the files: wait for the last line
    def last_line_written() -> bool:
        try:
            return "chatty line 003999" in (rig.state_dir / "worker.log").read_text()
        except FileNotFoundError:   # between a rotation's rename and the new file
            return False
    wait_for(last_line_written, timeout=30, what="the supervisor to write the worker's last line")
    logs = [rig.state_dir / n for n in ("worker.log.2", "worker.log.1", "worker.log")]
    assert all(p.exists() for p in logs) and not (rig.state_dir / "worker.log.3").exists()
    assert all(p.stat().st_size <= 4096 for p in logs), [p.stat().st_size for p in logs]
    lines = [ln for p in logs for ln in p.read_text().splitlines() if ln.startswith("chatty line")]
    numbers = [int(ln.split()[2]) for ln in lines]
    assert numbers[-1] == 3999 and numbers == list(range(numbers[0], 4000)), numbers[:3]
    assert numbers[0] > 0   # the oldest lines rotated away
    rc, stopped = rig.sv("stop")
    assert rc == 0 and stopped["changed"] is True, stopped
    assert "supervise: stopped" in rig.log.read_text()


def test_worker_exiting_zero_on_its_own_is_restarted(rig):
    rc, first = rig.start()
    assert rc == 0, first
    old, sup = first["worker_pid"], first["supervisor_pid"]
    Path(str(rig.ready) + ".quit").touch()
    new = wait_for(lambda: (p := rig.state().get("worker_pid")) not in (None, old) and rig.ready.exists()
                   and json.loads(rig.ready.read_text())["pid"] == p and p, what="the restarted worker")
    assert not alive(old) and alive(new) and alive(sup)
    rc, status = rig.sv("status")
    assert status["running"] and status["worker_pid"] == new and status["restarts"] == 1, status
    log = rig.log.read_text()
    assert f"child pid {old} exited with status 0" in log and "supervise: restarting in 0.5s" in log
    rc, stopped = rig.sv("stop")
    assert rc == 0 and stopped["changed"] is True and not alive(new) and not alive(sup)


def test_failure_answers_with_msg_and_log_tail(rig):
    rc, out = rig.start(args=("--name", "crashy", "--max-restarts", "1", "--ready-timeout", "20"), kind="crash")
    assert rc == 1 and out["state"] == "failed", out
    assert "crashy" in out["msg"] and "did not become ready" in out["msg"] and "supervisor gave up" in out["msg"]
    assert "start again" in out["msg"]
    tail = "\n".join(out["log_tail"])
    assert "cannot open checkpoint /nonexistent" in tail and "supervise: giving up" in tail
    assert not processes_mentioning(str(rig.root))
    assert not (rig.state_dir / "worker.pid").exists() and not (rig.state_dir / "supervisor.json").exists()

    rc, out = rig.start(args=("--name", "slow", "--ready-timeout", "1"), kind="slow")
    assert rc == 1 and out["state"] == "failed", out
    assert "within 1s" in out["msg"] and "ready timeout" in out["msg"], out
    assert not processes_mentioning(str(rig.root))

    rc, out = rig.sv("start", "--ready-timeout", "0", argv=rig.argv())
    assert rc == 2 and "--ready-timeout" in out["msg"] and out["state"] == "failed", out
    rc, out = rig.sv("start", argv=[])
    assert rc == 2 and "no command given" in out["msg"], out


def test_stale_or_reused_pids_are_not_trusted(rig):
    rig.state_dir.mkdir(mode=0o700)
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    bystander = subprocess.Popen([PY, "-c", "import time; time.sleep(60)", str(rig.root)])
    try:
        start_of = lambda pid: int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19])
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        record = {"pid": dead.pid, "pid_start": 1, "boot_id": boot, "name": "stage0", "argv": rig.argv(),
                  "ready_file": str(rig.ready), "restarts": 0, "state": "running",
                  # a live process with another start time: the pid was reused
                  "worker_pid": bystander.pid, "worker_start": start_of(bystander.pid) - 1}
        (rig.state_dir / "supervisor.json").write_text(json.dumps(record))
        (rig.state_dir / "worker.pid").write_text(f"{dead.pid}\n")
        rig.ready.write_text(json.dumps({"pid": bystander.pid}))
        rc, status = rig.sv("status")
        assert rc == 0 and status["running"] is False and status["supervisor_pid"] is None, status

        # a live pid (this test's own) with the wrong start time is not our supervisor either
        (rig.state_dir / "supervisor.json").write_text(json.dumps(
            {**record, "pid": os.getpid(), "pid_start": start_of(os.getpid()) + 1}))
        rc, status = rig.sv("status")
        assert status["running"] is False, status
        rc, out = rig.start()  # same argv as recorded, yet nothing trusted runs it: a fresh start
        assert rc == 0 and out["changed"] is True and out["msg"] == "started stage0", out
        assert out["supervisor_pid"] != os.getpid() and alive(bystander.pid)
        rc, out = rig.sv("stop")
        assert rc == 0 and out["changed"] is True and alive(bystander.pid)
    finally:
        bystander.kill()
        bystander.wait()


def test_stop_reaps_a_worker_whose_supervisor_was_killed(rig):
    rc, first = rig.start()
    assert rc == 0, first
    os.kill(first["supervisor_pid"], signal.SIGKILL)
    wait_for(lambda: not alive(first["supervisor_pid"]), what="the supervisor to die")
    assert alive(first["worker_pid"])
    rc, status = rig.sv("status")
    assert status["running"] is False and "still alive" in status["msg"], status
    rc, out = rig.sv("stop")
    assert rc == 0 and out["changed"] is True, out
    assert not alive(first["worker_pid"]) and not processes_mentioning(str(rig.root))


def test_real_worker_under_supervise(rig, small_ckpt):
    """A real worker: started, kept on the same argv, told to shut down by the controller (it exits
    0 untold by its supervisor, so it is restarted), then stopped for good."""
    from layerline.cli import _free_ports
    from layerline.keys import local_keys, place, read_key_file
    from layerline.pipeline import control

    (port,) = _free_ports(1)
    kd = local_keys(str(rig.root / "keys"), ["w", "x"])
    argv = [PY, "-m", "layerline.worker", "--checkpoint", str(small_ckpt), "--layers", "0:4",
            "--precision", "fp32", "--kv-context", "64", "--bind", f"tcp://127.0.0.1:{port}",
            "--name", "w", "--ready-file", str(rig.ready), "--first", "--last", "--threads", "1",
            "--keys", kd["w"], "--curve", "on"]
    opts = ("--name", "w", "--ready-timeout", "120")
    rc, out = rig.sv("start", *opts, argv=argv, timeout=180)
    assert rc == 0, out
    assert out["ready"]["pid"] == out["worker_pid"] and out["ready"]["layers"] == [0, 4]
    assert out["ready_file"] == str(rig.ready)  # found in the worker's own argv
    rc, again = rig.sv("start", *opts, argv=argv)
    assert rc == 0 and again["changed"] is False
    old = out["worker_pid"]
    ctl = f"tcp://127.0.0.1:{port + 1}"
    assert control(ctl, "shutdown", keys_dir=kd["controller"], peer="w")["op"] == "ok"
    new = wait_for(lambda: (p := rig.state().get("worker_pid")) not in (None, old) and rig.ready.exists()
                   and json.loads(rig.ready.read_text())["pid"] == p and p, timeout=120,
                   what="the restarted worker")
    assert f"child pid {old} exited with status 0" in rig.log.read_text()
    assert control(ctl, "health", keys_dir=kd["controller"], peer="w", timeout_s=30)["pid"] == new

    # keys rotate: x, in the keys, gets answers; the keys role's place() drops x (gone from the inventory),
    # and the restart the layerline_worker module asks for when a worker's inputs (its keys dir) changed
    # (tests/deploy/test_worker_module.py) gives a worker, on the same argv, that refuses x
    rc, same = rig.sv("start", *opts, argv=argv)
    assert rc == 0 and same["changed"] is False and same["worker_pid"] == new, same
    assert x_is_answered(kd, port)
    public = {n: read_key_file(str(rig.root / "keys" / "store" / f"{n}.key"))[0] for n in ("w", "controller")}
    assert place(kd["w"], "w", public)
    rc, rotated = rig.sv("start", *opts, "--restart", argv=argv, timeout=180)
    assert rc == 0 and rotated["changed"] is True, rotated
    assert rotated["worker_pid"] != new
    x_pub = read_key_file(str(rig.root / "keys" / "store" / "x.key"))[0].decode()
    assert not x_is_answered(kd, port, timeout_ms=1000)   # the proof is the worker's line below
    wait_for(lambda: f"refused a CURVE client whose key {x_pub}" in rig.log.read_text(), timeout=30,
             what="the worker's line refusing x")
    assert control(ctl, "health", keys_dir=kd["controller"], peer="w", timeout_s=30)["pid"] == rotated["worker_pid"]
    new = rotated["worker_pid"]
    rc, stopped = rig.sv("stop")
    assert rc == 0 and stopped["changed"] is True and not alive(new)
    assert f"child pid {new} exited with status 0" in rig.log.read_text()


def x_is_answered(kd: dict, port: int, timeout_ms: int = 30000) -> bool:
    """Whether the worker answers host x on its data socket (CURVE with x's keys; a junk message gets an error
    reply from a worker that let x in, nothing from one whose allow-list lacks x)."""
    import zmq
    from layerline.keys import connect_curve, load_host_keys
    xk = load_host_keys(kd["x"])
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        connect_curve(s, xk, xk.peers["w"])
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send_multipart([b"{not json"])
        return bool(s.poll(timeout_ms))
    finally:
        s.close()
        ctx.term()
