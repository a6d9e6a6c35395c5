"""Two or more layerline trees (or server flags) served in turns: is a change faster, and by how much?

    .venv/bin/python bench/bench_serve_ab.py [--gguf FILE] [--clients 16] [--requests 32] [--prompt 128]
        [--new 64] [--rounds 6] TREE[@SERVER ARGS] TREE[@SERVER ARGS] ...

Each side is a source tree (a checkout or `git worktree add /tmp/base HEAD~1`) with optional flags for
its server (`.@--busy-chunk 16`). Each round runs every side once, the order alternating a round, each
in a process of its own from its tree's runtime (PYTHONPATH=TREE/runtime: a worker refuses a server of
other code), the layerline half of bench_serve_llamacpp.py: three local workers at the file's own bits
and its server, the same streaming client and prompts. It prints each round's tokens/s and p99
inter-token latency, then each side's medians and their ratio to the first side's. A VM's speed drifts
over minutes: only sides measured in the same run compare.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_serve_llamacpp import cpu_name, load_args, median  # noqa: E402

# run in each side's process: its tree's layerline, this bench's client
ONE_SIDE = r'''
import asyncio, json, shlex, sys
sys.path.insert(0, sys.argv[1])
import bench_serve_llamacpp as b
from layerline.local import served_stages
p = b.load_args("side")
p.add_argument("--rounds", type=int, default=1)
a = p.parse_args(sys.argv[4:])
gguf, levels, prompts = b.load_prompts(a)
with served_stages(gguf, 3, "gguf", shlex.split(sys.argv[2])) as url:
    b.warm(url, "bench", prompts[-1])
    out, at = {}, int(sys.argv[3]) * sum(max(c, a.requests) for c in levels)
    for c in levels:
        n = max(c, a.requests)
        r = asyncio.run(b.level(url, "bench", c, n, prompts[at:at + n], a.new))
        out[c] = [r["tokens_per_s"], r["itl_p99"]]
        at += n
print(json.dumps(out))
'''


def main(argv: list[str] | None = None) -> int:
    p = load_args(__doc__.split("\n")[0])  # the load's options, as bench_serve_llamacpp's
    p.set_defaults(clients="16")
    p.add_argument("sides", nargs="+", help="TREE[@SERVER ARGS]: a source tree, optionally flags for its server")
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    sides = []
    for s in a.sides:
        tree, _, flags = s.partition("@")
        tree = Path(tree).resolve()
        if not (tree / "runtime" / "layerline").is_dir():
            p.error(f"{s}: {tree} holds no runtime/layerline (a layerline checkout is needed)")
        sides.append((s, tree, flags))
    if a.rounds < 1 or len(sides) < 2:
        p.error("two sides or more, and --rounds at least 1")
    # each round its own prompts (load_prompts makes a level set a round), each sent once
    load_all = ["--clients", a.clients, "--requests", str(a.requests), "--prompt", str(a.prompt), "--new", str(a.new),
                "--rounds", str(a.rounds), *(["--gguf", str(Path(a.gguf).resolve())] if a.gguf else [])]
    print(f"CPU: {cpu_name()}; clients {a.clients}, {a.requests} requests a level, {a.rounds} rounds", flush=True)
    got: dict[str, list[dict]] = {s: [] for s, _, _ in sides}
    for k in range(a.rounds):
        for name, tree, flags in (sides if k % 2 == 0 else sides[::-1]):
            env = dict(os.environ, PYTHONPATH=str(tree / "runtime"))
            r = subprocess.run([sys.executable, "-c", ONE_SIDE, str(ROOT / "bench"), flags, str(k), *load_all],
                               env=env, cwd=tree, capture_output=True, text=True)
            if r.returncode != 0 or not r.stdout.strip():
                print(f"{name}: failed (exit {r.returncode}):\n{r.stderr[-2000:]}", file=sys.stderr)
                return 1
            res = {int(c): v for c, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
            got[name].append(res)
            print(f"round {k + 1} {name}: " + "; ".join(f"{c} clients {t:.1f} tok/s, p99 {q * 1e3:.1f} ms"
                                                          for c, (t, q) in res.items()), flush=True)
    first = sides[0][0]
    for name, _, _ in sides:
        line = []
        for c in got[name][0]:
            t = median([r[c][0] for r in got[name]])
            q = median([r[c][1] for r in got[name]])
            t0 = median([r[c][0] for r in got[first]])
            line.append(f"{c} clients {t:.1f} tok/s ({t / t0:.3f}x), p99 {q * 1e3:.1f} ms")
        print(f"median {name}: " + "; ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
