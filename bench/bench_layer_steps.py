"""A stage's eager decode step through its modules against each layer's one C++ call, in turns.

    .venv/bin/python bench/bench_layer_steps.py [--files smollm2,gemma3] [--depth 128] [--new 64]
        [--threads 2] [--rounds 4]

For each file: one stage of the whole model at precision gguf in this process; each round a
`--depth`-token prefill, then `--new` greedy one-token steps timed (wall clock), once with
`Stage.decode_steps` off (`DecoderLayer.forward`, module by module) and once on (each layer's
`DecodeLayer`, csrc/layer.h), in alternating order. Prints the medians (ms a token) and
modules / steps. The files come from bench_llamacpp.py (its model_file); no llama.cpp runs here.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "runtime"))

import bench_llamacpp as bl  # noqa: E402
from bench_serve_llamacpp import cpu_name  # noqa: E402


def one_file(path: Path, a) -> dict[bool, float]:
    import torch
    from layerline.checkpoint import open_checkpoint
    from layerline.model.loader import load_stage
    torch.set_num_threads(a.threads)
    stage = load_stage(str(path), 0, open_checkpoint(str(path)).index.num_layers, True, True, "gguf")
    rng = random.Random(0)
    ids = torch.tensor([[rng.randrange(256, stage.args.vocab_size) for _ in range(a.depth)]])

    def decode() -> float:
        cache = stage.new_cache(1, a.depth + a.new + 1)
        tok = stage.forward(ids, 0, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for i in range(a.new):
            tok = stage.forward(tok, a.depth + i, cache)[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - t) / a.new

    decode()  # warm: the kernels built, the steps made
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(a.rounds):
        for steps in ((False, True) if r % 2 == 0 else (True, False)):
            stage.decode_steps = steps
            times[steps].append(decode())
    if not stage._steps:
        raise SystemExit(f"{path.name}: a layer has no DecodeLayer here (see DecoderLayer.decode_step)")
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="smollm2,gemma3")
    ap.add_argument("--depth", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    print(f"CPU: {cpu_name()}; {a.threads} thread(s); wall ms a decoded token, median of {a.rounds} rounds")
    print(f"{'file':12} {'modules':>9} {'steps':>9} {'modules / steps':>16}")
    for key in a.files.split(","):
        r = one_file(bl.model_file(key), a)
        print(f"{key:12} {r[False] * 1e3:9.2f} {r[True] * 1e3:9.2f} {r[False] / r[True]:15.2f}x", flush=True)


if __name__ == "__main__":
    main()
