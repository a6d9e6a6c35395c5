"""Gemma 3, Gemma 2, Qwen3 and Phi-3 against Hugging Face transformers, in one process.

transformers makes each random-init model (its own *ForCausalLM class, float32) and saves it;
layerline loads the saved dir as three stages. Logits must agree, and greedy generation through the
three stages, each with its own KV cache, must give transformers' generate() tokens. The
configs are small but keep what makes each family itself: Gemma's window layers (a window
shorter than the sequences, every other layer global), its own RoPE base on window layers, q/k
norms, sandwich norms, GeGLU, scaled embeddings, query_pre_attn_scalar, Gemma 2's soft-caps;
Qwen3's q/k norms; Phi-3's fused qkv_proj and gate_up_proj (and its window). Also: config keys
saved as null mean their default.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import chained_greedy  # noqa: E402
from layerline.checkpoint import open_checkpoint, write_demo_checkpoint  # noqa: E402
from layerline.model.llama import ModelArgs  # noqa: E402
from layerline.model.loader import load_stage  # noqa: E402

LAYERS = 4
SPLIT = ((0, 1), (1, 3), (3, 4))
WINDOW = 5
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128)
CONFIGS = {
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        COMMON, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=20, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 50000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 1000.0}})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        COMMON, sliding_window=WINDOW, query_pre_attn_scalar=20, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(COMMON, hidden_size=96, sliding_window=WINDOW,
                                                   tie_word_embeddings=False, pad_token_id=0,
                                                   bos_token_id=1, eos_token_id=2)),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    out = {}
    for mtype, (cfg_cls, model_cls, kw) in CONFIGS.items():
        torch.manual_seed(7)
        cfg = getattr(transformers, cfg_cls)(**kw)
        cfg._attn_implementation = "eager"
        model = getattr(transformers, model_cls)(cfg).eval()
        with torch.no_grad():  # norms away from their init (Gemma's zeros), so the offset is tested
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.3)
        d = tmp_path_factory.mktemp(mtype)
        model.save_pretrained(d)
        model.generation_config.eos_token_id = None  # random weights: never stop early
        out[mtype] = (d, model)
    return out


def _prompt(vocab: int, b: int = 2, t: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mtype", list(CONFIGS))
def test_family_matches_transformers(models, mtype):
    path, hf = models[mtype]
    assert json.loads((path / "config.json").read_text())["model_type"] == mtype
    full = load_stage(str(path), 0, LAYERS, True, True)
    ids = _prompt(COMMON["vocab_size"], t=11, seed=1)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    torch.testing.assert_close(full(ids), ref, atol=1e-4, rtol=1e-4)

    prompt, steps = _prompt(COMMON["vocab_size"], t=7, seed=2), 10  # past the window
    want = hf.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    stages = [load_stage(str(path), a, b, a == 0, b == LAYERS) for a, b in SPLIT]
    got = chained_greedy(stages, prompt, steps)
    assert torch.equal(got, want), f"{mtype}: pipeline {got.tolist()} != transformers {want.tolist()}"


def test_phi3_kv_width_from_its_fused_qkv(models):
    from layerline.cost import model_cost
    c = COMMON
    assert model_cost(open_checkpoint(models["phi3"][0]).index).kv_width == 2 * c["num_key_value_heads"] * c["head_dim"]


def test_gemma3_args_from_its_config(models):
    a = ModelArgs.from_config(open_checkpoint(models["gemma3_text"][0]).config)
    assert [a.window(i) for i in range(LAYERS)] == [WINDOW, None, WINDOW, None]
    assert [a.rope(i) for i in range(LAYERS)] == [1, 0, 1, 0]
    assert a.local_rope_theta == 1000.0 and a.rope_theta == 50000.0 and a.rope_scaling["factor"] == 2.0
    assert a.tie_word_embeddings and a.qk_norm and a.sandwich_norm and a.mlp_act == "gelu_tanh"
    assert a.attn_scale == 20 ** -0.5 and a.embed_scale == 64 ** 0.5 and a.final_softcap is None


def test_null_config_keys_mean_their_default(tmp_path):
    ckpt = write_demo_checkpoint(tmp_path / "m", arch="llama", layers=2, dtype="float32", seed=3)
    stage = load_stage(str(ckpt), 0, 2, True, True)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(head_dim=None, rope_scaling=None, attention_bias=None, sliding_window=None, pad_token_id=None)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    ck = open_checkpoint(ckpt)
    ck.index  # the config and tensors checked, as before
    again = load_stage(str(ckpt), 0, 2, True, True)
    ids = _prompt(cfg["vocab_size"], t=5)
    assert again.args.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    torch.testing.assert_close(again(ids), stage(ids), atol=0, rtol=0)
