"""A big random GGUF for the capped-host test: a Llama model whose quantized blocks are written
straight from random bytes, a tensor at a time, so neither this process nor any other ever holds
the model.

The blocks are laid out as llama.cpp stores them (Q8_0: fp16 d + 32 int8; Q4_K: fp16 d, fp16
dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit codes; Q6_K: 128 bytes of low
nibbles, 64 of high bits, 16 int8 scales, fp16 d). The codes are random; each block's fp16
scale fields are set to small finite values chosen so a weight's spread is about 0.02 and its
mean about 0, so 40-odd layers keep the residual stream (and an fp16 KV cache) finite. Norms are
F32 ones. The vocabulary is a byte-level BPE of the 256 byte tokens plus BOS/EOS: the server can
take text.

    python tests/multihost/big_gguf.py OUT_DIR [--layers N] [--hidden H]   # prints the path

`big_gguf(cache_dir, **shape)` writes `big-<key>.gguf` once per shape (the key hashes the shape
and this file's format version) and returns it; a file being written has another name until
it is complete, so an interrupted run never leaves a cached half.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

FORMAT = 1  # bump when the bytes written for a shape change
BLOCK = {"Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}   # weights, bytes per block


@dataclass(frozen=True)
class Shape:
    layers: int = 48
    hidden: int = 2048
    ffn: int = 5632             # a multiple of 256 (K-quant super-blocks along a row)
    heads: int = 16
    kv_heads: int = 4
    context: int = 2048
    seed: int = 0
    # the ggml type of each matrix family (a real Q4_K_M file mixes them like this)
    attn: str = "Q8_0"
    gate_up: str = "Q4_K"
    down: str = "Q6_K"
    edge: str = "Q8_0"          # token embedding and output head

    @property
    def vocab(self) -> int:
        return 258              # 256 byte tokens, BOS, EOS

    @property
    def key(self) -> str:
        return hashlib.sha1(json.dumps([FORMAT, asdict(self)], sort_keys=True).encode()).hexdigest()[:12]

    def tensors(self) -> list[tuple[str, tuple[int, int] | tuple[int], str]]:
        """(GGUF name, [rows, cols] as in Hugging Face, ggml type) in file order."""
        h, f, kv = self.hidden, self.ffn, self.hidden // self.heads * self.kv_heads
        out: list = [("token_embd.weight", (self.vocab, h), self.edge)]
        for i in range(self.layers):
            p = f"blk.{i}."
            out += [(p + "attn_norm.weight", (h,), "F32"),
                    (p + "attn_q.weight", (h, h), self.attn), (p + "attn_k.weight", (kv, h), self.attn),
                    (p + "attn_v.weight", (kv, h), self.attn), (p + "attn_output.weight", (h, h), self.attn),
                    (p + "ffn_norm.weight", (h,), "F32"),
                    (p + "ffn_gate.weight", (f, h), self.gate_up), (p + "ffn_up.weight", (f, h), self.gate_up),
                    (p + "ffn_down.weight", (h, f), self.down)]
        out += [("output_norm.weight", (h,), "F32"), ("output.weight", (self.vocab, h), self.edge)]
        return out

    def tensor_bytes(self) -> int:
        return sum(_nbytes(shape, t) for _, shape, t in self.tensors())


def _nbytes(shape: tuple, ggml: str) -> int:
    if ggml == "F32":
        return 4 * int(np.prod(shape))
    per, size = BLOCK[ggml]
    rows, cols = shape
    assert cols % per == 0, f"{cols} columns are not whole {ggml} blocks of {per}"
    return rows * cols // per * size


def _fp16(rng, n: int, lo: float, hi: float) -> np.ndarray:
    """n fp16 values in [lo, hi), as their two bytes each."""
    return (rng.random(n) * (hi - lo) + lo).astype(np.float16).view(np.uint8).reshape(n, 2)


def _blocks(rng, shape: tuple[int, int], ggml: str) -> np.ndarray:
    """Random blocks of a [rows, cols] matrix as uint8 [rows, bytes per row]: random codes, scales
    small and finite (weights spread about 0.02 around about 0)."""
    per, size = BLOCK[ggml]
    n = shape[0] * shape[1] // per
    b = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
    if ggml == "Q8_0":        # w = d * q, q int8: std ~ 74 d
        b[:, 0:2] = _fp16(rng, n, 2e-4, 4e-4)
    elif ggml == "Q4_K":      # w = d * sc * q - dmin * m, sc and m 6-bit, q 4-bit: mean d*236 - dmin*31.5
        b[:, 0:2] = _fp16(rng, n, 1.5e-5, 2.5e-5)
        b[:, 2:4] = _fp16(rng, n, 1.1e-4, 1.9e-4)
    elif ggml == "Q6_K":      # w = d * sc * (q - 32), sc int8, q 6-bit: std ~ 74 * 18 d
        b[:, 208:210] = _fp16(rng, n, 1.5e-5, 2.5e-5)
    return b.reshape(shape[0], -1)


def write_big_gguf(path: Path, s: Shape) -> Path:
    import gguf

    tmp = path.with_name(path.name + f".part-{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"layerline big test model {s.key}")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(s.hidden // s.heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    from layerline.text import _bytes_to_unicode   # the byte-level alphabet the tokenizer reads back
    spelling = _bytes_to_unicode()
    w.add_token_list([spelling[i] for i in range(256)] + ["<s>", "</s>"])
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2)
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    for name, shape, t in s.tensors():
        if t == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, t))
        else:  # the byte shape: the writer turns it into the weight shape of its ggml type
            per, size = BLOCK[t]
            w.add_tensor_info(name, (shape[0], shape[1] // per * size), np.dtype(np.uint8), _nbytes(shape, t),
                              raw_dtype=gguf.GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (_name, shape, t) in enumerate(s.tensors()):
        rng = np.random.default_rng([s.seed, i])
        w.write_tensor_data(np.ones(shape, np.float32) if t == "F32" else _blocks(rng, shape, t))
    w.close()
    os.replace(tmp, path)
    return path


def big_gguf(cache_dir: Path | str, **shape) -> Path:
    """The file for this shape under cache_dir, written when missing."""
    s = Shape(**shape)
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"big-{s.key}.gguf"
    if not path.exists():
        for old in cache.glob(f"big-{s.key}.gguf.part-*"):
            old.unlink(missing_ok=True)
        write_big_gguf(path, s)
    return path


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=Shape.layers)
    ap.add_argument("--hidden", type=int, default=Shape.hidden)
    ap.add_argument("--ffn", type=int, default=Shape.ffn)
    a = ap.parse_args()
    p = big_gguf(a.out, layers=a.layers, hidden=a.hidden, ffn=a.ffn)
    print(p, p.stat().st_size, file=sys.stdout)
