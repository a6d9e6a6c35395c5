"""A machine-wide lock so workers that share a machine's cores time their decode step alone.

A worker times its step at warm-up (`Worker.measure_step`) and the next plan predicts from that
time (the probe cache's step factor). Where several stages share one machine, a deploy starts
them together, and a stage that timed itself while another still loaded or compiled measured that
other's work too: on the default inventory's three local workers the hosts' factors read 1.27 /
1.94 / 1.19 in one deploy. So such workers hold this lock shared while they load and compile, and
exclusively while they time their step: no timing overlaps another worker's start-up or timing.

Best effort: where the lock cannot be had (no such file system, or `WAIT_S` passed) the worker
goes on and times its step as before. stdlib only: flock(2), released when the file closes.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time

PATH = os.path.join(tempfile.gettempdir(), "layerline-step-timing.lock")
WAIT_S = 30.0  # a start-up longer than this (a big model from a slow disk) is timed over


def lock_path(name: str) -> str:
    """A lock named by its file name alone lives in this machine's temp dir (the plan names one
    per deployment, layerline.spec, so two deployments' workers never wait on each other)."""
    return name if os.sep in name else os.path.join(tempfile.gettempdir(), name)


def _open(path: str) -> int | None:
    # open without O_CREAT first: /tmp's protected_regular refuses O_CREAT on another user's file
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return None


@contextlib.contextmanager
def held(exclusive: bool, path: str = PATH, wait_s: float = WAIT_S, poll_s: float = 0.02):
    """Hold the lock at `path` for the block, shared or `exclusive`; yields whether it was had
    within `wait_s` (the block runs either way)."""
    import fcntl  # POSIX only; imported here so the module imports anywhere

    fd = _open(path)
    got = False
    if fd is not None:
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, op)
                got = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(poll_s)
            except OSError:
                break
    try:
        yield got
    finally:
        if fd is not None:
            os.close(fd)
