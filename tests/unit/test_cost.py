"""layerline.cost: ModelCost from a tensor index, KV profiles, CostOptions from inventory vars.

Per-layer parameter counts are derived from config.json (and cross-checked against the
tensors safetensors actually loads), never from the module under test.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

import pytest

from layerline.checkpoint import CheckpointIndex, TensorEntry, read_index, write_demo_checkpoint
from layerline.cost import CostError, CostOptions, ModelCost, kv_profile, model_cost
from layerline.errors import LayerlineError

ELT = {"F32": 4, "BF16": 2, "F16": 2}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", layers=3, hidden=128, vocab=500,
                                 dtype="float32")


def _entry(name: str, shape: tuple[int, ...], dtype: str = "BF16", file: str = "m.safetensors") -> TensorEntry:
    return TensorEntry(name, dtype, tuple(shape), file, math.prod(shape) * ELT[dtype])


def _index(entries: list[TensorEntry], config: dict) -> CheckpointIndex:
    return CheckpointIndex("/synthetic", config, {e.name: e for e in entries})


# --- the demo checkpoint ---------------------------------------------------------------------

def test_demo_cost_from_config(demo):
    cfg = json.loads((demo / "config.json").read_text())
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    q, kv = nh * hd, nkv * hd
    per_layer = 2 * h + q * h + 2 * kv * h + h * q + 3 * i * h
    rows_per_layer = q + 2 * kv + h + 2 * i + h       # output channels of the 7 matrices

    mc = model_cost(read_index(demo))
    L = cfg["num_hidden_layers"]
    assert mc.num_layers == L == 3
    assert mc.dense_params == [per_layer] * L
    assert mc.expert_params == [0] * L
    assert mc.rows == [rows_per_layer] * L
    assert mc.kv_width == 2 * nkv * hd
    assert mc.embed_params == v * h
    assert mc.head_params == h + v * h               # final norm + untied lm_head
    assert mc.tied_embeddings is False
    assert mc.stored_precision == "fp32"
    assert (mc.hidden_size, mc.vocab_size) == (h, v)
    assert [mc.active_params(k) for k in range(L)] == [per_layer] * L


def test_demo_cost_matches_loaded_tensors(demo):
    """Cross-check with the tensors themselves (the one place data is read, by the test)."""
    from safetensors.torch import load_file
    dense, other = defaultdict(int), 0
    for f in demo.glob("*.safetensors"):
        for name, t in load_file(str(f)).items():
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if m:
                dense[int(m.group(1))] += t.numel()
            else:
                other += t.numel()
    mc = model_cost(read_index(demo))
    assert mc.dense_params == [dense[k] for k in range(len(dense))]
    assert mc.embed_params + mc.head_params == other


def test_tied_embeddings_without_lm_head():
    h, v = 16, 50
    entries = [_entry("model.embed_tokens.weight", (v, h)), _entry("model.norm.weight", (h,)),
               _entry("model.layers.0.self_attn.k_proj.weight", (8, h)),
               _entry("model.layers.0.self_attn.v_proj.weight", (8, h)),
               _entry("model.layers.0.mlp.up_proj.weight", (32, h))]
    mc = model_cost(_index(entries, {"hidden_size": h, "vocab_size": v}))
    assert mc.tied_embeddings is True
    assert mc.embed_params == v * h
    assert mc.head_params == h
    assert mc.kv_width == 16
    assert mc.stored_precision == "bf16"


def test_no_layers_is_an_error():
    with pytest.raises(CostError) as ei:
        model_cost(_index([_entry("model.embed_tokens.weight", (4, 4))], {}))
    assert "\n" not in str(ei.value) and "/synthetic" in str(ei.value)


# --- routed experts --------------------------------------------------------------------------

MOE_STYLES = {
    # Mixtral: block_sparse_moe.experts.N.w{1,2,3}; router block_sparse_moe.gate is dense
    "mixtral": (lambda l, e: [f"model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
                              f"model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight"],
                lambda l, e: [f"model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight"],
                lambda l: f"model.layers.{l}.block_sparse_moe.gate.weight"),
    # Qwen-MoE style: mlp.experts.N.{gate,up,down}_proj; mlp.gate is the router
    "qwen": (lambda l, e: [f"model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
                           f"model.layers.{l}.mlp.experts.{e}.up_proj.weight"],
             lambda l, e: [f"model.layers.{l}.mlp.experts.{e}.down_proj.weight"],
             lambda l: f"model.layers.{l}.mlp.gate.weight"),
}


@pytest.mark.parametrize("style", sorted(MOE_STYLES))
def test_experts_kept_apart(style):
    h, inter, E, k, v, L = 32, 64, 8, 2, 100, 3
    up, down, router = MOE_STYLES[style]
    entries = [_entry("model.embed_tokens.weight", (v, h)), _entry("model.norm.weight", (h,)),
               _entry("lm_head.weight", (v, h))]
    dense_expected, expert_expected = [0] * L, [0] * L
    for layer in range(L):
        p = f"model.layers.{layer}."
        dense = [_entry(p + "input_layernorm.weight", (h,)), _entry(p + "post_attention_layernorm.weight", (h,)),
                 _entry(p + "self_attn.q_proj.weight", (h, h)), _entry(p + "self_attn.k_proj.weight", (8, h)),
                 _entry(p + "self_attn.v_proj.weight", (8, h)), _entry(p + "self_attn.o_proj.weight", (h, h)),
                 _entry(router(layer), (E, h)),
                 # a shared (always-on) expert is dense, not routed
                 _entry(p + "mlp.shared_expert.up_proj.weight", (inter, h))]
        experts = []
        for e in range(E):
            experts += [_entry(n, (inter, h)) for n in up(layer, e)]
            experts += [_entry(n, (h, inter)) for n in down(layer, e)]
        entries += dense + experts
        dense_expected[layer] = sum(math.prod(t.shape) for t in dense)
        expert_expected[layer] = sum(math.prod(t.shape) for t in experts)
    cfg = {"hidden_size": h, "vocab_size": v, "num_local_experts": E, "num_experts_per_tok": k}
    mc = model_cost(_index(entries, cfg))
    assert mc.num_layers == L
    assert mc.dense_params == dense_expected
    assert mc.expert_params == expert_expected == [E * 3 * inter * h] * L
    assert (mc.num_experts, mc.experts_per_token) == (E, k)
    for layer in range(L):
        assert mc.active_params(layer) == pytest.approx(dense_expected[layer] + expert_expected[layer] * k / E)
        assert mc.active_params(layer) < dense_expected[layer] + expert_expected[layer]
    assert mc.kv_width == 16


def test_gguf_style_expert_names():
    h, E = 16, 4
    entries = [_entry("blk.0.attn_k.weight", (8, h)), _entry("blk.0.ffn_gate_exps.weight", (E, 32, h)),
               _entry("blk.0.ffn_down_exps.weight", (E, h, 32)), _entry("blk.0.ffn_gate_inp.weight", (E, h)),
               _entry("blk.1.attn_norm.weight", (h,))]
    mc = model_cost(_index(entries, {"hidden_size": h, "num_experts": E, "num_experts_per_tok": 1}))
    assert mc.num_layers == 2
    assert mc.expert_params[0] == 2 * E * 32 * h
    assert mc.dense_params == [8 * h + E * h, h]
    assert mc.active_params(0) == pytest.approx(8 * h + E * h + 2 * E * 32 * h / E)


# --- KV ----------------------------------------------------------------------------------------

def _no_kv_cost(hidden: int = 64) -> ModelCost:
    entries = [_entry("model.layers.0.self_attn.qkv_proj.weight", (3 * hidden, hidden)),
               _entry("model.layers.0.mlp.up_proj.weight", (128, hidden))]
    mc = model_cost(_index(entries, {"hidden_size": hidden}))
    assert mc.kv_width is None
    return mc


def test_kv_unknown_fail():
    with pytest.raises(CostError) as ei:
        kv_profile(_no_kv_cost(), CostOptions(on_unknown_kv="fail"), "bf16")
    msg = str(ei.value)
    assert "\n" not in msg and "kv_bytes_per_layer_token" in msg and "on_unknown_kv" in msg


# int8 is weight-only: its KV cache stays bf16
@pytest.mark.parametrize("prec,kv_dtype,width", [("bf16", None, 2), ("fp32", None, 4), ("int8", None, 2),
                                                 ("bf16", "fp32", 4), ("fp32", "fp16", 2)])
def test_kv_unknown_assume_and_ignore(prec, kv_dtype, width):
    mc = _no_kv_cost(hidden=64)
    k = kv_profile(mc, CostOptions(on_unknown_kv="assume", context=100, kv_dtype=kv_dtype), prec)
    want_dtype = kv_dtype or ("bf16" if prec == "int8" else prec)
    assert (k.bytes_per_token, k.source, k.context, k.dtype) == (2 * 64 * width, "assumed", 100, want_dtype)
    k = kv_profile(mc, CostOptions(on_unknown_kv="ignore", kv_dtype=kv_dtype), prec)
    assert (k.bytes_per_token, k.source) == (0, "ignored")


def test_kv_override_wins(demo):
    for mc in (_no_kv_cost(), model_cost(read_index(demo))):
        k = kv_profile(mc, CostOptions(kv_bytes_per_layer_token=1234), "bf16")
        assert (k.bytes_per_token, k.source) == (1234, "override")


@pytest.mark.parametrize("prec,kv_dtype,width", [("bf16", None, 2), ("int8", None, 2), ("bf16", "fp32", 4)])
def test_kv_from_index(demo, prec, kv_dtype, width):
    cfg = json.loads((demo / "config.json").read_text())
    mc = model_cost(read_index(demo))
    k = kv_profile(mc, CostOptions(kv_dtype=kv_dtype, context=777), prec)
    assert k.bytes_per_token == 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * width
    assert (k.source, k.context) == ("index", 777)


def test_model_cost_dict_round_trip(demo):
    mc = model_cost(read_index(demo))
    d = json.loads(json.dumps(mc.to_dict()))
    assert ModelCost.from_dict(d) == mc
    with pytest.raises(CostError):
        ModelCost.from_dict({"num_layers": 3})


# --- CostOptions.from_vars ---------------------------------------------------------------------

def test_from_vars_maps_design_names():
    o = CostOptions.from_vars({"optimize": "latency", "context": 512, "batch": 2, "hop_secs": 0.002,
                               "kv_dtype": "fp16", "kv_bytes_per_layer_token": 64, "on_unknown_kv": "assume",
                               "precision_ladder": ["bf16", "int8"]}, reserve_ram_gb=1.5)
    assert (o.objective, o.context, o.batch, o.hop_s, o.kv_dtype, o.kv_bytes_per_layer_token, o.on_unknown_kv,
            o.precision_ladder, o.reserve_ram_bytes) == ("latency", 512, 2, 0.002, "fp16", 64, "assume",
                                                         ["bf16", "int8"], int(1.5 * 2**30))
    d = CostOptions.from_vars(None)
    assert (d.objective, d.context, d.batch, d.on_unknown_kv, d.precision_ladder, d.reserve_ram_bytes) == \
        ("throughput", 4096, 1, "fail", [], 0)


def test_from_vars_rejects_unknown_keys():
    with pytest.raises(CostError) as ei:
        CostOptions.from_vars({"optimise": "latency", "contxt": 5})
    msg = str(ei.value)
    assert "\n" not in msg and "optimise" in msg and "contxt" in msg and "layerline_objective" in msg


@pytest.mark.parametrize("field,value", [
    ("optimize", "speed"), ("context", 0), ("context", -5), ("context", "4096"), ("context", True),
    ("batch", 0), ("batch", 1.5), ("on_unknown_kv", "maybe"), ("precision_ladder", ["bf16", "fp8"]),
    ("kv_dtype", "int4"), ("hop_secs", -0.1),
])
def test_from_vars_rejects_bad_values(field, value):
    with pytest.raises(CostError) as ei:
        CostOptions.from_vars({field: value})
    msg = str(ei.value)
    assert "\n" not in msg
    assert field in msg, f"{field} not named in {msg!r}"


def test_from_vars_hop_secs_not_a_number():
    with pytest.raises(CostError) as ei:
        CostOptions.from_vars({"hop_secs": "fast"})
    assert "hop_secs" in str(ei.value)


def test_from_vars_reserve_not_a_number():
    with pytest.raises(CostError) as ei:
        CostOptions.from_vars({}, reserve_ram_gb="lots")
    assert "layerline_reserve_ram_gb" in str(ei.value)


@pytest.mark.parametrize("value", [-5, "x"])
def test_from_vars_rejects_bad_kv_override(value):
    with pytest.raises(CostError) as ei:
        CostOptions.from_vars({"kv_bytes_per_layer_token": value})
    assert "kv_bytes_per_layer_token" in str(ei.value)


def test_cost_error_is_a_layerline_error():
    assert issubclass(CostError, LayerlineError)


def test_step_factor_is_measured_over_the_unfactored_model():
    from layerline.cost import STEP_FACTOR_RANGE, factor_for, step_factor, step_mode
    assert step_mode("int8", "max-autotune") == "int8/max-autotune"
    assert step_factor(0.02, 0.01) == 2.0
    # predicted_s already held a factor of 2: the model said 0.01, so 0.005 measured is 0.5
    assert step_factor(0.005, 0.02, 2.0) == 0.5
    # re-recording a running worker against the plan its factor made gives the same factor
    assert step_factor(0.005, 0.01 * step_factor(0.005, 0.01), step_factor(0.005, 0.01)) == 0.5
    for bad in ((None, 0.01), (0.01, 0), (0.01, -1.0), ("x", 0.01), (True, 0.01)):
        assert step_factor(*bad) is None
    assert step_factor(100.0, 0.001) == STEP_FACTOR_RANGE[1]  # a broken measurement is clamped
    factors = {"int8/off": 0.6, "bf16/default": 0.4, "bf16/max-autotune": -1, "int4/off": "x"}
    assert factor_for(factors, "int8", "off") == 0.6
    assert factor_for(factors, "bf16", "default") == 0.4
    assert factor_for(factors, "bf16", "off") == 1.0  # not measured
    assert factor_for(factors, "bf16", "max-autotune") == 1.0 and factor_for(factors, "int4", "off") == 1.0
    assert factor_for(None, "bf16", "off") == 1.0 and factor_for([1], "bf16", "off") == 1.0


# --- a GGUF at the bytes its file stores -------------------------------------------------------

def _gguf_entry(name: str, shape: tuple[int, ...], stype: str) -> TensorEntry:
    """A GGUF index entry: planned at BF16 when quantized (as layerline.checkpoint.gguf indexes it),
    stored as `stype` (Q4_0: 32 weights in 18 bytes; Q8_0: in 34)."""
    n = math.prod(shape)
    stored = {"F32": 4 * n, "F16": 2 * n, "Q4_0": n // 32 * 18, "Q8_0": n // 32 * 34}[stype]
    planned = stype if stype in ("F32", "F16") else "BF16"
    return TensorEntry(name, planned, tuple(shape), "m.gguf", n * ELT[planned], stored_type=stype,
                       stored_bytes=stored, offset=0)


def _gguf_model(matrix: str, tied: bool = True, layers: int = 2, h: int = 64, v: int = 256,
                embed: str = "Q8_0") -> CheckpointIndex:
    entries = [_gguf_entry("model.embed_tokens.weight", (v, h), embed), _gguf_entry("model.norm.weight", (h,), "F32")]
    if not tied:
        entries.append(_gguf_entry("lm_head.weight", (v, h), embed))
    for layer in range(layers):
        p = f"model.layers.{layer}."
        entries += [_gguf_entry(p + "input_layernorm.weight", (h,), "F32"),
                    _gguf_entry(p + "self_attn.k_proj.weight", (32, h), matrix),
                    _gguf_entry(p + "self_attn.v_proj.weight", (32, h), matrix),
                    _gguf_entry(p + "mlp.up_proj.weight", (128, h), matrix)]
    cfg = {"hidden_size": h, "vocab_size": v, "tie_word_embeddings": tied, "gguf": {"file": "m.gguf"}}
    return _index(entries, cfg)


def test_a_quantized_gguf_costs_its_stored_bytes():
    from layerline.cost import edge_bytes, head_read_bytes, read_bytes, weight_bytes
    h, v = 64, 256
    idx = _gguf_model("Q4_0")
    mc = model_cost(idx)
    assert mc.stored_precision == "gguf"
    layer = 4 * h + (32 + 32 + 128) * h // 32 * 18  # the F32 norm and three Q4_0 matrices
    assert [weight_bytes(mc, i, "gguf") for i in range(2)] == mc.stored_dense_bytes == [layer, layer]
    assert read_bytes(mc, 0, "gguf") == (layer, 0)
    embed, norm = v * h // 32 * 34, 4 * h
    assert edge_bytes(mc, "gguf", True, False) == embed
    assert edge_bytes(mc, "gguf", False, True) == norm + embed  # the tied head is the embedding
    assert edge_bytes(mc, "gguf", True, True) == embed + norm  # counted once on a stage holding both
    assert head_read_bytes(mc, "gguf") == norm + embed
    whole = sum(weight_bytes(mc, i, "gguf") for i in range(2)) + edge_bytes(mc, "gguf", True, True)
    assert whole == idx.stored_bytes
    # the other precisions keep their bytes per parameter
    assert weight_bytes(mc, 0, "bf16") == 2 * mc.dense_params[0]
    assert edge_bytes(mc, "int4", True, False) == mc.embed_params  # int4's embedding at int8
    untied = model_cost(_gguf_model("Q4_0", tied=False))
    assert edge_bytes(untied, "gguf", False, True) == norm + embed and not untied.tied_embeddings
    # a round trip keeps the stored bytes
    assert ModelCost.from_dict(json.loads(json.dumps(mc.to_dict()))) == mc


def test_a_float_gguf_keeps_its_float_precision_and_old_costs_say_regenerate():
    from layerline.cost import weight_bytes
    assert model_cost(_gguf_model("F16", embed="F16")).stored_precision == "fp16"
    assert model_cost(_gguf_model("F16")).stored_precision == "gguf"  # a Q8_0 embedding is a quantized matrix
    old = model_cost(_gguf_model("Q4_0")).to_dict()
    for k in ("stored_dense_bytes", "stored_expert_bytes", "stored_embed_bytes", "stored_head_bytes"):
        old.pop(k)
    mc = ModelCost.from_dict(old)
    assert weight_bytes(mc, 0, "bf16") == 2 * mc.dense_params[0]
    with pytest.raises(CostError, match="regenerate it with `layerline index CKPT --json`"):
        weight_bytes(mc, 0, "gguf")

