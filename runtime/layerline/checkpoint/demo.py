"""Deterministic random-init demo checkpoints in Hugging Face layout, and the tensor names and
shapes of each supported family (what `check_index` holds a dir's weights to)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..errors import CheckpointError

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
