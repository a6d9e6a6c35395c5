"""The Llama-family stage model against Hugging Face transformers, on small random-init checkpoints."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from layerline.checkpoint import CheckpointError, read_index, write_demo_checkpoint  # noqa: E402
from layerline.checkpoint import hf as hf_format  # noqa: E402
from layerline.errors import LayerlineError  # noqa: E402
from layerline.model.llama import ModelArgs, Stage  # noqa: E402
from layerline.model.loader import load_stage, stage_tensor_names  # noqa: E402

LAYERS, HIDDEN, VOCAB = 4, 256, 1000
ATOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def _hf(path, cls=None):
    cls = cls or transformers.LlamaForCausalLM
    model = cls.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _rewrite_tensors(ckpt: Path, drop=(), add=None):
    """Drop tensors from / add tensors to a checkpoint, keeping the HF index file in step."""
    from safetensors.torch import load_file, save_file
    idx_path = ckpt / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors = load_file(str(f))
        if any(n in tensors for n in drop):
            save_file({k: v for k, v in tensors.items() if k not in drop}, str(f), metadata={"format": "pt"})
    for n in drop:
        idx["weight_map"].pop(n, None)
    if add:
        save_file(add, str(ckpt / "extra.safetensors"), metadata={"format": "pt"})
        idx["weight_map"].update({n: "extra.safetensors" for n in add})
    idx_path.write_text(json.dumps(idx))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", layers=LAYERS, hidden=HIDDEN,
                                 vocab=VOCAB, dtype="float32")


@pytest.fixture(scope="module")
def hf(ckpt):
    return _hf(ckpt)


@pytest.fixture(scope="module")
def full(ckpt) -> Stage:
    return load_stage(str(ckpt), 0, LAYERS, first=True, last=True)


def _prompt(b=2, t=11, seed=0):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def test_full_model_as_one_stage_matches_hf(full, hf):
    ids = _prompt()
    out = full(ids)
    assert out.dtype == torch.float32 and out.shape == (2, 11, VOCAB)
    torch.testing.assert_close(out, _hf_logits(hf, ids), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(full(ids, last_only=True), out[:, -1:])


def test_chained_stages_equal_one_stage(ckpt, full):
    stages = [load_stage(str(ckpt), 0, 1, True, False), load_stage(str(ckpt), 1, 3, False, False),
              load_stage(str(ckpt), 3, 4, False, True)]
    ids = _prompt(seed=1)
    h = ids
    for s in stages:
        h = s(h)
    assert h.dtype == torch.float32 and h.shape == (2, 11, VOCAB)
    torch.testing.assert_close(h, full(ids), atol=1e-5, rtol=1e-5)


def test_kv_cache_decode_matches_hf_generate(ckpt, full, hf):
    prompt, steps = _prompt(b=2, t=7, seed=2), 8
    ref = hf.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    assert ref.shape == (2, 7 + steps)

    def greedy(stages):
        caches = [s.new_cache(batch=2, max_len=32) for s in stages]
        seq, x, pos, step_logits = prompt, prompt, 0, []
        for _ in range(steps):
            h = x
            for s, c in zip(stages, caches):
                h = s(h, pos, c)
            step_logits.append(h[:, -1])
            pos += x.shape[1]
            x = h[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, x], dim=1)
        assert all(c.length == pos for c in caches)
        return seq, torch.stack(step_logits, dim=1)

    seq, logits = greedy([full])
    assert torch.equal(seq, ref)
    # logits of every step equal the no-cache forward of the whole sequence
    nocache = full(seq[:, :-1])[:, 6:]
    torch.testing.assert_close(logits, nocache, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits, _hf_logits(hf, seq[:, :-1])[:, 6:], atol=ATOL, rtol=1e-4)

    # the same through a three-stage pipeline, each stage with its own cache
    pipe = [load_stage(str(ckpt), a, b, a == 0, b == LAYERS) for a, b in ((0, 1), (1, 3), (3, 4))]
    seq2, logits2 = greedy(pipe)
    assert torch.equal(seq2, ref)
    torch.testing.assert_close(logits2, logits, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_forward(full):
    ids = _prompt(b=2, t=12, seed=10)
    cache = full.new_cache(batch=3, max_len=16)  # a larger cache batch is fine
    chunks = [full(ids[:, a:b], a, cache) for a, b in ((0, 5), (5, 9), (9, 10), (10, 12))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full(ids), atol=1e-5, rtol=1e-5)


def test_cache_rejects_gaps_and_overflow(full):
    cache = full.new_cache(batch=1, max_len=8)
    full(_prompt(1, 5), 0, cache)
    with pytest.raises(LayerlineError, match="start_pos 6"):
        full(_prompt(1, 1), 6, cache)
    with pytest.raises(LayerlineError, match="KV cache full"):
        full(_prompt(1, 4), 5, cache)
    with pytest.raises(LayerlineError, match="without a KV cache"):
        full(_prompt(1, 2), 3)
    # rewinding (replaying from an earlier position) is allowed
    out = full(_prompt(1, 2, seed=5), 3, cache)
    assert cache.length == 5 and out.shape == (1, 2, VOCAB)


def test_llama3_rope_scaling_matches_hf(ckpt, tmp_path):
    d = _edit_config(ckpt, tmp_path / "llama3", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
                     max_position_embeddings=131072)
    model = _hf(d)
    stage = load_stage(str(d), 0, LAYERS, True, True)
    assert stage.args.rope_scaling["rope_type"] == "llama3"
    # all three llama3 bands (kept, smoothed, divided by factor) occur at head_dim 64 / theta 5e5
    plain = ModelArgs.from_config({**json.loads((d / "config.json").read_text()), "rope_scaling": None})
    from layerline.model.llama import rope_inv_freq
    base = rope_inv_freq(plain)
    ratio = base / stage.inv_freq
    assert (ratio == 1).any() and torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()
    torch.testing.assert_close(stage.inv_freq, model.model.rotary_emb.inv_freq, atol=0, rtol=1e-6)
    ids = _prompt(seed=3)
    torch.testing.assert_close(stage(ids), _hf_logits(model, ids), atol=ATOL, rtol=1e-4)
    # with the cache at later positions too: decode at position 300 after a long prefill
    long = _prompt(1, 301, seed=4)
    cache = stage.new_cache(1, 320)
    stage(long[:, :300], 0, cache)
    torch.testing.assert_close(stage(long[:, 300:], 300, cache)[:, -1], _hf_logits(model, long)[:, -1],
                               atol=ATOL, rtol=1e-4)


def test_transformers5_rope_parameters_config_parses_the_same():
    old = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
           "rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 131072}
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    assert ModelArgs.from_config(old) == ModelArgs.from_config(new)
    plain = dict(new, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    a = ModelArgs.from_config(plain)
    assert a.rope_scaling is None and a.rope_theta == 1e6 and a.head_dim == 16
    assert a.rms_norm_eps == 1e-6 and not a.attention_bias and not a.tie_word_embeddings


def test_tied_embeddings_read_embedding_as_head(ckpt, tmp_path):
    d = _edit_config(ckpt, tmp_path / "tied", tie_word_embeddings=True)
    _rewrite_tensors(d, drop=("lm_head.weight",))
    model = _hf(d)
    names = stage_tensor_names(read_index(d), 3, 4, False, True)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    one = load_stage(str(d), 0, LAYERS, True, True)
    assert one.lm_head.weight is one.embed_tokens.weight
    ids = _prompt(seed=6)
    torch.testing.assert_close(one(ids), _hf_logits(model, ids), atol=ATOL, rtol=1e-4)
    h = load_stage(str(d), 0, 3, True, False)(ids)
    torch.testing.assert_close(load_stage(str(d), 3, 4, False, True)(h), one(ids), atol=1e-5, rtol=1e-5)


def test_qwen2_qkv_bias_matches_hf(ckpt, tmp_path):
    d = _edit_config(ckpt, tmp_path / "qwen2", model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                     use_sliding_window=False, rope_theta=1000000.0)
    g = torch.Generator().manual_seed(7)
    a = ModelArgs.from_config(json.loads((d / "config.json").read_text()))
    bias = {}
    for i in range(LAYERS):
        for proj, n in (("q", a.num_heads), ("k", a.num_kv_heads), ("v", a.num_kv_heads)):
            bias[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(n * a.head_dim, generator=g) * 0.1
    _rewrite_tensors(d, add=bias)
    assert a.attention_bias and not a.o_proj_bias
    model = _hf(d, transformers.Qwen2ForCausalLM)
    stage = load_stage(str(d), 0, LAYERS, True, True)
    ids = _prompt(seed=8)
    torch.testing.assert_close(stage(ids), _hf_logits(model, ids), atol=ATOL, rtol=1e-4)


def test_loader_reads_only_its_tensors(ckpt, monkeypatch):
    idx = read_index(ckpt)
    names = stage_tensor_names(idx, 1, 3, False, False)
    assert len(names) == 2 * 9
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in names)
    first = stage_tensor_names(idx, 0, 1, True, False)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    last = stage_tensor_names(idx, 3, 4, False, True)
    assert {"model.norm.weight", "lm_head.weight"} <= set(last) and "model.embed_tokens.weight" not in last

    read: list[str] = []
    real = hf_format.safe_open

    class Recording:
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(hf_format, "safe_open", Recording)
    mid = load_stage(str(ckpt), 1, 3, False, False)
    assert sorted(read) == sorted(names)
    assert not hasattr(mid, "embed_tokens") and not hasattr(mid, "lm_head") and not hasattr(mid, "norm")
    assert not any("embed" in k or "lm_head" in k for k, _ in mid.named_parameters())
    assert sum(p.numel() for p in mid.parameters()) == sum(idx.tensors[n].nbytes // 4 for n in names)
    assert all(p.device.type == "cpu" for p in mid.parameters())
    out = mid(torch.randn(1, 3, HIDDEN))
    assert out.shape == (1, 3, HIDDEN) and out.dtype == torch.float32


@pytest.mark.parametrize("start,end,first,last,match", [
    (3, 5, False, True, "--layers 3:5"),
    (-1, 2, True, False, "--layers -1:2"),
    (2, 2, False, False, "empty range"),
    (1, 3, True, False, "--first"),
    (0, 2, True, True, "--last"),
])
def test_bad_range_is_one_line_checkpoint_error(ckpt, start, end, first, last, match):
    for call in (lambda: load_stage(str(ckpt), start, end, first, last),
                 lambda: stage_tensor_names(read_index(ckpt), start, end, first, last)):
        with pytest.raises(CheckpointError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


def test_other_errors_are_one_line(ckpt, tmp_path):
    with pytest.raises(LayerlineError, match="--precision fp8") as e:
        load_stage(str(ckpt), 0, 1, True, False, precision="fp8")
    assert "\n" not in str(e.value)

    bad_shape = _edit_config(ckpt, tmp_path / "shape", intermediate_size=512)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.gate_proj\.weight has shape") as e:
        load_stage(str(bad_shape), 1, 2, False, False)
    assert "\n" not in str(e.value)

    missing = _edit_config(ckpt, tmp_path / "missing")
    _rewrite_tensors(missing, drop=("model.layers.2.self_attn.k_proj.weight",))
    load_stage(str(missing), 0, 2, True, False)  # a stage that does not need it still loads
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight is missing") as e:
        load_stage(str(missing), 2, 4, False, True)
    assert "\n" not in str(e.value)

    cfg = json.loads((ckpt / "config.json").read_text())
    for key, value, match in [("hidden_size", None, "hidden_size: missing"),
                              ("num_key_value_heads", 3, "num_key_value_heads"),
                              ("num_hidden_layers", "4", "num_hidden_layers"),
                              ("model_type", "gpt2", "model_type"),
                              ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type"),
                              ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "low_freq_factor")]:
        bad = dict(cfg)
        if value is None:
            bad.pop(key)
        else:
            bad[key] = value
        with pytest.raises(CheckpointError, match=match) as e:
            ModelArgs.from_config(bad)
        assert str(e.value).startswith("config.json ") and "\n" not in str(e.value)


def test_bf16_stage_close_to_fp32(ckpt, full):
    ids = _prompt(seed=9)
    ref = full(ids)
    one = load_stage(str(ckpt), 0, LAYERS, True, True, precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in one.parameters())
    out = one(ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=0.05, rtol=0.05)
    # pipeline in bf16: hidden travels as bf16; a float32 hidden input is cast to the stage dtype
    a = load_stage(str(ckpt), 0, 2, True, False, precision="bf16")
    b = load_stage(str(ckpt), 2, 4, False, True, precision="bf16")
    h = a(ids)
    assert h.dtype == torch.bfloat16 and h.shape == (2, 11, HIDDEN)
    torch.testing.assert_close(b(h), out, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(b(h.float()), out, atol=1e-3, rtol=1e-3)
    cache = one.new_cache(2, 16)
    assert cache.layers[0].k.dtype == torch.bfloat16
    one(ids[:, :10], 0, cache)
    torch.testing.assert_close(one(ids[:, 10:], 10, cache)[:, -1], out[:, -1], atol=0.05, rtol=0.05)
