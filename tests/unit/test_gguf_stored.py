"""Precision gguf on small random-init GGUF files: each matrix held as the file's own blocks and run by
ggml's kernels, against the same file loaded at fp32 (every tensor dequantized to float32).

The files mix block types as Q4_K_M files do, matrix by matrix (gguf.quants quantizes the 32-weight
types, ggml's reference quantizer the K types), for a llama file (Q/K rows permuted as llama.cpp
writes them), a gemma3 file (tied head, norms stored as 1 + weight) and a qwen2 file (q/k/v
biases). The stage's modules hold the file's bytes exactly (`stored()` against
`Checkpoint.stored_blocks`, and those rows against the file's float decode), q/k/v and gate/up fuse
only when their block types agree (qwen2's biases with them), a block type without a kernel here
(Q2_K) is held as float32 and said so, and the logits are close to the fp32 stage's: the only
difference is ggml quantizing each matrix's input to 8 bits.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from helpers import gguf_writer  # noqa: E402
from layerline.checkpoint import open_checkpoint  # noqa: E402
from layerline.checkpoint.base import STORED_BLOCK_TYPES  # noqa: E402
from layerline.checkpoint.gguf import permute_for_gguf  # noqa: E402
from layerline.errors import LayerlineError  # noqa: E402
from layerline.model import gguf_blocks  # noqa: E402
from layerline.model.blocks import BlockEmbedding, BlockLinearModule  # noqa: E402
from layerline.model.loader import load_stage  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not gguf_blocks.load(), reason=f"GGUF block kernels: {gguf_blocks.status()}")]

T = gguf.GGMLQuantizationType
H, FF, HEADS, KV_HEADS, HD, VOCAB = 256, 512, 4, 2, 64, 320
# per layer: GGUF tensor -> block type (None: F32); layer 0 fuses gate/up (both Q4_0), not q/k/v
LAYER_TYPES = [
    {"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q8_0, "attn_output": T.Q6_K,
     "ffn_gate": T.Q4_0, "ffn_up": T.Q4_0, "ffn_down": T.Q5_1},
    {"attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q5_0, "attn_output": T.Q4_1,
     "ffn_gate": T.Q4_1, "ffn_up": T.Q5_0, "ffn_down": T.Q2_K},
]


def _blocks(w: np.ndarray, t) -> np.ndarray:
    """w [N, K] as `t` blocks: gguf.quants where it quantizes the type, else ggml's reference quantizer."""
    try:
        return gguf.quants.quantize(w, t)
    except NotImplementedError:
        pass
    size, nbytes = gguf.GGML_QUANT_SIZES[t]
    out = np.empty((w.shape[0], w.shape[1] // size * nbytes), dtype=np.uint8)
    fn = getattr(gguf_blocks._S.cpu, f"quantize_row_{t.name.lower().replace('_k', '_K')}_ref")
    src = np.ascontiguousarray(w, dtype=np.float32)
    fn(ctypes.c_void_p(src.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(src.size))
    return out


def _write(path: Path, arch: str) -> None:
    rng = np.random.default_rng(1)
    w = gguf_writer(path, arch, layers=len(LAYER_TYPES), context=128, hidden=H, ffn=FF, heads=HEADS,
                    kv_heads=KV_HEADS, head_dim=HD, rope_dims=HD, rope_base=10000.0, rms_eps=1e-6, vocab=VOCAB)
    if arch == "gemma3":
        w.add_sliding_window(8)

    def mat(name: str, shape: tuple[int, int], t, heads: int | None = None) -> None:
        a = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        if heads and arch == "llama":
            a = permute_for_gguf(a, heads)  # llama.cpp's Q/K rows
        a = np.ascontiguousarray(a)
        if t is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, _blocks(a, t), raw_dtype=t)

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(H if "q_norm" not in name and "k_norm" not in name
                                                           else HD)).astype(np.float32))

    mat("token_embd.weight", (VOCAB, H), T.Q8_0)
    for i, types in enumerate(LAYER_TYPES):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        if arch == "gemma3":
            for n in ("post_attention_norm", "post_ffw_norm", "attn_q_norm", "attn_k_norm"):
                norm(f"blk.{i}.{n}.weight")
        mat(f"blk.{i}.attn_q.weight", (HEADS * HD, H), types["attn_q"], HEADS)
        mat(f"blk.{i}.attn_k.weight", (KV_HEADS * HD, H), types["attn_k"], KV_HEADS)
        mat(f"blk.{i}.attn_v.weight", (KV_HEADS * HD, H), types["attn_v"])
        if arch == "qwen2":  # biased q/k/v: added to the kernels' float32 products
            for n, rows in (("attn_q", HEADS * HD), ("attn_k", KV_HEADS * HD), ("attn_v", KV_HEADS * HD)):
                w.add_tensor(f"blk.{i}.{n}.bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
        mat(f"blk.{i}.attn_output.weight", (H, HEADS * HD), types["attn_output"])
        mat(f"blk.{i}.ffn_gate.weight", (FF, H), types["ffn_gate"])
        mat(f"blk.{i}.ffn_up.weight", (FF, H), types["ffn_up"])
        mat(f"blk.{i}.ffn_down.weight", (H, FF), types["ffn_down"])
    norm("output_norm.weight")
    if arch != "gemma3":  # gemma3 ties its head to the embedding
        mat("output.weight", (VOCAB, H), T.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen2"])
def gguf_file(request, tmp_path_factory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("stored") / f"{request.param}.gguf"
    _write(path, request.param)
    return request.param, path


def test_stored_blocks_are_the_files_rows_in_hf_order(gguf_file):
    _arch, path = gguf_file
    ck = open_checkpoint(path)
    for name, e in ck.index.tensors.items():
        if len(e.shape) != 2:
            continue
        got = ck.stored_blocks(name)
        if e.stored_type not in STORED_BLOCK_TYPES:
            assert got is None, name
            continue
        raw, block = got
        assert block == e.stored_type and raw.dtype == torch.uint8 and raw.numel() == e.stored_bytes
        # the rows of blocks decode to the HF-order floats the fp32 path reads (Q/K un-permuted)
        floats = gguf.quants.dequantize(raw.numpy(), T[block]).reshape(e.shape)
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(floats)), ck.tensor(name)), name


def test_gguf_stage_holds_blocks_and_matches_fp32(gguf_file, capfd):
    arch, path = gguf_file
    ck = open_checkpoint(path)
    stage = load_stage(str(path), 0, len(LAYER_TYPES), True, True, precision="gguf")
    assert "no block kernel for 1 Q2_K" in capfd.readouterr().err  # said once, the matrix held as floats
    assert stage.dtype == torch.float32 and stage.kv_dtype == torch.float32
    l0, l1 = stage.layers["0"], stage.layers["1"]
    assert isinstance(l0.self_attn.q_proj, BlockLinearModule) and l0.self_attn.q_proj.block == "q4_K"
    assert l0.self_attn.qkv.weight is None  # Q4_K, Q5_K, Q8_0: kept apart
    assert l0.mlp.gate_up.weight is not None  # Q4_0 twice: one kernel over both
    assert l1.self_attn.qkv.weight is not None and l1.mlp.gate_up.weight is None
    assert (l1.self_attn.qkv.bias is not None) == (arch == "qwen2")
    if arch == "qwen2":  # the biases loaded, and added: the fused product minus the unbiased kernel's
        x = torch.randn(3, H)
        plain = l1.self_attn.qkv.blocks.run(x, l1.self_attn.qkv.weight)
        assert torch.allclose(torch.cat(l1.self_attn.qkv(x), -1) - plain, l1.self_attn.qkv.bias.expand(3, -1),
                              atol=1e-5)
        assert float(l1.self_attn.qkv.bias.abs().max()) > 0
    assert l1.mlp.down_proj.weight.dtype == torch.float32  # Q2_K: no kernel here
    assert isinstance(stage.embed_tokens, BlockEmbedding)
    if arch == "gemma3":  # the tied head is the embedding's blocks, not a copy
        assert stage.lm_head.weight is stage.embed_tokens.weight
    # every block module holds the file's bytes exactly (nothing requantized)
    sd_names = {id(m): n for n, m in stage.named_modules()}
    for m in stage.modules():
        if isinstance(m, BlockLinearModule):
            key = sd_names[id(m)] + ".weight"
            name = "model.embed_tokens.weight" if key == "lm_head.weight" and arch == "gemma3" else (
                key if key.startswith("lm_head") else "model." + key)
            assert torch.equal(m.stored(), ck.stored_blocks(name)[0]), name
    # and holds them once: fused parts' kernels look into the fused blocks, not at copies of their own
    storages = {}
    for m in stage.modules():
        for raw in (getattr(getattr(m, "kernel", None), "raw", None), getattr(getattr(m, "blocks", None), "raw", None),
                    getattr(m, "weight", None)):
            if raw is not None and raw.dtype == torch.uint8:
                storages[raw.untyped_storage().data_ptr()] = raw.untyped_storage().nbytes()
    file_blocks = sum(e.stored_bytes for e in ck.index.tensors.values()
                      if e.stored_type not in ("F32", "F16", "BF16", "Q2_K"))
    assert sum(storages.values()) == file_blocks

    ref = load_stage(str(path), 0, len(LAYER_TYPES), True, True, precision="fp32")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    got, want = stage(ids), ref(ids)
    err = float((got - want).abs().max()) / float(want.abs().max())
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"{arch}: max |gguf - fp32| / max |fp32| = {err:.4f}, top-1 agreement {agree:.3f}")
    assert err < 0.05 and agree >= 0.9

    # a decode step over the KV cache gives the prefill's last logits, up to the attention's order of
    # sums (the decode kernel against SDPA) moving an input across an 8-bit rounding step
    cache = stage.new_cache(1, 32)
    stage(ids[:1, :-1], 0, cache)
    step = stage(ids[:1, -1:], ids.shape[1] - 1, cache)
    assert float((step[0, -1] - got[0, -1]).abs().max()) <= 0.02 * float(got[0, -1].abs().max())


def test_gguf_precision_on_a_safetensors_dir_is_one_line(tmp_path):
    from layerline.checkpoint import write_demo_checkpoint
    write_demo_checkpoint(tmp_path / "demo", "llama")
    with pytest.raises(LayerlineError, match=r"^--precision gguf: .* is not a GGUF file.*--precision fp32"):
        load_stage(str(tmp_path / "demo"), 0, 1, True, False, precision="gguf")


def test_stored_block_types_are_the_kernels():
    assert {t.lower() for t in STORED_BLOCK_TYPES} == {t.lower() for t in gguf_blocks.BLOCK_TYPES}


def test_decode_steps_give_the_modules_bits(gguf_file):
    """Each layer's one-token step as one C++ call (`DecoderLayer.decode_step`: fused and apart
    projections, a Q2_K matrix held as floats, q/k norms, sandwich norms, biases, a sliding window)
    gives the eager modules' logits and caches bit for bit: one sequence of two rows, and rows of
    two sequences at different positions."""
    _arch, path = gguf_file
    stage = load_stage(str(path), 0, len(LAYER_TYPES), True, True, precision="gguf")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))

    def run(steps: bool) -> list[torch.Tensor]:
        stage.decode_steps = steps
        out = []
        cache = stage.new_cache(2, 32)
        stage(ids[:, :12], 0, cache)
        out += [stage(ids[:, p:p + 1], p, cache) for p in range(12, 22)]  # past gemma3's window of 8
        caches = [stage.new_cache(1, 32), stage.new_cache(1, 32)]
        stage(ids[:1, :5], 0, caches[0])
        stage(ids[1:, :11], 0, caches[1])
        out += [stage.forward_rows(torch.stack([ids[0, 5 + j:6 + j], ids[1, 11 + j:12 + j]]), [5 + j, 11 + j], caches)
                for j in range(6)]
        wide = stage.new_cache(2, 32)  # one row stepped in a cache of two
        stage(ids[:1, :7], 0, wide)
        out += [stage(ids[:1, p:p + 1], p, wide) for p in range(7, 10)]
        caches.append(wide)
        return out + [t for c in (cache, *caches) for layer in c.layers for t in (layer.k, layer.v)]

    fast = run(True)
    assert stage._steps, "every layer has its step"
    slow = run(False)
    assert len(fast) == len(slow) and all(torch.equal(a, b) for a, b in zip(fast, slow))
