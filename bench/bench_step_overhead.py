"""Where a one-worker decode step's time goes, beyond the stage's forward.

    .venv/bin/python bench/bench_step_overhead.py [--files smollm2,gemma3,demo-q8_0,demo-q4_0]
        [--new 64] [--depth 128] [--threads 2] [--rounds 2]

As bench_llamacpp.py's "local" setting (one local worker at the file's deploy defaults, batch 1,
`--depth` random ids of context, `--new` tokens, greedy), driven in this process so every decode
step's figures are at hand. Per token (means over the decode window's steps, so the parts add up;
the median over rounds), in ms:
  token     the decode window's seconds / its tokens (what `decode_tokens_per_s` inverts);
  forward   the worker's compute time for the step (its timing: the stage's forward, logits to CPU);
  hop       the step's round trip as the controller saw it, less forward: the message's encoding,
            ZeroMQ both ways, the worker's checks, KV bookkeeping and wake-ups (an answer that
            carries steps computed ahead counts once for each: its times are shared among them);
  driver    token less the round trip: the controller's engine, sampling and scheduling.
And the CPU a decoded token costs (a loaded machine scrambles wall time far more than CPU time):
  w cpu     the worker process's CPU (all its threads; its idle-priority spinners are processes
            of their own, left out), c cpu the controller process's (this one: engine, sampling,
            ZeroMQ's threads): a generate of 1 token then one of 1 + `--new` tokens, each after
            the same `--depth` prompt, on the same running worker; the difference over `--new`.
The files come from bench_llamacpp.py (its model_file); LAYERLINE_GGML_LIB in the environment
reaches the worker. No llama.cpp runs here.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "runtime"))

import bench_llamacpp as bl  # noqa: E402


def one_run(path: Path, vocab: int, a) -> dict[str, float]:
    from layerline.cost import model_cost
    from layerline.checkpoint import open_checkpoint
    from layerline.generate import Sampling, generate
    from layerline.local import local_stages, stop_local
    from layerline.pipeline import Pipeline
    import shutil
    precision = model_cost(open_checkpoint(str(path)).index).stored_precision
    rng = random.Random(0)
    ids = [rng.randrange(min(256, vocab // 2), vocab) for _ in range(a.depth)]
    import psutil
    procs, first, tmp, depth = local_stages(str(path), 1, precision, threads=a.threads)
    me = psutil.Process()

    def cpu() -> tuple[float, float]:
        w, c = psutil.Process(procs[0].pid).cpu_times(), me.cpu_times()
        return w.user + w.system, c.user + c.system
    try:
        with Pipeline(first, depth=depth, keys_dir=os.path.join(tmp, "keys", "controller"), first_key="stage0") as pipe:
            c0 = cpu()
            generate(pipe, [ids], 1, Sampling())
            c1 = cpu()
            g = generate(pipe, [ids], 1 + a.new, Sampling())
            c2 = cpu()
    finally:
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    tokens, seconds = g.decode_window
    # the window's answers, from the last back (the first one-token step may queue behind the
    # prefill); an answer carries 1 + the steps the worker computed ahead (StepResult.then)
    steps, n = [], 0
    for s in reversed(g.decode):
        if n >= tokens:
            break
        steps.append(s)
        n += 1 + (0 if s.then is None else int(s.then.shape[0]))
    fwd = sum(sum(t["s"] for t in s.timings) for s in steps) / n
    wall = sum(s.wall_s for s in steps) / n
    token = seconds / tokens
    w_cpu, c_cpu = (((c2[i] - c1[i]) - (c1[i] - c0[i])) / a.new * 1e3 for i in (0, 1))
    return {"token": token * 1e3, "forward": fwd * 1e3, "hop": (wall - fwd) * 1e3, "driver": (token - wall) * 1e3,
            "tokens_per_s": tokens / seconds, "w_cpu": w_cpu, "c_cpu": c_cpu}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="smollm2,gemma3")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--depth", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    print(f"CPU: {bl.cpu_line()}; load average {bl.load()}; "
          f"LAYERLINE_GGML_LIB={os.environ.get('LAYERLINE_GGML_LIB', '(unset: the wheel)')}", flush=True)
    files = {k: bl.model_file(k) for k in a.files.split(",") if k}
    print(f"{'file':<12} {'tokens/s':>9} {'token ms':>9} {'forward':>8} {'hop':>7} {'driver':>7} {'w cpu':>7} "
          f"{'c cpu':>7}  (ms a token)")
    for k, path in files.items():
        runs = [one_run(path, bl.vocab_size(path), a) for _ in range(a.rounds)]
        m = {f: statistics.median(r[f] for r in runs) for f in runs[0]}
        print(f"{k:<12} {m['tokens_per_s']:9.1f} {m['token']:9.2f} {m['forward']:8.2f} {m['hop']:7.2f} "
              f"{m['driver']:7.2f} {m['w_cpu']:7.2f} {m['c_cpu']:7.2f}", flush=True)
    print(f"load average now {bl.load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
