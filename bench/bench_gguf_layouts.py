"""Precision gguf's matrices on layerline's own kernels against ggml's, in turns.

    .venv/bin/python bench/bench_gguf_layouts.py [--files smollm2,demo-q4_0] [--prompt 512]
        [--new 48] [--threads 1] [--rounds 3]

For each file: two stages of the whole model in this process, one loaded with LAYERLINE_GGUF_OWN=off
(every type through ggml's `vec_dot` or its 8-row GEMV) and one with the
default (`gguf_blocks` layouts "int4" and "x16"), then in turns each round: a `--prompt`-token prefill in chunks
of 128 and `--new` greedy decode steps. Prints the process CPU time of each (a loaded machine moves
wall time far more than CPU time), medians over rounds, and own / ggml. The files come from
bench_llamacpp.py (its model_file); no llama.cpp runs here.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))

import bench_llamacpp as bl  # noqa: E402
from bench_serve_llamacpp import cpu_name  # noqa: E402


def one_file(path: Path, a) -> dict[str, tuple[float, float]]:
    import torch
    from layerline.checkpoint import open_checkpoint
    from layerline.model.loader import load_stage
    torch.set_num_threads(a.threads)
    layers = open_checkpoint(str(path)).index.num_layers
    stages = {}
    for name, env in (("ggml", "off"), ("own", "on")):
        os.environ["LAYERLINE_GGUF_OWN"] = env  # read as each matrix is loaded
        stages[name] = load_stage(str(path), 0, layers, True, True, "gguf")
    os.environ.pop("LAYERLINE_GGUF_OWN")
    vocab = stages["ggml"].args.vocab_size
    rng = random.Random(0)
    ids = torch.tensor([[rng.randrange(min(256, vocab // 2), vocab) for _ in range(a.prompt)]])
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in stages}
    for _ in range(a.rounds):
        for name, st in stages.items():
            cache = st.new_cache(1, a.prompt + a.new)
            t = time.process_time()
            for lo in range(0, a.prompt, 128):
                out = st.forward(ids[:, lo:lo + 128], lo, cache, last_only=True)
            prefill = time.process_time() - t
            tok = out[:, -1].argmax(-1, keepdim=True)
            t = time.process_time()
            for i in range(a.new):
                tok = st.forward(tok, a.prompt + i, cache)[:, -1].argmax(-1, keepdim=True)
            times[name].append((prefill, (time.process_time() - t) / a.new))
    return {n: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v)) for n, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="smollm2,demo-q4_0")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    print(f"CPU: {cpu_name()}; {a.threads} thread(s); CPU time of this process, median of {a.rounds} rounds")
    print(f"{'file':12} {'ggml prefill':>13} {'own prefill':>13} {'ratio':>6} {'ggml decode':>12} {'own decode':>12} {'ratio':>6}")
    for key in a.files.split(","):
        r = one_file(bl.model_file(key), a)
        (gp, gd), (ip, idd) = r["ggml"], r["own"]
        print(f"{key:12} {gp:12.2f}s {ip:12.2f}s {ip / gp:6.2f} {gd * 1e3:10.1f}ms {idd * 1e3:10.1f}ms {idd / gd:6.2f}",
              flush=True)


if __name__ == "__main__":
    main()
