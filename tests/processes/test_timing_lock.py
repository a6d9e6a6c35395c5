"""layerline.timing_lock: co-located workers time their steps alone, never while another loads."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from layerline.checkpoint import write_demo_checkpoint
from layerline.timing_lock import LOCK_DIR, held, lock_path
from stage_procs import start_workers


def test_shared_holders_overlap_and_an_exclusive_one_waits_for_them(tmp_path):
    lock = str(tmp_path / "lock")
    order = []
    with held(False, lock) as a, held(False, lock) as b:
        assert a and b  # two loading stages at once
        with held(True, lock, wait_s=0.1) as c:
            assert not c  # waited its while, then went on without the lock

        got = threading.Event()

        def timer():
            with held(True, lock, wait_s=30) as d:
                order.append(("timed", d))
                got.set()

        t = threading.Thread(target=timer)
        t.start()
        assert not got.wait(0.5)  # still waiting: the shared holders have not let go
        order.append(("released", True))
    t.join(30)
    assert order == [("released", True), ("timed", True)]
    with held(True, lock, wait_s=0) as e:
        assert e


def test_no_lock_file_possible_still_runs_the_block(tmp_path):
    with held(True, str(tmp_path / "missing-dir" / "lock"), wait_s=0) as got:
        assert got is False


def test_a_bare_name_is_a_file_in_the_lock_dir_and_an_empty_one_is_refused():
    assert lock_path("layerline-timing-x.lock") == os.path.join(LOCK_DIR, "layerline-timing-x.lock")
    assert lock_path("/srv/a.lock") == "/srv/a.lock"
    r = subprocess.run([sys.executable, "-m", "layerline.worker", "--checkpoint", "x", "--layers", "0:1", "--last",
                        "--bind", "tcp://127.0.0.1:1", "--time-alone="], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--time-alone needs a lock file name" in r.stderr, r.stderr


@pytest.mark.e2e
@pytest.mark.step_timing  # reads the step time
def test_a_worker_with_time_alone_waits_while_another_times(tmp_path):
    """A worker started with --time-alone neither loads nor times its step while another stage
    holds the lock alone; it becomes ready once that one lets go."""
    ck = write_demo_checkpoint(tmp_path / "m", layers=2, hidden=64, vocab=300, dtype="float32", seed=3)
    lock = str(tmp_path / "lock")
    out = {}

    def start():
        out["w"] = start_workers(str(ck), [(0, 2)], extra=["--time-alone", lock], timeout=120)

    t = threading.Thread(target=start)
    try:
        with held(True, lock) as got:
            assert got
            t.start()
            time.sleep(4)  # a worker of this model starts in 1-2.5 s here
            alive = t.is_alive()
            released = time.time()
    finally:
        t.join(120)
    w = out["w"]
    try:
        assert alive, "the worker became ready while another stage held the lock alone"
        assert os.path.getmtime(os.path.join(w.tmp, "ready0.json")) >= released
        assert w.info[0]["step_s"] > 0
    finally:
        w.stop()
