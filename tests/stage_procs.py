"""Real worker processes started straight from their argv (no planner, no Ansible), and a raw
wire client for them: what the worker tests (and bench/bench_rows.py) drive pipelines with."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

_ids = itertools.count()


def start_templates(where: str, spins=("10000", "300000", None)) -> list[subprocess.Popen]:
    """Templates for warm starts (layerline.forkserver) in the dir where, one per OpenMP spin a start
    may load torch with (libgomp reads GOMP_SPINCOUNT once): by default the worker's own, the plan's
    two, and none set (the server, the command line). Each logs its forks to template-SPIN.log."""
    procs = []
    for spin in spins:
        env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "LAYERLINE_FORKSERVER")}
        if spin:
            env["GOMP_SPINCOUNT"] = spin
        with open(os.path.join(where, f"template-{spin}.log"), "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "layerline.forkserver", str(where)], env=env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
    return procs


def stop_templates(procs: list[subprocess.Popen]) -> None:
    """SIGTERM: what they still run dies with them (PR_SET_PDEATHSIG)."""
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=30)


# control endpoint -> (the controller's keys dir, the worker's name): control sockets run CURVE
# always, so every worker these helpers start has keys, and control() here finds them
_CONTROL: dict[str, tuple[str, str]] = {}


def worker_keys(root: str, names: list[str]) -> dict[str, str]:
    """Keys dirs under root/keys for these worker names (added to any made before) and the
    controller: name -> keys dir (`controller` included)."""
    from layerline import keys
    return keys.local_keys(os.path.join(root, "keys"), names)


def register(control_endpoint: str, controller_keys: str, name: str) -> None:
    """Let control() here reach a worker started outside start_workers."""
    _CONTROL[control_endpoint] = (controller_keys, name)


def curve_dealer(endpoint: str, keys_dir: str, name: str, ctx=None):
    """A raw DEALER connected to a worker's socket (data or control) as the holder of keys_dir's
    keypair, trusting the worker whose key name is `name` (every worker socket runs CURVE)."""
    import zmq

    from layerline import keys
    hk = keys.load_host_keys(keys_dir)
    s = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    keys.connect_curve(s, hk, hk.server_key(name))
    s.connect(endpoint)
    return s


def curve_results(keys_dir: str, ctx=None):
    """A raw ROUTER result socket (a reply_to) on loopback, a CURVE server with keys_dir's keypair
    (the controller's: workers send results only to that key): (socket, its tcp:// endpoint)."""
    import zmq

    from layerline import keys
    hk = keys.load_host_keys(keys_dir)
    s = (ctx or zmq.Context.instance()).socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    keys.serve_curve(s, hk)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    return s, f"tcp://127.0.0.1:{port}"


def control_socket(endpoint: str, ctx=None, keys_dir: str | None = None, name: str | None = None):
    """A raw DEALER connected to a worker's control socket as the controller (CURVE), for
    messages control() would not send."""
    if keys_dir is None:
        keys_dir, name = _CONTROL[endpoint]
    return curve_dealer(endpoint, keys_dir, name, ctx)


def control(endpoint: str, op: str, timeout_s: float = 5.0, **fields) -> dict:
    """layerline.pipeline.control as the controller of a worker these helpers started (or registered)."""
    from layerline.pipeline import control as ctl
    keys_dir, name = _CONTROL[endpoint]
    return ctl(endpoint, op, timeout_s, keys_dir=keys_dir, peer=name, **fields)


def free_port_pairs(n: int) -> list[int]:
    """n ports p, each with p + 1 (the worker's control socket) free as well (layerline.local.free_ports:
    from this test process's own range, see tests/conftest.py)."""
    from layerline.local import free_ports
    return free_ports(n)


def start_workers(ckpt: str, splits: list[tuple[int, int]], precision: str = "fp32", kv_context: int = 128,
                  threads: int | None = 1, extra: list[str] | None = None, names: list[str] | None = None,
                  timeout: float = 180.0, first: bool = True, more_keys: list[str] = (),
                  keys_root: str | None = None) -> SimpleNamespace:
    """One `python -m layerline.worker` per [A, B) split, chained; waits for every ready file.
    The first split takes token ids (--first) unless first=False. more_keys: names of workers a
    test starts later (their keys are made now, so these workers know them as peers); keys_root:
    another start's tmp, whose keys these workers join (made there with its more_keys).

    Every worker gets its own keys dir (tmp/keys/NAME; the controller's is tmp/keys/controller,
    `keys`): control sockets always run CURVE; control() here speaks to them as the controller.

    Returns procs, data (bind endpoints), control (their control endpoints), info (ready files),
    tmp, first (stage 0's endpoint), names, keys, stop() (SIGTERM, then the exit statuses),
    pipeline(**kw) (a Pipeline into stage 0 as the controller), client() (a Client, likewise) and
    dealer(i) (a raw CURVE DEALER to stage i's data socket as the controller)."""
    tmp = tempfile.mkdtemp(prefix="layerline-stages-")
    ports = free_port_pairs(len(splits))
    data = [f"tcp://127.0.0.1:{p}" for p in ports]
    names = names or [f"stage{i}" for i in range(len(splits))]
    kd = worker_keys(keys_root or tmp, [*names, *more_keys])
    procs, ready = [], []
    try:
        for i, (a, b) in enumerate(splits):
            ready.append(os.path.join(tmp, f"ready{i}.json"))
            argv = [sys.executable, "-m", "layerline.worker", "--checkpoint", str(ckpt), "--layers", f"{a}:{b}",
                    "--precision", precision, "--kv-context", str(kv_context), "--bind", data[i],
                    "--name", names[i], "--ready-file", ready[i], "--keys", kd[names[i]], *(extra or [])]
            if threads:
                argv += ["--threads", str(threads)]
            argv += ["--first"] if i == 0 and first else []
            argv += ["--last"] if i == len(splits) - 1 else ["--next", data[i + 1], "--next-key", names[i + 1]]
            log = open(os.path.join(tmp, f"worker{i}.log"), "w")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            log.close()
        deadline = time.time() + timeout
        for i, (p, r) in enumerate(zip(procs, ready)):
            while not os.path.exists(r):
                if p.poll() is not None or time.time() > deadline:
                    text = open(os.path.join(tmp, f"worker{i}.log")).read()[-2000:]
                    raise AssertionError(f"worker {i} did not start (exit {p.poll()}): {text}")
                time.sleep(0.05)
    except BaseException:
        stop_workers(procs)
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    def stop() -> list:
        stop_workers(procs)
        shutil.rmtree(tmp, ignore_errors=True)
        return [p.returncode for p in procs]

    def control_of(endpoint: str) -> str:
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + 1}"
    info = [json.load(open(r)) for r in ready]
    for d, name in zip(data, names):
        register(control_of(d), kd["controller"], name)

    def pipeline(**kw):
        from layerline.pipeline import Pipeline
        return Pipeline(data[0], keys_dir=kd["controller"], first_key=names[0], **kw)
    return SimpleNamespace(procs=procs, data=data, control=[control_of(d) for d in data], info=info, tmp=tmp,
                           first=data[0], names=names, keys=kd["controller"], stop=stop, pipeline=pipeline,
                           client=lambda: Client(data[0], kd["controller"], names[0]),
                           dealer=lambda i=0, ctx=None: curve_dealer(data[i], kd["controller"], names[i], ctx))


def stop_workers(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Client:
    """Raw wire messages into stage 0 (a DEALER) and answers at a result socket (reply_to), the
    way a server talks to a pipeline; `send` returns the request id, `recv` (id, header, tensors).
    Both sockets run CURVE as the controller (keys_dir), as a server's do."""

    def __init__(self, first: str, keys_dir: str, first_name: str):
        import zmq

        from layerline import keys
        self.zmq = zmq
        self.ctx = zmq.Context()
        hk = keys.load_host_keys(keys_dir)
        self.auth = keys.Allowlist(self.ctx, hk.allowed)
        self.out = curve_dealer(first, keys_dir, first_name, self.ctx)
        self.res = self.ctx.socket(zmq.ROUTER)
        self.res.setsockopt(zmq.LINGER, 0)
        keys.serve_curve(self.res, hk)
        port = self.res.bind_to_random_port("tcp://127.0.0.1")
        self.reply_to = f"tcp://127.0.0.1:{port}"

    def send(self, header: dict, tensors: dict | None = None) -> str:
        from layerline import wire
        rid = header.get("id") or f"r{next(_ids)}"
        h = {"op": "forward", "id": rid, "reply_to": self.reply_to, **header}
        self.out.send_multipart(wire.encode(h, tensors), copy=False)
        return rid

    def recv(self, timeout_s: float = 60.0):
        from layerline import wire
        assert self.res.poll(timeout_s * 1000), f"no answer within {timeout_s} s"
        frames = self.res.recv_multipart(copy=False)
        h, t = wire.decode(frames[1:])
        return h.get("id"), h, t

    def call(self, header: dict, tensors: dict | None = None, timeout_s: float = 60.0):
        """send, then the answer to that request (header, tensors); other answers are dropped."""
        rid = self.send(header, tensors)
        while True:
            got, h, t = self.recv(timeout_s)
            if got == rid:
                return h, t

    def release(self, seq: str) -> None:
        from layerline import wire
        self.out.send_multipart(wire.encode({"op": "release", "seq": seq}))

    def close(self) -> None:
        self.out.close(0)
        self.res.close(0)
        self.auth.stop()
        self.ctx.term()
