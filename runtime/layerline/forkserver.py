"""Warm starts for the test suite: `python -m layerline.worker|server|cli` run in a fork of a
process that has torch and layerline loaded already.

Each of those entry points imports torch (1.5-2 s of CPU) before it does anything, and the
suite's process tier starts about 130 of them. With LAYERLINE_FORKSERVER=DIR in its environment
(tests/conftest.py sets it there; a deployment never does) an entry point, still torch-free,
looks for a template listening in DIR whose environment equals its own but for a few variables
read later (_FREE): what torch and Python read as they load (OpenMP's spin, the locale, paths)
is then what the template loaded with. If one is there it sends
its argv, environment, working dir and standard streams; the template forks a child that runs
the same `runpy` main, and the first process stays as the child's stand-in: the pid its starter
knows, the signals it gets passed on (a SIGSTOP mirrored by the template), its exit status the
child's, the child SIGKILLed when it dies. Otherwise it starts as usual. Nothing here is
pickled: the request is JSON, the streams go as file descriptors (SCM_RIGHTS).
"""
from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import os
import selectors
import signal
import socket
import struct
import sys

ENV = "LAYERLINE_FORKSERVER"
# variables a started process reads only after this hand-over (or that only tests set): they
# need not match the template's
_FREE = ("LAYERLINE_", "PYTEST_", "TMPDIR", "TMP", "TEMP", "COLUMNS", "LINES", "SHLVL", "PWD", "OLDPWD", "_")
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
              signal.SIGCONT)
_HEADER = struct.Struct("!I")
_in_child = False   # set in a template's child: it runs the main itself


def env_key(env: dict[str, str]) -> str:
    """The template a process may start in: a hash of the environment it starts with."""
    kept = sorted((k, v) for k, v in env.items() if not any(k == f or (f.endswith("_") and k.startswith(f))
                                                             for f in _FREE))
    return hashlib.sha256(json.dumps([sys.executable, kept]).encode()).hexdigest()[:16]


def _send(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [_HEADER.pack(len(data)) + data], fds)
    else:
        sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket, nfds: int = 0) -> tuple[dict | None, list[int]]:
    buf, fds = b"", []
    while len(buf) < _HEADER.size or len(buf) < _HEADER.size + _HEADER.unpack_from(buf)[0]:
        if nfds and not fds:
            chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, nfds)
        else:
            chunk = sock.recv(1 << 16)
        if not chunk:
            return None, fds
        buf += chunk
    return json.loads(buf[_HEADER.size:]), fds


def hand_over(module: str) -> None:
    """Run `python -m MODULE` in a template's fork when LAYERLINE_FORKSERVER names a dir holding
    one for this environment, and end this process with the child's status; else return."""
    where = os.environ.get(ENV)
    if not where or _in_child or sys.orig_argv[1:3] != ["-m", module]:
        return
    key = env_key(dict(os.environ))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)   # until there is a child to pass them to
    try:
        sock.connect(os.path.join(where, key + ".sock"))
        _send(sock, {"module": module, "argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
                     "proxy": os.getpid()}, [0, 1, 2])
        reply, _ = _recv(sock)
    except (OSError, ValueError):
        reply = None
    if not reply or "pid" not in reply:
        sock.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        try:   # no template (yet) for this environment: start as usual, and say so for whoever counts
            with open(os.path.join(where, "cold-starts"), "a") as f:
                f.write(f"{module} {key} {sys.argv[1:3]}\n")
        except OSError:
            pass
        return
    child = reply["pid"]

    def forward(sig, _frame):
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass
    for sig in _FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    end, _ = _recv(sock)
    if end is None:
        print(f"{module}: the fork server in {where} went away", file=sys.stderr)
        os._exit(1)
    status = end["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


MODULES = ("layerline.worker", "layerline.server", "layerline.cli")


def _valid(req, conn: socket.socket) -> bool:
    """A request from this user, for one of the entry points, its fields of the types they must be."""
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    return (uid == os.getuid() and isinstance(req, dict) and req.get("module") in MODULES
            and isinstance(req.get("argv"), list) and all(isinstance(a, str) for a in req["argv"])
            and isinstance(req.get("env"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in req["env"].items())
            and isinstance(req.get("cwd"), str) and os.path.isdir(req["cwd"])
            and isinstance(req.get("proxy"), int))


class _Child:
    def __init__(self, pid: int, conn: socket.socket, proxy: int):
        self.pid, self.conn, self.proxy, self.stopped = pid, conn, proxy, False
        self.pidfd = os.pidfd_open(pid)


def _serve(where: str) -> dict:
    """The template's loop; returns only in a forked child, with the request it is to run."""
    from .supervise import proc_stat   # the template's alone: hand_over stays a few imports
    path = os.path.join(where, env_key(dict(os.environ)) + ".sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + f".{os.getpid()}")
    listener.listen(64)
    os.replace(path + f".{os.getpid()}", path)   # ready once the name appears
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, _Child] = {}

    def reap(c: _Child, kill: bool) -> None:
        if kill:
            try:
                os.kill(c.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(c.pid, 0)   # gone before the next start may take its port
        try:
            _send(c.conn, {"status": status})
        except OSError:
            pass
        for f in (c.conn, c.pidfd):
            sel.unregister(f)
        c.conn.close()
        os.close(c.pidfd)
        del children[c.pid]

    while True:
        events = sel.select(timeout=0.05 if children else None)
        # exits before hang-ups: a proxy that ends with its child is told nothing it needs
        for key, _ in sorted(events, key=lambda e: not isinstance(e[0].data, tuple)):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                conn.settimeout(10)
                try:
                    req, fds = _recv(conn, 3)
                except (OSError, ValueError):
                    req, fds = None, []
                if not _valid(req, conn) or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    for c in children.values():
                        c.conn.close()
                        os.close(c.pidfd)
                    sel.close()
                    listener.close()
                    conn.close()
                    for i, fd in enumerate(fds):
                        os.dup2(fd, i)
                        os.close(fd)
                    return req
                for fd in fds:
                    os.close(fd)
                conn.settimeout(None)
                print(f"fork {pid}: {req['module']} {' '.join(req['argv'][:2])}", flush=True)
                c = children[pid] = _Child(pid, conn, int(req["proxy"]))
                try:
                    _send(conn, {"pid": pid})
                except OSError:
                    pass   # the proxy is gone: its hang-up, seen next, kills the child
                sel.register(c.pidfd, selectors.EVENT_READ, ("exit", pid))
                sel.register(conn, selectors.EVENT_READ, pid)
            elif isinstance(key.data, tuple):
                if key.data[1] in children:
                    reap(children[key.data[1]], kill=False)
            elif key.data in children:
                reap(children[key.data], kill=True)   # the proxy hung up: it died
        for c in list(children.values()):   # a SIGSTOP cannot be caught: mirror the proxy's state
            stat = proc_stat(c.proxy)
            stopped = bool(stat) and stat[0] in (b"T", b"t")
            if stopped != c.stopped:
                c.stopped = stopped
                try:
                    os.kill(c.pid, signal.SIGSTOP if stopped else signal.SIGCONT)
                except ProcessLookupError:
                    pass


PRELOAD = ("torch", "layerline.worker.serve", "layerline.worker.cli", "layerline.server.app",
           "layerline.server.cli", "layerline.cli")


def main() -> None:
    """python -m layerline.forkserver DIR: load what the entry points load, then fork them."""
    import importlib
    import runpy
    import tempfile
    where = sys.argv[1]
    importlib.import_module("numpy")   # its OpenBLAS starts its threads now, and re-makes them in a fork
    threads = len(os.listdir("/proc/self/task"))
    for name in PRELOAD:
        importlib.import_module(name)
    if len(os.listdir("/proc/self/task")) != threads:
        sys.exit("layerline.forkserver: loading started threads (an OpenMP pool?); a fork would lose them")
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()   # a child's collections then skip what the template loaded, and leave its pages shared
    req = _serve(where)
    importlib.import_module(__spec__.name)._in_child = True   # this file runs as __main__
    os.setsid()   # as a start_new_session: a worker's --nice then renices no one else's group
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: die with the template
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    tempfile.tempdir = None
    sys.path[0] = req["cwd"]
    sys.argv = [sys.argv[0], *req["argv"]]
    if not hasattr(sys.modules.get(req["module"]), "__path__"):
        sys.modules.pop(req["module"], None)   # a module run as __main__ is not imported before (runpy warns)
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
