"""Decoder layers of the Llama family and its relatives (Llama 2/3, Mistral, Qwen2, Qwen3, Mixtral,
Gemma 2/3, Phi-3), one pipeline *stage* at a time.

gpt-fast style: a dataclass of model args, the KV cache as a module, nothing the forward does
not need. A `Stage` holds a contiguous, half-open layer range [start, end) of the model, plus the
token embedding when it is the first stage and the final norm + LM head when it is the last.

Numerics follow Hugging Face transformers: RMSNorm in float32 and cast back, RoPE cos/sin
computed in float32 from `inv_freq` in the rotate_half layout (the order HF checkpoints' q/k
weights are in). Attention is torch's scaled_dot_product_attention (on the CPU its flash kernel:
softmax in float32, grouped-query heads without copying K/V) over the keys in view behind a
boolean mask: at bf16 a layer's one-token attention took 4-15x less time than the matmul +
softmax it replaced (which built a oneDNN plan per shape), a 512-token prefill's 8-70x less, at
fp32 as much or less (README, "Decode speed"). One new token per row on a CPU with the decode
kernels goes through `cpu_kernels.decode_attention` instead (the k/v write and the attention in one
C++ call): SDPA's flash kernel took about 100 us for one bf16 query over 130 keys, the kernel 11.

Submodule names mirror HF's, so a stage's state_dict key is the HF tensor name without the
leading "model." (layers are keyed by their global index): see `hf_name`.

Family differences: Qwen2 biases q/k/v; Mistral (and Mixtral, and Qwen2 with use_sliding_window)
attend over a sliding window of the last `sliding_window` positions: a query at position p sees
keys p-W+1..p. The KV cache still holds every position, and each window layer reads only the
last W keys of it, so decoding past the window costs O(W). Mixtral replaces the MLP with a
sparse mixture of experts (`moe.SparseMoE`, experts behind an `ExpertStore`). The other families
are the same layer with hooks `ModelArgs` turns on: q/k norms (Qwen3, Gemma 3); Gemma's norms
(scaled by 1 + weight, also after attention and around the MLP), GeGLU, embeddings scaled by
sqrt(hidden), query_pre_attn_scalar, window layers interleaved with global ones, Gemma 3's own RoPE
table for window layers and Gemma 2's soft-capped attention scores (spelled out: SDPA and the decode
kernel cannot cap) and logits; Phi-3's fused qkv / gate-up matrices (`SplitLinear`).

Precision int8 (weight-only): every Linear weight, the token embedding and the LM head are held as
int8 with a float32 scale per output row (`quant`); norms, biases, the Mixtral router, the
activations and the KV cache are bf16 (the precision table, `layerline.precision`). Precision int4
holds every layer's Linear weights as int4 in groups of 32 (`quant.Int4Linear`: layerline's CPU int4
kernel, or torch's where that cannot run) and the embedding and LM head as int8; the rest as at int8.
Precision gguf is a float32 stage whose matrices the loader replaces by the GGUF file's own blocks
(`blocks.BlockLinearModule`, `Stage.replace`); FusedLinears fuses such parts when their block types
agree.

One forward (`Stage._forward`, after gpt-fast's `Transformer.forward`): the new tokens come with a
positions tensor, each layer writes their K/V there with one update (`kv_update`) and attends to
the keys in view. A prefill, a one-token decode step and a step over rows of *different*
sequences, each at its own position (continuous batching: `Stage.forward_rows`), are that one
path, each attending over the filled part of its cache. Compiled (`compile()`), a one-token step
runs the same forward with its attention as one opaque op (`rows_attention`): the projections and
MLPs compile (one graph per row-count bucket), while each row attends over the keys its cache
holds, eagerly, outside the graph, so no cache length is a graph input. (A graph that attended
over the whole buffer behind a mask decoded 4x slower with 4096 tokens reserved.)
"""
from __future__ import annotations

import math
import threading
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import SUPPORTED_MODEL_TYPES, CheckpointError
from ..checkpoint.hf import drop_nulls
from ..errors import LayerlineError
from ..precision import of_dtype, precision, torch_dtype
from . import COMPILE_MODES, cpu_kernels
from .kv import KVCache, StageCache, check_write, kv_update
from .blocks import BlockLinearModule, fuse_blocks, keep_out_of_graphs
from .moe import ExpertStore, SparseMoE
from .quant import (Int4Linear, Int8Embedding, Int8Linear, Linear, int4_linear, int8_linear, make_linear,
                    quant_name, require_int4)

_ROPE_TYPES = ("default", "linear", "llama3")
GEMMA_TYPES = ("gemma2", "gemma3_text")
_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _cfg_err(key: str, what: str) -> CheckpointError:
    return CheckpointError(f"config.json {key}: {what}")


def _pos_int(cfg: dict, key: str, default: int | None = None) -> int:
    v = cfg.get(key)
    if v is None:
        if default is None:
            raise _cfg_err(key, "missing; a Llama-family config.json must set it (e.g. re-export the checkpoint "
                                "with transformers' save_pretrained)")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise _cfg_err(key, f"{v!r} is not a positive integer; fix the value in config.json")
    return v


def _pos_float(cfg: dict, key: str, default: float | None = None, where: str = "") -> float:
    v = cfg.get(key)
    if v is None:
        if default is None:
            raise _cfg_err(where + key, "missing; add it to config.json")
        return float(default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _cfg_err(where + key, f"{v!r} is not a positive number; fix the value in config.json")
    return float(v)


def _bool(cfg: dict, key: str, default: bool) -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _cfg_err(key, f"{v!r} is not true or false; fix the value in config.json")
    return v


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE, else a dict with "rope_type" ("linear" | "llama3")
    max_position_embeddings: int
    attention_bias: bool  # bias on q/k/v projections
    tie_word_embeddings: bool
    o_proj_bias: bool = False  # Llama's attention_bias also biases o_proj; Qwen2 biases q/k/v only
    model_type: str = "llama"
    sliding_window: int | None = None  # attention window (Mistral, Mixtral, Qwen2 with use_sliding_window)
    window_layers: tuple[int, ...] | None = None  # layers that use the window; None: all of them
    num_experts: int = 0  # Mixtral: num_local_experts (0: a dense MLP)
    experts_per_tok: int = 0  # Mixtral: num_experts_per_tok
    # the hooks other families turn on (Gemma 2/3: all but qk_norm for gemma2; Qwen3: qk_norm)
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), in float32 before the cast (Gemma)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before RoPE (q_norm, k_norm)
    sandwich_norm: bool = False  # norms after attention and the MLP too (pre/post_feedforward_layernorm)
    mlp_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float | None = None  # the embedding's output times this (Gemma: sqrt(hidden))
    attn_scale: float | None = None  # query scale (Gemma: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    local_rope_theta: float | None = None  # the window layers' RoPE base, unscaled (Gemma3); None: rope_theta
    attn_softcap: float | None = None  # attention scores through cap * tanh(s / cap) (Gemma2)
    final_softcap: float | None = None  # the logits through cap * tanh(l / cap) (Gemma2)
    fused_proj: bool = False  # q/k/v stored as one qkv_proj, gate/up as one gate_up_proj (Phi-3)

    def rope(self, layer: int) -> int:
        """Which RoPE table `layer` uses: 0 the global one, 1 the window layers' own (local_rope_theta)."""
        return int(self.local_rope_theta is not None and self.window(layer) is not None)

    def window(self, layer: int) -> int | None:
        """The attention window of `layer`, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Model args from a Hugging Face config.json dict (any of SUPPORTED_MODEL_TYPES); keys saved as
        null mean their default, as in transformers.

        Missing or invalid keys raise CheckpointError naming the config.json key.
        """
        if not isinstance(cfg, dict):
            raise CheckpointError("config.json: not a JSON object")
        cfg = drop_nulls(cfg)  # a key saved as null means its default
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise _cfg_err("model_type", f"{model_type!r} is not supported by layerline's model code; "
                                         f"use a {', '.join(SUPPORTED_MODEL_TYPES)} checkpoint")
        gemma = model_type in GEMMA_TYPES
        act_key = "hidden_activation" if gemma and "hidden_activation" in cfg else "hidden_act"
        act = cfg.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
        if act not in _ACTS:
            raise _cfg_err(act_key, f"{act!r} is not supported; only SwiGLU (silu) and GeGLU (gelu_pytorch_tanh) "
                                    "MLPs are")
        if model_type == "llama" and cfg.get("mlp_bias"):
            raise _cfg_err("mlp_bias", "true is not supported; only bias-free MLPs are")
        hidden = _pos_int(cfg, "hidden_size")
        heads = _pos_int(cfg, "num_attention_heads")
        kv_heads = _pos_int(cfg, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise _cfg_err("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}; "
                                                  "fix config.json")
        if cfg.get("head_dim") is None and hidden % heads:
            raise _cfg_err("head_dim", f"missing and hidden_size {hidden} does not divide by "
                                       f"num_attention_heads {heads}; add head_dim to config.json")
        head_dim = _pos_int(cfg, "head_dim", 256 if gemma else hidden // heads)  # transformers' defaults
        if head_dim % 2:
            raise _cfg_err("head_dim", f"{head_dim} is odd; rotary embeddings need an even head_dim")
        max_pos = _pos_int(cfg, "max_position_embeddings", 2048)

        # RoPE: transformers 5 writes "rope_parameters" (rope_theta inside); older configs write
        # "rope_theta" and "rope_scaling" at the top level.
        rp = cfg.get("rope_parameters")
        if rp is not None and not isinstance(rp, dict):
            raise _cfg_err("rope_parameters", f"{rp!r} is not an object; fix config.json")
        local_theta = None
        if model_type == "gemma3_text":  # the window layers' own RoPE base (never scaled); per layer type in 5
            local = (rp or {}).get("sliding_attention")
            local_theta = _pos_float(local if isinstance(local, dict) else cfg,
                                     "rope_theta" if isinstance(local, dict) else "rope_local_base_freq", 10000.0)
        if rp and ("full_attention" in rp or "sliding_attention" in rp):
            rp = rp.get("full_attention")
            if rp is not None and not isinstance(rp, dict):
                raise _cfg_err("rope_parameters.full_attention", f"{rp!r} is not an object; fix config.json")
        scaling = cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise _cfg_err("rope_scaling", f"{scaling!r} is not an object or null; fix config.json")
        theta_src = dict(cfg)
        if rp and rp.get("rope_theta") is not None:
            theta_src = rp
        theta = _pos_float(theta_src, "rope_theta", 1e6 if model_type == "gemma3_text" else 10000.0)
        src_key = "rope_scaling"
        if scaling is None and rp:
            scaling, src_key = rp, "rope_parameters"
        rope_scaling = None
        if scaling:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype not in _ROPE_TYPES:
                raise _cfg_err(f"{src_key}.rope_type", f"{rtype!r} is not supported; "
                                                       f"supported: {', '.join(_ROPE_TYPES)}")
            if rtype != "default":
                rope_scaling = {"rope_type": rtype,
                                "factor": _pos_float(scaling, "factor", where=src_key + ".")}
                if rtype == "llama3":
                    for k in ("low_freq_factor", "high_freq_factor"):
                        rope_scaling[k] = _pos_float(scaling, k, where=src_key + ".")
                    rope_scaling["original_max_position_embeddings"] = _pos_float(
                        scaling, "original_max_position_embeddings", max_pos, where=src_key + ".")
                    if rope_scaling["high_freq_factor"] <= rope_scaling["low_freq_factor"]:
                        raise _cfg_err(f"{src_key}.high_freq_factor",
                                       "must be larger than low_freq_factor; fix config.json")

        qwen2 = model_type == "qwen2"
        # Qwen2 always biases q/k/v (transformers ignores attention_bias there); Mistral and Mixtral
        # never do (transformers hard-codes bias=False); Llama by the key
        if qwen2:
            attention_bias = True
        elif model_type in ("mistral", "mixtral", "phi3"):
            attention_bias = False
        else:
            attention_bias = _bool(cfg, "attention_bias", False)
        n_layers = _pos_int(cfg, "num_hidden_layers")

        window, window_layers = None, None
        if model_type in ("mistral", "mixtral", "phi3"):
            if cfg.get("sliding_window") is not None:
                window = _pos_int(cfg, "sliding_window")
        elif (model_type in ("qwen2", "qwen3") and _bool(cfg, "use_sliding_window", False)) or gemma:
            window = _pos_int(cfg, "sliding_window", 4096 if gemma else None)
            types = cfg.get("layer_types")
            if types is None and gemma:  # transformers' default: every n-th layer global, the rest windowed
                every = _pos_int(cfg, "sliding_window_pattern", 6 if model_type == "gemma3_text" else 2)
                window_layers = tuple(i for i in range(n_layers) if (i + 1) % every)
            elif types is None:  # transformers' default: window from layer max_window_layers on
                first = cfg.get("max_window_layers", 28)
                if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                    raise _cfg_err("max_window_layers", f"{first!r} is not a non-negative integer; fix config.json")
                window_layers = tuple(range(first, n_layers))
            else:
                if (not isinstance(types, list) or len(types) != n_layers
                        or any(t not in ("full_attention", "sliding_attention") for t in types)):
                    raise _cfg_err("layer_types", f"must list full_attention or sliding_attention for each of "
                                                  f"the {n_layers} layers; fix config.json")
                window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")

        experts = per_tok = 0
        if model_type == "mixtral":
            experts = _pos_int(cfg, "num_local_experts", 8)
            per_tok = _pos_int(cfg, "num_experts_per_tok", 2)
            if per_tok > experts:
                raise _cfg_err("num_experts_per_tok", f"{per_tok} is more than num_local_experts {experts}; "
                                                      "fix config.json")
        hooks = {}
        if gemma:
            hooks = dict(norm_offset=True, sandwich_norm=True, qk_norm=model_type == "gemma3_text",
                         embed_scale=hidden ** 0.5, local_rope_theta=local_theta,
                         attn_scale=_pos_float(cfg, "query_pre_attn_scalar", 256) ** -0.5)
            if model_type == "gemma2":
                hooks.update(attn_softcap=_pos_float(cfg, "attn_logit_softcapping", 50.0),
                             final_softcap=_pos_float(cfg, "final_logit_softcapping", 30.0))
            else:  # gemma3: none unless the config sets them
                hooks.update({f"{k}_softcap": _pos_float(cfg, f"{k}_logit_softcapping")
                              for k in ("attn", "final") if cfg.get(f"{k}_logit_softcapping") is not None})
        elif model_type == "qwen3":
            hooks = dict(qk_norm=True)
        elif model_type == "phi3":
            if (rp or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
                raise _cfg_err("partial_rotary_factor", "only 1.0 (RoPE over the whole head) is supported")
            hooks = dict(fused_proj=True)
        return cls(
            vocab_size=_pos_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_pos_int(cfg, "intermediate_size"),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_pos_float(cfg, "rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and not qwen2,
            model_type=model_type,
            sliding_window=window,
            window_layers=window_layers,
            num_experts=experts,
            experts_per_tok=per_tok,
            mlp_act=_ACTS[act],
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", gemma),
            **hooks,
        )


def rope_inv_freq(args: ModelArgs, local: bool = False) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], float32 on the CPU, as transformers computes them.
    local: the window layers' table (base local_rope_theta, unscaled)."""
    dim = args.head_dim
    theta = args.local_rope_theta if local else args.rope_theta
    # explicit device: stages are built under `with torch.device("meta")` by the loader
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu")
                                .to(dtype=torch.float) / dim))
    sc = args.rope_scaling
    if not sc or local:
        return inv_freq
    if sc["rope_type"] == "linear":
        return inv_freq / sc["factor"]
    # llama3 (transformers' _compute_llama3_parameters)
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_llama)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    @staticmethod
    def of(args: ModelArgs, dim: int, dtype: torch.dtype) -> "RMSNorm":
        """The family's norm over `dim` features."""
        return (OffsetRMSNorm if args.norm_offset else RMSNorm)(dim, args.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # eager: one kernel call for eight ops (inductor fuses its own)
            out = cpu_kernels.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scaled by (1 + weight), in float32, cast back last (transformers' Gemma3RMSNorm)."""

    _scale: tuple | None = None  # (the weight's data_ptr and version, 1 + weight) for the kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32: the kernel's numbers are the module's (x * rsqrt(...) in fp32, times 1 + w in fp32); a
        # bf16 x is normed in fp32 and rounded once at the end, which the kernel does not do
        if x.dtype == torch.float32 and not torch.compiler.is_compiling():
            w = self.weight
            # an inference tensor keeps no version counter: its 1 + w is made each call
            key = None if w.is_inference() else (w.data_ptr(), w._version)
            if key is None or self._scale is None or self._scale[0] != key:
                self._scale = (key, 1.0 + w.detach().float())
            out = cpu_kernels.rms_norm(x, self._scale[1], self.eps)
            if out is not None:
                return out
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


# compiled one-token steps: one graph per bucket of rows (padded up to it); more rows go through
# the largest bucket a part at a time
ROWS_BUCKETS = (1, 2, 4, 8)
ROWS_OP = "rows-op"  # the views of a compiled step: attention through rows_attention


class _RowsCall(threading.local):
    """What `rows_attention` reads during one compiled rows step: the stage and its rows' caches,
    set only around that call, in the thread that makes it."""
    stage = None
    caches: list = []
    views: dict = {}  # per attention window, the rows' key views: made by the step's first layer, read by the rest


_ROWS = _RowsCall()


# Defined through torch.library's low-level API, not `torch.library.custom_op`: that one checks
# every call's output for aliasing and wraps it further, 5 us more a call from the compiled
# step's C++ (16 calls a step on the demo model). Its output never aliases an input
# (`Stage.rows_attention` returns a new tensor), which is what that check guards.
_LIB = torch.library.Library("layerline", "FRAGMENT")
_LIB.define("rows_attention(Tensor q, Tensor k, Tensor v, Tensor pos, int layer) -> Tensor")


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                   layer: int) -> torch.Tensor:
    """The attention of a compiled rows step, run eagerly: row i writes its k/v into its own cache
    at pos[i] and attends over that sequence's keys (`Attention._attend_rows`). Rows past the
    call's caches are padding and give zeros. q [B, nh, 1, hd] -> [B, 1, nh * hd]. The cache
    writes are hidden from the graph (the schema mutates nothing): each layer's call takes the
    one before's output, so the graph cannot reorder or drop them."""
    return _ROWS.stage.rows_attention(q, k, v, pos, layer)


_LIB.impl("rows_attention", rows_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("layerline::rows_attention")
def _(q, k, v, pos, layer):
    b, nh, t, hd = q.shape
    return q.new_empty(b, t, nh * hd)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin: eagerly in one kernel call where it applies (inductor fuses
    its own), the same bits either way."""
    if not torch.compiler.is_compiling():
        out = cpu_kernels.rope(x, cos, sin)
        if out is not None:
            return out
    return x * cos + rotate_half(x) * sin


class FusedLinears(nn.Module):
    """Linear layers that read the same input, run as one matrix (q/k/v, gate/up): one GEMV per
    step instead of three or two, which on a CPU saves each one's dispatch and thread start-up.

    The parts keep their modules and state_dict names (the checkpoint's); once `fuse()` has
    run, their weights are views into one concatenated tensor, so the fused matrix costs no
    extra memory and an in-place load updates both. bf16/fp32 Linear, int8 and int4 parts (of
    one group size) fuse: int4's packing keeps each output row's codes apart, so the packed
    parts concatenate by rows (compiled int4 steps: 1.08x, 5.25 vs 5.68 ms, in turns).
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = list(parts)  # a plain list: the parts stay registered (and named) where they are
        self.sizes = [m.out_features for m in parts]
        self.register_buffer("weight", None, persistent=False)
        self.register_buffer("scale", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self.group = None  # int4's group size when int4 parts are fused (its scales are `scale`)
        self.rows = False  # int4 parts in layerline's layout (quant.int4_rows)
        self.blocks = None  # GGUF block parts fused: their one kernel (blocks.fuse_blocks)

    def fuse(self) -> None:
        self.group, self.rows, self.blocks = None, False, None
        parts = list(self.parts)
        kinds = {type(m) for m in parts}
        if kinds == {BlockLinearModule}:  # GGUF blocks: one kernel when the parts share a block type
            self.blocks = fuse_blocks(parts)
            biases = [m.bias for m in parts]
            if self.blocks is None or (any(b is not None for b in biases) and any(b is None for b in biases)):
                self.blocks, self.weight, self.scale, self.bias = None, None, None, None
                return
            self.weight, self.scale = self.blocks.raw, None
            self.bias = torch.cat(biases) if biases[0] is not None else None
            return
        if (kinds not in ({Linear}, {nn.Linear}, {Int8Linear}, {Int4Linear}) or any(m.weight.is_meta for m in parts)
                or len({(getattr(m, "group", None), getattr(m, "rows", None)) for m in parts}) != 1):
            self.weight = self.scale = self.bias = None
            return
        quantized = kinds in ({Int8Linear}, {Int4Linear})
        # int8's scales are per output row [out], layerline's int4 [out, in / 32, 2]; torch's int4
        # [in / group, out, 2]: there the parts' are column views
        sdim = 1 if kinds == {Int4Linear} and not parts[0].rows else 0
        with torch.no_grad():
            w = torch.cat([m.weight for m in parts])
            b = torch.cat([m.bias for m in parts]) if all(m.bias is not None for m in parts) else None
            s = torch.cat([m.scale for m in parts], dim=sdim) if quantized else None
            splits = [t.split(self.sizes, dim=d) if t is not None else [None] * len(parts) for t, d in ((b, 0), (s, sdim))]
            for m, wi, bi, si in zip(parts, w.split(self.sizes), *splits):
                if quantized:
                    m.weight, m.scale = wi, si
                else:
                    m.weight.data = wi
                if bi is not None:
                    m.bias.data = bi
        if b is None and any(m.bias is not None for m in parts):  # some biased, some not: not fused
            self.weight = self.scale = self.bias = None
            return
        self.weight, self.scale, self.bias = w, s, b
        self.group = parts[0].group if kinds == {Int4Linear} else None
        self.rows = kinds == {Int4Linear} and parts[0].rows

    def calls(self) -> list[tuple] | None:
        """`linear_calls` of this forward: the fused product, or each part's."""
        if self.weight is None:
            each = [linear_calls(m) for m in self.parts]
            return None if any(c is None or len(c) != 1 for c in each) else [c[0] for c in each]
        if self.blocks is not None:
            return [self.blocks.call(self.weight, self.bias)]
        if self.group is None and self.scale is None and self.weight.dtype == torch.float32:
            return [(DENSE, self.weight, [], self.bias)]
        return None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.weight is None:
            return tuple(m(x) for m in self.parts)
        if self.blocks is not None:
            y = self.blocks.run(x, self.weight, self.bias)
            y = y if y.dtype == x.dtype else y.to(x.dtype)
        elif self.group is not None:
            y = int4_linear(x, self.weight, self.group, self.scale, self.bias, self.rows)
        elif self.scale is not None:
            y = int8_linear(x, self.weight, self.scale, self.bias)
        else:
            y = cpu_kernels.linear(x, self.weight, self.bias)
        return y.split(self.sizes, dim=-1)


class SplitLinear(nn.Module):
    """One stored matrix whose output is several projections' (Phi-3's qkv_proj, gate_up_proj): the
    product once, split by output rows; the matrix stays its own module (and checkpoint name)."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        super().__init__()
        self.parts = [linear]  # a plain list: the module stays registered where its owner put it
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.parts[0](x).split(self.sizes, dim=-1)

    def calls(self) -> list[tuple] | None:
        return linear_calls(self.parts[0])


DENSE = "dense"  # csrc/layer.h's LayerLinear kind for a float32 matrix (at::linear); the others: gguf_blocks layouts


def linear_calls(m: nn.Module) -> list[tuple] | None:
    """What a fp32 one-token step calls for projection `m` (csrc/layer.h's LayerLinear: kind, weight,
    ints, bias), one entry per product it computes; None where its forward does something else."""
    if isinstance(m, (FusedLinears, SplitLinear)):
        return m.calls()
    if isinstance(m, BlockLinearModule):
        return [m.kernel.call(m.weight, m.bias)]
    if type(m) in (Linear, nn.Linear) and m.weight.dtype == torch.float32:  # F.linear at fp32
        return [(DENSE, m.weight, [], m.bias)]
    return None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, quant=None):
        super().__init__()
        h, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, hd
        self.scale = args.attn_scale or hd ** -0.5
        self.softcap = args.attn_softcap  # scores capped: not what the decode kernel computes
        if args.qk_norm:
            self.q_norm, self.k_norm = RMSNorm.of(args, hd, dtype), RMSNorm.of(args, hd, dtype)
        sizes = [args.num_heads * hd, args.num_kv_heads * hd, args.num_kv_heads * hd]
        if args.fused_proj:  # stored as one matrix (Phi-3's qkv_proj): split after the product
            self.qkv_proj = make_linear(h, sum(sizes), args.attention_bias, dtype, quant)
            self.qkv = SplitLinear(self.qkv_proj, sizes)
        else:
            self.q_proj = make_linear(h, sizes[0], args.attention_bias, dtype, quant)
            self.k_proj = make_linear(h, sizes[1], args.attention_bias, dtype, quant)
            self.v_proj = make_linear(h, sizes[2], args.attention_bias, dtype, quant)
            self.qkv = FusedLinears([self.q_proj, self.k_proj, self.v_proj])
        self.o_proj = make_linear(args.num_heads * hd, h, args.o_proj_bias, dtype, quant)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: list,
                kv: list | None, view: list) -> torch.Tensor:
        """x [B, T, hidden] at positions pos[g] ([T] per row group g; cos/sin [P, 1, T, hd]).

        One group (P = 1) is one sequence of B rows; B groups (P = B, T = 1) are B sequences, row
        i at pos[i] with its own cache. kv: per group, the layer's (k, v) buffers, or None without
        a cache. view: per group, (lo, hi, mask): the key positions lo..hi-1 it attends and a
        [T, keys] mask (True: may attend), or None when every key is visible; or ROWS_OP.
        The projections run over all B rows at once; each of B groups attends over its own keys
        (`_attend_rows`).
        """
        b, t, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x)
        q = q.reshape(b, t, nh, hd).transpose(1, 2)
        k = k.reshape(b, t, nkv, hd).transpose(1, 2)
        v = v.reshape(b, t, nkv, hd).transpose(1, 2)
        if "q_norm" in self._modules:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        if view is ROWS_OP:  # compiled rows: the caches stay outside the graph
            return self.o_proj(torch.ops.layerline.rows_attention(q, k, v, torch.stack(pos), self.layer))
        if len(view) > 1:
            return self.o_proj(self._attend_rows(q, k, v, pos, kv, view))
        return self.o_proj(self._attend_one(q, k, v, pos[0], kv[0] if kv is not None else None, view[0]))

    def _attend_one(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                    kv: tuple | None, view: tuple) -> torch.Tensor:
        """One sequence (of B rows): write its k/v at `pos` into its (k, v) buffers `kv` (None: no
        cache) and attend over the keys in `view` (lo, hi, mask), read in place."""
        lo, hi, mask = view
        if kv is not None and q.shape[2] == 1 and self.softcap is None:  # one new token: the decode kernel
            n = q.shape[0]
            out = cpu_kernels.decode_attention(q, k, v, list(kv[0][:n].unbind(0)), list(kv[1][:n].unbind(0)),
                                               [hi - 1] * n, [lo] * n, self.scale)
            if out is not None:
                return out
        if kv is not None:
            k, v = kv_update(kv[0], kv[1], pos, k, v)
        k, v = k[:, :, lo:hi], v[:, :, lo:hi]  # only the keys in view (without a cache: the new ones, from 0)
        return self._attend(q, k, v, mask)

    def _attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: list, kv: list,
                     view: list) -> torch.Tensor:
        """B sequences, one new token each (q [B, nh, 1, hd], k/v [B, nkv, 1, hd]): row i writes its
        k/v into its own cache at pos[i] and attends over its own keys in place, one call per row.
        A row's numbers are then those of its sequence stepped alone: at bf16 a padded batch behind
        a mask gave other last bits, and greedy tokens that changed with what else was batched."""
        if self.softcap is None:
            out = cpu_kernels.decode_attention(q, k, v, [c[0] for c in kv], [c[1] for c in kv],
                                               [hi - 1 for _, hi, _ in view], [lo for lo, _, _ in view], self.scale)
            if out is not None:
                return out
        return torch.cat([self._attend_one(q[i:i + 1], k[i:i + 1], v[i:i + 1], pos[i], kv[i], view[i])
                          for i in range(q.shape[0])])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [b, nh, t, hd] over k, v [b, nkv, s, hd] -> [b, t, nh * hd]; mask [t, s] (True: may
        attend), or None: every key.

        Query head j*g + r uses kv head j (HF's repeat_kv order; SDPA's enable_gqa), without
        copying K/V."""
        b, nh, t, hd = q.shape
        if k.dtype != q.dtype:  # a KV cache kept in another dtype than the compute
            k, v = k.to(q.dtype), v.to(q.dtype)
        if self.softcap is not None:  # SDPA cannot cap the scores: spelled out (transformers' eager attention)
            g = nh // self.n_kv_heads
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            s = torch.tanh((q @ k.transpose(2, 3)) * self.scale / self.softcap) * self.softcap
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            out = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v
            return out.transpose(1, 2).reshape(b, t, nh * hd)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.n_kv_heads != nh)
        return out.transpose(1, 2).reshape(b, t, nh * hd)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, quant=None):
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        if args.fused_proj:  # Phi-3's gate_up_proj: gate rows first, then up
            self.gate_up_proj = make_linear(h, 2 * i, False, dtype, quant)
            self.gate_up = SplitLinear(self.gate_up_proj, [i, i])
        else:
            self.gate_proj = make_linear(h, i, False, dtype, quant)
            self.up_proj = make_linear(h, i, False, dtype, quant)
            self.gate_up = FusedLinears([self.gate_proj, self.up_proj])
        self.down_proj = make_linear(i, h, False, dtype, quant)
        self.gelu = args.mlp_act == "gelu_tanh"  # GeGLU (Gemma) instead of SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, layer: int = 0, quant=None,
                 resident_experts: bool = True):
        super().__init__()
        self.layer = layer
        self.window = args.window(layer)
        self.rope = args.rope(layer)
        self.input_layernorm = RMSNorm.of(args, args.hidden_size, dtype)
        self.self_attn = Attention(args, dtype, quant)
        self.self_attn.layer = layer  # which caches rows_attention reads
        # sandwich (Gemma): this one norms the attention's output; two more around the MLP
        self.post_attention_layernorm = RMSNorm.of(args, args.hidden_size, dtype)
        self.sandwich = args.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm.of(args, args.hidden_size, dtype)
            self.post_feedforward_layernorm = RMSNorm.of(args, args.hidden_size, dtype)
        if args.num_experts:
            self.block_sparse_moe = SparseMoE(layer, args.hidden_size, args.intermediate_size, args.num_experts,
                                              args.experts_per_tok, dtype, quant, resident_experts)
        else:
            self.mlp = MLP(args, dtype, quant)

    @property
    def ffn(self) -> nn.Module:
        """The feed-forward part: `mlp`, or Mixtral's `block_sparse_moe`."""
        return self._modules.get("block_sparse_moe") or self._modules["mlp"]

    def decode_step(self) -> object | None:
        """This layer's fp32 one-token step as one C++ call (csrc/layer.h's DecodeLayer: the same
        kernels in the same order as forward, so the same bits), or None where forward does
        something the call does not (an MoE, capped scores, a matrix held as int8/int4/bf16)."""
        att, mlp = self.self_attn, self._modules.get("mlp")
        if mlp is None or att.softcap is not None or att.head_dim % 16 or not cpu_kernels.enabled():
            return None
        norms = {"input": self.input_layernorm, "post_attention": self.post_attention_layernorm}
        if self.sandwich:
            norms.update(pre_feedforward=self.pre_feedforward_layernorm,
                         post_feedforward=self.post_feedforward_layernorm)
        if "q_norm" in att._modules:
            norms.update(q=att.q_norm, k=att.k_norm)
        if any(type(n) not in (RMSNorm, OffsetRMSNorm) or n.weight.dtype != torch.float32 or n.eps != self.input_layernorm.eps
               for n in norms.values()):
            return None
        linears = {"qkv": linear_calls(att.qkv), "o": linear_calls(att.o_proj), "gate_up": linear_calls(mlp.gate_up),
                   "down": linear_calls(mlp.down_proj)}
        if any(c is None for c in linears.values()):
            return None
        step = torch.classes.layerline_cpu.DecodeLayer(att.n_heads, att.n_kv_heads, att.head_dim,
                                                       mlp.down_proj.in_features, att.scale,
                                                       self.input_layernorm.eps, mlp.gelu, self.sandwich)
        for name, n in norms.items():   # the weight the kernel multiplies by, as forward passes it
            step.norm(name, 1.0 + n.weight.detach() if isinstance(n, OffsetRMSNorm) else n.weight.detach())
        for name, calls in linears.items():
            for kind, w, ints, bias in calls:
                step.linear(name, kind, w.detach(), ints, None if bias is None else bias.detach())
        return step if step.ready() else None

    def forward(self, x, cos, sin, pos, kv, view):
        a = self.self_attn(self.input_layernorm(x), cos, sin, pos, kv, view)
        if self.sandwich:
            h = x + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(self.ffn(self.pre_feedforward_layernorm(h)))
        h = x + a
        return h + self.ffn(self.post_attention_layernorm(h))


def hf_name(key: str, args: ModelArgs) -> str:
    """The Hugging Face checkpoint tensor name of a Stage state_dict key."""
    if key.startswith("lm_head."):
        return "model.embed_tokens." + key[len("lm_head."):] if args.tie_word_embeddings else key
    return "model." + key


def _views(starts: list[int], t: int, windows, device) -> dict:
    """Per attention window (None: full causal), per row group whose T new tokens start at
    position s: (lo, hi, mask) over the key positions lo..hi-1 the group attends: from the first
    key its first query may see to its last query; mask [T, hi - lo] (True: may attend), None
    when every key in that range is visible to every query (one new token)."""
    out = {}
    for w in windows:
        views = []
        for s in starts:
            hi = s + t
            lo = 0 if w is None else max(0, s + 1 - w)
            mask = None
            if t > 1:
                q = torch.arange(s, hi, device=device)[:, None]
                k = torch.arange(lo, hi, device=device)[None, :]
                mask = k <= q if w is None else (k <= q) & (k > q - w)
            views.append((lo, hi, mask))
        out[w] = views
    return out


class Stage(nn.Module):
    """Layers [start, end) of the model; the embedding if `first`; final norm + LM head if `last`.

    `quant`: "int8" holds the weights as int8 + per-row scales, "int4" as int4 in groups (embedding
    and LM head int8); `dtype` is then the compute dtype, bf16. `int8=True` is `quant="int8"`.
    `resident_experts`: False builds Mixtral's MoE blocks without experts; attach an
    `ExpertStore` with `set_expert_store` before running.

    One forward (`_forward`, gpt-fast's `Transformer.forward`): tokens at a positions tensor, K/V
    written there by one update (`kv_update`). A prefill, a one-token step and a step over rows of
    different sequences (`forward_rows`) are the same code; `compile()` compiles it for one-token
    steps (of one sequence's rows or of several sequences'), whose attention runs eagerly inside it
    over the keys each cache holds (`rows_attention`; a graph per ROWS_BUCKETS).
    """

    def __init__(self, args: ModelArgs, start: int, end: int, first: bool, last: bool, dtype: torch.dtype,
                 *, int8: bool = False, quant: str | None = None, resident_experts: bool = True):
        super().__init__()
        if not 0 <= start < end <= args.num_layers:
            raise LayerlineError(f"--layers {start}:{end}: not a non-empty range inside the model's "
                                 f"0:{args.num_layers}; choose A:B with 0 <= A < B <= {args.num_layers}")
        self.args, self.start, self.end = args, start, end
        quant = quant_name(quant or int8)
        if quant == "int4":
            require_int4()  # one line when this torch lacks the kernel
        self.first, self.last, self.dtype, self.quant = first, last, dtype, quant
        self.int8 = quant is not None  # quantized: the embedding (and a tied head) is int8
        # the KV cache's dtype unless asked otherwise: the precision table's rule (int8, int4 -> bf16)
        try:
            self.kv_dtype = torch_dtype(precision(quant).kv if quant else
                                        of_dtype(str(dtype).removeprefix("torch.")).kv)
        except LayerlineError:
            self.kv_dtype = dtype
        if first:
            if quant:
                self.embed_tokens = Int8Embedding(args.vocab_size, args.hidden_size, dtype)
            else:
                # _weight skips nn.Embedding's normal_ init, which on the meta device costs seconds of
                # one-time imports (torch._refs); the loader assigns the real weight anyway
                self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype,
                                                 _weight=torch.zeros(args.vocab_size, args.hidden_size, dtype=dtype))
        # keyed by global layer index, so state_dict keys read as the checkpoint's names
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, dtype, i, quant, resident_experts)
                                     for i in range(start, end)})
        self.windows = tuple(dict.fromkeys(layer.window for layer in self.layers.values()))
        if last:
            self.norm = RMSNorm.of(args, args.hidden_size, dtype)
            # the head at the precision table's `edge` (int4 stages: int8)
            self.lm_head = make_linear(args.hidden_size, args.vocab_size, False, dtype,
                                       quant and precision(quant).edge_precision)
            if first and args.tie_word_embeddings:
                self.tie_head()
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        # the window layers' own RoPE table (`ModelArgs.rope` 1), when the family has one
        self.register_buffer("inv_freq_local", rope_inv_freq(args, local=True)
                             if args.local_rope_theta is not None else None, persistent=False)
        self.expert_store: ExpertStore | None = None  # set by the loader when experts are paged
        self._step = None  # the compiled _forward, when compile() was asked for
        self._cpp_wrapper = False  # whether _step's graphs call their kernels from C++
        self._first_step = True  # no compiled step has run yet
        self.compile_error: str | None = None  # why compiling failed (the stage then steps eagerly)
        # eager fp32 one-token steps and one-row prompt chunks through the layers' C++ calls where each has one
        self.decode_steps = True
        self._steps: list | None = None  # those calls once built ([] where a layer has none)
        self._stack = None  # csrc/layer.h's DecodeStack over them: the layers in one call

    def fuse(self) -> None:
        """Fuse each layer's q/k/v and gate/up projections (`FusedLinears`); after any load."""
        self._steps = None
        for m in self.modules():
            if isinstance(m, FusedLinears):
                m.fuse()

    def replace(self, path: str, module: nn.Module) -> None:
        """Put `module` at submodule `path` (e.g. "layers.3.mlp.up_proj", a loader building a matrix's
        module once its stored form is known), also where a FusedLinears / SplitLinear lists the old one."""
        parent_path, _, name = path.rpartition(".")
        parent = self.get_submodule(parent_path) if parent_path else self
        old = getattr(parent, name)
        setattr(parent, name, module)
        self._steps = None
        for m in self.modules():
            if isinstance(m, (FusedLinears, SplitLinear)):
                m.parts = [module if p is old else p for p in m.parts]

    def load_state_dict(self, *a, **kw):
        out = super().load_state_dict(*a, **kw)
        self.fuse()  # the loaded weights, as views into the fused matrices
        return out

    def compile(self, mode: str = "default") -> None:
        """Run one-token steps through torch.compile with inductor freezing.

        mode: "off" (eager), "default", or "max-autotune" (searches GEMM kernels: slower to warm
        up, faster after). A graph per row bucket (ROWS_BUCKETS), attention outside it, so one
        graph serves every cache length. Prefills and replays run the same forward eagerly:
        their shapes vary. Mixtral's routing is data-dependent, so MoE stages stay eager.
        """
        if mode not in COMPILE_MODES:
            raise LayerlineError(f"--compile {mode}: not one of {', '.join(COMPILE_MODES)}")
        if mode == "off" or self.args.num_experts:
            self._step = None
            return
        import torch._dynamo
        import torch._inductor.config
        # weights become constants that inductor prepacks for its GEMMs. Process-wide (compile's
        # options= does not reach it); a worker process compiles nothing but its stage.
        torch._inductor.config.freezing = True
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        keep_out_of_graphs(self)
        self._compile_mode, self._first_step = mode, True
        self._step = self._compiled_step(cpp_wrapper=True)

    def _compiled_step(self, cpp_wrapper: bool):
        auto = self._compile_mode == "max-autotune"
        opts = torch._inductor.list_mode_options("max-autotune-no-cudagraphs") if auto else {}
        # No guards on the modules and weights: checking them took 0.4-0.6 ms of a 7-13 ms step.
        # Safe only because this stage's compiled forward is a code object of its own (dynamo keys
        # its graphs by code object, and without those guards another stage of the same class
        # would run this one's graph) and nothing replaces a stage's modules after loading.
        f = Stage._forward
        own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
        opts["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        # the graph's kernels and ops called from C++, not one by one from a Python wrapper: 0.4-0.5
        # ms less a step on the demo model (bf16 8.43 -> 7.95 ms, int8 5.88 -> 5.51, in turns)
        opts["cpp_wrapper"] = self._cpp_wrapper = cpp_wrapper
        return torch.compile(types.MethodType(own, self), dynamic=False, options=opts)

    @property
    def compiled(self) -> bool:
        """Whether one-token steps run through the compiled graph."""
        return self._step is not None

    def _compile_failed(self, e: Exception) -> None:
        # inductor needs a C++ compiler on the host, among other things; a stage that cannot
        # compile still serves, eagerly, and says why
        self._step = None
        text = str(e).strip()
        self.compile_error = f"{e.__class__.__name__}: {text.splitlines()[0][:300] if text else ''}"

    def _forward(self, h: torch.Tensor, pos: torch.Tensor, kv: list | None, views: dict | None,
                 last_only: bool = False) -> torch.Tensor:
        """The one forward. h: token ids [B, T] (first stage) or hidden [B, T, hidden].

        pos: int64 [P, T], the new tokens' positions: P = 1, one sequence of B rows at the same
        positions; P = B (T = 1), B sequences, row i at pos[i].
        kv: per layer, per sequence, its (k, v) buffers; None without a KV cache.
        views: per attention window, per sequence, (lo, hi, mask) (see `_views`), or ROWS_OP: one
        row per sequence through `rows_attention` (kv None; the compiled step).
        """
        if self.first:
            h = self.embed_tokens(h)
            if self.args.embed_scale is not None:  # as transformers: the scale rounded to the weights' dtype
                h = h * torch.tensor(self.args.embed_scale, dtype=h.dtype)
        ropes = []  # per RoPE table (`ModelArgs.rope`), cos and sin [P, 1, T, hd]: broadcast over heads
        tables = [self.inv_freq]
        if self.inv_freq_local is not None:  # moved with the stage where the loader moves inv_freq
            tables.append(self.inv_freq_local.to(self.inv_freq.device))
        for inv_freq in tables:
            inv_freq = inv_freq.float()
            freqs = pos[..., None].float() * inv_freq  # [P, T, hd / 2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None]
            ropes.append((emb.cos().to(h.dtype), emb.sin().to(h.dtype)))
        rows = pos.unbind(0)  # each row group's positions [T]
        if views is ROWS_OP:
            views = dict.fromkeys(self.windows, ROWS_OP)
        stack = self._decode_steps(h, kv, views)
        if stack is not None and h.shape[1] > 1:  # a prompt chunk of one sequence: its tokens as the rows
            h = stack.chunk(h, [c for c, _ in ropes], [s for _, s in ropes], [layer[0][0] for layer in kv],
                            [layer[0][1] for layer in kv], int(pos[0, 0]), [views[w][0][0] for w in self.windows],
                            [views[w][0][2] for w in self.windows])
        elif stack is not None:  # the layers in one C++ call: what each writes and attends, per row
            b = h.shape[0]
            first = views[self.windows[0]]
            pos_rows = [hi - 1 for _, hi, _ in first] * (b // len(first))
            los = [lo for w in self.windows for lo in [lo for lo, _, _ in views[w]] * (b // len(views[w]))]
            h = stack.step(h, [c for c, _ in ropes], [s for _, s in ropes], [k for layer in kv for k, _ in layer],
                           [v for layer in kv for _, v in layer], pos_rows, los)
        else:
            for i, layer in enumerate(self.layers.values()):
                h = layer(h, *ropes[layer.rope], rows, kv[i] if kv is not None else None, views[layer.window])
        if not self.last:
            return h
        if last_only:
            h = h[:, -1:]
        logits = self.lm_head(self.norm(h))
        if self.args.final_softcap is not None:
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits.float()

    def _decode_steps(self, h: torch.Tensor, kv: list | None, views: dict) -> object | None:
        """The layers' `DecoderLayer.decode_step`s as one DecodeStack, for an eager fp32 one-token
        step, or a prompt chunk of one sequence of one row, over caches of fp32 on the CPU where every
        layer has one; else None (the modules' forward)."""
        if (not self.decode_steps or kv is None or (h.shape[1] != 1 and (h.shape[0] != 1 or len(kv[0]) != 1))
                or h.dtype != torch.float32
                or h.device.type != "cpu" or ROWS_OP in views.values() or torch.compiler.is_compiling()
                or kv[0][0][0].dtype != torch.float32 or not cpu_kernels.enabled()):  # use_isa("off") later
            return None
        if self._steps is None:  # built once; fuse(), replace() and moves drop them
            steps = [layer.decode_step() for layer in self.layers.values()]
            self._steps = steps if all(s is not None for s in steps) else []
            self._stack = None
            if self._steps:
                self._stack = torch.classes.layerline_cpu.DecodeStack()
                for layer, step in zip(self.layers.values(), steps):
                    self._stack.add(step, layer.rope, self.windows.index(layer.window))
        return self._stack if self._steps else None

    def _apply(self, fn, *args, **kwargs):
        self._steps = None  # .to() and the like move the tensors the steps hold
        return super()._apply(fn, *args, **kwargs)

    def tie_head(self) -> None:
        """Make the LM head share the embedding's tensors (tied embeddings, first and last stage)."""
        if self.int8:
            self.lm_head.weight = self.embed_tokens.weight
            self.lm_head.scale = self.embed_tokens.scale
        else:
            self.lm_head.weight = self.embed_tokens.weight

    def set_expert_store(self, store: ExpertStore | None) -> None:
        """Serve every MoE layer's experts from `store` (None: back to the resident experts)."""
        for layer in self.layers.values():
            if isinstance(layer.ffn, SparseMoE):
                layer.ffn.store = store

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> StageCache:
        """Empty KV caches for `batch` rows of up to `max_len` tokens (dtype: the stage's KV dtype by default)."""
        if batch <= 0 or max_len <= 0:
            raise LayerlineError(f"KV cache of batch {batch} x {max_len} tokens: both must be positive")
        a = self.args
        layers = [KVCache(batch, a.num_kv_heads, max_len, a.head_dim, dtype or self.kv_dtype, self.device)
                  for _ in self.layers]
        if self._step is not None:  # one compiled step serves every cache length
            for c in layers:
                for t in (c.k, c.v):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                    torch._dynamo.mark_dynamic(t, 2)
        return StageCache(layers)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """x checked and on the stage's device (hidden states in its dtype)."""
        a = self.args
        if self.first:
            if x.dim() != 2 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
                raise LayerlineError(f"first stage input: expected integer token ids [batch, tokens], "
                                     f"got {x.dtype} {tuple(x.shape)}")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= a.vocab_size):
                raise LayerlineError(f"token ids must lie in [0, {a.vocab_size}); got "
                                     f"{int(x.min())}..{int(x.max())}")
            h = x.to(self.device)
        else:
            if x.dim() != 3 or x.shape[-1] != a.hidden_size or not x.dtype.is_floating_point:
                raise LayerlineError(f"stage {self.start}:{self.end} input: expected float hidden states "
                                     f"[batch, tokens, {a.hidden_size}], got {x.dtype} {tuple(x.shape)}")
            h = x.to(device=self.device, dtype=self.dtype)
        if h.shape[1] == 0:
            raise LayerlineError("stage input holds no tokens")
        return h

    def _run(self, h: torch.Tensor, starts: list[int], caches: list[StageCache] | None,
             last_only: bool) -> torch.Tensor:
        """h's T tokens per sequence at positions starts[i].. of caches[i] (one sequence: its B
        rows; several: row i each), through the compiled step when it applies, else eagerly."""
        t = h.shape[1]
        out = None
        if t == 1 and caches is not None and self._step is not None:
            # one sequence of B rows steps as B one-row sequences at the same position
            rows = caches if len(caches) > 1 else caches[0].rows()
            at = starts * len(rows) if len(caches) == 1 else starts
            try:
                out = self._rows_step(h, at, rows)
                self._first_step = False
            except Exception as e:  # noqa: BLE001 - the eager forward below rewrites what it wrote
                # the first graph failing to build may be its C++ wrapper: retry with inductor's
                # Python wrapper once (later failures, out of memory say, go eager at once)
                if self._first_step and self._cpp_wrapper:
                    self._first_step = False
                    self._step = self._compiled_step(cpp_wrapper=False)
                    try:
                        out = self._rows_step(h, at, rows)
                    except Exception as e2:  # noqa: BLE001 - as above
                        self._compile_failed(e2)
                else:
                    self._compile_failed(e)
        if out is None:
            if len(starts) == 1:
                pos = torch.arange(starts[0], starts[0] + t, device=self.device)[None]
            else:
                pos = torch.tensor(starts, device=self.device)[:, None]
            kv = None
            if caches is not None:
                kv = [[c.pairs[i] for c in caches] for i in range(len(self.layers))]
            out = self._forward(h, pos, kv, _views(starts, t, self.windows, self.device), last_only)
        for c, s in zip(caches or (), starts):
            c.length = s + t
        return out

    def _rows_step(self, h: torch.Tensor, starts: list[int], caches: list[StageCache]) -> torch.Tensor:
        """One-row sequences through the compiled step, up to ROWS_BUCKETS[-1] at a time, each part
        padded to its bucket (padding rows: zeros in, dropped out)."""
        outs, most = [], ROWS_BUCKETS[-1]
        for lo in range(0, len(caches), most):
            part = caches[lo:lo + most]
            n = len(part)
            b = next(x for x in ROWS_BUCKETS if x >= n)
            # always a new tensor (made here, in inference mode): the graph guards on how its input was made
            x = h.new_zeros((b,) + tuple(h.shape[1:]))
            x[:n] = h[lo:lo + n]
            pos = torch.tensor(starts[lo:lo + n] + [0] * (b - n), device=self.device)[:, None]
            _ROWS.stage, _ROWS.caches, _ROWS.views = self, part, {}
            try:
                outs.append(self._step(x, pos, None, ROWS_OP)[:n])
            finally:
                _ROWS.stage, _ROWS.caches, _ROWS.views = None, [], {}
        return torch.cat(outs)

    def rows_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                       layer: int) -> torch.Tensor:
        """`rows_attention`'s work for this stage: the eager rows attention of `layer` over the
        caches of the call in progress, the keys in view as the eager forward's (`_views`)."""
        caches, mod = _ROWS.caches, self.layers[str(layer)]
        n, i, w = len(caches), layer - self.start, mod.window
        view = _ROWS.views.get(w)
        if view is None:  # the step's first layer of this window: every layer sees the same keys
            view = _views(pos[:n, 0].tolist(), 1, (w,), self.device)[w]
            _ROWS.views[w] = view = (view, [hi - 1 for _, hi, _ in view], [lo for lo, _, _ in view])
        view, his, los = view
        out = None
        if mod.self_attn.softcap is None:
            out = cpu_kernels.decode_attention(q, k, v, [c.layers[i].k for c in caches],
                                               [c.layers[i].v for c in caches], his, los,
                                               mod.self_attn.scale)  # padding rows: zeros
        if out is not None:
            return out
        kv = [(c.layers[i].k, c.layers[i].v) for c in caches]
        res = mod.self_attn._attend_rows(q[:n], k[:n], v[:n], pos[:n].unbind(0), kv, view)
        if n == q.shape[0]:
            return res
        out = q.new_zeros(q.shape[0], q.shape[2], q.shape[1] * q.shape[3])
        out[:n] = res
        return out

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: StageCache | None = None,
                *, last_only: bool = False) -> torch.Tensor:
        """Run the stage on T new tokens at positions start_pos..start_pos+T-1 of one sequence.

        first stage: x is int64 token ids [B, T]; others: hidden states [B, T, hidden].
        Last stage returns float32 logits [B, T, vocab] ([B, 1, vocab] with last_only);
        others return hidden [B, T, hidden] in the stage dtype.
        """
        h = self._input(x)
        b, t = h.shape[:2]
        if cache is None:
            if start_pos != 0:
                raise LayerlineError(f"start_pos {start_pos} without a KV cache: a forward without cache "
                                     "must start at position 0")
        else:
            check_write(cache, start_pos, t, b)
        return self._run(h, [start_pos], None if cache is None else [cache], last_only)

    @torch.inference_mode()
    def forward_rows(self, x: torch.Tensor, positions: list[int], caches: list[StageCache]) -> torch.Tensor:
        """One new token for each of B sequences: row i of x ([B, 1] ids or [B, 1, hidden]) at
        position positions[i] of its own cache caches[i] (a one-row cache), attending to that
        sequence's keys only. The projections and the MLP run over all B rows at once.

        Returns [B, 1, vocab] float32 logits (last stage) or [B, 1, hidden]. Everything is
        checked before any cache is written.
        """
        h = self._input(x)
        b, t = h.shape[:2]
        if t != 1:
            raise LayerlineError(f"rows: one new token per row, got {t}")
        if len(positions) != b or len(caches) != b:
            raise LayerlineError(f"rows: {len(positions)} positions and {len(caches)} caches for a batch of {b}")
        if len({id(c) for c in caches}) != b:
            raise LayerlineError("rows: a sequence appears twice; step each sequence once per message")
        for i, (p, c) in enumerate(zip(positions, caches)):
            check_write(c, p, 1, 1, exact_batch=True, where=f"rows[{i}]: ", what="position")
            if len(c.layers) != len(self.layers):
                raise LayerlineError(f"rows[{i}]: a KV cache of {len(c.layers)} layers, this stage has "
                                     f"{len(self.layers)}")
        return self._run(h, list(positions), list(caches), False)
