"""A pipeline of workers on this machine, without Ansible (`layerline generate --local-stages N`).

The split comes from the planner (this machine's probed caps, one node per stage, policy
`uniform` unless told) and each worker's command line from the same WorkerSpec the playbooks
use, so a local pipeline runs exactly what a deployed one would.
"""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from .endpoints import control_port
from .errors import LayerlineError
from .planner import Plan


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def free_ports(n: int) -> list[int]:
    """n free loopback ports, each with its +1 control port also free.

    By default the kernel's ephemeral range (bind to port 0). With LAYERLINE_PORT_RANGE=LO-HI, ports
    from that range instead: outgoing connections never take a port there, and parallel test
    processes each get a range of their own (tests/conftest.py), so none takes another's ports
    between the pick and the worker's bind."""
    rng = os.environ.get("LAYERLINE_PORT_RANGE")
    if rng:
        try:
            lo, hi = (int(x) for x in rng.split("-"))
            assert 1024 <= lo < hi <= 65534
        except (ValueError, AssertionError):
            raise LayerlineError(f"LAYERLINE_PORT_RANGE {rng!r}: must be LO-HI with 1024 <= LO < HI < 65535") from None
        span = (hi - lo) // 2
        start = random.randrange(span)
        out = []
        for k in range(span):
            p = lo + 2 * ((start + k) % span)
            if _bindable(p) and _bindable(control_port(p)):
                out.append(p)
                if len(out) == n:
                    return out
        raise LayerlineError(f"LAYERLINE_PORT_RANGE {rng}: fewer than {n} free port pairs")
    out: list[int] = []
    while len(out) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if control_port(p) > 65535 or not _bindable(control_port(p)):
            continue
        if p not in out and control_port(p) not in out and all(control_port(q) != p for q in out):
            out.append(p)
    return out


def local_keys(tmp: str, n: int | list[str]) -> str:
    """Fresh CURVE keys for local stages (n of them: stage0..; or these names) and the driver:
    tmp/keys/{store,NAME,controller} (dirs 0700, secrets 0600). Every worker needs its keys dir
    (its control socket runs CURVE always); the controller's is how a local driver or server
    speaks to their control sockets. Returns tmp/keys."""
    from . import keys
    root = os.path.join(tmp, "keys")
    names = [f"stage{i}" for i in range(n)] if isinstance(n, int) else list(n)
    keys.local_keys(root, names)
    return root


def controller_keys(tmp: str) -> str:
    """The controller's keys dir of a local pipeline started by local_stages (tmp as it returned)."""
    return os.path.join(tmp, "keys", "controller")


def local_plan(checkpoint: str, n: int, precision: str, host_vars: dict[str, dict], kv_context: int = 4096,
               policy: str = "uniform") -> Plan:
    """The planner's split of the checkpoint over n stages on this machine (hosts stage0..)."""
    from .checkpoint import open_checkpoint
    from .cost import model_cost
    from .inventory import plan_for_hosts
    from .probe import probe
    cost = model_cost(open_checkpoint(checkpoint).index)
    if not 1 <= n <= cost.num_layers:
        raise LayerlineError(f"--local-stages {n}: must be 1..{cost.num_layers} (the model's layers)")
    caps = probe(checkpoint, budget_s=0.05, measure_disk=False)  # one machine: every stage sees the same
    hv = {h: {**v, "layerline_caps": caps} for h, v in host_vars.items()}
    return plan_for_hosts(hv, cost, {"context": kv_context, "precision_ladder": [precision]}, policy)


def local_stages(checkpoint: str, n: int, precision: str, kv_context: int = 4096, threads: int | None = None,
                 curve: str = "auto", compile: str = "off", compile_cache: str | None = None,
                 ready_timeout: float | None = None, policy: str = "uniform"):
    """Start n workers on this machine; returns LocalStages (procs, first endpoint, tmpdir, the
    plan's depth: pass it to the Pipeline, as pipeline_for_plan does).

    compile: the workers' --compile mode; they compile before they are ready, so the wait for
    them is the spec's compile wait unless ready_timeout says otherwise.

    Every run makes fresh keys under tmpdir/keys (the driver's keys dir is tmpdir/keys/controller,
    controller_keys(tmpdir); stage i's name "stageI"): every socket runs CURVE, loopback included
    (curve "auto" and "on" alike).
    """
    # free_ports cannot reserve what it finds: another process may bind one of them before our
    # worker does (the worker imports torch first). Such a start is tried again on other ports.
    for attempt in range(3):
        try:
            return _start_local(checkpoint, n, precision, kv_context, threads, curve, compile, compile_cache,
                                ready_timeout, policy)
        except _PortTaken:
            if attempt == 2:
                raise LayerlineError("local stages: their ports were taken by other processes three times; "
                                     "free some loopback ports and try again") from None


class LocalStages(NamedTuple):
    procs: list
    first: str      # stage 0's data endpoint
    tmp: str        # keys, state dirs
    depth: int      # micro-batches worth keeping in flight (Plan.depth: these stages share one machine's cores)


class _PortTaken(Exception):
    pass


def _start_local(checkpoint, n, precision, kv_context, threads, curve, compile, compile_cache, ready_timeout, policy):
    from .spec import worker_spec
    ports = free_ports(n)
    tmp = tempfile.mkdtemp(prefix="layerline-local-")
    keys_root = local_keys(tmp, n)
    host_vars = {}
    for i in range(n):
        v = {"ansible_connection": "local", "layerline_port": ports[i], "layerline_checkpoint": checkpoint,
             "layerline_state_dir": os.path.join(tmp, f"stage{i}"), "layerline_compile": compile,
             "layerline_curve": curve}
        if threads:
            v["layerline_threads"] = threads
        v["layerline_keys_dir"] = os.path.join(keys_root, f"stage{i}")
        if compile_cache:
            v["layerline_compile_cache"] = compile_cache
        if ready_timeout:
            v["layerline_worker_ready_timeout"] = ready_timeout
        host_vars[f"stage{i}"] = v
    plan = local_plan(checkpoint, n, precision, host_vars, kv_context, policy)
    procs, specs = [], []
    try:
        for st in plan.stages:
            spec = worker_spec(plan, st.host, host_vars[st.host], python=sys.executable)
            argv = list(spec.argv)
            os.makedirs(spec.state_dir, mode=0o700, exist_ok=True)
            with open(os.path.join(spec.state_dir, "worker.log"), "w") as log:
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            specs.append(spec)
        deadline = time.time() + max(s.ready_timeout for s in specs)
        for p, spec in zip(procs, specs):
            while not os.path.exists(spec.ready_file):
                if p.poll() is not None or time.time() > deadline:
                    log = open(os.path.join(spec.state_dir, "worker.log")).read()[-2000:].strip()
                    if "Address already in use" in log:
                        raise _PortTaken()
                    raise LayerlineError(f"local stage {spec.host} did not start: "
                                         f"{log.splitlines()[-1] if log else 'no output'}")
                time.sleep(0.05)
    except BaseException as e:
        stop_local(procs)
        # keys (secrets) never outlive the start; a failed stage's log stays for the user to read
        shutil.rmtree(tmp if isinstance(e, _PortTaken) else os.path.join(tmp, "keys"), ignore_errors=True)
        raise
    return LocalStages(procs, plan.actives[0].endpoint, tmp, plan.depth)


def stop_local(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def local_server(args: list[str], log_dir: str, timeout_s: float = 180.0,
                 env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m layerline.server ARGS --port P` on loopback (the benchmarks' and scripts' server over
    local stages), its stderr in LOG_DIR/server.err. Returns (process, url) once /health answers 200;
    else stops it and raises LayerlineError with the end of its stderr."""
    import urllib.request
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    err_path = os.path.join(log_dir, "server.err")
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "layerline.server", *args, "--port", str(port)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
    deadline = time.time() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            stop_server(proc)
            with open(err_path) as f:
                raise LayerlineError(f"layerline.server did not come up within {timeout_s:.0f} s: {f.read()[-2000:]}")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen | None) -> None:
    """Stop a server local_server started (None, or one already gone: nothing to do)."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


@contextmanager
def served_stages(checkpoint: str, n: int, precision: str, server_args: Sequence[str] = (), *,
                  model_name: str = "bench", threads: int | None = None) -> Iterator[str]:
    """N local stages and a server over them (the benchmarks' setup), as the url of the server;
    everything stopped and removed on exit. SERVER_ARGS go to layerline.server after the wiring."""
    procs, first, tmp, depth = local_stages(checkpoint, n, precision, threads=threads)
    server = None
    try:
        server, url = local_server(["--first", first, "--first-key", "stage0", "--keys", controller_keys(tmp),
                                    "--checkpoint", checkpoint, "--model-name", model_name,
                                    "--microbatches", str(depth), "--log-file", os.path.join(tmp, "server.log"),
                                    *server_args], tmp)
        yield url
    finally:
        stop_server(server)
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)
