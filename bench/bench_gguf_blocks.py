"""GGUF blocks run as stored (`gguf_blocks.BlockLinear`, ggml's kernels) against the layouts layerline
has today, on decode shapes.

    .venv/bin/python bench/bench_gguf_blocks.py [--types q4_0,q4_K,...] [--rows 1,4] [--rounds 7]
        [--shapes 1536x576,576x1536,8192x2048,2048x8192] [--threads N]

For each block type, shape (out x in; shapes whose `in` is not a multiple of the type's block are
skipped) and number of rows, timed in turns (each round runs every candidate once over its own set of
copies, so a noisy spell hits all alike):
- gguf: BlockLinear over the type's blocks (made from the same random weight), repacked for ggml's
  GEMV/GEMM where it does that (q4_0, q4_K: "rp" in the table);
- bf16: torch's F.linear of the dequantized weight in bf16 (oneDNN);
- int4: layerline's int4 kernel (`cpu_kernels.linear_int4`) on the weight requantized to groups of 32.
Each candidate cycles through enough copies of its weight to pass 2x the L3 cache, so weights stream
from memory as in a model's decode step. Printed: microseconds per call, the
ratios gguf / bf16 and gguf / int4 (below 1: gguf is faster), and GB/s of the stored bytes gguf read.
A figure is the lower quartile of single calls' times over all rounds: on a machine shared with other
work a preempted call lands above it, and every candidate is measured the same way.
Machines differ: read the ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))
os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as the other benches: torch's threads sleep soon

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

STREAM_BYTES = 64 << 20  # each candidate's copies together: past a 32 MiB L3 twice


def l3_bytes() -> int:
    try:
        for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
            if (idx / "level").read_text().strip() == "3":
                s = (idx / "size").read_text().strip()
                return int(s[:-1]) << (10 if s.endswith("K") else 20) if s[-1] in "KM" else int(s)
    except OSError:
        pass
    return 32 << 20


def copies(nbytes: int, stream: int) -> int:
    return max(2, -(-stream // nbytes))


def timed(fn, x: torch.Tensor, n: int) -> list[float]:
    """Seconds of each call fn(i, x), i in range(n): one pass through the copies."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i, x)
        out.append(time.perf_counter() - t0)
    return out


def lower_quartile(v: list[float]) -> float:
    """A call's time with the machine's other work mostly out of it (calls preempted land above)."""
    return statistics.quantiles(v, n=4)[0]


def make_blocks(name: str, w: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants
    if name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        return quants.quantize(w, GGMLQuantizationType[name.upper()])
    import ctypes

    from layerline.model import gguf_blocks
    bt = gguf_blocks.BLOCK_TYPES[name]
    out = np.empty((w.shape[0], w.shape[1] // bt.block * bt.block_bytes), dtype=np.uint8)
    getattr(gguf_blocks._S.cpu, f"quantize_row_{name}_ref")(
        ctypes.c_void_p(w.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(w.size))
    return out


def main(argv=None) -> list[dict]:
    from layerline.model import cpu_kernels, gguf_blocks
    from layerline.model.quant import Int4Linear

    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(gguf_blocks.BLOCK_TYPES))
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--shapes", default="1536x576,576x1536,8192x2048,2048x8192")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if not gguf_blocks.load():
        sys.exit(f"bench_gguf_blocks: {gguf_blocks.status()}")
    int4 = cpu_kernels.ready()
    stream = max(STREAM_BYTES, 2 * l3_bytes())
    print(f"gguf: {gguf_blocks.status()}; layerline kernels: {cpu_kernels.status()}; "
          f"threads {torch.get_num_threads()}; weights streamed over {stream >> 20} MiB a candidate")
    print(f"{'type':5} {'shape':>10} {'rows':>4} {'gguf us':>8} {'bf16 us':>8} {'int4 us':>8} "
          f"{'gguf/bf16':>9} {'gguf/int4':>9} {'GB/s':>6} rp")
    rng = np.random.default_rng(0)
    results = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    for name in a.types.split(","):
        bt = gguf_blocks.block_type(name)
        for n, k in shapes:
            if k % bt.block:
                continue
            w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
            raw = torch.from_numpy(make_blocks(bt.name, w))
            gl = [gguf_blocks.BlockLinear(raw.clone(), bt.id, n, k)
                  for _ in range(copies(raw.numel(), stream))]
            wd = gl[0].dequantize()
            wb = [wd.to(torch.bfloat16) for _ in range(copies(wd.numel() * 2, stream))]
            cands = {"gguf": lambda i, x: gl[i % len(gl)](x),
                     "bf16": lambda i, x: F.linear(x, wb[i % len(wb)])}
            if int4:
                codes, sz = Int4Linear.pack(wd, torch.bfloat16)
                q4 = [(codes.clone(), sz.clone()) for _ in range(copies(codes.numel() + sz.numel() * 2, stream))]
                cands["int4"] = lambda i, x: cpu_kernels.linear_int4(x, *q4[i % len(q4)])
            for rows in (int(r) for r in a.rows.split(",")):
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                reps = {c: 2 * len(gl if c == "gguf" else wb if c == "bf16" else q4) for c in cands}
                t: dict[str, list[float]] = {c: [] for c in cands}
                for c, fn in cands.items():  # warm up: build, page in
                    timed(fn, x, reps[c])
                for _ in range(a.rounds):
                    for c, fn in cands.items():
                        t[c] += timed(fn, x, reps[c])
                med = {c: lower_quartile(v) for c, v in t.items()}
                r = {"type": bt.name, "out": n, "in": k, "rows": rows, **{f"{c}_us": med[c] * 1e6 for c in med},
                     "gguf_over_bf16": med["gguf"] / med["bf16"],
                     "gguf_over_int4": med["gguf"] / med["int4"] if "int4" in med else None,
                     "gguf_gb_s": raw.numel() / med["gguf"] / 1e9}
                results.append(r)
                i4 = f"{r['int4_us']:8.1f}" if "int4" in med else f"{'-':>8}"
                r4 = f"{r['gguf_over_int4']:9.2f}" if "int4" in med else f"{'-':>9}"
                print(f"{bt.name:5} {f'{n}x{k}':>10} {rows:>4} {r['gguf_us']:8.1f} {r['bf16_us']:8.1f} {i4} "
                      f"{r['gguf_over_bf16']:9.2f} {r4} {r['gguf_gb_s']:6.1f} {'rp' if gl[0].repacked else ''}",
                      flush=True)
            gl = wb = q4 = None  # let go of this shape's weights before the next one's
    return results


if __name__ == "__main__":
    main()
