"""`layerline …`: the command line that playbooks, benchmarks and users call.

Every user mistake ends in one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from .cost import COMPILE_MODES
from .errors import LayerlineError


def _progress(done: int, total: int) -> None:
    print(f"\r  writing tensors {done}/{total}", end="", file=sys.stderr, flush=True)


def cmd_demo_checkpoint(a) -> int:
    from .checkpoint import write_demo_checkpoint
    sizes = {k: getattr(a, k) for k in ("heads", "kv_heads", "intermediate", "vocab", "sliding_window",
                                        "experts", "experts_per_tok") if getattr(a, k) is not None}
    t0 = time.perf_counter()
    out = write_demo_checkpoint(a.out, arch=a.arch, layers=a.layers, hidden=a.hidden, seed=a.seed,
                                dtype=a.dtype, progress=_progress if sys.stderr.isatty() else None, **sizes)
    print(f"checkpoint {out} ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


def cmd_index(a) -> int:
    from .checkpoint import read_index
    from .cost import model_cost
    idx = read_index(a.checkpoint)
    cost = model_cost(idx)
    if a.json:
        print(json.dumps({"path": idx.path, "num_layers": idx.num_layers, "total_bytes": idx.total_bytes,
                          "tensors": len(idx.tensors), "cost": cost.to_dict()}))
        return 0
    print(f"{idx.path}: {idx.num_layers} layers, {len(idx.tensors)} tensors, {idx.total_bytes / 2**20:.1f} MiB "
          f"stored as {cost.stored_precision}")
    print(f"  embedding {cost.embed_params:,} params, head {cost.head_params:,} params"
          f"{' (tied)' if cost.tied_embeddings else ''}")
    print(f"  per layer: dense {cost.dense_params[0]:,} params, experts {cost.expert_params[0]:,}, "
          f"KV width {cost.kv_width} elements/token")
    return 0


def _load_caps(path: str) -> dict[str, dict]:
    try:
        data = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise LayerlineError(f"--caps {path}: cannot read JSON ({e})") from None
    if isinstance(data, list):
        names = [str(c.get("hostname")) if isinstance(c, dict) else "" for c in data]
        if len(set(names)) != len(names) or "None" in names:
            names = [f"host{i}" for i in range(len(data))]
        return dict(zip(names, data))
    if isinstance(data, dict):
        return data
    raise LayerlineError(f"--caps {path}: must be a list of NodeCaps or an object of them keyed by host")


def cmd_plan(a) -> int:
    from .checkpoint import read_index
    from .cost import CostOptions, model_cost
    from .planner import Node, make_plan, plan_table
    caps = _load_caps(a.caps)
    cost = model_cost(read_index(a.checkpoint))
    opts = CostOptions(objective=a.objective, context=a.context, batch=a.batch,
                       precision_ladder=a.precision_ladder.split(",") if a.precision_ladder else [],
                       on_unknown_kv=a.on_unknown_kv)
    nodes = [Node(host=h, caps=c, endpoint=f"tcp://{c.get('addr', '127.0.0.1')}:9100") for h, c in caps.items()]
    plan = make_plan(nodes, cost, opts, a.policy)
    print(json.dumps(plan, indent=2) if a.json else plan_table(plan))
    return 0


def cmd_drive(a) -> int:
    import torch
    from .driver import Pipeline, drive_report, tolerance
    from .generate import Sampling, generate
    cfg = json.loads(open(os.path.join(a.checkpoint, "config.json")).read())
    g = torch.Generator().manual_seed(a.seed)
    tok = None
    if a.input_ids or a.prompt:
        prompts, tok = _prompts(a)
    else:  # random prompts of --seq tokens, one per --sequences
        prompts = [torch.randint(0, int(cfg["vocab_size"]), (a.seq,), generator=g).tolist()
                   for _ in range(max(1, a.sequences))]
    ids = torch.tensor([prompts[0]])
    with Pipeline(a.first, reply_host=a.reply_host, timeout_s=a.timeout, keys_dir=a.keys, first_key=a.first_key,
                  curve=a.curve) as pipe:
        pipe.forward(ids[:, :1])  # warm the path (connections, first allocations)
        r = pipe.forward(ids)
        result = {"tokens": ids.shape[1], "stages": r.timings, "wall_s": r.wall_s, "hop_s": r.hop_s,
                  "logits_shape": list(r.logits.shape), "next_token": int(r.logits[0, -1].argmax())}
        if a.generate:
            gen = generate(pipe, prompts, a.generate, Sampling(a.temperature, a.top_p, a.seed),
                           eos=_eos(a.checkpoint, a.ignore_eos))
            steps = max(1, len(gen.steps))
            result["generate"] = {
                "new_tokens": gen.tokens, "seconds": gen.seconds, "tokens_per_s": gen.tokens_per_s,
                "decode_tokens_per_s": gen.decode_tokens_per_s(),
                "stage_seconds": [t / steps for t in gen.stage_seconds()]}
            if tok is not None:
                result["generate"]["text"] = [tok.decode(t) for t in gen.tokens]
    if a.reference:
        from .model.loader import load_stage
        from .checkpoint import read_index
        full = load_stage(a.checkpoint, 0, read_index(a.checkpoint).num_layers, True, True, precision=a.precision)
        ref = full(ids)
        diff = float((ref - r.logits).abs().max())
        tol = tolerance(a.precision, ref)
        result.update(max_abs_diff=diff, tolerance=tol, ok=diff <= tol, precision=a.precision)
    print(json.dumps(result) if a.json else drive_report(result))
    return 0 if result.get("ok", True) else 1


def _free_ports(n: int) -> list[int]:
    """n free loopback ports, each with its +1 control port also free."""
    out: list[int] = []
    while len(out) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        if p not in out and p + 1 not in out and p - 1 not in out:
            out.append(p)
    return out


def local_keys(tmp: str, n: int) -> str:
    """Fresh CURVE keys for n local stages (stage0..) and the driver: tmp/keys/{store,stageI,controller}."""
    from . import keys
    root = os.path.join(tmp, "keys")
    names = [f"stage{i}" for i in range(n)]
    keys.make_store(os.path.join(root, "store"), names)
    for name in [*names, keys.CONTROLLER]:
        keys.install(os.path.join(root, "store"), name, os.path.join(root, name), [*names, keys.CONTROLLER])
    return root


def local_stages(checkpoint: str, n: int, precision: str, kv_context: int = 4096, threads: int | None = None,
                 curve: str = "auto", compile: str = "off", compile_cache: str | None = None,
                 ready_timeout: float | None = None):
    """Start n workers on this machine (no Ansible); yields (procs, first endpoint, tmpdir).

    compile: the workers' --compile mode; they compile before they are ready, so the wait for
    them grows from 5 minutes to 30 unless ready_timeout says otherwise.

    With curve="on" every socket runs CURVE with fresh keys under tmpdir/keys (the driver's
    keys dir is tmpdir/keys/controller, stage 0's name "stage0").
    """
    from .checkpoint import read_index
    L = read_index(checkpoint).num_layers
    if not 1 <= n <= L:
        raise LayerlineError(f"--local-stages {n}: must be 1..{L} (the model's layers)")
    bounds = [round(i * L / n) for i in range(n + 1)]
    ports = _free_ports(n)
    tmp = tempfile.mkdtemp(prefix="layerline-local-")
    keys_root = local_keys(tmp, n) if curve == "on" else None
    procs = []
    for i in range(n):
        argv = [sys.executable, "-m", "layerline.worker", "--checkpoint", checkpoint,
                "--layers", f"{bounds[i]}:{bounds[i + 1]}", "--precision", precision,
                "--kv-context", str(kv_context), "--bind", f"tcp://127.0.0.1:{ports[i]}",
                "--name", f"stage{i}", "--ready-file", os.path.join(tmp, f"ready{i}.json")]
        if threads:
            argv += ["--threads", str(threads)]
        if compile != "off":
            argv += ["--compile", compile]
            argv += ["--compile-cache", compile_cache] if compile_cache else []
        if keys_root:
            argv += ["--curve", "on", "--keys", os.path.join(keys_root, f"stage{i}")]
            argv += [] if i == n - 1 else ["--next-key", f"stage{i + 1}"]
        argv += ["--first"] if i == 0 else []
        argv += ["--last"] if i == n - 1 else ["--next", f"tcp://127.0.0.1:{ports[i + 1]}"]
        procs.append(subprocess.Popen(argv, stdout=open(os.path.join(tmp, f"worker{i}.log"), "w"),
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    deadline = time.time() + (ready_timeout or (300 if compile == "off" else 1800))
    for i, p in enumerate(procs):
        while not os.path.exists(os.path.join(tmp, f"ready{i}.json")):
            if p.poll() is not None or time.time() > deadline:
                stop_local(procs)
                log = open(os.path.join(tmp, f"worker{i}.log")).read()[-2000:]
                raise LayerlineError(f"local stage {i} did not start: {log.strip().splitlines()[-1] if log.strip() else 'no output'}")
            time.sleep(0.05)
    return procs, f"tcp://127.0.0.1:{ports[0]}", tmp


def stop_local(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def _prompts(a) -> tuple[list[list[int]], object | None]:
    """Token-id prompts from --input-ids, or text prompts through the checkpoint's tokenizer.json."""
    tok = None
    if a.prompt:
        path = os.path.join(a.checkpoint, "tokenizer.json")
        if not os.path.exists(path):
            raise LayerlineError(f"--prompt: {path} is missing; give --input-ids instead")
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(path)
        return [tok.encode(t).ids for t in a.prompt], tok
    out = []
    for spec in a.input_ids or []:
        try:
            ids = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            raise LayerlineError(f"--input-ids {spec!r}: must be comma-separated integers") from None
        if not ids:
            raise LayerlineError("--input-ids: give at least one token id")
        out.append(ids)
    if not out:
        raise LayerlineError("give --input-ids 1,2,3 (repeat for several sequences) or --prompt TEXT")
    return out, tok


def _eos(checkpoint: str, ignore: bool) -> int | None:
    if ignore:
        return None
    for name in ("generation_config.json", "config.json"):
        try:
            v = json.loads(open(os.path.join(checkpoint, name)).read()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int):
            return v
    return None


def cmd_generate(a) -> int:
    from .driver import Pipeline
    from .generate import Sampling, generate
    prompts, tok = _prompts(a)
    sampling = Sampling(a.temperature, a.top_p, a.seed)
    if a.compile != "off":
        print(f"layerline generate: the workers compile their decode step first (--compile {a.compile})",
              file=sys.stderr, flush=True)
    procs, first, tmp = local_stages(a.checkpoint, a.local_stages, a.precision, threads=a.threads, curve=a.curve,
                                     compile=a.compile)
    try:
        keys_dir = os.path.join(tmp, "keys", "controller") if a.curve == "on" else None
        with Pipeline(first, keys_dir=keys_dir, first_key="stage0", curve=a.curve) as pipe:
            g = generate(pipe, prompts, a.max_new_tokens, sampling, eos=_eos(a.checkpoint, a.ignore_eos))
    finally:
        stop_local(procs)
        shutil.rmtree(os.path.join(tmp, "keys"), ignore_errors=True)  # throwaway keys, secrets included
    res = {"tokens": g.tokens[0] if len(g.tokens) == 1 else g.tokens, "sequences": g.tokens,
           "stage_seconds": g.stage_seconds(), "seconds": g.seconds, "tokens_per_s": g.tokens_per_s,
           "decode_tokens_per_s": g.decode_tokens_per_s()}
    if tok is not None:
        res["text"] = [tok.decode(t) for t in g.tokens]
    if a.json:
        print(json.dumps(res))
    else:
        for i, t in enumerate(res.get("text") or [" ".join(map(str, t)) for t in g.tokens]):
            print(t if len(g.tokens) == 1 else f"[{i}] {t}")
        print(f"{g.new_tokens} tokens in {g.seconds:.2f} s ({g.tokens_per_s:.1f} tokens/s)", file=sys.stderr)
    return 0


def cmd_stage_checkpoint(a) -> int:
    from .staging import parse_range, stage_checkpoint
    start, end = parse_range(a.layers)
    man = stage_checkpoint(a.checkpoint, start, end, a.first, a.last, a.out)
    print(json.dumps(man) if a.json else
          f"{a.out}: layers {start}:{end}, {man['bytes']} of the model's {man['model_bytes']} bytes"
          f"{'' if man['changed'] else ' (already there)'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="layerline", description="one transformer split layer-wise across machines")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo-checkpoint", help="write a deterministic random-init checkpoint (HF layout)")
    d.add_argument("out")
    d.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "mixtral"])
    d.add_argument("--sliding-window", type=int, help="mistral/mixtral/qwen2: attention window")
    d.add_argument("--experts", type=int, help="mixtral: num_local_experts")
    d.add_argument("--experts-per-tok", type=int, help="mixtral: num_experts_per_tok")
    d.add_argument("--layers", type=int)
    d.add_argument("--hidden", type=int)
    d.add_argument("--heads", type=int)
    d.add_argument("--kv-heads", type=int)
    d.add_argument("--intermediate", type=int)
    d.add_argument("--vocab", type=int)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    d.set_defaults(fn=cmd_demo_checkpoint)

    sc = sub.add_parser("stage-checkpoint", help="a checkpoint dir with only one stage's tensors (weight staging)")
    sc.add_argument("checkpoint")
    sc.add_argument("--layers", required=True, help="A:B, half-open")
    sc.add_argument("--first", action="store_true")
    sc.add_argument("--last", action="store_true")
    sc.add_argument("--out", required=True)
    sc.add_argument("--json", action="store_true")
    sc.set_defaults(fn=cmd_stage_checkpoint)

    i = sub.add_parser("index", help="tensor index and model cost, from headers only")
    i.add_argument("checkpoint")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_index)

    pl = sub.add_parser("plan", help="plan placement from probed caps")
    pl.add_argument("--caps", required=True)
    pl.add_argument("--checkpoint", required=True)
    pl.add_argument("--objective", default="throughput", choices=["throughput", "latency", "memory"])
    pl.add_argument("--policy", default="auto", choices=["auto", "ram_balanced", "uniform"])
    pl.add_argument("--context", type=int, default=4096)
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--precision-ladder", default=None, help="e.g. bf16,int8")
    pl.add_argument("--on-unknown-kv", default="fail", choices=["fail", "assume", "ignore"])
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)

    dr = sub.add_parser("drive", help="push one forward through running workers, timing each stage")
    dr.add_argument("--first", required=True, help="stage 0's endpoint, tcp://HOST:PORT")
    dr.add_argument("--checkpoint", required=True)
    dr.add_argument("--seq", type=int, default=16, help="prompt length")
    dr.add_argument("--seed", type=int, default=0)
    dr.add_argument("--precision", default="fp32")
    dr.add_argument("--reference", action="store_true", help="compare with a one-process forward")
    dr.add_argument("--generate", type=int, default=0, help="also generate this many tokens")
    dr.add_argument("--input-ids", action="append", help="prompt token ids 1,2,3 (repeat: several sequences)")
    dr.add_argument("--prompt", action="append", help="prompt text, with the checkpoint's tokenizer.json")
    dr.add_argument("--sequences", type=int, default=1, help="random prompts generated together")
    dr.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    dr.add_argument("--top-p", type=float, default=1.0)
    dr.add_argument("--ignore-eos", action="store_true")
    dr.add_argument("--reply-host", default="127.0.0.1",
                    help="an address of this machine the last stage can reach (its result socket binds there)")
    dr.add_argument("--keys", default=None,
                    help="the controller's CURVE keys dir (made by playbooks/keys.yml; needed off loopback)")
    dr.add_argument("--first-key", default=None,
                    help="stage 0's host name in KEYS/peers/ (or a .key file, or its z85 public key)")
    dr.add_argument("--curve", default="auto", choices=["auto", "on"],
                    help="auto: CURVE on each socket whose address is not loopback; on: on every socket")
    dr.add_argument("--timeout", type=float, default=120.0)
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(fn=cmd_drive)

    g = sub.add_parser("generate", help="generate on N local worker processes (no Ansible)")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--local-stages", type=int, default=3)
    g.add_argument("--input-ids", action="append", help="1,2,3; repeat for several sequences in flight")
    g.add_argument("--prompt", action="append", help="text, with the checkpoint's tokenizer.json; repeatable")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    g.add_argument("--precision", default="bf16")
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--compile", default="off", choices=COMPILE_MODES,
                   help="torch.compile each worker's decode step (warm-up first; see the README)")
    g.add_argument("--curve", default="auto", choices=["auto", "on"],
                   help="on: run every local socket with CURVE, with fresh throwaway keys")
    g.add_argument("--json", action="store_true")
    g.set_defaults(fn=cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except LayerlineError as e:
        print(f"layerline {a.cmd}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
