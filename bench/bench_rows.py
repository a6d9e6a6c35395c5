"""Batched steps over rows of different sequences (continuous batching) vs one sequence alone.

    .venv/bin/python bench/bench_rows.py [--checkpoint DIR] [--stages 3] [--precision bf16]
        [--prompt 32] [--steps 16] [--rows 1,4,16] [--rounds 3]

Three local worker processes (real wire, real KV caches). Each sequence is prefilled with the
ordinary per-sequence messages, every one to a different length, so the rows of a step sit at
different positions. Then, taking turns (alone next to each rows figure, round by round) so a noisy spell hits
every figure alike:
- alone: one sequence, one token per message (the per-sequence decode step);
- rows R: R sequences, one `rows` message per step, one new token for each.
Printed: tokens/s of each (best of its rounds) and its ratio to `alone`, measured in this run.
Absolute times on shared machines are noisy; the ratios are what to read.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # stage_procs: workers from their argv, a raw wire client
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import torch  # noqa: E402


def splits(n_layers: int, n: int) -> list[tuple[int, int]]:
    b = [round(i * n_layers / n) for i in range(n + 1)]
    return list(zip(b, b[1:]))


def main(argv=None) -> dict:
    from layerline.checkpoint import read_index, write_demo_checkpoint
    from stage_procs import start_workers

    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(ROOT / ".cache" / "demo-llama"),
                    help="a checkpoint dir (made as the default demo model when missing)")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--prompt", type=int, default=32, help="the longest prompt; the others are shorter")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="--threads of each worker")
    a = ap.parse_args(argv)
    if not os.path.exists(os.path.join(a.checkpoint, "config.json")):
        write_demo_checkpoint(a.checkpoint)
    index = read_index(a.checkpoint)
    vocab = index.config["vocab_size"]
    sizes = sorted({int(r) for r in a.rows.split(",")})
    most = max(sizes)
    reserve = a.prompt + len(sizes) * (a.steps + 1) * a.rounds + len(sizes) + 4  # r0, alone: every figure
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (1, max(1, a.prompt - 3 * i % a.prompt)), generator=g).tolist()[0]
               for i in range(most + 1)]
    extra = ["--kv-bytes", str(2**34)]
    w = start_workers(a.checkpoint, splits(index.num_layers, a.stages), a.precision,
                      kv_context=max(reserve, 64), threads=a.threads, extra=extra)
    c = w.client()
    try:
        state = {}  # seq -> [position, last token]

        def prefill(seq: str, prompt: list[int]) -> None:
            h, t = c.call({"seq": seq, "pos": 0, "cache": True, "reserve": reserve, "logits": "last"},
                          {"input_ids": torch.tensor([prompt])})
            assert h["op"] == "result", h.get("error")
            state[seq] = [len(prompt), int(t["logits"][0, -1].argmax())]

        def alone(seq: str, steps: int) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                pos, tok = state[seq]
                h, t = c.call({"seq": seq, "pos": pos, "cache": True, "logits": "last"},
                              {"input_ids": torch.tensor([[tok]])})
                assert h["op"] == "result", h.get("error")
                state[seq] = [pos + 1, int(t["logits"][0, -1].argmax())]
            return steps / (time.perf_counter() - t0)

        def rows(seqs: list[str], steps: int) -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                h, t = c.call({"rows": [[s, state[s][0]] for s in seqs], "cache": True, "logits": "last"},
                              {"input_ids": torch.tensor([[state[s][1]] for s in seqs])})
                assert h["op"] == "result", h.get("error")
                for i, s in enumerate(seqs):
                    state[s] = [state[s][0] + 1, int(t["logits"][i, -1].argmax())]
            return len(seqs) * steps / (time.perf_counter() - t0)

        prefill("alone", prompts[0])
        for i in range(most):
            prefill(f"r{i}", prompts[i + 1])
        # warm: connections, allocations, every batch size once
        alone("alone", 2)
        for r in sizes:
            rows([f"r{i}" for i in range(r)], 1)
        best = {"alone": 0.0, **{r: 0.0 for r in sizes}}
        for _ in range(a.rounds):
            for r in sizes:  # alone measured next to each rows figure: its best meets the same spells
                seqs = [f"r{i}" for i in range(r)]
                # one untimed step first: the first step after another shape pays for new matmul plans
                alone("alone", 1)
                best["alone"] = max(best["alone"], alone("alone", a.steps))
                rows(seqs, 1)
                best[r] = max(best[r], rows(seqs, a.steps))
    finally:
        c.close()
        w.stop()
    print(f"rows benchmark: {a.checkpoint}, {a.precision}, {a.stages} local stages, prompts up to {a.prompt}, "
          f"{a.steps} steps x {a.rounds} rounds, {torch.get_num_threads()} threads here", flush=True)
    print(f"alone (one sequence, one token per message): {best['alone']:.1f} tokens/s")
    out = {"alone_tok_s": best["alone"]}
    for r in sizes:
        ratio = best[r] / best["alone"]
        out[f"rows{r}_tok_s"], out[f"rows{r}_ratio"] = best[r], ratio
        print(f"rows {r:>2} (one message, {r} sequences at their own positions): {best[r]:.1f} tokens/s "
              f"= {ratio:.2f}x alone", flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
