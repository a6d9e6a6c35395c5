"""SentencePiece GGUF vocabularies (tokenizer.ggml.model "llama": tokens, scores, token types) tokenize
as transformers' GGUF tokenizer does: Llama's build (Metaspace, merges by score) and Gemma's (spaces
as "▁", merges in the file's order), byte fallback, control and user-defined tokens kept whole, BOS
added. A small vocabulary written here; the trained Gemma 3 file is checked in tests/processes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from helpers import gguf_writer  # noqa: E402
from layerline.checkpoint import open_checkpoint  # noqa: E402

WORDS = ["▁", "a", "b", "c", "h", "e", "l", "o", "▁a", "ab", "▁ab", "he", "ll", "hel", "hell", "hello", "▁hello",
         "▁b", "bc", "abc", "▁abc", "lo", "▁c", "▁▁", "▁▁▁", "  ", "<start_of_turn>", "<think>"]
TEXTS = ["hello abc", " hello", "abc  ab", "héllo wörld", "a\nb", "<start_of_turn>hello<think>c", "   ",
         "hellohello ab c", "  two  spaces"]


def _write(path: Path, arch: str) -> None:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + WORDS
    types = [2, 3, 3] + [6] * 256 + [1] * (len(WORDS) - 2) + [3, 4]  # normal, control, user-defined, byte
    scores = [0.0] * 259 + [-float(i) for i in range(len(WORDS))]
    w = gguf_writer(path, arch, layers=1, context=64, hidden=8, ffn=16, heads=2, kv_heads=2, rms_eps=1e-6)
    w.add_sliding_window(4)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sentencepiece_ids_equal_transformers_gguf_tokenizer(tmp_path, arch):
    _write(tmp_path / "sp.gguf", arch)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    ck = open_checkpoint(tmp_path / "sp.gguf")
    ours = ck.tokenizer
    assert ck.special_tokens["add_bos"]
    for t in TEXTS:
        ids = ours.encode(t).ids
        assert ids == hf(t)["input_ids"], t
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), t
