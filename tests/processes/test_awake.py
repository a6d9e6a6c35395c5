"""Idle-priority spinners that keep a worker's CPUs from idling between pipeline steps: they run
at SCHED_IDLE, spin only for the window after a poke, block otherwise, and never outlive their
owner. Real processes, read from /proc; no timing is asserted beyond "within a few seconds"."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import alive, proc_state, wait_for
from layerline.awake import Awake
from layerline.checkpoint import write_demo_checkpoint
from stage_procs import start_workers

# cold_starts: a worker's spinners are looked for among the children of the pid its starter holds
pytestmark = [pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's"), pytest.mark.cold_starts]


def spinners_of(pid: int) -> list[int]:
    """Live children of pid that are layerline.awake spinners."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid and b"awake.py" in cmd and alive(entry):
            out.append(int(entry))
    return out


def test_spinners_idle_priority_spin_after_a_poke_then_block_and_stop_on_close():
    a = Awake(2, window_s=1.0)
    try:
        pids = [p.pid for p in a.procs]
        assert len(pids) == 2
        wait_for(lambda: all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in pids), what="SCHED_IDLE")
        wait_for(lambda: all(proc_state(p) == "S" for p in pids), what="spinners blocked before any poke")
        a.poke()
        wait_for(lambda: all(proc_state(p) == "R" for p in pids), timeout=0.8, what="spinning within the window")
        wait_for(lambda: all(proc_state(p) == "S" for p in pids), timeout=30, what="spinners blocked after the window")
        a.poke()  # a second window wakes them again
        wait_for(lambda: all(proc_state(p) == "R" for p in pids), timeout=0.8, what="spinning again")
    finally:
        a.close()
    assert not any(alive(p) for p in pids)


def test_off_means_no_processes():
    for a in (Awake(0), Awake(2, window_s=0)):
        a.poke()
        assert a.procs == []
        a.close()


def test_a_spinner_that_cannot_start_leaves_the_worker_serving_without_them(monkeypatch, capsys):
    import layerline.awake as awake_mod
    real, started = awake_mod.subprocess.Popen, []

    def second_fails(*a, **kw):
        if started:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(real(*a, **kw))
        return started[-1]
    monkeypatch.setattr(awake_mod.subprocess, "Popen", second_fails)
    a = Awake(2)
    a.poke()
    assert a.procs == [] and "no idle-priority spinners" in capsys.readouterr().err
    wait_for(lambda: not alive(started[0].pid) or started[0].poll() is not None, what="the first spinner to stop")


def test_spinners_exit_when_their_owner_is_killed(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from layerline.awake import Awake
        a = Awake(1, window_s=0.3)
        a.poke()
        print(a.procs[0].pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        spinner = int(owner.stdout.readline())
        assert alive(spinner)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        wait_for(lambda: not alive(spinner), timeout=10, what="the spinner to exit with its owner")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


@pytest.mark.parametrize("awake_ms", [None, "0"])
def test_a_worker_keeps_one_spinner_per_thread_unless_told_not_to(tmp_path, awake_ms):
    ck = write_demo_checkpoint(tmp_path / "m", layers=2, hidden=64, vocab=300, dtype="float32", seed=3)
    extra = [] if awake_ms is None else ["--awake-ms", awake_ms]
    w = start_workers(str(ck), [(0, 2)], threads=2, extra=extra)
    try:
        pid = w.procs[0].pid
        got = spinners_of(pid)
        assert len(got) == (2 if awake_ms is None else 0), got
        # a spinner sets its policy as its interpreter starts, which may be after the worker is
        # ready (it spins only after that, so waiting here tests what matters)
        wait_for(lambda: all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in got), timeout=30,
                 what="the spinners to run at SCHED_IDLE")
        assert all(os.getsid(p) == os.getsid(pid) for p in got), "in the worker's scheduling group"
    finally:
        w.stop()
    wait_for(lambda: not any(alive(p) for p in got), timeout=10, what="the worker's spinners to exit with it")


@pytest.mark.parametrize("value", ["-1", "1001"])
def test_awake_ms_out_of_range_is_refused_before_anything_starts(value):
    r = subprocess.run([sys.executable, "-m", "layerline.worker", "--checkpoint", "x", "--layers", "0:1", "--last",
                        "--bind", "tcp://127.0.0.1:1", "--awake-ms", value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--awake-ms must be 0-1000" in r.stderr, r.stderr
