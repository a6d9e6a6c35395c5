"""Variants of the decode kernels (the C++ in `runtime/layerline/model/csrc/`) against each other, in
one process, taking turns: a kernel change of 5-10% is lost in a machine's drift between separate
runs, not between calls milliseconds apart.

Each VARIANT is NAME=PATH, PATH a copy of the csrc/ directory with its files changed; each is built
under its own op namespace (torch.ops.llv_NAME), so all load into one process. NAME=torch times
torch's own kernel for the same product instead (`F.linear`, `_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu` on torch's int4 packing), the path a host without the kernels takes. Every round times
each variant (in shuffled order) over the demo model's decode matrices (--model smollm2: SmolLM2's) at 1, 4 and 8 rows of x,
best of 3 passes; the table gives each variant's median time and its median ratio to the first
variant over the rounds. docs/kernels.md keeps the results that shaped the kernels.

    cp -r runtime/layerline/model/csrc /tmp/v   # then edit /tmp/v's files
    .venv/bin/python bench/bench_kernel_variants.py bf16 main=runtime/layerline/model/csrc v=/tmp/v
    .venv/bin/python bench/bench_kernel_variants.py int4 torch=torch main=runtime/layerline/model/csrc
    .venv/bin/python bench/bench_kernel_variants.py int4 --isa avx2 --model smollm2 main=runtime/layerline/model/csrc v=/tmp/v
    .venv/bin/python bench/bench_kernel_variants.py x16 --type q6_K main=runtime/layerline/model/csrc v=/tmp/v
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from layerline.model import cpu_kernels, quant  # noqa: E402

# x16: GGUF type -> (its id, weights a block, bytes a block, offsets of its fp16 scales in a block)
X16_TYPES = {"q4_0": (2, 32, 18, (0,)), "q4_1": (3, 32, 20, (0, 2)), "q5_0": (6, 32, 22, (0,)),
             "q5_1": (7, 32, 24, (0, 2)), "q8_0": (8, 32, 34, (0,)), "q4_K": (12, 256, 144, (0, 2)),
             "q5_K": (13, 256, 176, (0, 2)), "q6_K": (14, 256, 210, (208,))}
# the demo model's one-token step: 16 layers of fused qkv, o, fused gate/up and down, then the head
DEMO_SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 16 + [(32000, 1024)]
# SmolLM2-135M's 30 layers (its file's Q4_1 matrices; the Q8_0 head is not one): rows 576 wide are 18
# groups of 32, which end int4's tiles (4 groups a step) with a half step
SHAPES = {"demo": DEMO_SHAPES, "smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30}


def sources_of(name: str, path: Path) -> dict[str, str]:
    """The C++ files of a copy of csrc/, their op namespace renamed to llv_NAME."""
    if not path.is_dir():
        raise SystemExit(f"{name}={path}: not a directory; give a copy of runtime/layerline/model/csrc")
    try:
        srcs = cpu_kernels.sources(path)
    except (OSError, RuntimeError, UnicodeDecodeError) as e:
        raise SystemExit(f"{name}={path}: {e}") from None
    return {f: text.replace("layerline_cpu", f"llv_{name}") for f, text in srcs.items()}


def load_variant(name: str, path: Path, build_dir: Path, isa: str = "avx512-bf16"):
    """torch.ops.llv_NAME: the variant's sources built under that namespace and loaded, on `isa`'s kernels."""
    srcs = sources_of(name, path)
    cxx, flags = cpu_kernels.compiler()
    lib = build_dir / f"{name}-{cpu_kernels.build_key(srcs, cxx, flags)}.so"
    if not lib.exists():
        try:
            cpu_kernels.compile_library(srcs, lib)
        except RuntimeError as e:
            raise SystemExit(f"{name} ({path}): {e}") from None
    torch.ops.load_library(str(lib))
    ops = getattr(torch.ops, f"llv_{name}")
    ops.use_isa(cpu_kernels.ISAS[isa])
    return ops


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("bf16", "int8", "int4", "x16"), help="which linear op to time")
    ap.add_argument("--type", default="q4_K", choices=sorted(X16_TYPES),
                    help="x16: the GGUF block type of the matrices (random blocks, sane scales)")
    ap.add_argument("variants", nargs="+", metavar="NAME=PATH",
                    help="the first is the baseline; torch=torch is torch's own kernel")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rows", default="1,4,8", help="rows of x to time, comma-separated")
    ap.add_argument("--model", default="demo", choices=sorted(SHAPES), help="whose matrices to time")
    ap.add_argument("--isa", default="avx512-bf16", choices=sorted(cpu_kernels.ISAS),
                    help="which of the kernels' ISAs the variants run (avx2: as on a CPU without AVX-512)")
    a = ap.parse_args(argv)
    pairs = [v.split("=", 1) for v in a.variants]
    if any(len(p) != 2 or not p[0].isidentifier() for p in pairs) or len({p[0] for p in pairs}) != len(pairs):
        raise SystemExit("variants: give NAME=PATH, each NAME a distinct identifier")
    rows = [int(r) for r in a.rows.split(",")]
    shapes = SHAPES[a.model]
    with tempfile.TemporaryDirectory() as tmp:
        ops = {name: None if path == "torch" else load_variant(name, Path(path), Path(tmp), a.isa)
               for name, path in pairs}
        g = torch.Generator().manual_seed(0)
        if a.kind == "int8":
            ws = [(torch.randint(-127, 127, s, dtype=torch.int8, generator=g), torch.rand(s[0], generator=g))
                  for s in shapes]
            def call(op, x, w):
                if op is None:
                    return torch._weight_int8pack_mm(x, w[0], w[1].to(x.dtype))
                return op.linear_int8(x, w[0], w[1], None)
        elif a.kind == "int4":
            ws = []
            for s in shapes:
                q, sz = quant.quantize_groups(torch.randn(s, generator=g))
                ws.append((*quant._pack_rows(q, sz), torch._convert_weight_to_int4pack_for_cpu(q, 2),
                           sz.to(torch.bfloat16)))
            def call(op, x, w):
                if op is None:
                    return torch._weight_int4pack_mm_for_cpu(x, w[2], 32, w[3])
                return op.linear_int4(x, w[0], w[1], None)
        elif a.kind == "x16":
            tid, qk, nbytes, scales = X16_TYPES[a.type]
            ws = []
            for n, k in shapes:
                raw = torch.randint(0, 256, (n, k // qk, nbytes), dtype=torch.uint8, generator=g)
                for o in scales:  # the blocks' fp16 scales: 0.01, not random bytes (NaN, Inf)
                    raw[:, :, o:o + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
                ws.append((raw.reshape(n, -1), n, k))

            def call(op, x, w):
                if op is None:
                    raise SystemExit("x16: torch has no kernel for GGUF blocks; compare variants of csrc/")
                return op.gguf_linear_x16(x, w[0], w[1], w[2], tid, None)
        else:
            ws = [(torch.randn(s, dtype=torch.bfloat16, generator=g),) for s in shapes]
            def call(op, x, w):
                if op is None:
                    return torch.nn.functional.linear(x, w[0])
                return op.linear_bf16(x, w[0], None)
        times = {(n, m): [] for n in ops for m in rows}
        order = list(ops.items())
        shuffle = random.Random(1)
        for _ in range(a.rounds):
            for m in rows:
                xs = {k: torch.randn(m, k, dtype=torch.bfloat16, generator=g) for k in {k for _, k in shapes}}
                if a.kind == "int4":  # codes [N, K / 2]: two a byte
                    xs.update({k // 2: x for k, x in list(xs.items())})
                shuffle.shuffle(order)  # no variant always runs first (or right after another)
                for n, op in order:
                    best = float("inf")
                    for _ in range(3):
                        t0 = time.perf_counter()
                        for w in ws:
                            call(op, xs[w[2] if a.kind == "x16" else w[0].shape[1]], w)
                        best = min(best, time.perf_counter() - t0)
                    times[n, m].append(best)
    base = pairs[0][0]
    mb = sum(w[i].numel() * w[i].element_size() for w in ws for i in range(2 if a.kind == "int4" else 1)) / 1e6
    what = f"x16 {a.type}" if a.kind == "x16" else a.kind
    print(f"{what} over the {a.model} model's {len(shapes)} matrices ({mb:.0f} MB), "
          f"{torch.get_num_threads()} threads, {a.isa}, {a.rounds} rounds; median ms and median ratio to {base}")
    out = {}
    for m in rows:
        cells = []
        for n in ops:
            ratio = statistics.median(t / b for t, b in zip(times[n, m], times[base, m]))
            out[n, m] = {"median_s": statistics.median(times[n, m]), "ratio": ratio}
            cells.append(f"{n} {out[n, m]['median_s'] * 1e3:.2f} ms ({ratio:.3f}x)")
        print(f"{m} row(s): " + " | ".join(cells), flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
