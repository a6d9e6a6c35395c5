"""The worker's command line: argv (DESIGN.md's worker argv contract), the process's priority, main.

Torch-free at import: `python -m layerline.worker` puts the plan's OpenMP spin in the
environment (openmp_env) before anything loads torch.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from ..endpoints import control_endpoint  # noqa: F401 - data port + 1, decided once (sockets and the package import it from here)
from ..errors import LayerlineError
from ..model import COMPILE_MODES

def openmp_env(argv: list[str]) -> None:
    """Put the plan's OpenMP spin (--spin N, GOMP_SPINCOUNT) in the environment, else a short
    one: idle stages that share a machine's cores must sleep, not spin on cores a busy one needs.
    libgomp reads the variable once, when `import torch` loads it, so `python -m layerline.worker`
    calls this before its first torch import; set later, it has no effect. Only a well-formed
    value is taken here; parse_args rejects the others."""
    spin = None
    for i, a in enumerate(argv):
        if a == "--spin" and i + 1 < len(argv):
            spin = argv[i + 1]
        elif a.startswith("--spin="):
            spin = a.split("=", 1)[1]
    if spin is not None and spin.isdigit():
        os.environ["GOMP_SPINCOUNT"] = spin
    else:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m layerline.worker",
                                description="The stage process: holds a layer range, takes activations in, "
                                            "sends activations on.")
    p.add_argument("--probe", action="store_true", help="print this host's NodeCaps as JSON and exit")
    p.add_argument("--checkpoint")
    p.add_argument("--layers", help="A:B, half-open")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--kv-context", type=int, default=4096)
    p.add_argument("--kv-dtype", default=None)
    p.add_argument("--rng-seed", type=int, default=0)
    p.add_argument("--bind")
    p.add_argument("--next", default=None)
    p.add_argument("--first", action="store_true")
    p.add_argument("--last", action="store_true")
    p.add_argument("--keys", default=None,
                   help="dir with this host's CURVE keys (required: the control socket always runs CURVE)")
    p.add_argument("--next-key", default=None,
                   help="the next stage's public key: its host name in KEYS/peers/, a .key file or z85 text")
    p.add_argument("--curve", default="auto", choices=["auto", "on"],
                   help="kept for existing command lines: both values run CURVE on every socket, loopback included")
    p.add_argument("--name", default=None, help="name reported in timings and errors")
    p.add_argument("--ready-file", default=None)
    p.add_argument("--control", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (the plan's stage threads)")
    p.add_argument("--spin", type=int, default=None,
                   help="OpenMP spin count before an idle thread sleeps (GOMP_SPINCOUNT); low when stages "
                        "share a machine's cores")
    p.add_argument("--awake-ms", type=int, default=None,
                   help="after each message, keep this worker's CPUs from idling this long with idle-priority "
                        "spinners (layerline.awake; 0: off; default 50)")
    p.add_argument("--time-alone", default=None, metavar="LOCK",
                   help="this stage shares the machine's cores with other stages: load and compile holding "
                        "the lock LOCK shared, time the step holding it alone (layerline.timing_lock; a bare "
                        "file name is in /dev/shm; the plan names one per deployment)")
    p.add_argument("--cores", type=int, default=None,
                   help="with --sharing: the cores of this machine its stages share; a message computes on "
                        "its share of them while others are in flight (planner.message_threads)")
    p.add_argument("--sharing", type=int, default=None,
                   help="with --cores: the stages that share those cores, this one included")
    p.add_argument("--nice", type=int, default=None,
                   help="yield the CPU to the machine's other work: nice value 1-19 for this worker and its "
                        "session's scheduling group (layerline_nice)")
    p.add_argument("--compile", default="off", choices=COMPILE_MODES,
                   help="torch.compile the decode step (warm-up before ready: about half a minute for "
                        "default, minutes for max-autotune; cached under --compile-cache)")
    p.add_argument("--compile-cache", default=None, help="inductor's cache dir (TORCHINDUCTOR_CACHE_DIR)")
    p.add_argument("--kv-bytes", type=int, default=None,
                   help="KV bytes this stage may hold across sequences (the plan's kv_bytes)")
    p.add_argument("--expert-cache-bytes", type=int, default=None,
                   help="page routed experts from disk through an LRU cache of this many bytes")
    p.add_argument("--layerline-version", default=None, metavar="V",
                   help="the controller's layerline version (layerline.version.full()): a worker on other code "
                        "refuses to start; in the argv, so a worker restarts when the controller's code changes")
    a = p.parse_args(argv)
    if a.probe:
        return a
    missing = [f"--{k}" for k in ("checkpoint", "layers", "bind") if not getattr(a, k)]
    if missing:
        p.error(f"missing {', '.join(missing)}")
    if not a.last and not a.next:
        p.error("--next is required unless --last")
    try:
        s, e = (int(x) for x in a.layers.split(":"))
        assert 0 <= s < e
    except (ValueError, AssertionError):
        p.error(f"--layers {a.layers!r}: must be A:B with 0 <= A < B")
    a.start, a.end = s, e
    if a.kv_context < 1:
        p.error("--kv-context must be positive")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be at least 1")
    if (a.cores is None) != (a.sharing is None):
        p.error("--cores and --sharing go together: give both or neither")
    if a.cores is not None and not (1 <= a.cores <= 4096 and 1 <= a.sharing <= 4096):
        p.error("--cores and --sharing must be 1-4096")
    if a.spin is not None and a.spin < 0:
        p.error("--spin must not be negative")
    if a.awake_ms is not None and not 0 <= a.awake_ms <= 1000:
        p.error("--awake-ms must be 0-1000")
    if a.time_alone is not None and not a.time_alone.strip("/"):
        p.error("--time-alone needs a lock file name or path")
    if a.nice is not None and not 0 <= a.nice <= 19:
        p.error("--nice must be 0-19 (a worker may only lower its priority)")
    for flag in ("kv_bytes", "expert_cache_bytes"):
        if getattr(a, flag) is not None and getattr(a, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must not be negative")
    from ..wire import WireError, endpoint
    try:
        endpoint(a.bind.replace("tcp://*:", "tcp://0.0.0.0:"), "--bind")
        if a.next:
            endpoint(a.next, "--next")
        if a.control:
            endpoint(a.control, "--control")
    except WireError as e:
        p.error(str(e))
    return a


def lower_priority(nice: int) -> None:
    """--nice: this process's nice value and, where the kernel groups processes by session
    (autogroup, on by default in most distributions), its session's: there a nice value ranks a
    process only within its session, and each session (the supervisor gives the worker its own)
    gets an equal share against every other. Linux keeps a nice value per thread (new threads
    inherit it), so every thread torch's import started gets it too. A priority that cannot be
    set is a warning in the worker's log, not a reason to stop serving."""
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except FileNotFoundError:  # a kernel without autogroup: the nice value is all there is
        pass
    except OSError as e:  # e.g. a higher nice value inherited (lowering it needs privilege), a read-only /proc
        print(f"layerline worker: --nice {nice} not fully applied ({e}); the worker runs at nice "
              f"{os.getpriority(os.PRIO_PROCESS, 0)}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)   # --spin took effect before torch loaded (openmp_env)
    if args.nice:
        lower_priority(args.nice)
    if getattr(args, "compile_cache", None):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.compile_cache
    try:
        if args.probe:  # layerline.probe's NodeCaps, as the probe module reports them
            from ..probe import probe
            print(json.dumps(probe(args.checkpoint, device=args.device)))
            return 0
        from .. import version
        version.refuse_other(args.layerline_version)
        from ..model import cpu_kernels
        from .serve import Worker
        w = Worker(args)

        def stop(signum, frame):
            w.running = False
        signal.signal(signal.SIGTERM, stop)
        print(f"layerline worker {w.name}: layers {args.start}:{args.end} {args.precision} on {args.device}, "
              f"decode kernels {cpu_kernels.status()}, serving {args.bind}{' (CURVE)' if w.net.curve_bind else ''}",
              flush=True)
        w.serve()
        return 0
    except LayerlineError as e:
        print(f"layerline worker: {e}", file=sys.stderr)
        return 2
