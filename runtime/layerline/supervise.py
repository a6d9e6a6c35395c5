"""Process lifecycle for one layerline worker: a small supervisor with a JSON interface.

    python -m layerline.supervise start --state-dir D [--name N] [--ready-timeout S]
        [--max-restarts K] [--ready-file R] [--env K=V ...] [--restart]
        [--log-max-bytes B] [--log-keep K] -- ARGV...
    python -m layerline.supervise stop --state-dir D
    python -m layerline.supervise status --state-dir D

Each prints one JSON object (one line) on stdout. ``start`` and ``stop`` exit 0 on success
and 1 on failure, ``status`` exits 0; a usage error exits 2 (still with a JSON object whose
"msg" names the flag).

``start`` is idempotent on ARGV: a supervisor of D that runs the same ARGV is left alone
({"changed": false}); another ARGV (or ``--restart``) stops it and starts anew. It starts the
supervisor detached (its own session, so it outlives the caller) and waits until the
worker's ready file exists, the supervisor gives up, or ``--ready-timeout`` passes. The
ready file is ``--ready-file``, else the ``--ready-file`` in ARGV (what a layerline worker is
given), else ``D/ready.json``; relative paths are taken from D, which is also the
supervisor's and the worker's working directory.

The supervisor itself runs as ``python -m layerline.supervise run --state-dir D --name N
--max-restarts K --ready-file R -- ARGV`` (``start`` launches it; nothing else should). It
starts ARGV (stdin from /dev/null, output appended to the log) and owns the stop decision:
a worker that exits on its own, with any status including 0, is restarted after a backoff of
0.5 s doubling up to 10 s; after K restarts in a row without 30 s of uptime it gives up,
records why and exits non-zero. On SIGTERM/SIGINT it forwards SIGTERM to the worker, waits
up to 10 s, SIGKILLs it if still there, and exits 0. It removes the ready file before every
(re)start, so a ready file never names a worker that is gone.

Files in D (all written atomically): ``supervisor.json`` (the facts: pid and its start time,
boot id, name, argv, ready_file, started_at, restarts, worker_pid and its start time, state),
``worker.pid`` (the supervisor's pid), ``argv.json`` (the argv last started), ``worker.log``.
The worker's output reaches the log through the supervisor (a pipe), which rotates it: once the
next write would take it past ``--log-max-bytes`` (LOG_MAX_BYTES, 16 MiB) worker.log becomes
worker.log.1 (.1 becomes .2, ...; ``--log-keep`` LOG_KEEP = 3 old files are kept), so a worker
that runs for months holds at most (keep + 1) x the limit of disk.
A recorded pid is trusted only while /proc shows a live process with the recorded start time
on the same boot, so a reused pid is never signalled. Only the standard library (and
layerline.files) is used here.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time

from .files import atomic_write, atomic_write_json, ensure_private_dir

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
HEALTHY_UPTIME_S = 30.0
STOP_GRACE_S = 10.0   # the supervisor's wait between SIGTERM and SIGKILL of its worker
STOP_TIMEOUT_S = 15.0  # `stop`'s wait for the supervisor before SIGKILL of the process group
KILL_TIMEOUT_S = 30.0  # a wait after SIGKILL, which cannot be refused: a niced worker on a loaded machine took over 5 s to exit (CI)
POLL_S = 0.05
LOG_TAIL_LINES = 20
LOG_MAX_BYTES = 16 * 2**20   # worker.log rotates before it grows past this
LOG_KEEP = 3                 # rotated logs kept: worker.log.1 (newest) .. worker.log.3
PIPE_CHUNK = 65536

STATE_FILE = "supervisor.json"
PIDFILE = "worker.pid"
LOG = "worker.log"
ARGV_FILE = "argv.json"
READY = "ready.json"
LOCK = "supervise.lock"


# -- processes ------------------------------------------------------------------------------


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def proc_stat(pid) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (which may hold anything): [0] the state letter
    (R, S, T, Z, ...), [19] the start time; None for no such process."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].split()


def proc_start(pid) -> int | None:
    """The start time (clock ticks after boot) of a live, non-zombie process; None otherwise."""
    fields = proc_stat(pid)
    if fields is None or len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def same_process(pid, start, boot) -> bool:
    """True while pid is the live process that was recorded with this start time and boot id."""
    if start is None or (boot and boot != boot_id()):
        return False
    return proc_start(pid) == start


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    return f"exited with status {returncode}"


def exit_status(returncode: int) -> int:
    """A shell-style exit status for a child's return code (negative: killed by a signal)."""
    return 128 - returncode if returncode < 0 else returncode


# -- files ----------------------------------------------------------------------------------


class Paths:
    def __init__(self, state_dir: str):
        self.state_dir = os.path.abspath(state_dir)
        self.state = os.path.join(self.state_dir, STATE_FILE)
        self.pidfile = os.path.join(self.state_dir, PIDFILE)
        self.log = os.path.join(self.state_dir, LOG)
        self.argv = os.path.join(self.state_dir, ARGV_FILE)
        self.lock = os.path.join(self.state_dir, LOCK)

    def resolve(self, path: str) -> str:
        return os.path.normpath(os.path.join(self.state_dir, path))


def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def read_dict(path: str) -> dict | None:
    data = read_json(path)
    return data if isinstance(data, dict) else None


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def log_tail(path: str, offset: int = 0, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last lines of the log written since offset (all of it when it rotated since)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset if offset <= os.fstat(fh.fileno()).st_size else 0)
            data = fh.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-lines:]


def append_log(path: str, message: str, who: str = "supervise") -> None:
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {who}: {message}\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        os.write(fd, line.encode("utf-8", "replace"))
    finally:
        os.close(fd)


def ready_file_of(argv: list[str], given: str | None, paths: Paths) -> str:
    """--ready-file if given, else the worker's own --ready-file in argv, else STATE_DIR/ready.json."""
    if not given:
        for i, arg in enumerate(argv):
            if arg == "--ready-file" and i + 1 < len(argv):
                given = argv[i + 1]
            elif arg.startswith("--ready-file="):
                given = arg.split("=", 1)[1]
    return paths.resolve(given or READY)


# -- the supervisor (the `run` command) -----------------------------------------------------


class RotatingLog:
    """The log the supervisor writes, its own lines and its worker's output: appended to `path`; a write that would
    take it past max_bytes first moves it to path.1 (path.1 to path.2, ..., path.KEEP dropped). Thread-safe."""

    def __init__(self, path: str, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP):
        self.path, self.max_bytes, self.keep = path, max(1, int(max_bytes)), max(0, int(keep))
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.size = os.fstat(self.fd).st_size

    def _rotate(self) -> None:
        os.close(self.fd)
        try:
            if self.keep:
                for i in range(self.keep - 1, 0, -1):
                    if os.path.exists(f"{self.path}.{i}"):
                        os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
                os.replace(self.path, f"{self.path}.1")
            else:
                os.unlink(self.path)
        except OSError:
            pass  # a log that cannot rotate keeps growing rather than losing the worker's output
        self._open()

    def write(self, data: bytes) -> None:
        """Append data; what does not fit goes to a fresh file, cut after the last whole line that fits (a line
        longer than a whole file is cut at the limit)."""
        with self._lock:
            while data:
                room = self.max_bytes - self.size
                if len(data) <= room:
                    part, data = data, b""
                else:
                    cut = data.rfind(b"\n", 0, room) + 1 if room > 0 else 0
                    if cut == 0 and self.size:
                        self._rotate()
                        continue
                    cut = cut or room
                    part, data = data[:cut], data[cut:]
                try:
                    os.write(self.fd, part)
                except OSError:
                    return
                self.size += len(part)
                if data:
                    self._rotate()

    def pump(self, pipe) -> threading.Thread:
        """Copy everything read from `pipe` (a child's stdout) into the log, on a thread, until EOF."""
        def run():
            fd = pipe.fileno()
            try:
                while True:
                    data = os.read(fd, PIPE_CHUNK)
                    if not data:
                        break
                    self.write(data)
            except OSError:
                pass
            finally:
                pipe.close()
        t = threading.Thread(target=run, name="log-pump", daemon=True)
        t.start()
        return t

    def close(self) -> None:
        with self._lock:
            os.close(self.fd)



class Supervisor:
    def __init__(self, paths: Paths, name: str, argv: list[str], ready_file: str, max_restarts: int,
                 log_max_bytes: int = LOG_MAX_BYTES, log_keep: int = LOG_KEEP):
        self.paths = paths
        self.argv = argv
        self.ready_file = ready_file
        self.max_restarts = max_restarts
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self._termed: subprocess.Popen | None = None
        self._log = RotatingLog(paths.log, log_max_bytes, log_keep)
        self._pump: threading.Thread | None = None
        self.record = {
            "pid": os.getpid(), "pid_start": proc_start(os.getpid()), "boot_id": boot_id(),
            "name": name, "argv": argv, "ready_file": ready_file, "log": paths.log,
            "max_restarts": max_restarts, "started_at": time.time(), "restarts": 0,
            "worker_pid": None, "worker_start": None, "state": "running",
        }

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._log.write(f"{stamp} supervise: {message}\n".encode("utf-8", "replace"))

    def save(self, **changes) -> None:
        self.record.update(changes)
        try:
            atomic_write_json(self.paths.state, self.record)
        except OSError as exc:
            self.log(f"cannot write {self.paths.state}: {exc}")

    def on_signal(self, signum, _frame) -> None:
        if not self.stopping:
            self.stopping = True
            self.log(f"received {signal.Signals(signum).name}, stopping")
        self.terminate(self.child)

    def terminate(self, child: subprocess.Popen | None) -> None:
        """SIGTERM the child once (a second one could cut its clean exit short)."""
        if child is not None and child.returncode is None and child is not self._termed:
            self._termed = child
            try:
                child.send_signal(signal.SIGTERM)
            except OSError:
                pass

    def start_child(self) -> subprocess.Popen | None:
        try:
            os.unlink(self.ready_file)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.log(f"could not remove ready file {self.ready_file}: {exc}")
        try:
            # its output through a pipe into the rotating log (a file the worker held open could not rotate)
            child = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, close_fds=True)
        except OSError as exc:
            reason = f"cannot start {self.argv[0]!r}: {exc}; check the worker argv"
            self.log(reason)
            self.save(state="failed", reason=reason, exit_status=127, worker_pid=None, worker_start=None)
            return None
        self._pump = self._log.pump(child.stdout)
        self.save(worker_pid=child.pid, worker_start=proc_start(child.pid))
        self.log(f"started child pid {child.pid}: {shlex.join(self.argv)}")
        return child

    def drain_output(self) -> None:
        """Let the exited child's last output reach the log before the supervisor's line about its exit (not
        for ever: a process it left behind may hold the pipe open)."""
        if self._pump is not None:
            self._pump.join(timeout=2.0)
            self._pump = None

    def stop_child(self) -> None:
        child = self.child
        if child is None:
            return
        if child.returncode is None:
            self.terminate(child)
            try:
                child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.log(f"child pid {child.pid} still running {STOP_GRACE_S:g}s after SIGTERM; sending SIGKILL")
                child.kill()
                child.wait()
        self.drain_output()
        self.log(f"child pid {child.pid} {describe(child.returncode)}")

    def wait_child(self, child: subprocess.Popen) -> None:
        """Until the child exits or a stop is asked for. Woken by the child's exit through a pidfd, else
        once a second to look at `stopping` (the signal handler SIGTERMs the child, so its exit wakes
        this at once): Popen.wait(timeout) polls 20 times a second, the CPU of an idle supervisor."""
        try:
            fd = os.pidfd_open(child.pid)
        except (AttributeError, OSError):  # no pidfd (Linux before 5.3): poll as Popen.wait does
            fd = None
        try:
            while child.poll() is None and not self.stopping:
                if fd is None:
                    try:
                        child.wait(timeout=POLL_S * 4)
                    except subprocess.TimeoutExpired:
                        pass
                else:
                    select.select([fd], [], [], 1.0)
        finally:
            if fd is not None:
                os.close(fd)

    def sleep(self, seconds: float) -> None:
        """Sleep, waking early when a stop was requested."""
        until = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < until:
            time.sleep(min(POLL_S * 2, max(0.0, until - time.monotonic())))

    def run(self) -> int:
        try:
            atomic_write(self.paths.pidfile, f"{os.getpid()}\n")
            atomic_write_json(self.paths.argv, self.argv)
            self.save()
            self.log(f"supervisor pid {os.getpid()} up (max restarts {self.max_restarts})")
            return self._loop()
        finally:
            if read_json(self.paths.pidfile) == os.getpid():
                remove(self.paths.pidfile)
            self._log.close()

    def _loop(self) -> int:
        backoff, in_row = BACKOFF_START_S, 0
        while not self.stopping:
            started = time.monotonic()
            self.child = self.start_child()
            if self.child is None:
                return 127
            self.wait_child(self.child)
            if self.stopping:
                break
            rc, uptime = self.child.returncode, time.monotonic() - started
            self.drain_output()
            # The supervisor owns the stop decision: any exit it did not ask for is a failure.
            self.log(f"child pid {self.child.pid} {describe(rc)} after {uptime:.1f}s without being asked to stop")
            self.child = None
            if uptime >= HEALTHY_UPTIME_S:
                in_row, backoff = 0, BACKOFF_START_S
            if in_row >= self.max_restarts:
                reason = (f"the worker failed {in_row + 1} time(s) in a row, each within "
                          f"{HEALTHY_UPTIME_S:g}s of starting (--max-restarts {self.max_restarts}); "
                          f"last: {describe(rc)}")
                self.log(f"giving up: {reason}")
                status = exit_status(rc) or 1
                self.save(state="gave_up", reason=reason, exit_status=status, worker_pid=None, worker_start=None)
                return status
            in_row += 1
            self.log(f"restarting in {backoff:g}s (restart {in_row} of {self.max_restarts})")
            self.save(restarts=self.record["restarts"] + 1, worker_pid=None, worker_start=None)
            self.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
        self.stop_child()
        self.log("stopped")
        self.save(state="stopped", worker_pid=None, worker_start=None)
        return 0


# -- what runs now --------------------------------------------------------------------------


def running_record(paths: Paths) -> dict | None:
    """The state file's record while its supervisor is alive (same pid, start time and boot)."""
    rec = read_dict(paths.state)
    if rec and same_process(rec.get("pid"), rec.get("pid_start"), rec.get("boot_id")):
        return rec
    return None


def worker_alive(rec: dict | None) -> bool:
    return bool(rec) and same_process(rec.get("worker_pid"), rec.get("worker_start"), rec.get("boot_id"))


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(paths: Paths, proc: subprocess.Popen | None = None) -> tuple[bool, int | None, str | None]:
    """Stop the recorded supervisor and worker; (something was running, supervisor pid, error)."""
    rec = read_dict(paths.state) or {}
    boot = rec.get("boot_id")
    sup, sup_start = rec.get("pid"), rec.get("pid_start")
    if proc is not None and sup != proc.pid:  # our own child that never recorded itself
        sup, sup_start = proc.pid, proc_start(proc.pid)

    def sup_gone() -> bool:
        if proc is not None and proc.pid == sup:
            return proc.poll() is not None
        return not same_process(sup, sup_start, boot)

    sup_running = not sup_gone()
    work_running = worker_alive(rec)
    if sup_running:
        try:
            os.kill(sup, signal.SIGTERM)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            return True, sup, f"cannot signal supervisor pid {sup}: {exc}; stop it as its owner"
        if not wait_until(sup_gone, STOP_TIMEOUT_S):
            append_log(paths.log, f"supervisor pid {sup} still running {STOP_TIMEOUT_S:g}s after SIGTERM; "
                                  "killing its process group")
            kill_group(sup, signal.SIGKILL)
            wait_until(sup_gone, KILL_TIMEOUT_S)
        # The supervisor leads its own group: whatever the worker left there goes too.
        kill_group(sup, signal.SIGKILL)
    if worker_alive(rec):  # a worker whose supervisor died without stopping it
        wpid = rec["worker_pid"]
        try:
            pgid = os.getpgid(wpid)
        except OSError:
            pgid = None
        append_log(paths.log, f"worker pid {wpid} outlived its supervisor; stopping it")
        try:
            os.kill(wpid, signal.SIGTERM)
        except OSError:
            pass
        if not wait_until(lambda: not worker_alive(rec), STOP_GRACE_S):
            try:
                os.kill(wpid, signal.SIGKILL)
            except OSError:
                pass
            wait_until(lambda: not worker_alive(rec), KILL_TIMEOUT_S)
        if pgid is not None and pgid == sup:  # its group is still the supervisor's: clear it
            kill_group(pgid, signal.SIGKILL)
    if proc is not None:
        try:
            proc.wait(timeout=KILL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    if not sup_gone() or worker_alive(rec):
        return True, sup, (f"supervisor pid {sup} or worker pid {rec.get('worker_pid')} survived SIGKILL; "
                           f"look at it (ps -o pid,stat,cmd -g {sup}) and remove {paths.state} by hand")
    for path in (paths.pidfile, paths.state, rec.get("ready_file")):
        if path:
            remove(path)
    return sup_running or work_running, (sup if sup_running else None), None


# -- the commands ---------------------------------------------------------------------------


def cmd_status(paths: Paths) -> tuple[int, dict]:
    rec = read_dict(paths.state)
    live = running_record(paths)
    out = {"running": live is not None, "supervisor_pid": None, "worker_pid": None, "argv": None,
           "ready": None, "restarts": None, "log": paths.log, "state_dir": paths.state_dir,
           "name": None, "ready_file": None, "started_at": None}
    if live is not None:
        out.update(supervisor_pid=live["pid"], argv=live.get("argv"), restarts=live.get("restarts"),
                   name=live.get("name"), ready_file=live.get("ready_file"), started_at=live.get("started_at"),
                   worker_pid=live.get("worker_pid") if worker_alive(live) else None)
        out["ready"] = read_dict(live["ready_file"]) if live.get("ready_file") else None
        out["msg"] = f"{live.get('name')} runs (supervisor pid {live['pid']})"
    elif rec:
        why = rec.get("reason") or f"state {rec.get('state')}"
        out["msg"] = (f"not running: the last supervisor (pid {rec.get('pid')}) is gone ({why})"
                      + ("; its worker is still alive, run stop" if worker_alive(rec) else ""))
    else:
        out["msg"] = f"not running: no {STATE_FILE} in {paths.state_dir}"
    return 0, out


def cmd_stop(paths: Paths) -> tuple[int, dict]:
    out = {"changed": False, "state": "stopped", "supervisor_pid": None, "log": paths.log}
    if not os.path.isdir(paths.state_dir):
        out["msg"] = f"not running: {paths.state_dir} does not exist"
        return 0, out
    with _locked(paths):
        name = (read_dict(paths.state) or {}).get("name") or os.path.basename(paths.state_dir)
        changed, sup, error = stop_all(paths)
    out.update(changed=changed, supervisor_pid=sup)
    if error:
        out.update(state="failed", msg=f"{name}: could not stop: {error}", log_tail=log_tail(paths.log))
        return 1, out
    out["msg"] = f"stopped {name}" if changed else f"{name} was not running"
    return 0, out


def _wait_ready(ready_file: str, alive, timeout: float) -> tuple[dict | None, str | None]:
    deadline = time.monotonic() + timeout
    while True:
        ready = read_dict(ready_file)
        if ready is not None:
            return ready, None
        if not alive():
            return None, "gone"
        if time.monotonic() >= deadline:
            return None, "timeout"
        time.sleep(POLL_S)


def cmd_start(paths: Paths, ns, argv: list[str]) -> tuple[int, dict]:
    name = ns.name or os.path.basename(paths.state_dir)
    ready_file = ready_file_of(argv, ns.ready_file, paths)
    out = {"changed": False, "state": "failed", "name": name, "supervisor_pid": None, "worker_pid": None,
           "argv": argv, "ready": None, "ready_file": ready_file, "log": paths.log,
           "state_dir": paths.state_dir, "log_tail": []}
    try:
        ensure_private_dir(paths.state_dir)
    except OSError as exc:
        out["msg"] = (f"{name}: cannot create state dir {paths.state_dir}: {exc}; choose one the user "
                      "may write to")
        return 1, out
    with _locked(paths):
        return _start(paths, ns, argv, name, ready_file, out)


def _start(paths: Paths, ns, argv, name, ready_file, out) -> tuple[int, dict]:
    live = running_record(paths)
    if live is not None and live.get("argv") == argv and live.get("ready_file") == ready_file and not ns.restart:
        out["supervisor_pid"] = live["pid"]
        offset = max(0, log_size(paths.log) - 8192)
        ready, why = _wait_ready(ready_file, lambda: running_record(paths) is not None, ns.ready_timeout)
        rec = read_dict(paths.state) or live
        out["worker_pid"] = rec.get("worker_pid")
        if ready is None:
            what = ("its supervisor exited meanwhile: " + str(rec.get("reason") or rec.get("state"))
                    if why == "gone" else f"no ready file {ready_file} within {ns.ready_timeout:g}s")
            out.update(msg=f"{name}: the running worker (supervisor pid {live['pid']}) is not ready: {what}. "
                           "It was left as it is; look at the log, then restart it (start --restart, "
                           "state=restarted)", log_tail=log_tail(paths.log, offset))
            return 1, out
        out.update(state="started", ready=ready, msg=f"{name} is running with this argv")
        return 0, out

    out["changed"] = True
    what = "restart" if ns.restart else "restart (argv changed)" if live is not None else "start"
    _, old, error = stop_all(paths)
    if error:
        out.update(msg=f"{name}: could not stop the old worker: {error}", log_tail=log_tail(paths.log))
        return 1, out
    remove(ready_file)
    remove(paths.pidfile)
    offset = log_size(paths.log)
    append_log(paths.log, f"starting {name}" + (f" (stopped supervisor pid {old})" if old else ""))
    env = dict(os.environ)
    env.update(ns.env)
    cmd = [sys.executable, "-m", "layerline.supervise", "run", "--state-dir", paths.state_dir,
           "--name", name, "--max-restarts", str(ns.max_restarts), "--ready-file", ready_file,
           "--log-max-bytes", str(ns.log_max_bytes), "--log-keep", str(ns.log_keep), "--", *argv]
    log_fd = os.open(paths.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        # Its own session: the supervisor outlives this command and the caller's connection;
        # no inherited pipes, so whoever reads our stdout is not kept waiting.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=subprocess.STDOUT,
                                close_fds=True, start_new_session=True, cwd=paths.state_dir, env=env)
    except OSError as exc:
        out.update(msg=f"{name}: cannot run {sys.executable} -m layerline.supervise: {exc}")
        return 1, out
    finally:
        os.close(log_fd)
    out["supervisor_pid"] = proc.pid
    ready, why = _wait_ready(ready_file, lambda: proc.poll() is None, ns.ready_timeout)
    rec = read_dict(paths.state) or {}
    if ready is not None:
        out.update(state="started", ready=ready, worker_pid=rec.get("worker_pid") or ready.get("pid"),
                   msg=f"{'started' if what == 'start' else 'restarted'} {name}",
                   log_tail=log_tail(paths.log, offset))
        return 0, out

    if why == "timeout":
        reason = (f"it did not write its ready file {ready_file} within {ns.ready_timeout:g}s; raise the "
                  "ready timeout if the worker needs longer to load")
    elif rec.get("pid") != proc.pid:
        reason = (f"the supervisor did not come up ({describe(proc.returncode)}); "
                  f"check that {sys.executable} can import layerline")
    elif rec.get("state") == "gave_up":
        reason = (f"the supervisor gave up with status {rec.get('exit_status')}: {rec.get('reason')} "
                  f"before the worker wrote {ready_file}")
    else:
        reason = f"the supervisor exited ({rec.get('reason') or describe(proc.returncode)})"
    stop_all(paths, proc)
    remove(paths.state)
    out.update(worker_pid=None, log_tail=log_tail(paths.log, offset),
               msg=f"{name}: the worker did not become ready: {reason}. It has been stopped; fix the cause "
                   f"shown in the log ({paths.log}) and start again")
    return 1, out


class _locked:
    """Serialise start and stop of one state dir (flock on STATE_DIR/supervise.lock)."""

    def __init__(self, paths: Paths):
        self.path = paths.lock

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


# -- command line ---------------------------------------------------------------------------


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: give K=V")
    return key, value


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be more than 0 seconds")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be 0 or more")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m layerline.supervise",
                     description="Start, stop and report one supervised worker; answers in JSON.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    start = sub.add_parser("start", help="start ARGV (after --) supervised, unless it already runs")
    run = sub.add_parser("run", help="be the supervisor (start runs this; not for people)")
    for p in (start, run):
        p.add_argument("--state-dir", required=True)
        p.add_argument("--name", default=None, help="name used in messages (default: the state dir's name)")
        p.add_argument("--max-restarts", type=_count, default=5,
                       help="restarts in a row, each with under 30 s of uptime, before giving up (default 5)")
        p.add_argument("--ready-file", default=None,
                       help="the worker's ready file (default: --ready-file in ARGV, else STATE_DIR/ready.json)")
        p.add_argument("--log-max-bytes", type=_count, default=LOG_MAX_BYTES,
                       help=f"rotate worker.log before it grows past this (default {LOG_MAX_BYTES})")
        p.add_argument("--log-keep", type=_count, default=LOG_KEEP,
                       help=f"rotated logs kept, worker.log.1 the newest (default {LOG_KEEP})")
    start.add_argument("--ready-timeout", type=_positive, default=120.0,
                       help="seconds to wait for the ready file (default 120)")
    start.add_argument("--env", type=_env_pair, action="append", default=[], metavar="K=V",
                       help="extra environment for the supervisor and the worker (repeatable)")
    start.add_argument("--restart", action="store_true", help="restart even when ARGV is unchanged")
    for cmd in ("stop", "status"):
        sub.add_parser(cmd).add_argument("--state-dir", required=True)
    return parser


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


def main(args: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if args is None else args)
    argv: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, argv = args[:cut], args[cut + 1:]
    try:
        ns = build_parser().parse_args(args)
        if ns.command in ("start", "run") and not argv:
            raise UsageError(f"python -m layerline.supervise {ns.command}: no command given: put it after --, "
                             "e.g. -- python -m layerline.worker ...")
        if ns.command not in ("start", "run") and argv:
            raise UsageError(f"python -m layerline.supervise {ns.command}: takes no command after --")
    except UsageError as exc:
        emit({"changed": False, "state": "failed", "msg": str(exc), "log_tail": []})
        return 2
    paths = Paths(ns.state_dir)
    if ns.command == "run":
        supervisor = Supervisor(paths, ns.name or os.path.basename(paths.state_dir), argv,
                                ready_file_of(argv, ns.ready_file, paths), ns.max_restarts,
                                ns.log_max_bytes, ns.log_keep)
        signal.signal(signal.SIGTERM, supervisor.on_signal)
        signal.signal(signal.SIGINT, supervisor.on_signal)
        return supervisor.run()
    if ns.command == "start":
        ns.env = dict(ns.env)
        rc, out = cmd_start(paths, ns, argv)
    elif ns.command == "stop":
        rc, out = cmd_stop(paths)
    else:
        rc, out = cmd_status(paths)
    emit(out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
