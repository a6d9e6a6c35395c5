"""open_checkpoint: one object for a Hugging Face dir and for a GGUF file. The same model written
both ways (float32, so the GGUF holds the very values; Q and K rows permuted as llama.cpp does,
a byte-level BPE vocabulary and a chat template in its metadata) opens to the same config,
index names, tensors, tokenizer, chat template and stop tokens, and stages to the same tensors;
a path that is neither is one clear error."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import llama_gguf_writer

from layerline.checkpoint import (Checkpoint, CheckpointError, GGUFCheckpoint, HFCheckpoint, open_checkpoint,
                                  write_demo_checkpoint)
from layerline.checkpoint.gguf import hf_tensor_name, permute_for_gguf
from layerline.model.llama import ModelArgs
from layerline.model.loader import stage_tensor_names

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}" \
           "{% if add_generation_prompt %}<s>assistant: {% endif %}"
TEXTS = ["Hello, world!", "  two  spaces\nand a line", "naïve café 🙂", "<s>user: hi</s>"]


def _tokenizer():
    """A small byte-level BPE tokenizer (ids 0..2: <unk>, <s>, </s>), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. " * 8, "hello world, hello there"] * 4,
                            trainer)
    return tok


def _write_gguf(src: Path, out: Path, tok) -> None:
    """The HF dir's tensors as a llama GGUF (all F32), with `tok` and TEMPLATE as metadata."""
    from safetensors.torch import load_file
    cfg = json.loads((src / "config.json").read_text())
    hf = {}
    for f in sorted(src.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    names = ["token_embd.weight", "output_norm.weight", "output.weight"] + [
        f"blk.{n}.{p}.weight" for n in range(cfg["num_hidden_layers"])
        for p in ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    to_gguf = {hf_tensor_name(g): g for g in names}
    w = llama_gguf_writer(out, cfg)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _i in vocab])
    w.add_token_types([3 if t in ("<unk>", "<s>", "</s>") else 1 for t, _i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_chat_template(TEMPLATE)
    for name, t in hf.items():
        g = to_gguf[name]
        a = t.float().numpy()
        if ".attn_q." in g:
            a = permute_for_gguf(a, cfg["num_attention_heads"])
        elif ".attn_k." in g:
            a = permute_for_gguf(a, cfg["num_key_value_heads"])
        w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Checkpoint, Checkpoint]:
    """(the model as a Hugging Face dir, the same model as a GGUF file)."""
    root = tmp_path_factory.mktemp("pair")
    hf_dir = write_demo_checkpoint(root / "hf", layers=3, hidden=128, vocab=500, dtype="float32",
                                   shard_bytes=300_000)  # sharded: several files
    tok = _tokenizer()
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}))
    path = root / "model.gguf"
    _write_gguf(hf_dir, path, tok)
    return open_checkpoint(hf_dir), open_checkpoint(path)


def test_the_format_is_decided_once_by_what_the_path_is(pair):
    hf, gg = pair
    assert isinstance(hf, HFCheckpoint) and isinstance(gg, GGUFCheckpoint)
    assert len(hf.source_files()) > 1 and gg.source_files() == [gg.path]


def _args(cfg: dict) -> ModelArgs:
    """The model a config describes, its norm epsilon as GGUF stores it (float32)."""
    args = ModelArgs.from_config(cfg)
    return dataclasses.replace(args, rms_norm_eps=float(np.float32(args.rms_norm_eps)))


def test_same_config_and_index(pair):
    hf, gg = pair
    assert _args(gg.config) == _args(hf.config)
    for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rope_theta",
              "bos_token_id", "eos_token_id"):
        assert gg.config[k] == hf.config[k], k
    a, b = hf.index, gg.index
    assert list(a.tensors) != [] and set(a.tensors) == set(b.tensors)
    assert a.num_layers == b.num_layers == 3 and a.total_bytes == b.total_bytes == a.stored_bytes == b.stored_bytes
    for name, e in a.tensors.items():
        g = b.tensors[name]
        assert (e.shape, e.dtype, e.nbytes) == (g.shape, g.dtype, g.nbytes), name
        assert (e.stored_type, g.stored_type) == ("F32", "F32") and e.stored_bytes == g.stored_bytes == e.nbytes


def test_byte_ranges_hold_each_tensors_stored_bytes(pair):
    """What staging ships: every entry's byte range in its file is that tensor's bytes as stored (the
    GGUF's Q and K rows in llama.cpp's order)."""
    hf, gg = pair
    cfg = hf.config
    for name, t in hf.tensors(list(hf.index.tensors)):
        for ck, want in ((hf, t), (gg, t)):
            e = ck.index.tensors[name]
            a, b = e.byte_range
            with open(ck.file_path(e), "rb") as f:
                f.seek(a)
                raw = np.frombuffer(f.read(b - a), dtype=np.float32).reshape(e.shape)
            if ck is gg and ".q_proj." in name:
                want = torch.from_numpy(permute_for_gguf(want.numpy(), cfg["num_attention_heads"]))
            elif ck is gg and ".k_proj." in name:
                want = torch.from_numpy(permute_for_gguf(want.numpy(), cfg["num_key_value_heads"]))
            assert np.array_equal(raw, want.numpy()), (type(ck).__name__, name)


def test_same_tensors_whole_and_by_rows(pair):
    hf, gg = pair
    names = list(hf.index.tensors)
    got = dict(gg.tensors(names))
    for name, want in hf.tensors(names):
        assert want.dtype == got[name].dtype == torch.float32
        assert torch.equal(got[name], want), name
    q = "model.layers.1.self_attn.q_proj.weight"
    head_dim = hf.config["head_dim"]
    for ck in (hf, gg):
        blocks = list(ck.row_blocks(q, max_bytes=head_dim * 4 * 128))  # one head (of 128 floats a row) a block
        assert [a for a, _r in blocks] == list(range(0, 128, head_dim))
        assert torch.equal(torch.cat([r for _a, r in blocks]), hf.tensor(q))
        assert ck.int4_codes(q) is None  # float32: no stored 4-bit codes


def test_same_tokenizer_template_and_stop_tokens(pair):
    hf, gg = pair
    assert hf.tokenizer is not None and gg.tokenizer is not None
    for t in TEXTS:
        ids = hf.tokenizer.encode(t, add_special_tokens=False).ids
        assert gg.tokenizer.encode(t, add_special_tokens=False).ids == ids, t
        assert gg.tokenizer.decode(ids, skip_special_tokens=False) == t
    assert hf.chat_template == gg.chat_template == TEMPLATE
    for key in ("bos", "eos"):
        assert hf.special_tokens[key] == gg.special_tokens[key], key
    assert hf.special_tokens["eos_ids"] == gg.special_tokens["eos_ids"] == [2]


def test_both_stage_to_the_same_tensors(pair, tmp_path):
    """An HF dir stages as an HF dir, a GGUF as a GGUF file of its own bytes with all its metadata (the
    config and text side inside it); both open again with the same tensors, config and tokenizer."""
    hf, gg = pair
    names = stage_tensor_names(hf.index, 1, 3, False, True)
    for ck in (hf, gg):
        out = tmp_path / type(ck).__name__
        out.mkdir()
        ck.write_stage(names, out)
    a, b = tmp_path / "HFCheckpoint", tmp_path / "GGUFCheckpoint"
    assert sorted(p.name for p in b.iterdir()) == ["model.gguf"]
    staged = {"hf": open_checkpoint(a, check=False), "gguf": open_checkpoint(b)}
    assert isinstance(staged["hf"], HFCheckpoint) and isinstance(staged["gguf"], GGUFCheckpoint)
    assert staged["gguf"].config == gg.config and set(staged["gguf"].index.tensors) == set(names)
    want = dict(hf.tensors(names))
    for ck in staged.values():
        assert ck.chat_template == TEMPLATE and _args(ck.config) == _args(hf.config)
        assert ck.tokenizer.encode(TEXTS[0]).ids == hf.tokenizer.encode(TEXTS[0]).ids
        for name, t in ck.tensors(names):
            assert torch.equal(t, want[name]), name


def test_a_dir_without_text_files_has_no_tokenizer(tmp_path):
    ck = open_checkpoint(write_demo_checkpoint(tmp_path / "bare", layers=1, hidden=64, vocab=100, dtype="float32"))
    assert ck.tokenizer is None and ck.chat_template is None
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        ck.require_tokenizer()
    assert ck.special_tokens["eos_ids"] == [2]  # from config.json / generation_config.json


@pytest.mark.parametrize("name, content, says", [
    ("notes.txt", b"just some text\n", "not GGUF"),
    ("model.gguf", b"this is not a GGUF file\n", "not GGUF"),
    ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", "the dir that holds it"),
])
def test_a_file_that_is_neither_is_one_clear_error(tmp_path, name, content, says):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(p)
    msg = str(e.value)
    assert str(p) in msg and says in msg and "\n" not in msg
    assert "layerline_checkpoint" in msg and ("Hugging Face" in msg or "config.json" in msg)


def test_a_missing_path_says_what_is_expected(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory.*layerline_checkpoint"):
        open_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        open_checkpoint(tmp_path / "nowhere.gguf")
