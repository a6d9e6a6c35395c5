"""Llama-family decoder layers (Llama 2/3, Mistral, Qwen2, Mixtral), one pipeline *stage* at a time.

gpt-fast style: a dataclass of model args, the KV cache as a module, nothing the forward does
not need. A `Stage` holds a contiguous, half-open layer range [start, end) of the model, plus the
token embedding when it is the first stage and the final norm + LM head when it is the last.

Numerics follow Hugging Face transformers: RMSNorm in float32 and cast back, RoPE cos/sin
computed in float32 from `inv_freq` in the rotate_half layout (the order HF checkpoints' q/k
weights are in), softmax in float32. Attention is plain matmul + softmax with a causal mask
(SDPA measured slower on the target CPUs); grouped-query attention folds the query heads of
one KV head together instead of copying K/V per query head.

Submodule names mirror HF's, so a stage's state_dict key is the HF tensor name without the
leading "model." (layers are keyed by their global index): see `hf_name`.

Family differences: Qwen2 biases q/k/v; Mistral (and Mixtral, and Qwen2 with use_sliding_window)
attend over a sliding window of the last `sliding_window` positions: a query at position p sees
keys p-W+1..p. The KV cache still holds every position, and each window layer reads only the
last W keys of it, so decoding past the window costs O(W). Mixtral replaces the MLP with a
sparse mixture of experts (`moe.SparseMoE`, experts behind an `ExpertStore`).

Precision int8 (weight-only): every Linear weight, the token embedding and the LM head are held as
int8 with a float32 scale per output row (`quant`); norms, biases, the Mixtral router, the
activations and the KV cache are bf16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import CheckpointError
from ..cost import COMPILE_MODES
from ..errors import LayerlineError
from .moe import ExpertStore, SparseMoE
from .quant import Int8Embedding, make_linear

# precision name -> the dtype activations, norms and the KV cache compute in
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.bfloat16}
QUANTIZED = ("int8",)  # precisions whose weights are held quantized (weight-only)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")
_ROPE_TYPES = ("default", "linear", "llama3")


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

    def window(self, layer: int) -> int | None:
        """The attention window of `layer`, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.window_layers is not None and layer not in self.window_layers:
            return None
        return self.sliding_window

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        """Model args from a Hugging Face config.json dict (Llama, Mistral, Qwen2, Mixtral).

        Missing or invalid keys raise CheckpointError naming the config.json key.
        """
        if not isinstance(cfg, dict):
            raise CheckpointError("config.json: not a JSON object")
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise _cfg_err("model_type", f"{model_type!r} is not supported by layerline's model code; "
                                         f"use a {', '.join(SUPPORTED_MODEL_TYPES)} checkpoint")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise _cfg_err("hidden_act", f"{act!r} is not supported; only SwiGLU (silu) MLPs are")
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
        head_dim = _pos_int(cfg, "head_dim", hidden // heads)
        if head_dim % 2:
            raise _cfg_err("head_dim", f"{head_dim} is odd; rotary embeddings need an even head_dim")
        max_pos = _pos_int(cfg, "max_position_embeddings", 2048)

        # RoPE: transformers 5 writes "rope_parameters" (rope_theta inside); older configs write
        # "rope_theta" and "rope_scaling" at the top level.
        rp = cfg.get("rope_parameters")
        if rp is not None and not isinstance(rp, dict):
            raise _cfg_err("rope_parameters", f"{rp!r} is not an object; fix config.json")
        scaling = cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise _cfg_err("rope_scaling", f"{scaling!r} is not an object or null; fix config.json")
        theta_src = dict(cfg)
        if rp and rp.get("rope_theta") is not None:
            theta_src = rp
        theta = _pos_float(theta_src, "rope_theta", 10000.0)
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
        elif model_type in ("mistral", "mixtral"):
            attention_bias = False
        else:
            attention_bias = _bool(cfg, "attention_bias", False)
        n_layers = _pos_int(cfg, "num_hidden_layers")

        window, window_layers = None, None
        if model_type in ("mistral", "mixtral"):
            if cfg.get("sliding_window") is not None:
                window = _pos_int(cfg, "sliding_window")
        elif qwen2 and _bool(cfg, "use_sliding_window", False):
            window = _pos_int(cfg, "sliding_window")
            types = cfg.get("layer_types")
            if types is None:  # transformers' default: window from layer max_window_layers on
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
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
            o_proj_bias=attention_bias and not qwen2,
            model_type=model_type,
            sliding_window=window,
            window_layers=window_layers,
            num_experts=experts,
            experts_per_tok=per_tok,
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], float32 on the CPU, as transformers computes them."""
    dim = args.head_dim
    # explicit device: stages are built under `with torch.device("meta")` by the loader
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu")
                                          .to(dtype=torch.float) / dim))
    sc = args.rope_scaling
    if not sc:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class KVCache(nn.Module):
    """One layer's keys and values: buffers [batch, n_kv_heads, max_len, head_dim]."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, n_kv, T, hd] at positions start_pos.. and return all keys/values up to them."""
        b, end = k.shape[0], start_pos + k.shape[2]
        self.k[:b, :, start_pos:end] = k
        self.v[:b, :, start_pos:end] = v
        ks, vs = self.k[:b, :, :end], self.v[:b, :, :end]
        if ks.dtype != k.dtype:  # a KV cache kept in another dtype than the compute
            ks, vs = ks.to(k.dtype), vs.to(k.dtype)
        return ks, vs


class StageCache:
    """The KV caches of one stage's layers for one batch of sequences, and how many tokens they hold."""

    def __init__(self, layers: list[KVCache]):
        self.layers = layers
        self.length = 0

    @property
    def batch(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def max_len(self) -> int:
        return self.layers[0].k.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(c.k.numel() * c.k.element_size() * 2 for c in self.layers)

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are overwritten as new ones come)."""
        self.length = 0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, int8: bool = False):
        super().__init__()
        h, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, hd
        self.scale = hd ** -0.5
        self.q_proj = make_linear(h, args.num_heads * hd, args.attention_bias, dtype, int8)
        self.k_proj = make_linear(h, args.num_kv_heads * hd, args.attention_bias, dtype, int8)
        self.v_proj = make_linear(h, args.num_kv_heads * hd, args.attention_bias, dtype, int8)
        self.o_proj = make_linear(args.num_heads * hd, h, args.o_proj_bias, dtype, int8)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                start_pos: int, kv: KVCache | None, lo: int = 0) -> torch.Tensor:
        """`mask` [t, s - lo] (True: may attend) over keys lo..s-1; None when every key is visible."""
        b, t, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(b, t, nh, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv is not None:
            k, v = kv.update(start_pos, k, v)
        if lo:  # a sliding window: only the last keys are visible to these queries
            k, v = k[:, :, lo:], v[:, :, lo:]
        s = k.shape[2]
        g = nh // nkv
        # GQA without copying K/V: query head j*g + r uses kv head j (HF's repeat_kv order), so fold
        # the g query heads of each kv head into the row dimension: [b, nkv, g*t, hd].
        q = q.reshape(b, nkv, g * t, hd)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale  # [b, nkv, g*t, s]
        if mask is not None:
            scores = scores.view(b, nkv, g, t, s).masked_fill(mask.logical_not(), float("-inf"))
            scores = scores.view(b, nkv, g * t, s)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # [b, nkv, g*t, hd]
        out = out.view(b, nh, t, hd).transpose(1, 2).reshape(b, t, nh * hd)
        return self.o_proj(out)

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
               kbuf: torch.Tensor, vbuf: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One new token per sequence at position `pos` (int64 [1]) over the whole KV buffer.

        Every shape is fixed by the cache, not by how many tokens it holds, so a compiled step
        is reused for the whole generation; `visible` [max_len] masks keys not (yet) in view.
        """
        b = x.shape[0]
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(b, 1, nh, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, 1, nkv, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, 1, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        ks, vs = kbuf[:b], vbuf[:b]
        ks.index_copy_(2, pos, k.to(ks.dtype))
        vs.index_copy_(2, pos, v.to(vs.dtype))
        if ks.dtype != q.dtype:
            ks, vs = ks.to(q.dtype), vs.to(q.dtype)
        q = q.reshape(b, nkv, nh // nkv, hd)
        scores = torch.matmul(q, ks.transpose(2, 3)) * self.scale  # [b, nkv, g, max_len]
        scores = scores.masked_fill(visible.logical_not(), float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, vs)  # [b, nkv, g, hd]
        return self.o_proj(out.reshape(b, 1, nh * hd))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, int8: bool = False):
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_proj = make_linear(h, i, False, dtype, int8)
        self.up_proj = make_linear(h, i, False, dtype, int8)
        self.down_proj = make_linear(i, h, False, dtype, int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, layer: int = 0, int8: bool = False,
                 resident_experts: bool = True):
        super().__init__()
        self.layer = layer
        self.window = args.window(layer)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = Attention(args, dtype, int8)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        if args.num_experts:
            self.block_sparse_moe = SparseMoE(layer, args.hidden_size, args.intermediate_size, args.num_experts,
                                              args.experts_per_tok, dtype, int8, resident_experts)
        else:
            self.mlp = MLP(args, dtype, int8)

    @property
    def ffn(self) -> nn.Module:
        """The feed-forward part: `mlp`, or Mixtral's `block_sparse_moe`."""
        return self._modules.get("block_sparse_moe") or self._modules["mlp"]

    def forward(self, x, cos, sin, mask, start_pos, kv, lo=0):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, start_pos, kv, lo)
        return h + self.ffn(self.post_attention_layernorm(h))

    def decode(self, x, cos, sin, pos, kbuf, vbuf, visible):
        h = x + self.self_attn.decode(self.input_layernorm(x), cos, sin, pos, kbuf, vbuf, visible)
        return h + self.ffn(self.post_attention_layernorm(h))


def hf_name(key: str, args: ModelArgs) -> str:
    """The Hugging Face checkpoint tensor name of a Stage state_dict key."""
    if key.startswith("lm_head."):
        return "model.embed_tokens." + key[len("lm_head."):] if args.tie_word_embeddings else key
    return "model." + key


def _masks(start_pos: int, t: int, windows: set, device) -> dict:
    """Per attention window (None: full causal): (lo, mask over keys lo..start_pos+t-1 or None)."""
    s = start_pos + t
    out = {}
    q = torch.arange(start_pos, s, device=device)[:, None]
    for w in windows:
        if w is None:
            # key s' is visible to query t' when s' <= start_pos + t'; one new token sees everything
            out[w] = (0, torch.ones(t, s, dtype=torch.bool, device=device).tril(start_pos) if t > 1 else None)
            continue
        lo = max(0, start_pos + 1 - w)  # the first key the first new query may see
        if t == 1:  # one query, keys lo..start_pos: all inside its window
            out[w] = (lo, None)
            continue
        k = torch.arange(lo, s, device=device)[None, :]
        out[w] = (lo, (k <= q) & (k > q - w))
    return out


class Stage(nn.Module):
    """Layers [start, end) of the model; the embedding if `first`; final norm + LM head if `last`.

    `int8`: hold the weights as int8 + per-row scales (`dtype` is then the compute dtype, bf16).
    `resident_experts`: False builds Mixtral's MoE blocks without experts; attach an
    `ExpertStore` with `set_expert_store` before running.
    """

    def __init__(self, args: ModelArgs, start: int, end: int, first: bool, last: bool, dtype: torch.dtype,
                 *, int8: bool = False, resident_experts: bool = True):
        super().__init__()
        if not 0 <= start < end <= args.num_layers:
            raise LayerlineError(f"--layers {start}:{end}: not a non-empty range inside the model's "
                                 f"0:{args.num_layers}; choose A:B with 0 <= A < B <= {args.num_layers}")
        self.args, self.start, self.end = args, start, end
        self.first, self.last, self.dtype, self.int8 = first, last, dtype, int8
        if first:
            if int8:
                self.embed_tokens = Int8Embedding(args.vocab_size, args.hidden_size, dtype)
            else:
                # _weight skips nn.Embedding's normal_ init, which on the meta device costs seconds of
                # one-time imports (torch._refs); the loader assigns the real weight anyway
                self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype,
                                                 _weight=torch.zeros(args.vocab_size, args.hidden_size, dtype=dtype))
        # keyed by global layer index, so state_dict keys read as the checkpoint's names
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, dtype, i, int8, resident_experts)
                                     for i in range(start, end)})
        if last:
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
            self.lm_head = make_linear(args.hidden_size, args.vocab_size, False, dtype, int8)
            if first and args.tie_word_embeddings:
                self.tie_head()
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.expert_store: ExpertStore | None = None  # set by the loader when experts are paged
        self._step = None  # the compiled decode_step, when compile() was asked for
        self.compile_error: str | None = None  # why compiling failed (the stage then decodes eagerly)

    def compile(self, mode: str = "default") -> None:
        """Run decode steps (one token per sequence) through torch.compile with inductor freezing.

        mode: "off" (eager), "default", or "max-autotune" (searches GEMM kernels: slower to warm
        up, faster after). Prefill and replays stay eager: their lengths vary, a step's do not.
        Mixtral's routing is data-dependent, so MoE stages stay eager.
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
        kw = {"mode": "max-autotune-no-cudagraphs"} if mode == "max-autotune" else {}
        self._step = torch.compile(self.decode_step, dynamic=False, **kw)

    @property
    def compiled(self) -> bool:
        """Whether decode steps run through the compiled graph."""
        return self._step is not None

    def _compile_failed(self, e: Exception) -> None:
        # inductor needs a C++ compiler on the host, among other things; a stage that cannot
        # compile still serves, eagerly, and says why
        self._step = None
        text = str(e).strip()
        self.compile_error = f"{e.__class__.__name__}: {text.splitlines()[0][:300] if text else ''}"

    def decode_step(self, x: torch.Tensor, pos: torch.Tensor, ks: list[torch.Tensor],
                    vs: list[torch.Tensor]) -> torch.Tensor:
        """One token per sequence at position `pos` (int64 [1]) through every layer, over the full
        KV buffers `ks`/`vs` (one per layer): the part of decoding that compiles."""
        h = self.embed_tokens(x) if self.first else x
        freqs = pos[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        idx = torch.arange(ks[0].shape[2], device=pos.device)
        visible: dict = {}
        for layer, kb, vb in zip(self.layers.values(), ks, vs):
            w = layer.window
            if w not in visible:
                visible[w] = (idx <= pos) if w is None else (idx <= pos) & (idx > pos - w)
            h = layer.decode(h, cos, sin, pos, kb, vb, visible[w])
        if not self.last:
            return h
        return self.lm_head(self.norm(h)).float()

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
        """Empty KV caches for `batch` sequences of up to `max_len` tokens (dtype: the stage's by default)."""
        if batch <= 0 or max_len <= 0:
            raise LayerlineError(f"KV cache of batch {batch} x {max_len} tokens: both must be positive")
        a = self.args
        layers = [KVCache(batch, a.num_kv_heads, max_len, a.head_dim, dtype or self.dtype, self.device)
                  for _ in self.layers]
        if self._step is not None:  # one compiled step serves every cache length
            for c in layers:
                for t in (c.k, c.v):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                    torch._dynamo.mark_dynamic(t, 2)
        return StageCache(layers)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, start_pos: int = 0, cache: StageCache | None = None,
                *, last_only: bool = False) -> torch.Tensor:
        """Run the stage on T new tokens at positions start_pos..start_pos+T-1.

        first stage: x is int64 token ids [B, T]; others: hidden states [B, T, hidden].
        Last stage returns float32 logits [B, T, vocab] ([B, 1, vocab] with last_only);
        others return hidden [B, T, hidden] in the stage dtype.
        """
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
        b, t = h.shape[:2]
        if t == 0:
            raise LayerlineError("stage input holds no tokens")
        if cache is None:
            if start_pos != 0:
                raise LayerlineError(f"start_pos {start_pos} without a KV cache: a forward without cache "
                                     "must start at position 0")
        else:
            if not 0 <= start_pos <= cache.length:
                raise LayerlineError(f"start_pos {start_pos}: the KV cache holds {cache.length} tokens; "
                                     "positions must continue from at most there (replay the prefix)")
            if start_pos + t > cache.max_len:
                raise LayerlineError(f"KV cache full: {start_pos + t} tokens do not fit its {cache.max_len}; "
                                     "raise --kv-context")
            if b > cache.batch:
                raise LayerlineError(f"batch {b} is larger than the KV cache's {cache.batch}")
        s = start_pos + t
        if t == 1 and cache is not None and self._step is not None:
            pos = torch.tensor([start_pos], device=self.device)
            # canonical strides: a [b, 1] slice of a wider tensor keeps its old strides, and the
            # compiled step guards on them (a needless recompile)
            h = h.clone(memory_format=torch.contiguous_format)
            torch._dynamo.maybe_mark_dynamic(h, 0)
            try:
                out = self._step(h, pos, [c.k for c in cache.layers], [c.v for c in cache.layers])
            except Exception as e:  # noqa: BLE001 - a failed compile leaves the cache as it was
                self._compile_failed(e)
            else:
                cache.length = s
                return out
        if self.first:
            h = self.embed_tokens(h)

        pos = torch.arange(start_pos, s, device=self.device)
        freqs = pos[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        layers = list(self.layers.values())
        masks = _masks(start_pos, t, {layer.window for layer in layers}, self.device)

        kvs = cache.layers if cache is not None else [None] * len(layers)
        for layer, kv in zip(layers, kvs):
            lo, mask = masks[layer.window]
            h = layer(h, cos, sin, mask, start_pos, kv, lo)
        if cache is not None:
            cache.length = s
        if not self.last:
            return h
        if last_only:
            h = h[:, -1:]
        return self.lm_head(self.norm(h)).float()
