"""Where a served token's time goes: the server, each stage's compute and the rest of each worker.

    .venv/bin/python bench/bench_serve_profile.py [--gguf FILE] [--clients 1,4,16] [--requests 32]
        [--prompt 128] [--new 64]

The same setup and client as bench_serve_llamacpp.py's layerline (three local workers at the file's own
bits, `python -m layerline.server` over them, token-id prompts, greedy, eos ignored, streamed; each client
sends its next request when one ends), no llama.cpp. For each client count it reads, before and after the
level, each process's CPU time (psutil: user + system, all threads) and the server's /metrics, and prints
per generated token, in ms:
  wall      the level's seconds / its tokens (what the aggregate tokens/s inverts);
  server    the server process's CPU: HTTP, the engine, sampling, streaming, its ZeroMQ threads;
  stageN    stage N's compute as its worker times it (layerline_stage_step_seconds: the forward of
            prompt chunks and decode steps alike) / its worker process's CPU (the forward's threads,
            message checks, KV bookkeeping, ZeroMQ; its idle-priority spinners are processes of their
            own, left out: they take only CPU nothing else wants);
  client    this process's CPU (the benchmark's own client, which a real client's machine would pay);
  busy      all of the above, against the machine's capacity (wall x cores).
And `generated a step`: the generated tokens over the steps each stage ran (a prefill chunk is a step
that generates none, so this is below the decode batch); `hop a step`: the mean of each step's round
trip beyond its stages' compute (layerline_step_hop_seconds: the links, framing and copies between
the server and the stages, and waits at a stage busy with another micro-batch), in ms a step. The CPU
is named: figures move with it.
"""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "runtime"))

from bench_serve_llamacpp import cpu_name, level, load_args, load_prompts  # noqa: E402

STEP_SUM = re.compile(r'^layerline_stage_step_seconds_(sum|count)\{stage="([^"]+)"\} (\S+)$', re.M)
HOP_SUM = re.compile(r'^layerline_step_hop_seconds_(sum|count) (\S+)$', re.M)


def scrape_steps(url: str) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
    """From one read of the server's /metrics: each stage's (compute seconds, steps) so far, and the
    steps' (seconds beyond their stages' compute, steps) so far."""
    import httpx
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, list[float]] = {}
    for kind, stage, value in STEP_SUM.findall(text):
        out.setdefault(stage, [0.0, 0.0])[0 if kind == "sum" else 1] = float(value)
    hop = dict(HOP_SUM.findall(text))
    return {k: (v[0], v[1]) for k, v in out.items()}, (float(hop.get("sum", 0.0)), float(hop.get("count", 0.0)))


def cpu_s(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    a = load_args(__doc__.split("\n")[0]).parse_args(argv)
    import psutil

    from layerline.local import controller_keys, local_server, local_stages, stop_local, stop_server
    gguf, levels, prompts = load_prompts(a)
    cores = os.cpu_count() or 1
    print(f"CPU: {cpu_name()}, {cores} logical cores; file {Path(gguf).name}; prompt {a.prompt}, new {a.new}; "
          "three local workers at precision gguf", flush=True)
    procs, first, tmp, depth = local_stages(gguf, 3, "gguf")
    server = None
    try:
        server, url = local_server(["--first", first, "--first-key", "stage0", "--keys", controller_keys(tmp),
                                    "--checkpoint", gguf, "--model-name", "bench", "--microbatches", str(depth),
                                    "--log-file", os.path.join(tmp, "server.log")], tmp)
        me, srv = psutil.Process(), psutil.Process(server.pid)
        workers = [psutil.Process(w.pid) for w in procs]
        asyncio.run(level(url, "bench", 1, 1, prompts[-1:], 4))  # warm, with a prompt no level sends
        stages = sorted(scrape_steps(url)[0])
        head = "".join(f" {s + ' comp/cpu':>18}" for s in stages)
        print(f"{'clients':>7} {'tok/s':>7} {'wall':>6} {'server':>7}{head} {'client':>7} {'busy':>12} "
              f"{'generated a step':>16} {'hop a step':>10}  (ms a generated token; hop: ms a step)")
        at = 0
        for c in levels:
            k = max(c, a.requests)
            before = (cpu_s(srv), [cpu_s(w) for w in workers], cpu_s(me), *scrape_steps(url))
            r = asyncio.run(level(url, "bench", c, k, prompts[at:at + k], a.new))
            after = (cpu_s(srv), [cpu_s(w) for w in workers], cpu_s(me), *scrape_steps(url))
            at += k
            tok = r["tokens"]
            wall = tok / r["tokens_per_s"]
            ms = 1e3 / tok
            server_ms = (after[0] - before[0]) * ms
            worker_ms = [(x1 - x0) * ms for x0, x1 in zip(before[1], after[1])]
            comp = [(after[3][s][0] - before[3].get(s, (0, 0))[0]) * ms for s in stages]
            steps = [after[3][s][1] - before[3].get(s, (0, 0))[1] for s in stages]
            client_ms = (after[2] - before[2]) * ms
            busy = server_ms + sum(worker_ms) + client_ms
            cols = "".join(f" {f'{cp:.2f} / {w:.2f}':>18}" for cp, w in zip(comp, worker_ms))
            per_step = "/".join(f"{tok / s:.1f}" for s in steps if s)
            hop_n = after[4][1] - before[4][1]
            hop = f"{(after[4][0] - before[4][0]) / hop_n * 1e3:.2f}" if hop_n else "-"
            print(f"{c:7d} {r['tokens_per_s']:7.1f} {wall * ms:6.2f} {server_ms:7.2f}{cols} {client_ms:7.2f} "
                  f"{busy:5.2f} of {wall * ms * cores:5.2f} {per_step:>16} {hop:>10}", flush=True)
    finally:
        stop_server(server)
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
