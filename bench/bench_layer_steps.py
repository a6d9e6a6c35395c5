"""A stage's eager decode step through its modules against each layer's one C++ call, in turns.

    .venv/bin/python bench/bench_layer_steps.py [--files smollm2,gemma3] [--depth 128] [--new 64]
        [--threads 2] [--rounds 4]

For each file: one stage of the whole model at precision gguf in this process; each round a
`--depth`-token prefill, then `--new` greedy one-token steps timed (wall clock), once with
`Stage.decode_steps` off (`DecoderLayer.forward`, module by module) and once on (the layers'
`DecodeStack`, csrc/layer.h), in alternating order. Prints the medians (ms a token) and
modules / steps. The files come from bench_llamacpp.py (its model_file); no llama.cpp runs here.

--parts also times, in the same turns, the step's matrix products alone: each projection's kernel
called back to back on one row (each call from Python, a few microseconds), and the rate at
which they read the weights: what is left of a step beyond them is attention, norms, RoPE and
the calls' own overhead.
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


def matrix_calls(stage) -> list[tuple]:
    """The one-token step's products, as `llama.linear_calls` gives them (kind, weight, ints, bias):
    a fused or split matrix once, not its parts as well."""
    from layerline.model import llama
    mods = list(stage.modules())
    covered = {id(p) for m in mods if isinstance(m, (llama.FusedLinears, llama.SplitLinear)) for p in m.parts}
    return [c for m in mods if id(m) not in covered for c in llama.linear_calls(m) or ()]


def in_features(call) -> int:
    from layerline.model import llama
    return call[1].shape[1] if call[0] == llama.DENSE else call[2][1]  # the kernels' ints: N, K, ...


def run_call(x, call):
    """One product as csrc/layer.h's LayerLinear runs it (its kinds: gguf_blocks' layouts, llama.DENSE)."""
    import torch
    from layerline.model import gguf_blocks, llama
    kind, w, ints, bias = call
    if kind == llama.DENSE:
        return torch.nn.functional.linear(x, w, bias)
    return gguf_blocks.layout_op(kind)(x, w, *ints, bias)


def one_file(path: Path, a) -> dict:
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

    calls = matrix_calls(stage) if a.parts else []
    xs = {k: torch.randn(1, k) for k in {in_features(c) for c in calls}}

    def matrices() -> float:
        t = time.perf_counter()
        for _ in range(a.new):
            for c in calls:
                run_call(xs[in_features(c)], c)
        return (time.perf_counter() - t) / a.new

    decode()  # warm: the kernels built, the steps made
    times: dict = {False: [], True: [], "matrices": []}
    for r in range(a.rounds):
        for steps in ((False, True) if r % 2 == 0 else (True, False)):
            stage.decode_steps = steps
            times[steps].append(decode())
        if calls:
            times["matrices"].append(matrices())
    if not stage._steps:
        raise SystemExit(f"{path.name}: a layer has no DecodeLayer here (see DecoderLayer.decode_step)")
    out = {k: statistics.median(v) for k, v in times.items() if v}
    out["bytes"] = sum(c[1].numel() * c[1].element_size() for c in calls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="smollm2,gemma3")
    ap.add_argument("--depth", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--parts", action="store_true", help="also time the step's matrix products alone")
    a = ap.parse_args()
    print(f"CPU: {cpu_name()}; {a.threads} thread(s); wall ms a decoded token, median of {a.rounds} rounds")
    print(f"{'file':12} {'modules':>9} {'steps':>9} {'modules / steps':>16}"
          + (f" {'matrices':>9} {'MB':>7} {'GB/s':>6} {'rest of steps':>14}" if a.parts else ""))
    for key in a.files.split(","):
        r = one_file(bl.model_file(key), a)
        line = f"{key:12} {r[False] * 1e3:9.2f} {r[True] * 1e3:9.2f} {r[False] / r[True]:15.2f}x"
        if a.parts:
            m = r["matrices"]
            line += f" {m * 1e3:9.2f} {r['bytes'] / 1e6:7.1f} {r['bytes'] / m / 1e9:6.1f} {(r[True] - m) * 1e3:14.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
