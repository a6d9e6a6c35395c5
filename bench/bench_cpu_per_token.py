"""CPU time a decoded token costs, llama.cpp beside one layerline worker, on one thread each.

    .venv/bin/python bench/bench_cpu_per_token.py [--files smollm2,gemma3,demo-q8_0,demo-q4_0]
        [--rounds 2] [--depth 128] [--short 16] [--long 80] [--ggml-lib DIR] [--llama-only]
        [--llama-args="--repack 0"]

Wall-clock tokens/s on a machine other work loads (a shared 2-core VM) move by 2-10x from one
run to the next; the CPU time the processes consume does not count the time they wait for a core.
Each side runs with one thread (llama-bench -t 1; layerline generate --threads 1), once with
`--short` and once with `--long` new tokens after the same `--depth` tokens of context, and the
difference of the CPU time (user + system of the process and all it started, read from /proc;
layerline's idle-priority spinners left out) over the difference of the tokens is the CPU a
decoded token costs: start-up, loading and the context's prefill are in both runs and drop out.
For layerline the part of it in the controller process (`layerline generate`: the engine,
sampling, its end of the wire) is printed too; the rest is the worker's. Memory stalls count as CPU; a busy machine's shared caches
and memory bus still slow both sides. --ggml-lib: LAYERLINE_GGML_LIB for a second layerline run.
Files and tools from bench_llamacpp.py / llamacpp.py (built there first).

Caveat, measured on a loaded 2-core VM: a layerline run's start-up (the worker's probe and
warm-up timing) moved by seconds of CPU between runs, so its per-token figure came out 8 to
54 ms for the same file; bench_step_overhead.py measures the worker's CPU a token on a running
worker instead, and is the figure to use. llama.cpp's start-up is steady (two runs within 10%).
--llama-only skips layerline; --llama-args adds llama-bench arguments (e.g. "--repack 0": ggml's
plain vec_dot, the kernels layerline calls, instead of its AMX or repacked buffers).
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_llamacpp as bl  # noqa: E402
import llamacpp  # noqa: E402

POLL_S = 0.05


def cpu_of(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """CPU seconds (user + sys) of cmd and the processes it starts, less layerline's idle-priority
    spinners (layerline.awake: they take only time no one else wants, and would count it all):
    every process of the tree is read from /proc every POLL_S while the command runs, each one's
    last reading summed (what a process spends after its last reading, in its last POLL_S, is
    missed; it is the same in a short and a long run: shutting down). (all, cmd's own process alone)."""
    import psutil
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True)
    seen: dict[int, float] = {}
    try:
        root = psutil.Process(p.pid)
        while p.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for q in procs:
                try:
                    if any(a.endswith("awake.py") for a in q.cmdline()):
                        continue
                    t = q.cpu_times()
                    seen[q.pid] = t.user + t.system
                except psutil.Error:
                    pass
            time.sleep(POLL_S)
    except BaseException:
        llamacpp.stop(p)
        raise
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    if p.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited {p.returncode}: {err.strip().splitlines()[-1:]}")
    return sum(seen.values()), seen.get(p.pid, 0.0)


def llama_cmd(path: Path, new: int, depth: int, ub1: bool) -> list[str]:
    cmd = [str(llamacpp.binary("llama-bench")), "-m", str(path), "-p", "0", "-n", str(new), "-d", str(depth),
           "-t", "1", "-r", "1", "-o", "json"]
    return cmd + (["-ub", "1"] if ub1 else [])


def layerline_cmd(path: Path, new: int, ids: str) -> list[str]:
    return [sys.executable, "-m", "layerline.cli", "generate", "--checkpoint", str(path), "--local-stages", "1",
            "--input-ids", ids, "--max-new-tokens", str(new), "--ignore-eos", "--threads", "1", "--json"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="smollm2,gemma3,demo-q8_0,demo-q4_0")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--depth", type=int, default=128)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=80)
    ap.add_argument("--ggml-lib", default=None)
    ap.add_argument("--llama-only", action="store_true")
    ap.add_argument("--llama-args", default="", help="more llama-bench arguments, one string")
    a = ap.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):  # unwind as Ctrl-C: the run in progress is stopped
        signal.signal(sig, bl._interrupted)
    print(f"CPU: {bl.cpu_line()}; load average {bl.load()}", flush=True)
    llamacpp.build()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "runtime"), os.environ.get("PYTHONPATH")])))
    env.pop("LAYERLINE_GGML_LIB", None)
    env["LAYERLINE_GGML_NATIVE"] = "off"  # the wheel's ggml, not a `layerline build-ggml` one
    sides = {"llama.cpp": None} if a.llama_only else {"llama.cpp": None, "layerline": env}
    if a.ggml_lib and not a.llama_only:
        sides["native"] = dict(env, LAYERLINE_GGML_LIB=a.ggml_lib)
    n = a.long - a.short
    own: dict[str, list[float]] = {s: [] for s in sides}  # the layerline controller's share
    print(f"ms of CPU a decoded token, 1 thread, {a.depth} tokens of context ({a.long} - {a.short} tokens)", flush=True)
    for k in [x for x in a.files.split(",") if x]:
        path = bl.model_file(k)
        vocab = bl.vocab_size(path)
        rng = random.Random(0)
        ids = ",".join(str(rng.randrange(min(256, vocab // 2), vocab)) for _ in range(a.depth))
        ub1 = False
        res: dict[str, list[float]] = {s: [] for s in sides}
        for _ in range(a.rounds):
            for side, e in sides.items():
                def run(new: int) -> tuple[float, float]:
                    nonlocal ub1
                    if e is None:
                        try:
                            return cpu_of(llama_cmd(path, new, a.depth, ub1) + a.llama_args.split())
                        except RuntimeError:
                            if ub1:
                                raise
                            ub1 = True  # as bench_llamacpp: its AMX prefill crashes on some VMs
                            return cpu_of(llama_cmd(path, new, a.depth, ub1) + a.llama_args.split())
                    return cpu_of(layerline_cmd(path, new, ids), e)
                (long_all, long_own), (short_all, short_own) = run(a.long), run(a.short)
                res[side].append((long_all - short_all) / n * 1e3)
                own[side].append((long_own - short_own) / n * 1e3)
        base = statistics.median(res["llama.cpp"])
        print(f"{k:<10} " + "  ".join(f"{s} {statistics.median(v):.2f} ({', '.join(f'{x:.2f}' for x in v)})"
                                       + ("" if s == "llama.cpp" else f" = {statistics.median(v) / base:.2f}x"
                                          f" (controller {statistics.median(own[s]):.2f})")
                                       for s, v in res.items())
              + (" [llama-bench -ub 1]" if ub1 else ""), flush=True)
    print(f"load average now {bl.load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
