"""Every benchmark, one after the other: `make bench`. Each prints ratios against a baseline
measured in the same run; absolute times on shared machines lie."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode  # noqa: E402
import bench_ops  # noqa: E402
import bench_planner  # noqa: E402
import bench_predicted  # noqa: E402


def main() -> int:
    # decode: (b) and (c) on compiled workers (the goal is that compiled pipelines keep their
    # speed; max-autotune: only its GEMMs gain from rows of several sequences), then where a
    # compiled step's time goes (its kernels are cached by then). (q) takes the compiled goals'
    # ratios again in turns with transformers: (a) measures each setting once, minutes apart, and
    # this machine's rate drifts between them (transformers 27.4 then 19.6 tokens/s ten minutes on)
    for name, mod, argv in (("planner", bench_planner, []),
                            ("decode", bench_decode, ["--pipeline-compile", "max-autotune"]),
                            ("in turns", bench_decode, ["--parts", "q"]),
                            ("profile", bench_decode, ["--profile", "--new", "16"]),
                            ("predicted", bench_predicted, []), ("ops", bench_ops, [])):
        print(f"\n=== {name} ===", flush=True)
        mod.main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
