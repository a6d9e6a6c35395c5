"""Every benchmark, one after the other: `make bench`. Each prints ratios against a baseline
measured in the same run; absolute times on shared machines lie."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode  # noqa: E402
import bench_llamacpp  # noqa: E402
import bench_ops  # noqa: E402
import bench_planner  # noqa: E402
import bench_predicted  # noqa: E402


def main() -> int:
    # decode: (b) and (c) on compiled workers (the goal is that compiled pipelines keep their
    # speed; max-autotune: only its GEMMs gain from rows of several sequences), then where a
    # compiled step's time goes (its kernels are cached by then). (q) takes the compiled goals'
    # ratios again in turns with transformers: (a) measures each setting once, minutes apart, and
    # this machine's rate drifts between them (transformers 27.4 then 19.6 tokens/s ten minutes on).
    # llama.cpp: the same GGUF files in llama-bench (and over rpc-servers) and layerline, in turns;
    # its first run builds llama.cpp under .cache/llamacpp (minutes). A section that returns a
    # non-zero int had a broken run: `make bench` then fails, after every section has printed.
    rc = 0
    for name, mod, argv in (("planner", bench_planner, []),
                            ("decode", bench_decode, ["--pipeline-compile", "max-autotune"]),
                            ("in turns", bench_decode, ["--parts", "q"]),
                            ("profile", bench_decode, ["--profile", "--new", "16"]),
                            ("predicted", bench_predicted, []), ("ops", bench_ops, []),
                            ("llama.cpp", bench_llamacpp, [])):
        print(f"\n=== {name} ===", flush=True)
        r = mod.main(argv)
        if isinstance(r, int) and r:
            print(f"run_all: section {name} had a broken run (exit {r})", flush=True)
            rc = rc or r
    return rc


if __name__ == "__main__":
    sys.exit(main())
