"""A lock so workers that share a machine's cores time their decode step alone.

A worker times its step at warm-up (`Worker.measure_step`) and the next plan predicts from that
time (the probe cache's step factor). Where several stages share one machine, a deploy starts
them together, and a stage that timed itself while another still loaded or compiled measured that
other's work too: on the default inventory's three local workers the hosts' factors read 1.27 /
1.94 / 1.19 in one deploy. So such workers hold this lock shared while they load and compile, and
exclusively while they time their step: no timing overlaps another worker's start-up or timing.

The plan names one lock per deployment (`spec.timing_lock_name`), a file in `LOCK_DIR`: /dev/shm,
which namespace hosts share (each has a /tmp of its own); containers with their own /dev/shm are
not covered. Best effort: where the lock cannot be had (no such file system, or `WAIT_S` passed)
the worker says so and times its step as before. stdlib only: flock(2), released when the file
closes, so a worker that dies holding it holds nothing.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time

LOCK_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# a sibling's load and default compile take well under this; a max-autotune compile on a cold
# cache may not, and then the stage times over it: a longer wait would risk the stage's own
# ready timeout (spec.READY_TIMEOUT_S, 300 s)
WAIT_S = 120.0


def lock_path(name: str) -> str:
    """The file of the lock `name`: a bare file name lives in LOCK_DIR."""
    return name if os.sep in name else os.path.join(LOCK_DIR, name)


def _open(path: str) -> int | None:
    # open without O_CREAT first: /tmp's protected_regular refuses O_CREAT on another user's
    # file, which a second user racing us to create it may have just made
    for flags in (os.O_RDONLY, os.O_RDONLY | os.O_CREAT, os.O_RDONLY):
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:
            continue
        except OSError:
            if flags & os.O_CREAT:
                continue
            return None
    return None


@contextlib.contextmanager
def held(exclusive: bool, path: str, wait_s: float = WAIT_S, poll_s: float = 0.02):
    """Hold the lock at `path` for the block, shared or `exclusive`; yields whether it was had
    within `wait_s` (the block runs either way)."""
    import fcntl  # POSIX only; imported here so the module imports anywhere

    fd = _open(path)
    try:
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
        yield got
    finally:
        if fd is not None:
            os.close(fd)
