"""ggml libraries side by side on a GGUF file's own matrices, timed in CPU time (robust on a busy machine).

    .venv/bin/python bench/bench_ggml_libs.py [--files smollm2,gemma3,demo-q8_0,demo-q4_0]
        [--libs wheel,DIR,...] [--rounds 3] [--steps 20]

For each file, every matrix precision gguf runs through ggml (the file's own blocks, held as
`gguf_blocks.BlockLinear` holds them, repacked where it repacks) is called once with one row of x,
as in a batch-1 decode step (the LM head included: a tied one is the embedding's blocks): a "step".
Each library runs in a process of its own (LAYERLINE_GGML_LIB; "wheel" leaves it unset) on ONE
torch thread, timed by that thread's CPU time (time.thread_time), so time the process waits for a
core does not count; the figure is the median step over `--steps` steps after a warm-up. Libraries
take turns each round. Printed: ms of CPU a step per library and the ratio to the first.
Files come from bench_llamacpp.py (model_file).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "runtime"))


def child(path: str, steps: int) -> dict:
    import torch
    from layerline.checkpoint import open_checkpoint
    from layerline.model import gguf_blocks
    torch.set_num_threads(1)
    if not gguf_blocks.load():
        raise SystemExit(gguf_blocks.status())
    ck = open_checkpoint(path)
    mats = []
    tied = not any("lm_head" in n for n in ck.index.tensors)  # the LM head is the embedding's blocks
    for name, e in ck.index.tensors.items():
        if len(e.shape) != 2 or ("embed" in name and not tied):
            continue
        got = ck.stored_blocks(name)
        if got is None:
            continue
        raw, kind = got
        n = raw.shape[0]
        k = raw.shape[1] // gguf_blocks.block_type(kind).block_bytes * gguf_blocks.block_type(kind).block
        mats.append(gguf_blocks.BlockLinear(raw, kind, n, k))
    xs = {m.in_features: torch.randn(1, m.in_features) for m in mats}
    times = []
    for i in range(steps + 2):
        t0 = time.thread_time()
        for m in mats:
            m(xs[m.in_features])
        if i >= 2:
            times.append(time.thread_time() - t0)
    return {"status": gguf_blocks.status(), "matrices": len(mats), "bytes": sum(m.stored_bytes for m in mats),
            "step_ms": statistics.median(times) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="smollm2,gemma3,demo-q8_0,demo-q4_0")
    ap.add_argument("--libs", default="wheel")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.steps)))
        return 0
    import bench_llamacpp as bl
    libs = [x for x in a.libs.split(",") if x]
    print(f"CPU: {bl.cpu_line()}; load average {bl.load()}", flush=True)
    res: dict[tuple[str, str], list[float]] = {}
    for k in [x for x in a.files.split(",") if x]:
        path = bl.model_file(k)
        for rnd in range(a.rounds):
            for lib in (libs if rnd % 2 == 0 else libs[::-1]):
                env = dict(os.environ)
                env.pop("LAYERLINE_GGML_LIB", None)
                env["LAYERLINE_GGML_NATIVE"] = "off"  # "wheel" is the wheel's, not a build-ggml one
                if lib != "wheel":
                    env["LAYERLINE_GGML_LIB"] = lib
                r = subprocess.run([sys.executable, __file__, "--child", str(path), "--steps", str(a.steps)],
                                   capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    print(f"{k} {lib}: failed: {r.stderr.strip().splitlines()[-1:]}")
                    return 1
                out = json.loads(r.stdout.strip().splitlines()[-1])
                res.setdefault((k, lib), []).append(out["step_ms"])
                if rnd == 0:
                    print(f"  {k}: {out['matrices']} matrices, {out['bytes'] / 2**20:.1f} MiB; {out['status']}",
                          flush=True)
        base = statistics.median(res[(k, libs[0])])
        print(f"{k:<10} " + "  ".join(f"{lib if lib == 'wheel' else Path(lib).name}: "
                                       f"{statistics.median(res[(k, lib)]):.2f} ms "
                                       f"({statistics.median(res[(k, lib)]) / base:.2f}x)" for lib in libs), flush=True)
    print(f"load average now {bl.load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
