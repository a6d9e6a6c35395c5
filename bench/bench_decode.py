"""Decode speed, as ratios against baselines measured in the same run.

    .venv/bin/python bench/bench_decode.py [--checkpoint DIR] [--prompt 128] [--new 64]
        [--compile max-autotune|default|off] [--pipeline-compile off|default|max-autotune]
        [--parts abcdkw|q] [--rounds 4]

(a) one stage, in process, batch 1: layerline's decoder vs transformers generate, same
    checkpoint and dtype: eager, weight-only int8 and int4 (groups of 32, CPU kernel), and with
    --compile (torch.compile of the decode step, inductor freezing; its warm-up is timed and left
    out of the rate) at each; layerline's stage reserves KV for 4096 tokens, the most a worker's
    sequence may reserve by default, so the reserve shows if it costs decode time;
(b) three local worker processes vs one, one sequence, through the real wire;
(c) three local stages decoding four sequences together vs one sequence on one stage
    ((b) and (c) take turns on pipelines that both stay up);
(d) the per-hop cost of layerline's wire (validated header + frames, both ways) vs a raw
    ZeroMQ round trip of the same bytes, each echoed by another process (as workers are),
    rounds interleaved so both see the same machine;
(k) layerline's decode kernels (`layerline.model.cpu_kernels`) vs torch's (oneDNN bf16,
    `_weight_int8pack_mm`), the same eager stage at bf16 and at int8, switched round by round;
(w) a stage's step after an idle wait, with a worker's idle-priority spinners (`layerline.awake`)
    and without, in turns: what a stage alone on its machine gains from them;
(q) (only with --parts q; `make bench` runs it on its own) the precisions interleaved:
    transformers generate and one stage at bf16, int8 and int4 (eager, or compiled with
    --compile) held in one process, taking turns round by round, best of --rounds each, so a
    busy spell on a shared machine hits all alike.
--profile: where one decode step's time goes (torch profiler over --new steps of one stage, at
    --precision and int8, compiled with --compile): weight GEMVs, attention, norms/RoPE/sampling,
    Python and framework, next to the bandwidth bound (streamed weight bytes / the probe's rates).
Absolute times on these machines are noisy; the ratios are what to read.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# compiled kernels are kept here, so a second run skips most of the warm-up
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))

import torch  # noqa: E402


def ensure_demo(path: Path) -> Path:
    from layerline.checkpoint import write_demo_checkpoint
    return write_demo_checkpoint(path)


# the most KV a worker's sequence may reserve by default (layerline_kv_context): a sequence's
# cache is its reserve (prompt + max_new from the engine; this when a forward names none)
WORKER_RESERVE = 4096
PLAIN_WINDOWS = 3  # --profile: windows of unprofiled steps, the fastest kept


def ours_one_stage(ckpt: str, prompt: torch.Tensor, new: int, precision: str,
                   compile: str = "off", reserve: int | None = None) -> tuple[float, float]:
    """Decode tokens/s of one Stage holding every layer, with its KV cache (`reserve` tokens, or
    just what the run fills); and the seconds its first decode steps took (the compile warm-up
    when compiling)."""
    from layerline.checkpoint import read_index
    from layerline.model.loader import load_stage
    stage = load_stage(ckpt, 0, read_index(ckpt).num_layers, True, True, precision=precision)
    stage.compile(compile)
    t0 = time.perf_counter()
    cache = stage.new_cache(1, prompt.shape[1] + new + 1)
    stage(prompt[:, :2], start_pos=0, cache=cache)
    stage(prompt[:, 2:3], start_pos=2, cache=cache)
    warm = time.perf_counter() - t0
    best = 0.0
    for _ in range(3):  # best of three: a noisy spell hits one run, not all
        cache = stage.new_cache(1, reserve or prompt.shape[1] + new + 1)
        logits = stage(prompt, start_pos=0, cache=cache)
        tok = logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for i in range(new):
            logits = stage(tok, start_pos=prompt.shape[1] + i, cache=cache)
            tok = logits[:, -1:].argmax(-1)
        best = max(best, new / (time.perf_counter() - t0))
    return best, warm


def hf_decode_rate(model, prompt: torch.Tensor, new: int) -> float:
    """Decode tokens/s of one transformers generate (greedy, `new` steps after the first token),
    as `decode_rate` counts layerline's: each step timed as it ends (a StoppingCriteria that stops
    nothing), so the prefill is not in it. Subtracting a prefill-only run instead let one noisy
    prefill (seconds on an AVX2 machine) shrink the difference: (q)'s best of four rounds read
    transformers at 40.4 tokens/s in the hour (a) read 22.1 (2026-12-03, Zen 3)."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    ends: list[float] = []

    class StepEnds(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            ends.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=new + 1, min_new_tokens=new + 1, do_sample=False,
                       eos_token_id=None, pad_token_id=0, stopping_criteria=StoppingCriteriaList([StepEnds()]))
    if len(ends) != new + 1:
        raise RuntimeError(f"transformers generate took {len(ends)} steps, not {new + 1}")
    return new / max(1e-9, ends[-1] - ends[0])


def transformers_generate(ckpt: str, prompt: torch.Tensor, new: int, dtype: torch.dtype) -> float:
    """Decode tokens/s of transformers generate (greedy, static length): the best of three runs."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    model.eval()
    hf_decode_rate(model, prompt, 2)  # warm
    return max(hf_decode_rate(model, prompt, new) for _ in range(3))


def pipelines(ckpt: str, prompt: list[int], new: int, precision: str, compile: str = "off",
              rounds: int = 3) -> tuple[float, float, float]:
    """Decode tokens/s of one sequence on one local worker, one sequence on three, and four
    sequences together on three (aggregate), taking turns (decode_in_turns)."""
    kw = dict(compile=compile, compile_cache=str(ROOT / ".cache" / "inductor"))
    best = decode_in_turns(ckpt, precision, {"one": (1, kw), "three": (3, kw)},
                           [("one", 1), ("three", 1), ("three", 4)], prompt, new, rounds)
    return best["one", 1], best["three", 1], best["three", 4]


def decode_in_turns(ckpt: str, precision: str, setups: dict, runs: list[tuple[str, int]], prompt: list[int],
                    new: int, rounds: int) -> dict[tuple[str, int], float]:
    """Best decode tokens/s of each run (setup name, sequences). setups: name -> (stages,
    layerline.cli.local_stages keywords). Every pipeline stays up and the runs take turns, round by
    round, so a noisy spell on the machine hits every figure alike. Idle workers sleep
    (GOMP_SPINCOUNT), so the waiting pipelines do not slow the running one."""
    from layerline.cli import local_stages, stop_local
    from layerline.driver import Pipeline
    from layerline.generate import generate
    from layerline.local import controller_keys
    procs: list = []
    tmps: list = []
    pipes: dict = {}
    try:
        for name, (n, kw) in setups.items():
            ls = local_stages(ckpt, n, precision, **kw)
            procs += ls.procs
            tmps.append(ls.tmp)
            # each pipeline keeps as many micro-batches in flight as its plan says (its depth)
            pipes[name] = Pipeline(ls.first, depth=ls.depth, keys_dir=controller_keys(ls.tmp), first_key="stage0")
        for name, seqs in runs:  # warm: connections, allocations
            generate(pipes[name], [prompt[:8]] * seqs, 4)
        best = dict.fromkeys(runs, 0.0)
        for _ in range(rounds):
            for name, seqs in runs:
                prompts = [[(t + 7 * i) % 1000 for t in prompt] for i in range(seqs)]
                rate = generate(pipes[name], prompts, new).decode_tokens_per_s() or 0.0
                best[name, seqs] = max(best[name, seqs], rate)
        return best
    finally:
        for pipe in pipes.values():
            pipe.close()
        stop_local(procs)
        for t in tmps:
            shutil.rmtree(t, ignore_errors=True)


def _echo(port: int, mode: str) -> None:
    """Echo server process: raw bytes back, or decode + validate + re-encode with the wire."""
    import zmq

    from layerline import wire
    srv = zmq.Context().socket(zmq.ROUTER)
    srv.bind(f"tcp://127.0.0.1:{port}")
    while True:
        frames = srv.recv_multipart(copy=False)
        if mode == "raw":
            srv.send_multipart(frames, copy=False)
        else:
            h, t = wire.decode(frames[1:])
            srv.send_multipart([frames[0], *wire.encode(h, t)], copy=False)


def hop_overhead(nbytes: int = 2048, rounds: int = 12, per_round: int = 300) -> tuple[float, float]:
    """Median round trip: raw zmq bytes echo vs layerline wire (encode, validate, rebuild) echo."""
    import multiprocessing as mp
    import socket

    import zmq

    from layerline import wire
    ctx = zmq.Context()
    socks, procs = {}, []
    medians: dict[str, list[float]] = {"raw": [], "wire": []}
    try:
        for mode in ("raw", "wire"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            p = mp.get_context("spawn").Process(target=_echo, args=(port, mode), daemon=True)
            p.start()
            procs.append(p)
            socks[mode] = ctx.socket(zmq.DEALER)
            socks[mode].setsockopt(zmq.RCVTIMEO, 60_000)  # an echo that died raises zmq.Again, not a hang
            socks[mode].connect(f"tcp://127.0.0.1:{port}")
        x = torch.zeros(1, 1, nbytes // 2, dtype=torch.bfloat16)
        payload = bytes(nbytes)
        for mode, cli in socks.items():  # wait for both echoes to answer
            cli.send_multipart([b"{}", payload] if mode == "raw" else wire.encode({"op": "forward"}, {"hidden": x}))
            cli.recv_multipart()
        for _ in range(rounds):  # interleaved: a noisy spell hits both
            for mode, cli in socks.items():
                times = []
                for i in range(per_round):
                    t0 = time.perf_counter()
                    if mode == "raw":
                        cli.send_multipart([b"{}", payload])
                        cli.recv_multipart()
                    else:
                        cli.send_multipart(wire.encode({"op": "forward", "id": f"r{i}"}, {"hidden": x}), copy=False)
                        wire.decode(cli.recv_multipart(copy=False))
                    times.append(time.perf_counter() - t0)
                medians[mode].append(statistics.median(times[per_round // 10:]))
    finally:
        for p in procs:
            p.kill()
            p.join()
        for cli in socks.values():
            cli.close(0)
        ctx.term()
    return statistics.median(medians["raw"]), statistics.median(medians["wire"])


def wire_cpu_us(nbytes: int = 2048, n: int = 20000) -> tuple[float, float]:
    """Microseconds per wire encode and per decode of the (d) message in a warm loop: the
    work itself, without the wake-ups and cold caches a real round trip adds."""
    from layerline import wire
    x = torch.zeros(1, 1, nbytes // 2, dtype=torch.bfloat16)
    frames = [bytes(f) for f in wire.encode({"op": "forward", "id": "r0"}, {"hidden": x})]
    out = []
    for fn in (lambda: wire.encode({"op": "forward", "id": "r0"}, {"hidden": x}), lambda: wire.decode(frames)):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return out[0], out[1]


def main(argv=None) -> dict:
    from layerline.model import COMPILE_MODES
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=str(ROOT / ".cache" / "demo-llama"))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--compile", default="max-autotune", choices=COMPILE_MODES,
                    help="the compiled setting (a) also measures (off: skip it)")
    ap.add_argument("--pipeline-compile", default="off", choices=COMPILE_MODES,
                    help="--compile for the workers of (b) and (c)")
    ap.add_argument("--parts", default="abcdkw", help="which of (a)-(d), (k), (w) and (q) to run, e.g. a or q")
    ap.add_argument("--rounds", type=int, default=4, help="(q): rounds of taking turns")
    ap.add_argument("--profile", action="store_true",
                    help="print where a decode step's time goes instead of running (a)-(d)")
    ap.add_argument("--profile-precisions", default=None,
                    help="comma-separated precisions --profile covers (default: --precision,int8)")
    a = ap.parse_args(argv)
    ckpt = str(ensure_demo(Path(a.checkpoint)))
    torch.manual_seed(0)
    import json
    vocab = json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(0, vocab, (1, a.prompt))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[a.precision]
    out = {}
    print(f"decode benchmark: {ckpt}, {a.precision}, prompt {a.prompt}, {a.new} new tokens, "
          f"{torch.get_num_threads()} threads", flush=True)
    if a.profile:
        precs = (a.profile_precisions or f"{a.precision},int8").split(",")
        out["profile"] = profile_steps(ckpt, prompt, a.new, precs, a.compile)
        return out
    if "a" in a.parts:
        _part_a(a, ckpt, prompt, dtype, out)
    if "b" in a.parts or "c" in a.parts:
        _parts_bc(a, ckpt, prompt, out)
    if "d" in a.parts:
        _part_d(out)
    if "k" in a.parts:
        _part_k(a, ckpt, prompt, out)
    if "w" in a.parts:
        _part_w(a, ckpt, out)
    if "q" in a.parts:
        _part_q(a, ckpt, prompt, dtype, out)
    return out


# where a profiled op's self time goes, first match wins: inductor's kernels are named for
# what they fuse (cpp_fused_..._softmax_...), extern GEMMs for their library call; a kernel
# fusing RoPE with the KV write counts as RoPE
PROFILE_BUCKETS = ("weight GEMVs", "attention", "norms/RoPE/sampling")
_PROFILE_RULES = (
    ("weight GEMVs", ("gemm_", "linear", "aten::mm", "aten::addmm", "int8pack", "int4pack", "mkldnn")),
    ("norms/RoPE/sampling", ("rsqrt", "_cos_", "_sin_", "argmax", "embedding")),
    ("attention", ("scaled_dot_product", "flash_attention", "bmm", "softmax", "index_copy", "masked_fill",
                   "decode_attention", "rows_attention")),
    ("norms/RoPE/sampling", ("cpp_fused", "aten::")),
)
FRAMEWORK = "Python and framework"


def profile_bucket(name: str) -> str | None:
    """The PROFILE_BUCKETS bucket of a profiler event name; None: framework (dynamo guards,
    the compiled graph's Python wrapper, profiler markers, anything unnamed)."""
    if name.startswith(("Torch-Compiled", "## ", "TorchDynamo", "AOTDispatcher", "Pregraph",
                        "aten::empty", "aten::as_strided", "aten::resolve", "aten::resize_",
                        "aten::view", "aten::_local_scalar", "aten::item")):
        return None
    low = name.lower()
    if low.startswith("graph_") and low.endswith("kernel") and "cpp_fused" not in low:
        return PROFILE_BUCKETS[0]  # inductor's GEMM templates (graph_0_gemm_m1n..._kernel, int8's graph_1_kernel)
    fused = "cpp_fused" in low  # inductor's elementwise kernels, named also for a linear op they follow
    for bucket, keys in _PROFILE_RULES:
        if not (fused and bucket == PROFILE_BUCKETS[0]) and any(k.lower() in low for k in keys):
            return bucket
    return None


def streamed_weight_bytes(stage) -> int:
    """Bytes one decode step reads from weights: every parameter and buffer except the embedding
    table (one row of it) and the RoPE frequencies, each storage once (fused projections' parts
    are views into one matrix)."""
    total, seen = 0, set()
    for name, t in list(stage.named_parameters()) + list(stage.named_buffers()):
        ptr = t.untyped_storage().data_ptr()
        if name == "inv_freq" or ptr in seen:
            continue
        seen.add(ptr)
        if name.startswith("embed_tokens."):
            total += t[0].numel() * t.element_size() if t.dim() == 2 else 0
            continue
        total += t.untyped_storage().nbytes()
    return total


def profile_steps(ckpt: str, prompt: torch.Tensor, new: int, precisions: list[str], compile: str) -> dict:
    """Per precision, one stage holding the whole model: the mean decode step's time split into
    PROFILE_BUCKETS and framework (the wall time no kernel accounts for), and the bandwidth bound:
    streamed weight bytes over the probe's decode streaming rate and over its raw copy rate."""
    from torch.profiler import ProfilerActivity, profile

    import torch._inductor.config as inductor_config
    from layerline import probe as probe_mod
    from layerline.checkpoint import read_index
    from layerline.model.loader import load_stage
    # inductor's C++ kernels then show up in the profile by name (otherwise as one graph call)
    inductor_config.cpp.enable_kernel_profile = True
    with torch.inference_mode():
        decode_bw, _ = probe_mod._decode_rates(torch, 2.0)
        copy_bw = probe_mod._copy_bandwidth(torch, torch.device("cpu"), 1.0, 64 << 20)
    n = prompt.shape[1]
    layers = read_index(ckpt).num_layers
    res = {}
    for prec in precisions:
        stage = load_stage(ckpt, 0, layers, True, True, precision=prec)
        stage.compile(compile)
        cache = stage.new_cache(1, n + (2 + PLAIN_WINDOWS) * new + 8)
        tok = stage(prompt, start_pos=0, cache=cache)[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for i in range(3):  # compiles when compiling
            tok = stage(tok, start_pos=n + i, cache=cache)[:, -1:].argmax(-1)
        warm = time.perf_counter() - t0
        pos = n + 3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for i in range(new):
                tok = stage(tok, start_pos=pos + i, cache=cache)[:, -1:].argmax(-1)
            wall = (time.perf_counter() - t0) / new
        # the same steps unprofiled (the profiler's own overhead stays out of the step time), the
        # fastest of a few windows: on a shared machine one window can take twice as long
        plain = math.inf
        for w in range(PLAIN_WINDOWS):
            t0 = time.perf_counter()
            for i in range(new):
                tok = stage(tok, start_pos=pos + (1 + w) * new + i, cache=cache)[:, -1:].argmax(-1)
            plain = min(plain, (time.perf_counter() - t0) / new)
        split = dict.fromkeys(PROFILE_BUCKETS, 0.0)
        for ev in prof.key_averages():
            b = profile_bucket(ev.key)
            if b is not None:
                split[b] += ev.self_cpu_time_total / 1e6 / new
        kernels = sum(split.values())
        split[FRAMEWORK] = max(0.0, wall - kernels)
        wb = streamed_weight_bytes(stage)
        res[prec] = {"compile": stage.compile_error and "off (failed)" or compile, "warmup_s": warm,
                     "step_s": plain, "profiled_step_s": wall, "split_s": split, "weight_bytes": wb,
                     "bound_decode_bw_s": wb / decode_bw if decode_bw else None,
                     "bound_copy_bw_s": wb / copy_bw, "decode_bw": decode_bw, "copy_bw": copy_bw}
        del stage, cache
    _print_profile(res, compile, new)
    return res


def _print_profile(res: dict, compile: str, new: int) -> None:
    precs = list(res)
    first = res[precs[0]]
    dbw = f"{first['decode_bw'] / 1e9:.1f}" if first["decode_bw"] else "n/a"
    print(f"profile: one decode step, --compile {compile}, mean of {new} profiled steps (ms and share of "
          f"the profiled step); probe rates: decode streaming {dbw} GB/s, raw copy {first['copy_bw'] / 1e9:.1f} GB/s",
          flush=True)
    print("| part | " + " | ".join(precs) + " |")
    print("|---|" + "---|" * len(precs))
    for b in [*PROFILE_BUCKETS, FRAMEWORK]:
        cells = [f"{r['split_s'][b] * 1e3:.2f} ms ({r['split_s'][b] / r['profiled_step_s']:.0%})" for r in res.values()]
        print(f"| {b} | " + " | ".join(cells) + " |")
    rows = (("profiled step", lambda r: f"{r['profiled_step_s'] * 1e3:.2f} ms"),
            ("step without the profiler", lambda r: f"{r['step_s'] * 1e3:.2f} ms ({1 / r['step_s']:.1f} tokens/s)"),
            ("weight bytes streamed per step", lambda r: f"{r['weight_bytes'] / 1e6:.0f} MB"),
            ("bound: bytes / probe decode rate", lambda r: f"{r['bound_decode_bw_s'] * 1e3:.2f} ms"
             if r["bound_decode_bw_s"] else "n/a"),
            ("bound: bytes / raw copy rate", lambda r: f"{r['bound_copy_bw_s'] * 1e3:.2f} ms"),
            ("step / copy bound", lambda r: f"{r['step_s'] / r['bound_copy_bw_s']:.2f}x"))
    for label, fn in rows:
        print(f"| {label} | " + " | ".join(fn(r) for r in res.values()) + " |", flush=True)


def decode_rate(stage, prompt: torch.Tensor, new: int) -> float:
    """Greedy decode tokens/s of one in-process stage after a prefill of `prompt` (a cache of just
    what the run fills)."""
    n = prompt.shape[1]
    cache = stage.new_cache(1, n + new + 1)
    tok = stage(prompt, start_pos=0, cache=cache)[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for i in range(new):
        tok = stage(tok, start_pos=n + i, cache=cache)[:, -1:].argmax(-1)
    return new / (time.perf_counter() - t0)


def _part_k(a, ckpt: str, prompt: torch.Tensor, out: dict) -> None:
    """(k): one eager stage per precision decoding with layerline's kernels and with torch's in
    turns, best of --rounds each."""
    from layerline.checkpoint import read_index
    from layerline.model import cpu_kernels
    from layerline.model.loader import load_stage
    layers = read_index(ckpt).num_layers
    for prec in ("bf16", "int8"):
        stage = load_stage(ckpt, 0, layers, True, True, precision=prec)
        if not cpu_kernels.enabled():
            print(f"(k) {prec}: no decode kernels here ({cpu_kernels.status()})", flush=True)
            return
        isa = cpu_kernels.status()
        best = {"ours": 0.0, "torch": 0.0}
        try:
            for _ in range(a.rounds):
                for who in best:
                    cpu_kernels.use_isa(isa if who == "ours" else "off")
                    best[who] = max(best[who], decode_rate(stage, prompt, a.new))
        finally:
            cpu_kernels.use_isa(isa)
        out[f"k_{prec}"] = best
        print(f"(k) decode kernels ({isa}) vs torch's, eager {prec}: {best['ours']:.1f} vs {best['torch']:.1f} "
              f"tokens/s = {best['ours'] / best['torch']:.2f}x", flush=True)
        del stage


def _part_w(a, ckpt: str, out: dict) -> None:
    """(w): the middle third of the model as one eager int8 stage (as a stage of three), each step
    after an idle (two such steps, as in a three-stage pipeline, and 16 ms, as beside slower
    stages), with the worker's idle-priority spinners (layerline.awake) and without, in turns,
    median step of each."""
    from layerline.awake import Awake
    from layerline.checkpoint import read_index
    from layerline.model.loader import load_stage
    n = read_index(ckpt).num_layers
    stage = load_stage(ckpt, n // 3, 2 * n // 3, False, False, precision="int8")
    hidden = stage.args.hidden_size
    cache = stage.new_cache(1, 4096)
    stage(torch.zeros(1, 128, hidden, dtype=stage.dtype), start_pos=0, cache=cache)
    x = torch.zeros(1, 1, hidden, dtype=stage.dtype)

    def steps(awake, idle: float, k: int = 16) -> float:
        times = []
        for _ in range(k):
            awake.poke()  # as the worker does after each message
            if idle:
                time.sleep(idle)
            t0 = time.perf_counter()
            stage(x, start_pos=128, cache=cache)  # the same position again: its KV is overwritten
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    on, off = Awake(torch.get_num_threads()), Awake(0)
    try:
        if not on.procs:
            print("(w) no spinners on this platform (Linux only)", flush=True)
            return
        steps(off, 0.0)
        idles = {"an idle of two steps": 2 * steps(off, 0.0), "16 ms idle": 0.016}
        med: dict = {(i, w): [] for i in idles for w in ("on", "off")}
        for _ in range(max(a.rounds, 5)):
            for i, idle in idles.items():
                for w, aw in (("on", on), ("off", off)):
                    med[i, w].append(steps(aw, idle))
    finally:
        on.close()
    res = {i: {w: statistics.median(med[i, w]) for w in ("on", "off")} for i in idles}
    out["w"] = {i: {"idle_s": idles[i], "step_s_awake": r["on"], "step_s_idle": r["off"]} for i, r in res.items()}
    for i, r in res.items():
        print(f"(w) one int8 stage ({n // 3}:{2 * n // 3}), each step after {i} ({idles[i] * 1e3:.1f} ms): "
              f"{r['on'] * 1e3:.2f} ms with the worker's spinners vs {r['off'] * 1e3:.2f} without = "
              f"{r['off'] / r['on']:.2f}x faster", flush=True)


def _part_q(a, ckpt: str, prompt: torch.Tensor, dtype: torch.dtype, out: dict) -> None:
    from transformers import AutoModelForCausalLM

    from layerline.checkpoint import read_index
    from layerline.model.loader import load_stage
    from layerline.model.quant import int4_kernel_error
    new = a.new
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()

    precs = [a.precision, "int8"] + (["int4"] if int4_kernel_error() is None else [])
    layers = read_index(ckpt).num_layers
    stages = {}
    for p in precs:
        stages[p] = load_stage(ckpt, 0, layers, True, True, precision=p)
        stages[p].compile(a.compile)
    t0 = time.perf_counter()
    for st in stages.values():
        decode_rate(st, prompt, new)  # warm: compiles when compiling
    warm = time.perf_counter() - t0
    hf_decode_rate(hf, prompt, 2)  # warm
    best = dict.fromkeys(["transformers", *precs], 0.0)
    for _ in range(a.rounds):
        best["transformers"] = max(best["transformers"], hf_decode_rate(hf, prompt, new))
        for p, st in stages.items():
            best[p] = max(best[p], decode_rate(st, prompt, new))
    h = best["transformers"]
    out["q"] = {"compile": a.compile, "transformers_tok_s": h, "warmup_s": warm,
                **{f"{p}_tok_s": best[p] for p in precs}, **{f"{p}_ratio": best[p] / h for p in precs}}
    print(f"(q) interleaved, --compile {a.compile} (warm-up {warm:.0f} s), best of {a.rounds} rounds: transformers "
          f"{a.precision} {h:.1f} tokens/s; " + "; ".join(f"{p} {best[p]:.1f} = {best[p] / h:.2f}x" for p in precs),
          flush=True)


# issue #15: one compiled stage against transformers bf16, per precision
COMPILED_GOALS = {"bf16": 3.0, "int8": 4.5, "int4": 6.5}


def _part_a(a, ckpt: str, prompt: torch.Tensor, dtype: torch.dtype, out: dict) -> None:
    from layerline.model.quant import int4_kernel_error
    hf = transformers_generate(ckpt, prompt, a.new, dtype)
    # layerline's stages reserve the most a worker's sequence may: decoding must not pay for it
    one, _ = ours_one_stage(ckpt, prompt, a.new, a.precision, reserve=WORKER_RESERVE)
    q8, _ = ours_one_stage(ckpt, prompt, a.new, "int8", reserve=WORKER_RESERVE)
    out["a"] = {"transformers_tok_s": hf, "layerline_tok_s": one, "ratio": one / hf,
                "layerline_int8_tok_s": q8, "int8_ratio": q8 / hf}
    print(f"(a) one stage vs transformers generate ({a.precision}): {one:.1f} vs {hf:.1f} tokens/s = {one / hf:.2f}x "
          f"eager, KV reserve {WORKER_RESERVE} tokens; with --precision int8 (weight-only): {q8:.1f} "
          f"tokens/s = {q8 / hf:.2f}x", flush=True)
    quants = ["int8"]
    if int4_kernel_error() is None:
        q4, _ = ours_one_stage(ckpt, prompt, a.new, "int4", reserve=WORKER_RESERVE)
        out["a"].update(layerline_int4_tok_s=q4, int4_ratio=q4 / hf)
        print(f"(a) with --precision int4 (weight-only, groups of 32): {q4:.1f} tokens/s = {q4 / hf:.2f}x "
              "transformers", flush=True)
        quants.append("int4")
    else:
        print(f"(a) int4 skipped: {int4_kernel_error()}", flush=True)
    if a.compile != "off":
        for prec in (a.precision, *quants):
            rate, warm = ours_one_stage(ckpt, prompt, a.new, prec, a.compile, reserve=WORKER_RESERVE)
            out["a"][f"compile_{prec}_tok_s"] = rate
            out["a"][f"compile_{prec}_ratio"] = rate / hf
            out["a"][f"compile_{prec}_warmup_s"] = warm
            goal = COMPILED_GOALS.get(prec)
            print(f"(a) with --compile {a.compile} --precision {prec}: {rate:.1f} tokens/s = {rate / hf:.2f}x "
                  f"transformers (warm-up {warm:.0f} s){f'; goal {goal}x' if goal else ''}", flush=True)


def _parts_bc(a, ckpt: str, prompt: torch.Tensor, out: dict) -> None:
    pc = a.pipeline_compile
    p1, p3, p34 = pipelines(ckpt, prompt[0].tolist(), a.new, a.precision, compile=pc)
    out["b"] = {"one_stage_tok_s": p1, "three_stage_tok_s": p3, "ratio": p3 / p1, "compile": pc}
    print(f"(b) three local stages vs one (--compile {pc}): {p3:.1f} vs {p1:.1f} tokens/s = {p3 / p1:.2f}x "
          "(goal 0.9x)", flush=True)
    out["c"] = {"one_seq_one_stage_tok_s": p1, "four_seq_three_stage_tok_s": p34, "ratio": p34 / p1, "compile": pc}
    print(f"(c) three stages, four sequences together vs one sequence on one stage: {p34:.1f} vs {p1:.1f} "
          f"tokens/s = {p34 / p1:.2f}x (goal 2.5x)", flush=True)


def _part_d(out: dict) -> None:
    raw, wired = hop_overhead()
    enc_us, dec_us = wire_cpu_us()
    out["d"] = {"raw_rtt_s": raw, "wire_rtt_s": wired, "ratio": wired / raw,
                "warm_encode_us": enc_us, "warm_decode_us": dec_us}
    print(f"(d) wire round trip vs raw zmq, 2 KiB, echoed by another process: {wired * 1e3:.3f} vs "
          f"{raw * 1e3:.3f} ms = {wired / raw:.2f}x (goal 1.5x); in a warm loop one encode takes "
          f"{enc_us:.1f} us and one decode {dec_us:.1f} us (a round trip has two of each)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
