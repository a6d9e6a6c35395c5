"""What a model costs, from its tensor index alone: bytes, FLOPs and KV per layer.

Pure functions over data: ModelCost is built from a CheckpointIndex (headers, never tensor
data) and priced under CostOptions. Routed-expert bytes are kept apart from dense bytes so
the planner can page experts from disk.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from .checkpoint import DTYPE_BYTES, CheckpointIndex
from .errors import LayerlineError
from .precision import KV_NAMES, PRECISIONS, kv_bytes
from .precision import precision as precision_row

# Bytes per parameter at each precision a worker may run (precision.PRECISIONS). int8 carries one
# fp32 scale per output channel (`row_bytes`), charged per layer from its row count; int4's group
# scales are in its bytes per parameter, and its embedding and LM head are charged at int8 (`edge`).
PRECISION_BYTES = {name: p.weight_bytes for name, p in PRECISIONS.items()}
KV_DTYPE_BYTES = {name: kv_bytes(name) for name in KV_NAMES}
STORED_PRECISION = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "I8": "int8"}
# GGUF block types held as plain floats; any other (Q4_K, Q8_0, ...) makes a file "gguf": run at its own bits
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
EXPERT_RE = re.compile(r"\.(?:block_sparse_moe|mlp)\.experts\.\d+\.|\.ffn_(?:gate|up|down)_exps\.")
OBJECTIVES = ("throughput", "latency", "memory")


class CostError(LayerlineError):
    """The model cannot be costed as asked (unknown KV width, bad option)."""


@dataclass
class ModelCost:
    num_layers: int
    stored_precision: str
    dense_params: list[int]          # per layer, non-expert parameters
    expert_params: list[int]         # per layer, all routed-expert parameters
    rows: list[int]                  # per layer, output channels of its matrices (int8 scales)
    embed_params: int
    head_params: int                 # final norm + lm_head (0 extra when tied: it reuses the embedding)
    num_experts: int = 0
    experts_per_token: int = 0
    kv_width: int | None = None      # K+V elements per token per layer (2 x kv_heads x head_dim)
    hidden_size: int = 0
    vocab_size: int = 0
    tied_embeddings: bool = False
    # the bytes the checkpoint stores (a GGUF: its blocks), what precision "gguf" costs; an HF dir: as stored
    stored_dense_bytes: list[int] = field(default_factory=list)   # per layer, non-expert tensors (norms too)
    stored_expert_bytes: list[int] = field(default_factory=list)  # per layer, routed experts
    stored_embed_bytes: int = 0
    stored_head_bytes: int = 0       # final norm + lm_head (nothing extra when tied)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelCost":
        try:
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except TypeError as e:
            raise CostError(f"model cost: malformed ({e}); regenerate it with `layerline index CKPT --json`") from e

    def active_params(self, layer: int) -> float:
        """Parameters one token touches in a layer: dense + its share of routed experts."""
        e = self.expert_params[layer]
        if e and self.num_experts:
            e = e * self.experts_per_token / self.num_experts
        return self.dense_params[layer] + e


@dataclass
class KvProfile:
    context: int
    dtype: str
    bytes_per_token: int             # per layer, per sequence
    source: str                      # "index", "override", "assumed", "ignored"


@dataclass
class CostOptions:
    objective: str = "throughput"
    context: int = 4096
    batch: int = 1
    kv_dtype: str | None = None              # default: the precision's width
    kv_bytes_per_layer_token: int | None = None
    on_unknown_kv: str = "fail"              # fail | assume | ignore
    precision_ladder: list[str] = field(default_factory=list)  # empty: the stored precision
    reserve_ram_bytes: int = 0
    hop_s: float | None = None               # per hop; None: the planner takes the measured round trips

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise CostError(f"layerline_objective.optimize: {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        for name in ("context", "batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise CostError(f"layerline_objective.{name}: {v!r} must be a positive integer")
        if self.on_unknown_kv not in ("fail", "assume", "ignore"):
            raise CostError(f"layerline_objective.on_unknown_kv: {self.on_unknown_kv!r} is not fail, assume or ignore")
        for p in self.precision_ladder:
            if p not in PRECISION_BYTES:
                raise CostError(f"layerline_objective.precision_ladder: {p!r} is not one of {', '.join(PRECISION_BYTES)}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPE_BYTES:
            raise CostError(f"layerline_objective.kv_dtype: {self.kv_dtype!r} is not one of {', '.join(KV_DTYPE_BYTES)}")
        kvo = self.kv_bytes_per_layer_token
        if kvo is not None and (not isinstance(kvo, int) or isinstance(kvo, bool) or kvo < 0):
            raise CostError(f"layerline_objective.kv_bytes_per_layer_token: {kvo!r} must be a non-negative integer")
        if (self.hop_s is not None and self.hop_s < 0) or self.reserve_ram_bytes < 0:
            raise CostError("layerline_objective: hop_secs and layerline_reserve_ram_gb must not be negative")

    @classmethod
    def from_vars(cls, objective: dict | None, reserve_ram_gb: float | None = None) -> "CostOptions":
        """From the inventory's layerline_objective dict (DESIGN names)."""
        o = dict(objective or {})
        known = {"optimize", "context", "batch", "hop_secs", "kv_dtype", "kv_bytes_per_layer_token",
                 "on_unknown_kv", "precision_ladder"}
        extra = sorted(set(o) - known)
        if extra:
            raise CostError(f"layerline_objective: unknown key(s) {', '.join(extra)}; known: {', '.join(sorted(known))}")
        kw = {"objective": o.get("optimize", "throughput"), "context": o.get("context", 4096),
              "batch": o.get("batch", 1), "kv_dtype": o.get("kv_dtype"),
              "kv_bytes_per_layer_token": o.get("kv_bytes_per_layer_token"),
              "on_unknown_kv": o.get("on_unknown_kv", "fail"),
              "precision_ladder": list(o.get("precision_ladder") or []),
              "reserve_ram_bytes": int(_number(reserve_ram_gb or 0, "layerline_reserve_ram_gb") * 2**30)}
        if o.get("hop_secs") is not None:
            kw["hop_s"] = _number(o["hop_secs"], "layerline_objective.hop_secs")
        return cls(**kw)


def _number(v, field: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise CostError(f"{field}: {v!r} must be a number") from None


def model_cost(index: CheckpointIndex) -> ModelCost:
    """ModelCost from a tensor index: layers by block prefix, experts by name."""
    cfg = index.config
    n = index.num_layers
    if n == 0:
        raise CostError(f"{index.path}: no layer tensors found (expected names like model.layers.N.*)")
    dense, expert, rows = [0] * n, [0] * n, [0] * n
    sdense, sexpert = [0] * n, [0] * n
    embed = head = sembed = shead = 0
    stored = None
    blocks = False  # a GGUF whose matrices are (some of them) quantized blocks
    kv_width = None
    first = min(t.layer for t in index.tensors.values() if t.layer is not None)  # 0 but in a stage's own index
    for t in index.tensors.values():
        params = t.nbytes // DTYPE_BYTES[t.dtype]
        sbytes = t.stored_bytes if t.stored_bytes is not None else t.nbytes
        if t.dtype in STORED_PRECISION and len(t.shape) >= 2:
            stored = stored or STORED_PRECISION[t.dtype]
        if "gguf" in cfg and len(t.shape) >= 2 and t.stored_type not in (None, *GGUF_FLOAT_TYPES):
            blocks = True
        layer = t.layer
        if layer is None:
            if "embed_tokens" in t.name or t.name.startswith(("tok_embeddings", "token_embd")):
                embed += params
                sembed += sbytes
            else:  # final norm, lm_head, output
                head += params
                shead += sbytes
            continue
        if EXPERT_RE.search(t.name):
            expert[layer] += params
            sexpert[layer] += sbytes
        else:
            dense[layer] += params
            sdense[layer] += sbytes
        if len(t.shape) == 2:
            rows[layer] += t.shape[0]
        if layer == first and re.search(r"\.(k_proj|v_proj)\.weight$", t.name):
            kv_width = (kv_width or 0) + t.shape[0]
        elif layer == first and t.name.endswith(".qkv_proj.weight"):  # fused (Phi-3): K and V are the rows after Q
            heads = int(cfg.get("num_attention_heads") or 0)
            q_rows = heads * int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // max(heads, 1)))
            kv_width = t.shape[0] - q_rows if 0 < q_rows < t.shape[0] else None
    tied = bool(cfg.get("tie_word_embeddings")) or not any(
        "lm_head" in name or name.startswith("output.") for name in index.tensors)
    return ModelCost(
        num_layers=n, stored_precision="gguf" if blocks else (stored or "fp32"), dense_params=dense,
        expert_params=expert, rows=rows, embed_params=embed, head_params=head,
        num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
        experts_per_token=int(cfg.get("num_experts_per_tok") or 0),
        kv_width=kv_width, hidden_size=int(cfg.get("hidden_size") or 0),
        vocab_size=int(cfg.get("vocab_size") or 0), tied_embeddings=tied,
        stored_dense_bytes=sdense, stored_expert_bytes=sexpert, stored_embed_bytes=sembed, stored_head_bytes=shead)


def kv_profile(cost: ModelCost, opts: CostOptions, precision: str) -> KvProfile:
    """KV bytes per token per layer after the options' override and unknown-handling."""
    # the precision table's KV rule (int8 is weight-only: its stages keep the KV cache in bf16)
    dtype = opts.kv_dtype or precision_row(precision, "precision").kv
    if opts.kv_bytes_per_layer_token is not None:
        return KvProfile(opts.context, dtype, int(opts.kv_bytes_per_layer_token), "override")
    if cost.kv_width:
        return KvProfile(opts.context, dtype, cost.kv_width * KV_DTYPE_BYTES[dtype], "index")
    if opts.on_unknown_kv == "assume":  # as if full multi-head attention: K and V of hidden width
        return KvProfile(opts.context, dtype, 2 * cost.hidden_size * KV_DTYPE_BYTES[dtype], "assumed")
    if opts.on_unknown_kv == "ignore":
        return KvProfile(opts.context, dtype, 0, "ignored")
    raise CostError("KV width: cannot be inferred from the checkpoint (no k_proj/v_proj in layer 0); set "
                    "layerline_objective.kv_bytes_per_layer_token, or on_unknown_kv: assume | ignore")


def _stored(cost: ModelCost, precision: str) -> bool:
    """Whether `precision` costs the checkpoint's stored bytes (gguf); CostError when the cost lacks them."""
    if not PRECISIONS[precision].stored:
        return False
    if len(cost.stored_dense_bytes) != cost.num_layers or len(cost.stored_expert_bytes) != cost.num_layers:
        raise CostError(f"model cost: has no stored bytes per layer, which precision {precision} is costed by; "
                        "regenerate it with `layerline index CKPT --json`")
    return True


def weight_bytes(cost: ModelCost, layer: int, precision: str, experts: bool = True) -> int:
    """A layer's weight bytes at `precision` (gguf: the bytes its file stores, norms included)."""
    if _stored(cost, precision):
        return cost.stored_dense_bytes[layer] + (cost.stored_expert_bytes[layer] if experts else 0)
    p = cost.dense_params[layer] + (cost.expert_params[layer] if experts else 0)
    extra = cost.rows[layer] * PRECISIONS[precision].row_bytes
    return int(p * PRECISION_BYTES[precision]) + extra


def read_bytes(cost: ModelCost, layer: int, precision: str) -> tuple[float, float]:
    """Weight bytes one decode step reads in a layer: (dense, the active experts' share of theirs)."""
    if _stored(cost, precision):
        dense, experts = float(cost.stored_dense_bytes[layer]), float(cost.stored_expert_bytes[layer])
    else:
        per = PRECISION_BYTES[precision]
        dense, experts = cost.dense_params[layer] * per, cost.expert_params[layer] * per
    if experts and cost.num_experts:
        experts = experts * cost.experts_per_token / cost.num_experts
    return dense, experts


def edge_param_bytes(precision: str) -> float:
    """Bytes per parameter of the embedding and LM head (int4 holds them at int8; gguf: see edge_bytes)."""
    return PRECISION_BYTES[PRECISIONS[precision].edge_precision]


def _edges(cost: ModelCost, precision: str) -> tuple[float, float]:
    """(embedding bytes, final norm + head bytes) at `precision`."""
    if _stored(cost, precision):
        return float(cost.stored_embed_bytes), float(cost.stored_head_bytes)
    per = edge_param_bytes(precision)
    return cost.embed_params * per, cost.head_params * per


def edge_bytes(cost: ModelCost, precision: str, first: bool, last: bool) -> int:
    embed, head = _edges(cost, precision)
    b = 0.0
    if first:
        b += embed
    if last:
        b += head
        if cost.tied_embeddings and not first:
            b += embed  # the head is the embedding
    return int(b)


def head_read_bytes(cost: ModelCost, precision: str) -> float:
    """Weight bytes the last stage's head reads a step: final norm and LM head (the embedding when tied)."""
    embed, head = _edges(cost, precision)
    return head + (embed if cost.tied_embeddings else 0.0)


def edge_flops(cost: ModelCost, last: bool) -> float:
    """The head's matmul: 2 x vocab x hidden per token (the embedding lookup is free)."""
    return 2.0 * cost.vocab_size * cost.hidden_size if last else 0.0


# --- measured step factors ------------------------------------------------------------------
# The cost model prices a step from bytes and FLOPs at the probe's rates, which it measured for
# eager bf16: a compiled or int8 step differs by more than its bytes say (kernels, fusion, per-op
# overhead). A worker measures its step at warm-up; measured / modelled is kept per host and
# mode in the probe cache, and the next plan multiplies that mode's model by it.
STEP_FACTOR_RANGE = (0.05, 20.0)  # outside: a broken measurement, not a mode's real speed


def step_mode(precision: str, compile: str) -> str:
    """The key a host's step factor for this precision and compile mode is kept under."""
    return f"{precision}/{compile}"


def step_factor(measured_s, predicted_s, factor_used=1.0) -> float | None:
    """The factor for a mode: a measured step over the cost model's step (`predicted_s` was the
    model times `factor_used`); None when any of them is not a positive number."""
    vals = (measured_s, predicted_s, factor_used)
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in vals):
        return None
    lo, hi = STEP_FACTOR_RANGE
    return round(min(hi, max(lo, measured_s / (predicted_s / factor_used))), 3)


def usable_factor(v) -> bool:
    """A kept step factor the planner may use: a number within STEP_FACTOR_RANGE."""
    lo, hi = STEP_FACTOR_RANGE
    return not isinstance(v, bool) and isinstance(v, (int, float)) and lo <= v <= hi


def factor_for(factors, precision: str, compile: str) -> float:
    """The factor a host's probe facts hold for this mode, 1.0 when none (or not a usable number)."""
    v = factors.get(step_mode(precision, compile)) if isinstance(factors, dict) else None
    return float(v) if usable_factor(v) else 1.0
