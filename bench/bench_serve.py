"""Serving throughput and latency, as ratios against baselines measured in the same run.

    .venv/bin/python bench/bench_serve.py [--checkpoint DIR] [--prompt 128] [--new 64]
        [--clients 1,4,16] [--requests 32] [--precision fp32] [--no-transformers]

Three local worker stages and `python -m layerline.server` over them (real uvicorn, HTTP,
SSE). Clients stream `--new` tokens after `--prompt`-token prompts (greedy, eos ignored):
(a) aggregate tokens/s, p50/p99 time-to-first-token and inter-token latency, and the server
    process's own CPU per token, at 1, 4 and 16 concurrent clients (each client sends requests
    one after another);
(b) one client through the server vs `generate()` straight over the same stages;
(c) transformers generate at batch 16 in one process, the same checkpoint, as a reference.
Goals: 16 clients >= 4x the aggregate of 1; p99 ITL at 16 <= 3x at 1; one client via the
server >= 0.9x direct. The report says whether each was met; nothing is tuned to pass.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import psutil  # noqa: E402
import torch  # noqa: E402


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def one_request(client, url: str, prompt: list[int], new: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            n = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
            now = time.perf_counter()
            times += [now] * n
    return {"start": t0, "times": times}


async def level(url: str, clients: int, per_client: int, prompts: list[list[int]], new: int) -> dict:
    import httpx
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        async def worker(k: int):
            out = []
            for j in range(per_client):
                out.append(await one_request(c, url, prompts[(k * per_client + j) % len(prompts)], new))
            return out
        t0 = time.perf_counter()
        res = [r for rs in await asyncio.gather(*(worker(k) for k in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    return summary(clients, [(res, wall)])


def summary(clients: int, runs: list[tuple[list[dict], float]]) -> dict:
    """Latencies over every request of the runs; aggregate rate = all tokens / all wall time."""
    res = [r for rs, _ in runs for r in rs]
    wall = sum(w for _, w in runs)
    ttft = [r["times"][0] - r["start"] for r in res if r["times"]]
    itl = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(len(r["times"]) for r in res)
    per_req = [len(r["times"]) / (r["times"][-1] - r["start"]) for r in res if r["times"]]
    return {"clients": clients, "requests": len(res), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "request_tokens_per_s": statistics.median(per_req), "_runs": runs}


def transformers_batch(ckpt: str, prompts: list[list[int]], new: int) -> float:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    model.eval()
    ids = torch.tensor(prompts)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=48, help="requests per level, shared by its clients")
    p.add_argument("--chunk", type=int, default=128, help="the server's prefill chunk (tokens per message)")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from layerline.checkpoint import write_demo_checkpoint
    from layerline.cli import local_stages, stop_local
    from layerline.local import local_server, stop_server
    from layerline.driver import Pipeline
    from layerline.generate import generate

    ckpt = a.checkpoint or str(write_demo_checkpoint(ROOT / ".cache" / "bench-serve-ckpt", layers=6, hidden=256,
                                                     vocab=2048, dtype="float32", seed=0))
    vocab = int(json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (a.prompt,), generator=g).tolist() for _ in range(64)]
    levels = [int(x) for x in a.clients.split(",")]
    procs, first, tmp, depth = local_stages(ckpt, 3, a.precision, threads=a.threads)
    server = None
    report: dict = {"prompt": a.prompt, "new": a.new, "levels": []}
    try:
        # the server asks the stages' control sockets as the controller (CURVE, the run's keys); as
        # deployed, the role gives the server no OpenMP setting of its own
        server, url = local_server(["--first", first, "--first-key", "stage0", "--keys",
                                    os.path.join(tmp, "keys", "controller"), "--checkpoint", ckpt,
                                    "--model-name", "bench", "--chunk", str(a.chunk), "--microbatches", str(depth),
                                    "--log-file", os.path.join(tmp, "server.log")], tmp, timeout_s=120,
                                   env={k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"})
        asyncio.run(level(url, 1, 2, prompts, 8))  # warm the path
        with Pipeline(first, timeout_s=300, depth=depth, keys_dir=os.path.join(tmp, "keys", "controller"),
                      first_key="stage0") as pipe:
            generate(pipe, [prompts[0]], 8)
            # (b) one client via the server vs generate() straight, taking turns
            direct, served = [], []
            for i in range(5):
                t0 = time.perf_counter()
                gen = generate(pipe, [prompts[i]], a.new)
                direct.append(len(gen.tokens[0]) / (time.perf_counter() - t0))
                r = asyncio.run(level(url, 1, 1, prompts[i:], a.new))
                served.append(r["request_tokens_per_s"])
        report["direct_tokens_per_s"] = statistics.median(direct)
        report["served_one_tokens_per_s"] = statistics.median(served)
        # (a) each level in two halves, run in the order 1 4 16 16 4 1, so a noisy spell on a shared
        # machine weighs on every level alike
        halves: dict[int, list] = {c: [] for c in levels}
        server_cpu = dict.fromkeys(levels, 0.0)  # the server process's own CPU (HTTP, engine, sampling)
        proc = psutil.Process(server.pid)
        for c in levels + levels[::-1]:
            c0 = sum(proc.cpu_times()[:2])  # user + system
            halves[c] += asyncio.run(level(url, c, max(1, a.requests // c // 2), prompts, a.new))["_runs"]
            server_cpu[c] += sum(proc.cpu_times()[:2]) - c0
        for c in levels:
            r = summary(c, halves[c])
            del r["_runs"]
            r["server_cpu_ms_per_token"] = server_cpu[c] / r["tokens"] * 1e3
            report["levels"].append(r)
            print(f"{c:>3} clients: {r['tokens_per_s']:8.1f} tok/s aggregate; TTFT p50 {r['ttft_p50'] * 1e3:7.1f} "
                  f"p99 {r['ttft_p99'] * 1e3:7.1f} ms; ITL p50 {r['itl_p50'] * 1e3:6.1f} "
                  f"p99 {r['itl_p99'] * 1e3:6.1f} ms"
                  f"; server CPU {r['server_cpu_ms_per_token']:.2f} ms/token ({r['requests']} requests)",
                  file=sys.stderr, flush=True)
    finally:
        stop_server(server)
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    if not a.no_transformers:  # (c) after the workers are gone: the whole machine for it
        report["transformers_batch16_tokens_per_s"] = transformers_batch(ckpt, prompts[:16], a.new)
    by = {r["clients"]: r for r in report["levels"]}
    goals = {}
    if 1 in by and 16 in by:
        goals["16 clients >= 4x aggregate of 1"] = (by[16]["tokens_per_s"] / by[1]["tokens_per_s"], 4.0, ">=")
        goals["p99 ITL at 16 <= 3x at 1"] = (by[16]["itl_p99"] / by[1]["itl_p99"], 3.0, "<=")
    goals["one client via server >= 0.9x direct"] = (report["served_one_tokens_per_s"] / report["direct_tokens_per_s"],
                                                     0.9, ">=")
    report["goals"] = {k: {"ratio": v, "goal": g_, "met": v >= g_ if op == ">=" else v <= g_}
                       for k, (v, g_, op) in goals.items()}
    if "transformers_batch16_tokens_per_s" in report and 16 in by:
        ref = report["transformers_batch16_tokens_per_s"]
        report["server16_vs_transformers_batch16"] = by[16]["tokens_per_s"] / ref
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"direct generate(): {report['direct_tokens_per_s']:.1f} tok/s; one client via the server: "
          f"{report['served_one_tokens_per_s']:.1f} tok/s")
    if "transformers_batch16_tokens_per_s" in report:
        print(f"transformers generate, batch 16, one process: {report['transformers_batch16_tokens_per_s']:.1f} tok/s"
              + (f"; server at 16 clients = {report['server16_vs_transformers_batch16']:.2f}x that"
                 if "server16_vs_transformers_batch16" in report else ""))
    for k, v in report["goals"].items():
        print(f"{k}: {v['ratio']:.2f} ({'met' if v['met'] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
