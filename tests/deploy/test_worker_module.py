"""layerline_worker with real processes, through real ansible.

No mocks: each test writes a fake worker script into tmp_path, runs the module with the
`ansible` ad-hoc command against localhost (local connection), and checks the processes
themselves. A fixture kills anything left behind. The supervise CLI the module calls has its
own tests in test_supervise.py.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

from pathlib import Path

import pytest

from helpers import alive, kill_leftovers, processes_mentioning, wait_for

REPO = Path(__file__).resolve().parents[2]
VENV_PY = REPO / ".venv" / "bin" / "python"
ANSIBLE = REPO / ".venv" / "bin" / "ansible"
PY = str(VENV_PY if VENV_PY.exists() else Path(sys.executable))

pytestmark = pytest.mark.skipif(
    not ANSIBLE.exists() or not Path("/proc/self/stat").exists(),
    reason="needs the project venv's ansible and Linux /proc",
)

# Writes the ready file atomically with its pid, then serves until SIGTERM.
FAKE_WORKER = """\
import json, os, signal, sys, time
ready = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
tmp = ready + ".tmp"
with open(tmp, "w") as fh:
    json.dump({"pid": os.getpid(), "args": sys.argv[2:]}, fh)
os.replace(tmp, ready)
print("fake worker %d serving" % os.getpid(), flush=True)
while True:
    time.sleep(1)
"""

# Fails at once, the way a worker with a bad checkpoint path would.
FAKE_CRASH = """\
import sys
print("fake worker: cannot open checkpoint /nonexistent: no such directory", file=sys.stderr)
sys.exit(1)
"""


# -- helpers ----------------------------------------------------------------------------


def run_module(args: dict, check: bool = False) -> dict:
    """Run layerline_worker once via `ansible`; the result dict plus `_status` and `_rc`."""
    cmd = [str(ANSIBLE), "localhost", "-i", "localhost,", "-c", "local",
           "-m", "layerline_worker", "-a", json.dumps(args),
           "-e", f"ansible_python_interpreter={PY}"]
    if check:
        cmd.append("--check")
    env = dict(os.environ)
    env.update({
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        # ansible-core has no json stdout callback; minimal prints `host | STATUS => {json}`.
        "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.minimal",
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_DEPRECATION_WARNINGS": "0",
    })
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    head, sep, body = proc.stdout.partition(" => ")
    assert sep, f"no result from ansible (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    result, _ = json.JSONDecoder().raw_decode(body)
    result["_status"] = head.split("|")[-1].strip()
    result["_rc"] = proc.returncode
    return result


class Rig:
    """One worker's paths and the module arguments that go with them."""

    def __init__(self, root: Path):
        self.root = root
        self.state_dir = root / "state"
        self.ready = self.state_dir / "ready.json"
        self.worker = root / "fake_worker.py"
        self.crash = root / "fake_crash.py"
        self.worker.write_text(FAKE_WORKER)
        self.crash.write_text(FAKE_CRASH)

    def argv(self, *extra: str, script: Path | None = None) -> list[str]:
        return [PY, str(script or self.worker), str(self.ready), *extra]

    def args(self, **kw) -> dict:
        base = {"name": "stage0", "state_dir": str(self.state_dir), "ready_timeout": 20}
        base.update(kw)
        return base

    def ready_pid(self):
        try:
            return json.loads(self.ready.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return None


@pytest.fixture
def rig(tmp_path):
    rig = Rig(tmp_path)
    yield rig
    kill_leftovers(tmp_path)  # whatever a failed test left


# -- the module -------------------------------------------------------------------------


def test_start_is_idempotent_and_restarts_on_argv_change(rig):
    first = run_module(rig.args(argv=rig.argv("--layers", "0:2")))
    assert first["_rc"] == 0 and first["changed"] is True, first
    pid, sup = first["pid"], first["supervisor_pid"]
    assert alive(pid) and alive(sup)
    assert first["ready"]["pid"] == pid == rig.ready_pid()
    assert first["log"] == str(rig.state_dir / "worker.log")
    assert stat.S_IMODE(rig.state_dir.stat().st_mode) == 0o700
    assert (rig.state_dir / "worker.pid").read_text().strip() == str(sup)
    assert json.loads((rig.state_dir / "argv.json").read_text()) == rig.argv("--layers", "0:2")
    assert stat.S_IMODE((rig.state_dir / "argv.json").stat().st_mode) == 0o600

    again = run_module(rig.args(argv=rig.argv("--layers", "0:2")))
    assert again["changed"] is False, again
    assert (again["pid"], again["supervisor_pid"]) == (pid, sup)
    checked = run_module(rig.args(argv=rig.argv("--layers", "0:2")), check=True)
    assert checked["changed"] is False and checked["pid"] == pid, checked

    # Check mode with a new argv: says it would restart, touches nothing.
    checked = run_module(rig.args(argv=rig.argv("--layers", "2:4")), check=True)
    assert checked["changed"] is True and "would restart" in checked["msg"], checked
    assert alive(pid) and alive(sup) and rig.ready_pid() == pid
    assert json.loads((rig.state_dir / "argv.json").read_text()) == rig.argv("--layers", "0:2")

    moved = run_module(rig.args(argv=rig.argv("--layers", "2:4")))
    assert moved["changed"] is True, moved
    assert moved["pid"] != pid and alive(moved["pid"])
    assert moved["ready"]["args"] == ["--layers", "2:4"]
    assert not alive(pid) and not alive(sup)

    # inputs (a keys dir) and env: the same argv restarts exactly when what it read at start changed
    keys = rig.root / "keys"
    keys.mkdir()
    (keys / "self.key").write_text("one")
    argv = rig.argv("--layers", "2:4")
    pid = run_module(rig.args(argv=argv, inputs=[str(keys)]))["pid"]
    same = run_module(rig.args(argv=argv, inputs=[str(keys)]))
    assert same["changed"] is False and same["pid"] == pid, same
    (keys / "self.key").write_text("two")
    checked = run_module(rig.args(argv=argv, inputs=[str(keys)]), check=True)
    assert checked["changed"] is True and "inputs changed" in checked["msg"] and rig.ready_pid() == pid, checked
    rekeyed = run_module(rig.args(argv=argv, inputs=[str(keys)]))
    assert rekeyed["changed"] is True and rekeyed["pid"] != pid and "restarted_for" in rekeyed, rekeyed
    assert run_module(rig.args(argv=argv, inputs=[str(keys)]))["changed"] is False
    env = run_module(rig.args(argv=argv, inputs=[str(keys)], env={"LAYERLINE_X": "1"}))
    assert env["changed"] is True and env["pid"] != rekeyed["pid"], env


def test_killed_worker_is_restarted_then_stopped(rig):
    first = run_module(rig.args(argv=rig.argv()))
    assert first["changed"] is True, first
    old, sup = first["pid"], first["supervisor_pid"]
    os.kill(old, signal.SIGKILL)
    new = wait_for(lambda: (p := rig.ready_pid()) not in (None, old) and alive(p) and p,
                   what="the restarted worker's ready file")
    assert alive(sup)

    again = run_module(rig.args(argv=rig.argv()))
    assert again["changed"] is False, again
    assert again["pid"] == new and again["supervisor_pid"] == sup
    log = (rig.state_dir / "worker.log").read_text()
    assert f"child pid {old} killed by signal SIGKILL" in log
    assert "supervise: restarting in 0.5s" in log

    # Check mode: would stop, stops nothing; it reads which of the given unit files the host holds (the
    # stop play's systemd units: one module run finds them)
    held = rig.root / "layerline-worker-stage0.service"
    held.write_text("[Unit]\n")
    unit_files = [str(held), str(rig.root / "layerline-worker-stage0.1.service")]
    checked = run_module(rig.args(state="stopped", unit_files=unit_files), check=True)
    assert checked["changed"] is True and checked["msg"].startswith("would stop"), checked
    assert checked["units"] == [{"name": held.name, "path": str(held)}], checked
    assert alive(new) and alive(sup)

    stopped = run_module(rig.args(state="stopped"))
    assert stopped["_rc"] == 0 and stopped["changed"] is True, stopped
    assert stopped["supervisor_pid"] == sup
    assert not alive(new) and not alive(sup)
    assert not (rig.state_dir / "worker.pid").exists() and not rig.ready.exists()
    assert not processes_mentioning(str(rig.root))
    assert "supervise: stopped" in (rig.state_dir / "worker.log").read_text()

    again = run_module(rig.args(state="stopped", unit_files=unit_files))
    assert again["_rc"] == 0 and again["changed"] is False and again["units"] == checked["units"], again


def test_crashing_worker_fails_with_log_tail(rig):
    result = run_module(rig.args(name="crashy", argv=rig.argv(script=rig.crash), max_restarts=1))
    assert result["_rc"] != 0 and result["_status"] == "FAILED!", result
    msg = result["msg"]
    assert "crashy" in msg and "did not become ready" in msg
    assert "supervisor gave up" in msg
    assert "cannot open checkpoint /nonexistent" in msg  # the log tail
    assert "supervise: giving up" in msg
    assert any("cannot open checkpoint" in line for line in result["log_tail"])
    assert not processes_mentioning(str(rig.root))
    assert not (rig.state_dir / "worker.pid").exists()


@pytest.mark.skipif(subprocess.run(["/usr/bin/python3", "-c", "import layerline"], capture_output=True,
                                   cwd="/").returncode == 0 or not Path("/usr/bin/python3").exists(),
                    reason="needs a /usr/bin/python3 without layerline")
def test_python_without_layerline_fails_clearly(rig):
    result = run_module(rig.args(argv=rig.argv(), python="/usr/bin/python3"))
    assert result["_status"] == "FAILED!" and "can import layerline" in result["msg"], result
    missing = run_module(rig.args(argv=rig.argv(), python=str(rig.root / "no-such-python")))
    assert missing["_status"] == "FAILED!" and "is not an executable" in missing["msg"], missing
