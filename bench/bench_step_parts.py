"""What a served token's parts cost in one process: a prompt chunk, a rows step, and both as one forward.

    .venv/bin/python bench/bench_step_parts.py [--gguf FILE] [--threads 1] [--chunk 32] [--rows 4,8]
        [--rounds 2]

The whole model as one stage at the file's own bits (precision gguf), on `--threads` threads: a
`--chunk`-token prompt chunk at position 64 of its sequence (last position's logits only, as the
engine asks), a rows step of R sequences each at position 100 of its own cache, and one forward of
chunk + R tokens of one sequence, the linear layers' share of a message that would carry both (its
attention is one sequence's, not R + 1). Each the median of 7. It prints each, the chunk's ms a token
and the rows' ms a row, and the ratio of the one forward to the chunk and rows computed apart: what a
mixed message could save at most (docs/serving.md, "Where a served token's time goes"). The CPU is
named: figures move with it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "runtime"))

from bench_serve_llamacpp import cpu_name  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", default=None, help="default: the packaged SmolLM2-135M-Instruct Q4_1 file")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--rows", default="4,8")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    import torch

    from layerline.checkpoint import open_checkpoint
    from layerline.cli import packaged_smollm2
    from layerline.model.loader import load_stage
    torch.set_num_threads(a.threads)
    path = str(a.gguf or packaged_smollm2())
    ck = open_checkpoint(path)
    stage = load_stage(path, 0, ck.index.num_layers, True, True, "gguf")
    vocab = int(ck.index.config.get("vocab_size") or 32000)
    rows = [int(r) for r in a.rows.split(",")]
    g = torch.Generator().manual_seed(0)

    def ids(*shape: int) -> torch.Tensor:
        return torch.randint(100, vocab - 100, shape, generator=g)

    def prefilled(n: int):
        c = stage.new_cache(1, 512)
        stage(ids(1, n), start_pos=0, cache=c, last_only=True)
        return c

    seqs = [prefilled(100) for _ in range(max(rows))]

    def chunk(t: int) -> float:
        c = prefilled(64)
        t0 = time.perf_counter()
        stage(ids(1, t), start_pos=64, cache=c, last_only=True)
        return time.perf_counter() - t0

    def step(r: int) -> float:
        t0 = time.perf_counter()
        stage.forward_rows(ids(r, 1), [c.length for c in seqs[:r]], seqs[:r])
        dt = time.perf_counter() - t0
        for c in seqs[:r]:
            c.length -= 1  # the same position again next time
        return dt

    def ms(f, arg: int) -> float:
        return sorted(f(arg) for _ in range(7))[3] * 1e3

    print(f"CPU: {cpu_name()}; {Path(path).name}; {a.threads} thread(s); medians of 7, ms")
    for k in range(a.rounds):
        c = ms(chunk, a.chunk)
        line = [f"round {k + 1}: chunk {a.chunk} {c:.1f} ({c / a.chunk:.2f} a token)"]
        for r in rows:
            s, one = ms(step, r), ms(chunk, a.chunk + r)
            line.append(f"rows {r} {s:.1f} ({s / r:.2f} a row), one {a.chunk + r}-token forward {one:.1f} = "
                        f"{one / (c + s):.2f}x apart")
        print("; ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
