"""Gemma 2 and Gemma 3 GGUF files as llama.cpp writes them (names, `<arch>.*` metadata, norms stored
as 1 + weight), made here from random-init transformers models: layerline reads them back to the
model transformers runs, logits equal. The trained Gemma 3 file is checked in tests/processes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from helpers import gguf_writer  # noqa: E402
from layerline.checkpoint import open_checkpoint  # noqa: E402
from layerline.checkpoint.gguf import hf_tensor_name  # noqa: E402
from layerline.model.llama import ModelArgs  # noqa: E402
from layerline.model.loader import load_stage  # noqa: E402

HD = 16
COMMON = dict(vocab_size=200, hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=HD, query_pre_attn_scalar=HD, sliding_window=4, max_position_embeddings=64,
              rms_norm_eps=1e-6)
CASES = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(COMMON, num_hidden_layers=7)),
         "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(COMMON, num_hidden_layers=3,
                                                               attn_logit_softcapping=5.0,
                                                               final_logit_softcapping=6.0))}
NAMES = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "post_attention_norm",
         "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _write(model, arch: str, path: Path) -> None:
    cfg = model.config
    sd = model.state_dict()
    w = gguf_writer(path, arch, layers=cfg.num_hidden_layers, context=cfg.max_position_embeddings,
                    hidden=cfg.hidden_size, ffn=cfg.intermediate_size, heads=cfg.num_attention_heads,
                    kv_heads=cfg.num_key_value_heads, head_dim=HD, rms_eps=cfg.rms_norm_eps,
                    rope_base=cfg.rope_parameters.get("full_attention", cfg.rope_parameters)["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in range(cfg.num_hidden_layers):
        for n in NAMES:
            g = f"blk.{i}.{n}.weight"
            hf = hf_tensor_name(g, arch)
            if hf in sd:
                names[g] = hf
    assert len(names) == len(sd) - ("lm_head.weight" in sd)  # every tensor but the tied head
    for g, hf in names.items():
        t = sd[hf].float().numpy()
        w.add_tensor(g, t + 1 if g.endswith("norm.weight") else t)  # llama.cpp's Gemma norms: 1 + weight
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(CASES))
def test_gemma_gguf_equals_transformers(tmp_path, arch):
    cfg_cls, model_cls, kw = CASES[arch]
    torch.manual_seed(3)
    cfg = getattr(transformers, cfg_cls)(**kw)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path / f"{arch}.gguf"
    _write(model, arch, path)
    a = ModelArgs.from_config(open_checkpoint(path).config)
    layers = cfg.num_hidden_layers
    assert [a.window(i) is not None for i in range(layers)] == [t == "sliding_attention" for t in cfg.layer_types]
    ids = torch.randint(0, 200, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.float()
    stages = [load_stage(str(path), s, e, s == 0, e == layers) for s, e in ((0, 2), (2, layers))]
    got = stages[1](stages[0](ids))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
