"""Variants of the decode kernels (`layerline.model.cpu_kernels.SOURCE`) against each other, in one
process, taking turns: a kernel change of 5-10% is lost in this machine's drift between separate
runs (one row's GEMVs moved 9.3-13.7 ms between processes minutes apart), not between calls
milliseconds apart.

Each VARIANT is NAME=PATH, PATH a copy of cpu_kernels.py holding a changed SOURCE; each is built
under its own op namespace (torch.ops.llv_NAME), so all load into one process. NAME=torch times
torch's own kernel for the same product instead (`F.linear`, `_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu` on torch's int4 packing), the path a host without the kernels takes. Every round times
each variant (in shuffled order) over the demo model's decode matrices at 1, 4 and 8 rows of x,
best of 3 passes; the table gives each variant's median time and its median ratio to the first
variant over the rounds.

    cp runtime/layerline/model/cpu_kernels.py /tmp/v.py   # then edit /tmp/v.py's SOURCE
    .venv/bin/python bench/bench_kernel_variants.py bf16 main=runtime/layerline/model/cpu_kernels.py v=/tmp/v.py
    .venv/bin/python bench/bench_kernel_variants.py int4 torch=torch main=runtime/layerline/model/cpu_kernels.py
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

from layerline.model import cpu_kernels, quant  # noqa: E402

# the demo model's one-token step: 16 layers of fused qkv, o, fused gate/up and down, then the head
DEMO_SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 16 + [(32000, 1024)]


def source_of(path: Path) -> str:
    """The SOURCE string a copy of cpu_kernels.py assigns (read, never imported)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path}: not a readable copy of cpu_kernels.py ({e.__class__.__name__}: {e})") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SOURCE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{path}: no SOURCE = ... assignment; give a copy of cpu_kernels.py")


def load_variant(name: str, path: Path, build_dir: Path):
    """torch.ops.llv_NAME: the variant's SOURCE built under that namespace and loaded."""
    src = source_of(path).replace("layerline_cpu", f"llv_{name}")
    cxx, flags = cpu_kernels.compiler()
    lib = build_dir / f"{name}-{hashlib.sha256(src.encode()).hexdigest()[:12]}.so"
    if not lib.exists():
        cpp = lib.with_suffix(".cpp")
        cpp.write_text(src)
        r = subprocess.run([cxx, str(cpp), "-o", str(lib), *flags], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{name} ({path}): {cxx} failed: {r.stderr.strip().splitlines()[:3]}")
    torch.ops.load_library(str(lib))
    ops = getattr(torch.ops, f"llv_{name}")
    ops.use_isa(cpu_kernels.ISAS["avx512-bf16"])
    return ops


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("bf16", "int8", "int4"), help="which linear op to time")
    ap.add_argument("variants", nargs="+", metavar="NAME=PATH",
                    help="the first is the baseline; torch=torch is torch's own kernel")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rows", default="1,4,8", help="rows of x to time, comma-separated")
    a = ap.parse_args(argv)
    pairs = [v.split("=", 1) for v in a.variants]
    if any(len(p) != 2 or not p[0].isidentifier() for p in pairs) or len({p[0] for p in pairs}) != len(pairs):
        raise SystemExit("variants: give NAME=PATH, each NAME a distinct identifier")
    rows = [int(r) for r in a.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ops = {name: None if path == "torch" else load_variant(name, Path(path), Path(tmp)) for name, path in pairs}
        g = torch.Generator().manual_seed(0)
        if a.kind == "int8":
            ws = [(torch.randint(-127, 127, s, dtype=torch.int8, generator=g), torch.rand(s[0], generator=g))
                  for s in DEMO_SHAPES]
            def call(op, x, w):
                if op is None:
                    return torch._weight_int8pack_mm(x, w[0], w[1].to(x.dtype))
                return op.linear_int8(x, w[0], w[1], None)
        elif a.kind == "int4":
            ws = []
            for s in DEMO_SHAPES:
                q, sz = quant.quantize_groups(torch.randn(s, generator=g))
                ws.append((*quant._pack_rows(q, sz), torch._convert_weight_to_int4pack_for_cpu(q, 2),
                           sz.to(torch.bfloat16)))
            def call(op, x, w):
                if op is None:
                    return torch._weight_int4pack_mm_for_cpu(x, w[2], 32, w[3])
                return op.linear_int4(x, w[0], w[1], None)
        else:
            ws = [(torch.randn(s, dtype=torch.bfloat16, generator=g),) for s in DEMO_SHAPES]
            def call(op, x, w):
                if op is None:
                    return torch.nn.functional.linear(x, w[0])
                return op.linear_bf16(x, w[0], None)
        times = {(n, m): [] for n in ops for m in rows}
        order = list(ops.items())
        shuffle = random.Random(1)
        for _ in range(a.rounds):
            for m in rows:
                xs = {k: torch.randn(m, k, dtype=torch.bfloat16, generator=g) for k in (1024, 2816)}
                if a.kind == "int4":  # codes [N, K / 2]: two a byte
                    xs.update({512: xs[1024], 1408: xs[2816]})
                shuffle.shuffle(order)  # no variant always runs first (or right after another)
                for n, op in order:
                    best = float("inf")
                    for _ in range(3):
                        t0 = time.perf_counter()
                        for w in ws:
                            call(op, xs[w[0].shape[1]], w)
                        best = min(best, time.perf_counter() - t0)
                    times[n, m].append(best)
    base = pairs[0][0]
    mb = sum(w[i].numel() * w[i].element_size() for w in ws for i in range(2 if a.kind == "int4" else 1)) / 1e6
    print(f"{a.kind} over the demo model's {len(DEMO_SHAPES)} matrices ({mb:.0f} MB), "
          f"{torch.get_num_threads()} threads, {a.rounds} rounds; median ms and median ratio to {base}")
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
