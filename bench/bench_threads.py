"""Threads per stage when stages share a machine, as ratios measured in the same run.

    .venv/bin/python bench/bench_threads.py [--checkpoint PATH ...] [--precision bf16] [--new 32]

Three local worker processes (the planner's plan for three hosts on this machine) hold each
checkpoint twice: once with the plan's default, every stage on all the machine's cores (they
take turns on a token), once with `layerline_threads: 1` (the plan then keeps as many
micro-batches in flight as the cores hold). Both pipelines stay up and the runs take turns,
round by round, so a busy spell hits both alike; each figure is the best of --rounds. Printed per
checkpoint: decode tokens/s of one sequence and of four together, and 1-thread / all-cores.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def default_checkpoints() -> list[str]:
    """The packaged SmolLM2 GGUF (where `make demo` put it) and the 246M demo-llama, as far as present."""
    cache = ROOT / ".cache"
    found = sorted(str(p) for p in cache.glob("SmolLM2-*.gguf")) + \
        [str(cache / "demo-llama")] * (cache / "demo-llama").is_dir()
    if not found:
        sys.exit(f"no checkpoint in {cache}: run `make demo` (SmolLM2) or bench/bench_decode.py (demo-llama) "
                 "first, or pass --checkpoint")
    return found


def measure(ckpt: str, precision: str, new: int, rounds: int) -> dict[tuple[str, int], float]:
    from bench_decode import decode_in_turns
    prompt = [(11 * j + 5) % 400 + 3 for j in range(32)]
    setups = {"all cores": (3, {}), "1 thread": (3, {"threads": 1})}
    return decode_in_turns(ckpt, precision, setups, [(s, q) for s in setups for q in (1, 4)], prompt, new, rounds)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", action="append", help="a safetensors dir or GGUF file (repeatable)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    import torch
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, {a.precision}, {a.new} new tokens, "
          f"best of {a.rounds} rounds", flush=True)
    out = {}
    for ckpt in a.checkpoint or default_checkpoints():
        t = measure(ckpt, a.precision, a.new, a.rounds)
        print(f"{Path(ckpt).name}: three local stages", flush=True)
        for seqs in (1, 4):
            one, every = t["1 thread", seqs], t["all cores", seqs]
            print(f"  {seqs} sequence(s): 1 thread {one:.1f} vs all cores {every:.1f} tokens/s = "
                  f"{one / every:.2f}x", flush=True)
        out[ckpt] = t
    return out


if __name__ == "__main__":
    main()
