"""Serving beside llama.cpp on the same GGUF file: one streaming client, measured in one run.

    .venv/bin/python bench/bench_serve_llamacpp.py [--gguf FILE] [--clients 1,4,16] [--requests 32]
        [--prompt 128] [--new 64] [--threads 2] [--rounds 3]

Three servers, all started first and then taking turns on this machine, each given the same requests
(token-id prompts of `--prompt` tokens, `--new` tokens each, greedy, eos ignored, streamed; each client
sends its next request when one ends). Each client count is measured in `--rounds` rounds, each round
every server once with new prompts, the servers' order rotating a round: a VM's speed drifts over
minutes (the rpc split measured alone, one after the other, ran at 0.82x to 1.07x llama-server's
rate in four runs of one hour), so a ratio compares figures taken minutes apart no more than one
round. Every round is printed; the ratios are of the servers' medians over the rounds:
  layerline   `python -m layerline.server` over three local workers at the file's own bits
              (precision gguf, what a deploy of a GGUF file picks), as `layerline generate
              --local-stages 3` starts them;
  llama-server `-np 16` slots with continuous batching, one process, the file whole;
  llama-server over three local `ggml-rpc-server`s (`--rpc`, `-ngl 99`): llama.cpp's own split.
It prints aggregate tokens/s and p50/p99 inter-token latency at each client count, and layerline's
ratios against both (issue #39's goals: at 16 clients >= 1.0x llama-server's aggregate, >= 0.8x at
1, p99 inter-token <= 2x llama-server's, >= 2x llama-server over rpc-servers). llama.cpp comes from
bench/llamacpp.py (built once, never used by the tests). The CPU is named: ratios move with it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import llamacpp  # noqa: E402
from bench_serve import pct  # noqa: E402


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


async def one(client, url: str, model: str, prompt: list[int], new: int) -> dict:
    """One streamed completion; each data chunk with text or token ids counts its tokens (llama-server
    streams one token a chunk; layerline says how many in token_ids)."""
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0, times = time.perf_counter(), []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"]
            if not c:
                continue
            n = len(c[0].get("token_ids") or []) or (1 if c[0].get("text") else 0)
            times += [time.perf_counter()] * n
    return {"start": t0, "times": times}


async def level(url: str, model: str, clients: int, requests: int, prompts, new: int) -> dict:
    """`clients` clients sending `requests` requests in all, request i with prompts[i] (each prompt once
    in a run: neither llama-server's prompt cache nor layerline's prefix cache may answer a repeat)."""
    import httpx
    per = max(1, requests // clients)
    # no keep-alive: llama-server closes an idle connection after 5 s, racing a reused one
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, limits=limits) as c:
        async def client(k: int):
            return [await one(c, url, model, prompts[(k * per + j) % len(prompts)], new) for j in range(per)]
        t0 = time.perf_counter()
        res = [r for rs in await asyncio.gather(*(client(k) for k in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    itl = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(len(r["times"]) for r in res)
    return {"tokens_per_s": tokens / wall, "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "ttft_p50": pct([r["times"][0] - r["start"] for r in res if r["times"]], 50), "tokens": tokens}


def warm(url: str, model: str, prompt: list[int]) -> None:
    asyncio.run(level(url, model, 1, 1, [prompt], 4))  # with a prompt no level sends


def report(name: str, c: int, r: dict, tag: str = "") -> None:
    print(f"{name:28} {c:3d} clients{tag}: {r['tokens_per_s']:7.1f} tok/s; ITL p50 {r['itl_p50'] * 1e3:6.1f} "
          f"p99 {r['itl_p99'] * 1e3:7.1f} ms; TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms", file=sys.stderr, flush=True)


NOTES: list[str] = []


def start_llama(stack: contextlib.ExitStack, name: str, gguf: str, log: Path, slots: int, threads: int, ctx: int,
                rpc: str | None) -> str:
    """llama-server started in `stack`; its URL. This build's AMX kernels (a GGML_NATIVE build on a CPU
    with AMX) die of SIGSEGV while the server sets up its context: then it starts again with
    --no-repack (no extra buffer types: AVX-512 kernels instead of AMX), and the report says so."""
    for extra in ([], ["--no-repack"]):
        srv = llamacpp.LlamaServer(gguf, log, slots=slots, threads=threads, ctx_per_slot=ctx, rpc=rpc)
        srv.cmd += extra
        try:
            stack.enter_context(srv)
        except RuntimeError as e:
            if "exited with -11" not in str(e) or extra:
                raise
            continue
        if extra:
            NOTES.append(f"{name}: its default (AMX) path died of SIGSEGV at start; ran with {' '.join(extra)}")
        return srv.url
    raise AssertionError("unreachable")


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def in_turns(servers: dict[str, tuple[str, str]], levels, requests: int, rounds: int, prompts, new: int) -> dict:
    """{server: {clients: {figure: the median over the rounds}}}: each level `rounds` times, each round
    every server once on the same new prompts, the order rotating a round."""
    names = list(servers)
    for url, model in servers.values():
        warm(url, model, prompts[-1])
    runs: dict = {name: {} for name in names}
    at = 0
    for c in levels:
        n = max(c, requests)
        for k in range(rounds):
            for name in names[k % len(names):] + names[:k % len(names)]:
                url, model = servers[name]
                r = asyncio.run(level(url, model, c, n, prompts[at:at + n], new))
                runs[name].setdefault(c, []).append(r)
                report(name, c, r, f" (round {k + 1})")
            at += n
    return {name: {c: {f: median([r[f] for r in rs]) for f in rs[0]} for c, rs in by.items()}
            for name, by in runs.items()}


def load_args(description: str) -> argparse.ArgumentParser:
    """The load's options (this bench's and bench_serve_profile.py's): the file, client counts, requests, sizes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--gguf", default=None, help="default: the packaged SmolLM2-135M-Instruct Q4_1 file")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=32, help="requests per level (at least one per client)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    return p


def load_prompts(a: argparse.Namespace) -> tuple[str, list[int], list[list[int]]]:
    """(the GGUF file, the client counts, the prompts): token-id prompts, each sent once in a run (a repeat
    would be answered from a prompt cache), one more for the warm-up."""
    import random

    from layerline.checkpoint import open_checkpoint
    from layerline.cli import packaged_smollm2
    gguf = a.gguf or packaged_smollm2()
    levels = [int(x) for x in a.clients.split(",")]
    vocab = int(open_checkpoint(gguf).index.config.get("vocab_size") or 32000)
    rng = random.Random(0)
    n = sum(max(c, a.requests) for c in levels) * getattr(a, "rounds", 1) + 1
    return gguf, levels, [[rng.randrange(100, vocab - 100) for _ in range(a.prompt)] for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = load_args(__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (each rpc-server's too)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each client count, the servers in turns")
    p.add_argument("--server-args", default="", help="more flags for layerline's server (e.g. \"--busy-chunk 32\"); "
                   "default: none, a deploy's settings")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds: at least 1")
    gguf, levels, prompts = load_prompts(a)
    if not llamacpp.built():
        llamacpp.build()
    logs = ROOT / ".cache" / "bench-serve-llamacpp"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical cores; file {Path(gguf).name}; prompt {a.prompt}, "
          f"new {a.new}; {a.rounds} rounds", file=sys.stderr)
    from layerline.local import served_stages
    slots, ctx = max(levels), a.prompt + a.new + 64
    with contextlib.ExitStack() as stack:
        servers = {"layerline (3 workers, gguf)":
                   (stack.enter_context(served_stages(gguf, 3, "gguf", shlex.split(a.server_args))), "bench")}
        name = f"llama-server -np {slots}"
        servers[name] = (start_llama(stack, name, gguf, logs / "llama-server.log", slots, a.threads, ctx, None), "m")
        rpc = stack.enter_context(llamacpp.RpcServers(3, threads=a.threads))
        servers["llama-server over 3 rpc"] = (start_llama(stack, "llama-server over 3 rpc", gguf,
                                                          logs / "llama-rpc.log", slots, a.threads, ctx,
                                                          rpc.endpoints()), "m")
        results = in_turns(servers, levels, a.requests, a.rounds, prompts, a.new)
    ll, ls, lr = results.values()
    print(f"\nCPU: {cpu_name()}; {Path(gguf).name}; layerline / llama.cpp, same run, medians of {a.rounds} rounds")
    for name, by in results.items():
        for c in levels:
            report(name, c, by[c], " (median)")
    print(f"{'clients':>7} {'agg vs llama-server':>20} {'agg vs llama rpc x3':>20} {'p99 ITL vs llama-server':>24}")
    for c in levels:
        print(f"{c:7d} {ll[c]['tokens_per_s'] / ls[c]['tokens_per_s']:20.2f} {ll[c]['tokens_per_s'] / lr[c]['tokens_per_s']:20.2f} "
              f"{ll[c]['itl_p99'] / ls[c]['itl_p99']:24.2f}")
    for n in NOTES:
        print("note: " + n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
