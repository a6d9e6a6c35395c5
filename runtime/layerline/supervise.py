"""A tiny process supervisor for one worker.

Run as::

    python -m layerline.supervise --pidfile P --log L [--max-restarts N] \
        [--ready-file R] -- ARGV...

It detaches nothing itself (the ``layerline_worker`` Ansible module starts it in a new
session). It writes its own pid to the pidfile atomically, starts ARGV as a child
(stdout and stderr appended to the log, stdin from /dev/null) and:

- exits 0 when the child exits 0;
- restarts the child when it dies with a non-zero status or a signal, with a backoff of
  0.5 s doubling up to 10 s; after N restarts in a row without 30 s of uptime it gives
  up, logs why and exits non-zero (the child's status, or 128 + signal);
- on SIGTERM/SIGINT forwards SIGTERM to the child, waits up to 10 s, SIGKILLs it if it
  is still there, removes the pidfile and exits 0.

With ``--ready-file`` it removes that file before every (re)start, so a ready file
never names a worker that is gone. Lines it writes itself are prefixed with a
timestamp and ``supervise:``. Only the standard library is used here.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
HEALTHY_UPTIME_S = 30.0
STOP_GRACE_S = 10.0
POLL_S = 0.05


@dataclass
class Options:
    pidfile: str
    log: str
    max_restarts: int
    ready_file: str | None
    argv: list[str]


def parse_args(args: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m layerline.supervise",
        description="Run ARGV, restart it when it fails, stop it on SIGTERM.",
    )
    parser.add_argument("--pidfile", required=True, help="where to write this supervisor's pid")
    parser.add_argument("--log", required=True, help="file the child's output is appended to")
    parser.add_argument(
        "--max-restarts", type=int, default=5,
        help="restarts in a row (each with under 30 s of uptime) before giving up (default 5)",
    )
    parser.add_argument("--ready-file", default=None,
                        help="file removed before every (re)start of the child")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command to run")
    ns = parser.parse_args(args)
    argv = list(ns.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        parser.error("no command given: put it after --, e.g. -- python -m layerline.worker ...")
    if ns.max_restarts < 0:
        parser.error("--max-restarts must be 0 or more")
    return Options(ns.pidfile, ns.log, ns.max_restarts, ns.ready_file, argv)


def exit_status(returncode: int) -> int:
    """A shell-style exit status for a child's return code (negative: killed by a signal)."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    return f"exited with status {returncode}"


class Supervisor:
    def __init__(self, opts: Options):
        self.opts = opts
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self._log_fd = os.open(opts.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    # -- logging and pidfile ------------------------------------------------------------

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        line = f"{stamp} supervise: {message}\n"
        try:
            os.write(self._log_fd, line.encode("utf-8", "replace"))
        except OSError:
            pass

    def write_pidfile(self) -> None:
        tmp = f"{self.opts.pidfile}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.opts.pidfile)

    def remove_pidfile(self) -> None:
        """Remove the pidfile, but only while it still names this process."""
        try:
            with open(self.opts.pidfile, encoding="ascii") as fh:
                content = fh.read().strip()
        except OSError:
            return
        if content == str(os.getpid()):
            try:
                os.unlink(self.opts.pidfile)
            except OSError:
                pass

    # -- signals --------------------------------------------------------------------------

    def on_signal(self, signum, _frame) -> None:
        if not self.stopping:
            self.stopping = True
            self.log(f"received {signal.Signals(signum).name}, stopping")
        child = self.child
        if child is not None and child.returncode is None:
            try:
                child.send_signal(signal.SIGTERM)
            except OSError:
                pass

    # -- the child ------------------------------------------------------------------------

    def start_child(self) -> subprocess.Popen | None:
        if self.opts.ready_file:
            try:
                os.unlink(self.opts.ready_file)
            except FileNotFoundError:
                pass
            except OSError as exc:
                self.log(f"could not remove ready file {self.opts.ready_file}: {exc}")
        try:
            child = subprocess.Popen(
                self.opts.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log_fd,
                stderr=subprocess.STDOUT,
                close_fds=True,
            )
        except OSError as exc:
            self.log(f"cannot start {self.opts.argv[0]!r}: {exc}; check the worker argv")
            return None
        self.log(f"started child pid {child.pid}: {shlex.join(self.opts.argv)}")
        return child

    def stop_child(self) -> None:
        child = self.child
        if child is None:
            return
        if child.returncode is not None:
            self.log(f"child pid {child.pid} {describe(child.returncode)}")
            return
        try:
            child.send_signal(signal.SIGTERM)
        except OSError:
            pass
        try:
            child.wait(timeout=STOP_GRACE_S)
            self.log(f"child pid {child.pid} {describe(child.returncode)}")
        except subprocess.TimeoutExpired:
            self.log(f"child pid {child.pid} still running {STOP_GRACE_S:g}s after SIGTERM; sending SIGKILL")
            child.kill()
            child.wait()

    def sleep(self, seconds: float) -> None:
        """Sleep, waking early when a stop was requested."""
        until = time.monotonic() + seconds
        while not self.stopping:
            left = until - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(POLL_S * 2, left))

    def run(self) -> int:
        self.write_pidfile()
        self.log(f"supervisor pid {os.getpid()} up (max restarts {self.opts.max_restarts})")
        backoff = BACKOFF_START_S
        restarts_in_row = 0
        try:
            while not self.stopping:
                started = time.monotonic()
                self.child = self.start_child()
                if self.child is None:
                    return 127
                if self.stopping:  # a signal arrived while the child was being started
                    break
                while self.child.returncode is None and not self.stopping:
                    try:
                        self.child.wait(timeout=POLL_S * 4)
                    except subprocess.TimeoutExpired:
                        continue
                    except InterruptedError:
                        continue
                if self.stopping:
                    break
                rc = self.child.returncode
                uptime = time.monotonic() - started
                if rc == 0:
                    self.log(f"child pid {self.child.pid} exited with status 0 after {uptime:.1f}s; done")
                    return 0
                self.log(f"child pid {self.child.pid} {describe(rc)} after {uptime:.1f}s")
                self.child = None  # reported; nothing left to stop
                if uptime >= HEALTHY_UPTIME_S:
                    restarts_in_row = 0
                    backoff = BACKOFF_START_S
                if restarts_in_row >= self.opts.max_restarts:
                    self.log(
                        f"giving up: the child failed {restarts_in_row + 1} time(s) in a row, "
                        f"each within {HEALTHY_UPTIME_S:g}s of starting (--max-restarts "
                        f"{self.opts.max_restarts}); last: {describe(rc)}"
                    )
                    return exit_status(rc) or 1
                restarts_in_row += 1
                self.log(f"restarting in {backoff:g}s (restart {restarts_in_row} of {self.opts.max_restarts})")
                self.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            self.stop_child()
            self.log("stopped")
            return 0
        finally:
            self.remove_pidfile()
            os.close(self._log_fd)


def main(args: list[str] | None = None) -> int:
    opts = parse_args(args)
    supervisor = Supervisor(opts)
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    signal.signal(signal.SIGINT, supervisor.on_signal)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
