"""Warm starts (layerline.forkserver): a `python -m layerline.worker|server|cli` run forked from a
template that has torch loaded answers, ends and takes signals as a fresh interpreter does.

This tier starts its processes so (tests/conftest.py): what is proved here is that nothing it checks
through them differs. Each test runs its own template, so its log says which starts it forked."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerline.driver import greedy_generate
from helpers import alive, proc_state, wait_for
from stage_procs import start_templates, start_workers, stop_templates

pytestmark = pytest.mark.cold_starts   # the starts here choose for themselves


@pytest.fixture
def template(tmp_path):
    """One template for the worker's default OpenMP spin (its `python -m layerline.worker` sets
    GOMP_SPINCOUNT=10000 before torch loads) and one for none set (the command line)."""
    where = tmp_path / "fork"
    where.mkdir()
    procs = start_templates(str(where), ("10000", None))
    deadline = time.time() + 120
    while len(list(where.glob("*.sock"))) < 2:
        assert all(p.poll() is None for p in procs), [(where / f).read_text() for f in os.listdir(where)]
        assert time.time() < deadline, "the templates did not start"
        time.sleep(0.1)
    yield where
    stop_templates(procs)


def forks(where: Path) -> list[str]:
    return [ln for f in sorted(where.glob("template-*.log")) for ln in f.read_text().splitlines()
            if ln.startswith("fork ")]


def cli(args: list[str], where: Path | None, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "LAYERLINE_FORKSERVER"}
    e.update(env)
    if where is not None:
        e["LAYERLINE_FORKSERVER"] = str(where)
    return subprocess.run([sys.executable, "-m", "layerline.cli", *args], env=e, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_a_warm_command_line_prints_and_ends_as_a_cold_one(template, small_ckpt):
    for args in (["index", str(small_ckpt), "--json"], ["generate", "--checkpoint", str(small_ckpt),
                                                          "--input-ids", "1,x"]):
        cold, warm = cli(args, None), cli(args, template)
        assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert cold.returncode == 2 and len(cold.stderr.strip().splitlines()) == 1
    assert len(forks(template)) == 2 and all("layerline.cli" in f for f in forks(template))


def test_another_environment_starts_cold_and_says_so(template, small_ckpt):
    """OMP_NUM_THREADS is read when torch loads: a start that sets it cannot be a template's fork."""
    r = cli(["index", str(small_ckpt), "--json"], template, OMP_NUM_THREADS="1")
    assert r.returncode == 0 and json.loads(r.stdout)
    assert forks(template) == []
    assert "layerline.cli" in (template / "cold-starts").read_text()


def worker(template: Path | None, ckpt: Path, mp: pytest.MonkeyPatch):
    if template is None:
        mp.delenv("LAYERLINE_FORKSERVER", raising=False)
    else:
        mp.setenv("LAYERLINE_FORKSERVER", str(template))
    return start_workers(str(ckpt), [(0, 4)])


def tokens(stages) -> list[int]:
    pipe = stages.pipeline()
    try:
        return greedy_generate(pipe, [1, 2, 3], 4)[0]
    finally:
        pipe.close()


def test_a_warm_worker_serves_and_takes_signals_through_its_stand_in(template, small_ckpt):
    """The starter holds a stand-in: SIGTERM reaches the worker, which ends as a cold one does (its
    exit status the stand-in's); SIGSTOP and SIGCONT to the stand-in stop and resume the worker;
    SIGKILL of the stand-in kills the worker; a worker killed ends its stand-in with the same signal."""
    with pytest.MonkeyPatch.context() as mp:
        cold = worker(None, small_ckpt, mp)
        want = tokens(cold)
        cold_status = cold.stop()
        warm = worker(template, small_ckpt, mp)
        try:
            pid = warm.info[0]["pid"]
            assert pid != warm.procs[0].pid and forks(template) and alive(pid)
            assert tokens(warm) == want   # it serves, as the cold one did
            os.kill(warm.procs[0].pid, signal.SIGSTOP)
            wait_for(lambda: proc_state(pid) == "T", 20, what="the worker did not stop with its stand-in")
            os.kill(warm.procs[0].pid, signal.SIGCONT)
            wait_for(lambda: proc_state(pid) != "T", 20, what="the worker did not go on with its stand-in")
        finally:
            warm_status = warm.stop()
        assert warm_status == cold_status and not alive(pid)

        warm = worker(template, small_ckpt, mp)
        pid = warm.info[0]["pid"]
        warm.procs[0].kill()
        wait_for(lambda: not alive(pid), 20, what="the worker outlived its SIGKILLed stand-in")
        warm.stop()

        warm = worker(template, small_ckpt, mp)
        os.kill(warm.info[0]["pid"], signal.SIGKILL)
        assert warm.procs[0].wait(20) == -signal.SIGKILL
        warm.stop()
