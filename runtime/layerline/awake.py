"""Keep a worker's CPUs from going idle between pipeline steps.

On the VMs measured (2-core Firecracker guests), a vCPU left idle for some milliseconds costs the
step that follows: one int8 stage (layers 5-11 of the demo model, 1.9-2.0 ms back to back) took
2.4-3.1 ms a step after 8 ms idle and 14-18 ms after 16 ms idle; with this module's spinners,
1.8-1.9 ms after either. A stage of a pipeline idles while the others compute, so it pays this
on every token once the others' steps add up to a few milliseconds.

So a worker keeps `Awake` spinners: one process per torch thread, at SCHED_IDLE, which spin for
`window_s` after each message and otherwise block on a pipe. In the worker's own session
(its scheduling group), SCHED_IDLE means the worker's threads preempt them at once and they
only ever take time nobody else in the group wants. Across groups it does not: where stages
share a machine's cores the plan turns them off (`--awake-ms 0`, layerline.spec). They exit
when their worker does (the pipe closes). Nothing here touches torch: a spinner is this file run
as a script, so it starts in milliseconds.
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

WINDOW_S = 0.05  # how long spinners stay after a message: the idle a pipeline stage sees, at most


class Awake:
    """`spinners` idle-priority spinner processes, woken by `poke()` for `window_s`. Off (pokes do
    nothing) with 0 spinners, a window of 0, or off Linux."""

    def __init__(self, spinners: int, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.procs: list[subprocess.Popen] = []
        self._pokes: list[int] = []
        self._deadline = None  # the spinners' deadline (time.monotonic), shared with them
        if spinners <= 0 or window_s <= 0 or not (hasattr(os, "memfd_create") and hasattr(os, "SCHED_IDLE")):
            return
        try:
            fd = os.memfd_create("layerline-awake")
            try:
                os.ftruncate(fd, 8)
                # one 8-byte store per update (struct.pack_into zeroes the bytes first: a spinner could read 0)
                self._deadline = memoryview(mmap.mmap(fd, 8)).cast("d")
                for _ in range(spinners):
                    r, w = os.pipe()
                    self._pokes.append(w)
                    os.set_blocking(w, False)
                    try:
                        self.procs.append(subprocess.Popen([sys.executable, "-I", __file__, str(fd), str(r)],
                                                           pass_fds=(fd, r), stdin=subprocess.DEVNULL))
                    finally:
                        os.close(r)
            finally:
                os.close(fd)
        except OSError as e:  # out of processes or memory: serve without them
            print(f"layerline: no idle-priority spinners ({e}); steps after an idle may be slower",
                  file=sys.stderr, flush=True)
            self.close()

    def poke(self) -> None:
        """Spin for the next window_s (a message just came, the next is due soon)."""
        if self._deadline is None:
            return
        now = time.monotonic()
        asleep = now > self._deadline[0] - 0.001  # spinners past their deadline block on their pipes
        self._deadline[0] = now + self.window_s  # before the wake-up: they read it first
        if asleep:
            for w in self._pokes:
                try:
                    os.write(w, b"\0")
                except BlockingIOError:  # its pipe already holds a wake-up
                    pass

    def close(self) -> None:
        """Stop the spinners (each exits at its pipe's end, within a window)."""
        for w in self._pokes:
            os.close(w)
        self._pokes, self._deadline = [], None
        for p in self.procs:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def _spin(fd: int, r: int) -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:  # a sandbox that refuses the policy: the lowest nice value is nearly as idle
        os.nice(19)
    deadline = memoryview(mmap.mmap(fd, 8, access=mmap.ACCESS_READ)).cast("d")
    clock = time.monotonic
    while os.read(r, 64):  # b"": the worker is gone
        while clock() < deadline[0]:
            pass


if __name__ == "__main__":
    _spin(int(sys.argv[1]), int(sys.argv[2]))
