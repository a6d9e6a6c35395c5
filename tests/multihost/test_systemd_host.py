"""deploy.yml on a host whose PID 1 is systemd (layerline_service_manager auto -> systemd units), end to end.

The host is this machine's own tree booted by systemd in a container (systemd-nspawn from Debian's
systemd-container package: a tmpfs root with the host's /usr, /etc as an overlay on a tmpfs, the checkout and
its interpreter bound in; the network is the host's). ansible-playbook runs inside it (nsenter), local
connection, on the embedded inventory's three workers and a small random-init checkpoint: check mode from
nothing passes and starts nothing; the workers and the server become units (`systemctl is-active`), each
answers through the server, a second deploy leaves them as they run, and teardown.yml stops and removes every
unit.

Opt-in (`make test-systemd`, LAYERLINE_SYSTEMD=1): it needs root and systemd-nspawn; `make test` skips it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import BIN, ROOT

pytestmark = [
    pytest.mark.systemd,
    pytest.mark.timeout(3600),  # its deploys are bounded at 1800 s each (pyproject's 900 s is for the suite)
    pytest.mark.skipif(os.environ.get("LAYERLINE_SYSTEMD") != "1",
                       reason="the systemd host runs under `make test-systemd` (LAYERLINE_SYSTEMD=1)"),
]


@pytest.fixture(autouse=True, scope="module")
def _can_boot():
    """Asked for (LAYERLINE_SYSTEMD=1), a missing piece fails in one line rather than skipping."""
    missing = [t for t in ("systemd-nspawn", "nsenter") if not shutil.which(t)]
    if os.geteuid() != 0 or missing:
        pytest.fail(f"a systemd container needs root and {', '.join(missing) or 'nothing else'}: run "
                    "`sudo python3 scripts/testhosts.py install` (Debian's systemd-container), as `make test-systemd` does")

PORT_BASE = 29400   # clear of the demo (29100), test_cluster (29500), molecule (29600)
UNITS = ("layerline-worker-w1.service", "layerline-worker-w2.service", "layerline-worker-w3.service",
         "layerline-server-localhost.service")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


class Container:
    """One systemd-booted container of this machine's tree; run() runs a command inside it."""

    def __init__(self, name: str, binds: list[str]):
        prefix = Path(os.path.realpath(sys.executable)).parents[1]    # the interpreter the venv points at
        cmd = ["systemd-nspawn", "-D", "/", "--volatile=yes", "--overlay=/etc::/etc", f"--bind-ro={prefix}",
               *[f"--bind={b}" for b in binds], "-M", name, "--register=no", "--keep-unit", "-b",
               "--console=read-only"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.leader = None
        deadline = time.monotonic() + 120
        state = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            kids = _children(self.proc.pid)
            if kids:
                self.leader = kids[0]
                state = self.run(["systemctl", "is-system-running"], check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return
            time.sleep(0.5)
        out = self.stop()
        raise AssertionError(f"the container did not boot (state {state!r}): {out[-3000:]}")

    def run(self, argv: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        # env -C: the working dir as the container sees it (nsenter --wd would keep this side's, unreachable there)
        r = subprocess.run(["nsenter", "-t", str(self.leader), "-m", "-u", "-i", "-n", "-p", "env", "-C", str(ROOT),
                            *argv],
                           capture_output=True, text=True, timeout=timeout, **kw)
        assert not check or r.returncode == 0, f"{argv}: rc {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
        return r

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()     # nspawn asks the container's systemd to power off
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stdout.read().decode("utf-8", "replace") if self.proc.stdout else ""


def test_deploy_on_a_systemd_host_runs_units(tmp_path):
    from layerline.checkpoint import write_demo_checkpoint
    t0 = time.perf_counter()
    home = tmp_path / "home"
    ckpt = write_demo_checkpoint(tmp_path / "ckpt", layers=6, hidden=128, vocab=500, dtype="float32", seed=7)
    ev = json.dumps({"layerline_home": str(home), "layerline_checkpoint": str(ckpt), "layerline_demo_checkpoint": False,
                     "layerline_policy": "uniform", "layerline_precision": "fp32", "layerline_port_base": PORT_BASE,
                     "layerline_prompt": "", "layerline_seq": 8, "layerline_generate": 4,
                     "layerline_drive_reference": False, "layerline_start_at_boot": True})
    box = Container(f"llsysd{os.getpid()}", [str(ROOT), str(tmp_path)])
    booted = time.perf_counter() - t0
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1", "HOME": "/root",
           "PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin"}
    play = ["env", *[f"{k}={v}" for k, v in env.items()], str(BIN / "ansible-playbook")]
    try:
        # check mode from nothing: it predicts the units and starts nothing (systemd is asked about no unit yet)
        check = box.run([*play, "deploy.yml", "--check", "-e", ev], timeout=600)
        assert "Write the worker's systemd unit" in check.stdout
        assert box.run(["systemctl", "is-active", UNITS[0]], check=False).stdout.strip() != "active"
        first = box.run([*play, "deploy.yml", "-e", ev], timeout=900)
        for unit in UNITS:
            assert box.run(["systemctl", "is-active", unit], check=False).stdout.strip() == "active", unit
            assert box.run(["systemctl", "is-enabled", unit], check=False).stdout.strip() == "enabled", unit
        text = box.run(["cat", f"/etc/systemd/system/{UNITS[0]}"]).stdout
        assert "Restart=on-failure" in text and "MemoryMax=" in text and "--layers 0:2" in text
        # the workers' output is the journal's, not a worker.log
        assert not list(home.rglob("worker.log")) or all(p.stat().st_size == 0 for p in home.rglob("worker.log"))
        assert "layerline" in box.run(["journalctl", "--no-pager", "-u", UNITS[0]]).stdout
        body = json.dumps({"model": "ckpt", "prompt": [1, 2, 3], "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{PORT_BASE + 90}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert len(json.load(r)["choices"][0]["text"]) >= 0
        pids = {u: box.run(["systemctl", "show", "-p", "MainPID", "--value", u]).stdout.strip() for u in UNITS}
        again = box.run([*play, "deploy.yml", "-e", ev], timeout=900)
        assert pids == {u: box.run(["systemctl", "show", "-p", "MainPID", "--value", u]).stdout.strip()
                        for u in UNITS}, "a deploy that changes nothing restarted a unit"
        box.run([*play, "teardown.yml", "-e", ev], timeout=300)
        for unit in UNITS:
            assert not box.run(["test", "-e", f"/etc/systemd/system/{unit}"], check=False).returncode == 0, unit
            assert box.run(["systemctl", "is-active", unit], check=False).stdout.strip() != "active", unit
        print(f"[systemd] boot {booted:.1f} s, whole test {time.perf_counter() - t0:.1f} s; first deploy tail:\n"
              f"{first.stdout[-600:]}\nsecond:\n{again.stdout[-400:]}")
    finally:
        box.stop()
