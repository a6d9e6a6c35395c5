"""Checkpoints: the tensor index (headers only), the config, and demo checkpoints.

A checkpoint is a Hugging Face model dir or a `.gguf` file (`gguf_checkpoint`). The index is read
from the safetensors headers alone (8-byte length + JSON), or the GGUF header alone, so planning
a 100 GB model costs a few kilobytes of reads. Either way tensors are keyed by HF names.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LayerlineError

# Bytes per element of every safetensors dtype we may meet in a header.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
MAX_HEADER_BYTES = 100 * 2**20
LAYER_RE = re.compile(r"^(?:model\.layers|blk|transformer\.h|model\.decoder\.layers)\.(\d+)\.")


# a staged checkpoint (layerline.staging) holds one stage's tensors; this file says which
STAGE_MANIFEST = "layerline-stage.json"
# the families layerline's model code runs (config.json model_type)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")


class CheckpointError(LayerlineError):
    """A checkpoint is missing, malformed or of an unsupported kind."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # file name relative to the checkpoint dir (a GGUF: the file's own name)
    nbytes: int  # at `dtype` (a quantized GGUF tensor: its size dequantized to the planned dtype)
    stored_type: str | None = None  # GGUF only: the on-disk tensor type (Q4_1, Q8_0, F32, ...)
    stored_bytes: int | None = None  # GGUF only: the on-disk bytes

    @property
    def layer(self) -> int | None:
        m = LAYER_RE.match(self.name)
        return int(m.group(1)) if m else None


@dataclass
class CheckpointIndex:
    path: str
    config: dict
    tensors: dict[str, TensorEntry] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        layers = {t.layer for t in self.tensors.values() if t.layer is not None}
        return max(layers) + 1 if layers else 0

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of one .safetensors file, validated for size."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes is over the {MAX_HEADER_BYTES} limit")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    return header


def _entries_of(path: Path) -> tuple[list[TensorEntry], int]:
    """The file's tensors, and where their data ends (offset from the end of the header)."""
    out, end_max = [], 0
    for name, meta in read_safetensors_header(path).items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
            start, end = (int(o) for o in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({e})") from e
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if end - start != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} spans {end - start} bytes but its shape needs {nbytes}")
        out.append(TensorEntry(name, dtype, shape, path.name, nbytes))
        end_max = max(end_max, end)
    return out, end_max


def is_gguf(ckpt: str | os.PathLike) -> bool:
    """Whether the checkpoint is a GGUF file rather than a Hugging Face dir."""
    from .gguf_checkpoint import is_gguf as _is_gguf
    return _is_gguf(ckpt)


def read_config(ckpt: str | os.PathLike) -> dict:
    """The model's config.json dict; for a GGUF file, the same keys derived from its metadata."""
    if is_gguf(ckpt):
        from .gguf_checkpoint import gguf_config
        return gguf_config(ckpt)
    p = Path(ckpt) / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{p}: missing; layerline_checkpoint must be a Hugging Face model dir "
                              "(make one with `layerline demo-checkpoint DIR`)") from None
    except ValueError as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{p}: not a JSON object")
    return cfg


def read_index(ckpt: str | os.PathLike, check: bool = True) -> CheckpointIndex:
    """Tensor index of a checkpoint dir (config.json and safetensors headers only) or of a GGUF
    file (its header only). check: also refuse a dir whose files are cut short or whose config
    and tensors disagree (check_index)."""
    if is_gguf(ckpt):
        from .gguf_checkpoint import gguf_index
        return gguf_index(ckpt)
    root = Path(ckpt)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory; set layerline_checkpoint to a model dir "
                              "or a .gguf file, or make one with `layerline demo-checkpoint DIR`")
    config = read_config(root)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: holds no *.safetensors files")
    idx = CheckpointIndex(str(root), config)
    for f in files:
        size = f.stat().st_size
        entries, data_end = _entries_of(f)
        for e in entries:
            if e.name in idx.tensors:
                raise CheckpointError(f"{root}: tensor {e.name!r} appears in both {idx.tensors[e.name].file} and {f.name}")
            idx.tensors[e.name] = e
        end = _header_end(f) + data_end if check else 0
        if end > size:
            raise CheckpointError(f"{f}: truncated: its header places tensor data up to byte {end} but the file has "
                                  f"{size} bytes; copy or download it again")
    if check:
        check_index(idx, _staged_range(root))
    return idx


def _staged_range(root: Path) -> tuple[int, int, bool] | None:
    """(start, end, first) of a staged checkpoint, else None (the whole model)."""
    try:
        man = json.loads((root / STAGE_MANIFEST).read_text())
        a, b = man["layers"]
        return int(a), int(b), bool(man.get("first"))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{root / STAGE_MANIFEST}: not a stage manifest ({e}); stage the checkpoint "
                              "again (playbooks/stage.yml)") from None


def _header_end(path: Path) -> int:
    """Where a safetensors file's data starts: its 8-byte length plus the header's bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n


def _config_int(cfg: dict, key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"config.json: {key} is {'missing' if key not in cfg else repr(v)}; "
                              "it must be a positive integer")
    return v


def check_index(idx: CheckpointIndex, staged: tuple[int, int, bool] | None = None) -> None:
    """A Hugging Face checkpoint's config and tensors agree: a supported family, the keys the
    model needs, every layer's tensors (a staged one: its range's) with the shapes the config
    gives (headers only)."""
    cfg = idx.config
    mtype = cfg.get("model_type", "llama")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"config.json: model_type {mtype!r} is not supported; layerline runs "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
    h, heads = _config_int(cfg, "hidden_size"), _config_int(cfg, "num_attention_heads")
    want = dict(cfg, hidden_size=h, num_attention_heads=heads,
                num_hidden_layers=_config_int(cfg, "num_hidden_layers"),
                intermediate_size=_config_int(cfg, "intermediate_size"), vocab_size=_config_int(cfg, "vocab_size"),
                num_key_value_heads=_config_int(cfg, "num_key_value_heads", heads),
                head_dim=_config_int(cfg, "head_dim", h // heads if h % heads == 0 else None))
    if mtype == "mixtral":
        want["num_local_experts"] = _config_int(cfg, "num_local_experts")
    layers = want["num_hidden_layers"]
    beyond = sorted({t.layer for t in idx.tensors.values() if t.layer is not None and t.layer >= layers})
    if beyond:
        raise CheckpointError(f"{idx.path}: the weights hold layer {beyond[-1]} but config.json num_hidden_layers "
                              f"is {layers}; the config and the weights are of different models")
    for name, shape in demo_tensor_shapes(want):
        t = idx.tensors.get(name)
        if t is None:
            m = LAYER_RE.match(name)
            needed = (staged[0] <= int(m.group(1)) < staged[1]) if m and staged else \
                (bool(m) or (name == "model.embed_tokens.weight" and (staged is None or staged[2])))
            if needed:
                raise CheckpointError(f"{idx.path}: tensor {name} is missing (config.json num_hidden_layers "
                                      f"{layers}); the checkpoint is incomplete")
            continue   # lm_head / final norm: tie_word_embeddings defaults differ between families
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{idx.path}: tensor {name} has shape {list(t.shape)} but config.json gives "
                                  f"{list(shape)}; the config and the weights are of different models")


# --- demo checkpoints -------------------------------------------------------------------

DEMO_DEFAULTS = {
    # about 250M parameters: the default demo model
    "llama": dict(hidden=1024, layers=16, heads=16, kv_heads=4, intermediate=2816, vocab=32000),
    # small models of the other families (a few M parameters): tests and quick demos
    "mistral": dict(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=768, vocab=1000, sliding_window=256),
    "qwen2": dict(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=768, vocab=1000, sliding_window=None),
    "mixtral": dict(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=512, vocab=1000,
                    experts=4, experts_per_tok=2, sliding_window=None),
}
DEMO_ARCHS = tuple(DEMO_DEFAULTS)
_ARCH_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mixtral": "MixtralForCausalLM"}


def demo_config(arch: str = "llama", layers: int | None = None, hidden: int | None = None,
                heads: int | None = None, kv_heads: int | None = None,
                intermediate: int | None = None, vocab: int | None = None, *,
                sliding_window: int | None = None, experts: int | None = None,
                experts_per_tok: int | None = None) -> dict:
    """config.json of a demo model of family `arch` (llama | mistral | qwen2 | mixtral), as
    transformers writes it for that family's *ForCausalLM.

    sliding_window: attention window (mistral, mixtral; qwen2 turns use_sliding_window on for all
    layers); experts / experts_per_tok: Mixtral's num_local_experts / num_experts_per_tok.
    """
    if arch not in DEMO_DEFAULTS:
        raise CheckpointError(f"--arch {arch}: unknown; choose one of {', '.join(DEMO_DEFAULTS)}")
    d = dict(DEMO_DEFAULTS[arch])
    extra = dict(sliding_window=sliding_window, experts=experts, experts_per_tok=experts_per_tok)
    for k, v in extra.items():
        if v is not None and k not in d:
            raise CheckpointError(f"--{k.replace('_', '-')} {v}: not a setting of --arch {arch}")
    for k, v in dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     intermediate=intermediate, vocab=vocab, **extra).items():
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise CheckpointError(f"--{k.replace('_', '-')} {v}: must be a positive integer")
            d[k] = v
    if hidden is not None and intermediate is None:
        d["intermediate"] = 256 * math.ceil(hidden * 8 / 3 / 256)
    if hidden is not None and heads is None:
        d["heads"] = max(1, d["hidden"] // 64)
        d["kv_heads"] = kv_heads or max(1, d["heads"] // 4)
    if d["hidden"] % d["heads"] or d["heads"] % d["kv_heads"]:
        raise CheckpointError(f"--hidden {d['hidden']} must divide by heads {d['heads']}, "
                              f"and heads by kv heads {d['kv_heads']}")
    if arch == "mixtral" and d["experts_per_tok"] > d["experts"]:
        raise CheckpointError(f"--experts-per-tok {d['experts_per_tok']}: more than --experts {d['experts']}")
    cfg = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": arch,
        "vocab_size": d["vocab"],
        "hidden_size": d["hidden"],
        "intermediate_size": d["intermediate"],
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "head_dim": d["hidden"] // d["heads"],
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    if arch == "llama":
        return cfg
    for k in ("attention_bias", "mlp_bias"):  # Llama-only keys
        cfg.pop(k)
    if arch == "mistral":
        cfg["sliding_window"] = d["sliding_window"]
    elif arch == "qwen2":
        # q/k/v biases (always, in Qwen2) and tied embeddings, like the small Qwen2 / Qwen2.5 models
        window = d["sliding_window"]
        cfg.update(rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                   use_sliding_window=window is not None, sliding_window=window or 4096,
                   max_window_layers=0 if window is not None else d["layers"])
    elif arch == "mixtral":
        cfg.update(rope_theta=1000000.0, sliding_window=d["sliding_window"], num_local_experts=d["experts"],
                   num_experts_per_tok=d["experts_per_tok"], output_router_logits=False,
                   router_aux_loss_coef=0.02, router_jitter_noise=0.0)
    return cfg


def demo_tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of every tensor of a Llama-family checkpoint (Llama, Mistral, Qwen2 with
    its q/k/v biases, Mixtral with experts in the Hugging Face hub layout), in file order."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    mtype = cfg.get("model_type", "llama")
    qkv_bias = mtype == "qwen2" or (mtype == "llama" and cfg.get("attention_bias"))
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,))]
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            out += [(p + f"self_attn.{proj}_proj.weight", (rows, h))]
            if qkv_bias:
                out += [(p + f"self_attn.{proj}_proj.bias", (rows,))]
        out += [(p + "self_attn.o_proj.weight", (h, q))]
        if mtype == "llama" and cfg.get("attention_bias"):
            out += [(p + "self_attn.o_proj.bias", (h,))]
        out += [(p + "post_attention_layernorm.weight", (h,))]
        if mtype == "mixtral":
            out += [(p + "block_sparse_moe.gate.weight", (cfg["num_local_experts"], h))]
            for e in range(cfg["num_local_experts"]):
                x = p + f"block_sparse_moe.experts.{e}."
                out += [(x + "w1.weight", (i, h)), (x + "w2.weight", (h, i)), (x + "w3.weight", (i, h))]
        else:
            out += [
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
    out += [("model.norm.weight", (h,))]
    if not cfg.get("tie_word_embeddings"):
        out += [("lm_head.weight", (v, h))]
    return out


def write_demo_checkpoint(out: str | os.PathLike, arch: str = "llama", layers: int | None = None,
                          hidden: int | None = None, seed: int = 0, dtype: str = "bfloat16",
                          shard_bytes: int = 200 * 2**20, progress=None, **sizes) -> Path:
    """Write a deterministic random-init checkpoint in Hugging Face layout.

    arch: llama | mistral | qwen2 | mixtral (see `demo_config`; `sizes` takes its other keywords).

    Reuses an existing one made with the same arguments (a stamp file records them), so
    the demo is made once. Written to a temp dir and renamed, so a crash leaves nothing half-made.
    """
    import torch
    from safetensors.torch import save_file

    cfg = demo_config(arch, layers=layers, hidden=hidden, **sizes)
    cfg["torch_dtype"] = dtype
    out = Path(out)
    stamp = {"arch": arch, "seed": seed, "config": cfg, "format": 1}
    stamp_path = out / "layerline-demo.json"
    if stamp_path.exists():
        try:
            if json.loads(stamp_path.read_text()) == stamp:
                return out
        except ValueError:
            pass
    if out.exists() and any(out.iterdir()) and not stamp_path.exists():
        raise CheckpointError(f"{out}: exists and is not a layerline demo checkpoint; choose an empty dir")
    tdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = demo_tensor_shapes(cfg)
    shards: list[dict] = [{}]
    size = 0
    for k, (name, shape) in enumerate(shapes):
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)  # not all-ones, so norms are exercised
        elif name.endswith(".bias"):
            t = torch.randn(shape, generator=gen) * 0.1  # large enough to matter
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        t = t.to(tdtype)
        nb = t.numel() * t.element_size()
        if size and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
        if progress and k % 9 == 0:
            progress(k + 1, len(shapes))
    weight_map, total = {}, 0
    for n, shard in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2))
    (tmp / "layerline-demo.json").write_text(json.dumps(stamp, indent=2))
    if out.exists():
        for f in out.iterdir():
            f.unlink()
        out.rmdir()
    tmp.rename(out)
    return out
