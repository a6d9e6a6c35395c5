"""Time to first token with a shared prefix, beside llama-server's prompt cache, measured in one run.

    .venv/bin/python bench/bench_prefix.py [--gguf FILE] [--system 1100] [--new 16] [--threads 2]
        [--slots 4] [--prefix-cache on|off]

The scenario of issue #39 (item 2), the same chat requests to each server in turn (greedy, streamed):
  1. a first long prompt: a system prompt of about `--system` tokens and a user question;
  2. the same conversation one turn on: a fixed assistant answer and a new user message appended
     (its prompt starts with all of the first one's tokens);
  3. another long prompt: another system prompt of that length (nothing to reuse).
Servers: layerline (`python -m layerline.server` over three local workers at the file's own bits, a
deploy's defaults: prefix cache on, chunk 128) and llama-server (`-np --slots`, its prompt cache on by
default, one process, the file whole). Each first answers a short warm-up request. It prints each
request's time to first token, layerline / llama-server for each, and layerline's prefix-cache
metrics (hits, tokens reused, bytes each stage's entries hold). Goals (issue #39): the first long
prompt's TTFT at most llama-server's, the shared-prefix request's at most 2x llama-server's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import llamacpp  # noqa: E402
from bench_serve_llamacpp import cpu_name  # noqa: E402

WORDS = ("the model cluster stage worker layer token cache prompt request server route plan host memory "
         "network answer question system user assistant reads writes keeps sends holds computes after before "
         "every each one two three many small large fast slow first last next other same new old always never "
         "because while when where which what how why if then so but and or not with without from into over "
         "under between through about against during").split()
ANSWER = ("Layerline splits the model's layers across the machines, so each one holds only its share of the "
          "weights and the KV cache, and the server keeps every stage busy with micro-batches.")


def document(tok, target: int, seed: int) -> str:
    """Sentences of random words until the text is `target` tokens long (by the model's tokenizer)."""
    rng = random.Random(seed)
    out: list[str] = []
    while True:
        words = [rng.choice(WORDS) for _ in range(rng.randrange(6, 16))]
        out.append(" ".join(words).capitalize() + ".")
        if len(out) % 8 == 0 and len(tok.encode(" ".join(out))) >= target:
            return " ".join(out)


def conversations(tok, system_tokens: int) -> list[list[dict]]:
    sys1 = "You are a careful assistant. Use this document to answer.\n" + document(tok, system_tokens, 1)
    sys2 = "You are a careful assistant. Use this document to answer.\n" + document(tok, system_tokens, 2)
    q1 = {"role": "user", "content": "What does the document say about the cache? Answer briefly."}
    first = [{"role": "system", "content": sys1}, q1]
    turn = first + [{"role": "assistant", "content": ANSWER},
                    {"role": "user", "content": "And what does it say about the network?"}]
    other = [{"role": "system", "content": sys2}, q1]
    return [first, turn, other]


def ttft(url: str, model: str, messages: list[dict], new: int) -> float:
    """Seconds from sending a streamed greedy chat request to its first chunk with text."""
    import httpx
    body = {"model": model, "messages": messages, "max_tokens": new, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices") or []:
                if first is None and ((c.get("delta") or {}).get("content") or c.get("token_ids")):
                    first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: no text came back")
    return first


def scenario(name: str, url: str, model: str, convs, new: int) -> list[float]:
    ttft(url, model, [{"role": "user", "content": "Say hello."}], 4)   # warm-up
    out = []
    for label, msgs in zip(("first long prompt", "+1 turn (shared prefix)", "another long prompt"), convs):
        out.append(ttft(url, model, msgs, new))
        print(f"{name:24} {label:26} TTFT {out[-1]:7.2f} s", file=sys.stderr, flush=True)
    return out


def prefix_metrics(url: str) -> dict:
    import httpx
    text = httpx.get(url + "/metrics", timeout=10).text
    got = {}
    for name in ("layerline_prefix_lookups_total", "layerline_prefix_hits_total", "layerline_prefix_hit_ratio",
                 "layerline_prefix_reused_tokens_total", "layerline_prefix_lost_total", "layerline_prefix_tokens"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        got[name] = float(m.group(1)) if m else None
    got["layerline_prefix_bytes"] = {h: float(v) for h, v in
                                     re.findall(r'^layerline_prefix_bytes\{host="([^"]+)"\} (\S+)$', text, re.M)}
    return got


def layerline_run(gguf: str, convs, new: int, prefix_cache: str) -> tuple[list[float], dict]:
    from layerline.local import served_stages
    with served_stages(gguf, 3, "gguf", ["--prefix-cache", prefix_cache]) as url:
        times = scenario(f"layerline (prefix {prefix_cache})", url, "bench", convs, new)
        return times, prefix_metrics(url)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", default=None, help="default: the packaged SmolLM2-135M-Instruct Q4_1 file")
    p.add_argument("--system", type=int, default=1100, help="tokens of each system prompt")
    p.add_argument("--new", type=int, default=16, help="tokens each answer may have")
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    p.add_argument("--slots", type=int, default=4, help="llama-server's parallel slots (-np)")
    p.add_argument("--prefix-cache", default="on", choices=["on", "off"], help="layerline's --prefix-cache")
    a = p.parse_args(argv)
    from layerline.cli import packaged_smollm2
    from layerline.server.chat import TextSide
    gguf = a.gguf or packaged_smollm2()
    if not llamacpp.built():
        llamacpp.build()
    text = TextSide.load(gguf)
    convs = conversations(text, a.system)
    lens = [len(text.chat_ids(c)) for c in convs]
    load = os.getloadavg()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical cores, load {load[0]:.1f}; {Path(gguf).name}; prompts of "
          f"{lens} tokens; {a.new} new", file=sys.stderr)
    ll, metrics = layerline_run(gguf, convs, a.new, a.prefix_cache)
    logs = ROOT / ".cache" / "bench-prefix"
    logs.mkdir(parents=True, exist_ok=True)
    for extra in ([], ["--no-repack"]):   # this build's AMX path may die of SIGSEGV at start (bench_serve_llamacpp)
        srv = llamacpp.LlamaServer(gguf, logs / "llama-server.log", slots=a.slots, threads=a.threads,
                                   ctx_per_slot=max(lens) + a.new + 64)
        srv.cmd += extra
        try:
            with srv:
                lc = scenario(f"llama-server -np {a.slots} {' '.join(extra)}", srv.url, "m", convs, a.new)
            break
        except RuntimeError as e:
            if "exited with -11" not in str(e) or extra:
                raise
            print("llama-server died of SIGSEGV at start (AMX); again with --no-repack", file=sys.stderr)
    print(f"\nCPU: {cpu_name()}; load before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}; {Path(gguf).name}; "
          f"prompts {lens} tokens; layerline / llama-server TTFT, same run")
    print(f"{'request':26} {'layerline s':>11} {'llama-server s':>14} {'ratio':>6} {'goal':>6}")
    for label, x, y, goal in zip(("first long prompt", "+1 turn (shared prefix)", "another long prompt"), ll, lc,
                                 ("<= 1", "<= 2", "")):
        print(f"{label:26} {x:11.2f} {y:14.2f} {x / y:6.2f} {goal:>6}")
    print("layerline prefix cache: " + json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
