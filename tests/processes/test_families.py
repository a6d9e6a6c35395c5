"""Every supported family (Llama, Mistral, Qwen2, Mixtral) against Hugging Face transformers.

Each family's demo checkpoint (random init, float32, written by layerline) is loaded by
transformers' own *ForCausalLM class: logits must agree, and greedy generation through three
chained stages, each with its own KV cache, must give transformers' generate() tokens. Mistral
runs with a sliding window shorter than the sequences, so the window mask is exercised in
prefill and decode. Mixtral's experts are also served from disk by an LRU store and must give
the same numbers as the resident ones. The sampling helper is checked at the end.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import chained_greedy  # noqa: E402
from layerline.checkpoint import CheckpointError, demo_config, read_index, write_demo_checkpoint  # noqa: E402
from layerline.model.llama import ModelArgs  # noqa: E402
from layerline.model.loader import load_stage  # noqa: E402
from layerline.model.moe import LRUExpertStore, SparseMoE  # noqa: E402
from layerline.model.sampling import sample  # noqa: E402

LAYERS = 4
SPLIT = ((0, 1), (1, 3), (3, 4))  # three stages
ATOL = 1e-4
WINDOW = 6  # Mistral's sliding window in these tests: shorter than the prompts and generations
FAMILIES = {
    "llama": dict(hidden=128, vocab=500),
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": {},
    "mixtral": {},
}
HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "mixtral": "MixtralForCausalLM"}


# small models: one thread is as fast, and much faster on a busy shared machine
pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: write_demo_checkpoint(root / arch, arch=arch, layers=LAYERS, dtype="float32", seed=11, **kw)
            for arch, kw in FAMILIES.items()}


_HF_CACHE: dict[str, object] = {}


def _hf(path: Path):
    key = str(path)
    if key not in _HF_CACHE:
        model = transformers.AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # random weights: never stop early
        _HF_CACHE[key] = model
    return _HF_CACHE[key]


def _prompt(vocab: int, b: int = 2, t: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _pipeline(ckpt: Path, **kw):
    return [load_stage(str(ckpt), a, b, a == 0, b == LAYERS, **kw) for a, b in SPLIT]


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_matches_transformers(ckpts, arch):
    ckpt = ckpts[arch]
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == [HF_CLASS[arch]] and cfg["model_type"] == arch
    hf = _hf(ckpt)
    assert type(hf).__name__ == HF_CLASS[arch]
    vocab = cfg["vocab_size"]

    full = load_stage(str(ckpt), 0, LAYERS, True, True)
    ids = _prompt(vocab, t=11, seed=1)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    out = full(ids)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)

    prompt, steps = _prompt(vocab, t=7, seed=2), 10
    want = hf.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    got = chained_greedy(_pipeline(ckpt), prompt, steps)
    assert torch.equal(got, want), f"{arch}: pipeline {got.tolist()} != transformers {want.tolist()}"


def test_family_specific_structure(ckpts):
    idx = {arch: read_index(p) for arch, p in ckpts.items()}
    # Qwen2: q/k/v biases (no o_proj bias) and tied embeddings, so no lm_head tensor
    q = idx["qwen2"].tensors
    assert "model.layers.0.self_attn.q_proj.bias" in q and "model.layers.0.self_attn.o_proj.bias" not in q
    assert "lm_head.weight" not in q
    last = load_stage(str(ckpts["qwen2"]), 3, 4, False, True)
    first = load_stage(str(ckpts["qwen2"]), 0, 1, True, False)
    assert torch.equal(last.lm_head.weight, first.embed_tokens.weight)
    # Mistral: the window is read from config.json and applies to every layer
    m = ModelArgs.from_config(idx["mistral"].config)
    assert m.sliding_window == WINDOW and all(m.window(i) == WINDOW for i in range(LAYERS))
    assert ModelArgs.from_config(idx["llama"].config).window(0) is None
    # Mixtral: hub layout (block_sparse_moe.gate, experts.E.w1/w2/w3), 4 experts, top-2
    x = idx["mixtral"].tensors
    c = idx["mixtral"].config
    assert c["num_local_experts"] == 4 and c["num_experts_per_tok"] == 2
    h, i = c["hidden_size"], c["intermediate_size"]
    assert x["model.layers.2.block_sparse_moe.gate.weight"].shape == (4, h)
    assert x["model.layers.2.block_sparse_moe.experts.3.w1.weight"].shape == (i, h)
    assert x["model.layers.2.block_sparse_moe.experts.3.w2.weight"].shape == (h, i)
    assert x["model.layers.2.block_sparse_moe.experts.3.w3.weight"].shape == (i, h)
    assert not any(".mlp." in n for n in x)


def test_sliding_window_chunked_prefill_and_long_decode(ckpts):
    """Past the window: chunked prefill equals one forward, and decode at a later position
    equals the no-cache forward of the whole sequence (both windowed)."""
    ckpt = ckpts["mistral"]
    full = load_stage(str(ckpt), 0, LAYERS, True, True)
    ids = _prompt(1000, b=2, t=20, seed=3)
    one = full(ids)
    cache = full.new_cache(2, 24)
    chunks = [full(ids[:, a:b], a, cache) for a, b in ((0, 4), (4, 13), (13, 14), (14, 20))]
    torch.testing.assert_close(torch.cat(chunks, 1), one, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        ref = _hf(ckpt)(ids).logits.float()
    torch.testing.assert_close(one, ref, atol=ATOL, rtol=1e-4)
    # without the window the logits differ: the window really is applied
    wide = _edit_config(ckpt, ckpt.parent / "mistral-nowindow", sliding_window=None)
    assert (load_stage(str(wide), 0, LAYERS, True, True)(ids)[:, WINDOW:] - one[:, WINDOW:]).abs().max() > 1e-3


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    if not dst.exists():
        shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_qwen2_sliding_window_layers_match_transformers(ckpts, tmp_path):
    # transformers: layers from max_window_layers on use the window when use_sliding_window is true
    d = _edit_config(ckpts["qwen2"], tmp_path / "qwen2-window", use_sliding_window=True, sliding_window=4,
                     max_window_layers=2)
    stage = load_stage(str(d), 0, LAYERS, True, True)
    assert [stage.args.window(i) for i in range(LAYERS)] == [None, None, 4, 4]
    ids = _prompt(1000, t=10, seed=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(ids).logits.float()
    torch.testing.assert_close(stage(ids), ref, atol=ATOL, rtol=1e-4)


def test_demo_config_errors_are_one_line():
    for call, match in [(lambda: demo_config("gpt2"), "--arch gpt2"),
                        (lambda: demo_config("llama", experts=4), "--experts 4"),
                        (lambda: demo_config("mixtral", experts=2, experts_per_tok=3), "--experts-per-tok 3"),
                        (lambda: demo_config("mistral", sliding_window=0), "--sliding-window 0")]:
        with pytest.raises(CheckpointError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    bad = dict(demo_config("mixtral"), num_experts_per_tok=5)
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        ModelArgs.from_config(bad)


# --- Mixtral experts from disk --------------------------------------------------------------

def _expert_bytes(cfg: dict, itemsize: int) -> int:
    return 3 * cfg["hidden_size"] * cfg["intermediate_size"] * itemsize


def test_mixtral_lru_expert_store_equals_resident(ckpts):
    ckpt = ckpts["mixtral"]
    cfg = json.loads((ckpt / "config.json").read_text())
    budget = 3 * _expert_bytes(cfg, 4)  # 3 of the 16 experts of the model at a time
    resident = _pipeline(ckpt)
    paged = _pipeline(ckpt, expert_cache_bytes=budget)
    # the paged stages hold no expert weights, only routers, attention and norms
    for r, p in zip(resident, paged):
        assert not any(".experts." in k for k in p.state_dict())
        assert sum(t.numel() for t in p.parameters()) < sum(t.numel() for t in r.parameters())
        assert isinstance(p.expert_store, LRUExpertStore)
    ids = _prompt(1000, t=9, seed=5)
    hr, hp = ids, ids
    for r, p in zip(resident, paged):
        hr, hp = r(hr), p(hp)
    assert torch.equal(hr, hp)
    prompt = _prompt(1000, t=5, seed=6)
    assert torch.equal(chained_greedy(paged, prompt, 6), chained_greedy(resident, prompt, 6))
    mid = paged[1].expert_store.stats  # layers 1 and 2: 8 experts through a 3-expert cache
    assert mid.misses > 8 and mid.evictions == mid.misses - 3  # cycling through more than fit
    assert mid.bytes_read == mid.misses * _expert_bytes(cfg, 4)
    assert 0 < mid.resident_bytes <= budget and mid.peak_bytes <= budget
    assert len(paged[1].expert_store.cached()) == 3


def test_mixtral_lru_store_unit(ckpts):
    ckpt = ckpts["mixtral"]
    cfg = json.loads((ckpt / "config.json").read_text())
    one = _expert_bytes(cfg, 4)
    store = LRUExpertStore(str(ckpt), read_index(ckpt), torch.float32, False, 2 * one)
    a = store.get(0, 0)
    assert store.get(0, 0) is a and store.stats.hits == 1 and store.stats.misses == 1
    store.get(0, 1)
    store.get(0, 0)  # 0 is now the most recently used
    store.get(1, 2)  # evicts (0, 1)
    assert store.cached() == [(0, 0), (1, 2)] and store.stats.evictions == 1
    assert store.stats.bytes_read == 3 * one and store.stats.resident_bytes == 2 * one
    with pytest.raises(CheckpointError, match=r"experts\.9\.w1\.weight is missing"):
        store.get(0, 9)
    store.close()
    # the resident experts serve the same weights through the same interface
    stage = load_stage(str(ckpt), 0, 1, True, False)
    moe = stage.layers["0"].block_sparse_moe
    assert isinstance(moe, SparseMoE)
    w1, w2, w3 = moe.experts.get(0, 1)
    s1, s2, s3 = LRUExpertStore(str(ckpt), read_index(ckpt), torch.float32, False, one).get(0, 1)
    assert all(torch.equal(x.weight, y.weight) for x, y in ((w1, s1), (w2, s2), (w3, s3)))


def test_mixtral_int8_lru_equals_int8_resident(ckpts):
    ckpt = ckpts["mixtral"]
    a = load_stage(str(ckpt), 0, LAYERS, True, True, precision="int8")
    b = load_stage(str(ckpt), 0, LAYERS, True, True, precision="int8", expert_cache_bytes=10**9)
    ids = _prompt(1000, t=6, seed=7)
    assert torch.equal(a(ids), b(ids))
    st = b.expert_store.stats
    assert st.evictions == 0 and 0 < st.misses <= 16 and st.hits == 0
    assert torch.equal(a(ids), b(ids))
    assert st.hits > 0 and st.misses == len(b.expert_store.cached())  # all cached: the second pass only hits
    # held as int8 + float32 row scales: a bit over a quarter of the fp32 bytes read
    i, h = json.loads((ckpt / "config.json").read_text())["intermediate_size"], 256
    assert st.resident_bytes == st.misses * (3 * i * h + 4 * (2 * i + h))


# --- sampling -------------------------------------------------------------------------------

def _logits(b=3, v=50, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_sample_greedy_and_tiny_top_p_are_argmax():
    x = _logits()
    assert torch.equal(sample(x, 0.0, 1.0), x.argmax(-1))
    assert sample(x, 0.0, 1.0).dtype == torch.int64 and sample(x, 0.0).shape == (3,)
    for t in (0.5, 1.0, 5.0):
        assert torch.equal(sample(x, t, 1e-6, torch.Generator().manual_seed(1)), x.argmax(-1))


def test_sample_is_reproducible_with_a_seeded_generator():
    x = _logits(b=4, v=1000, seed=1)
    draws = [sample(x, 1.0, 0.9, torch.Generator().manual_seed(42)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    g = torch.Generator().manual_seed(42)
    seq1 = [sample(x, 1.0, 0.9, g) for _ in range(5)]
    g = torch.Generator().manual_seed(42)
    seq2 = [sample(x, 1.0, 0.9, g) for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(seq1, seq2))
    others = {tuple(sample(x, 1.0, 1.0, torch.Generator().manual_seed(s)).tolist()) for s in range(8)}
    assert len(others) > 1  # it does sample


def test_sample_top_p_keeps_only_the_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two, 0.85 the first three
    p = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = p.log().expand(2000, 4).contiguous()
    got = sample(logits, 1.0, 0.7, torch.Generator().manual_seed(0))
    assert set(got.tolist()) == {1, 3}
    frac = (got == 1).float().mean().item()
    assert abs(frac - 0.5 / 0.8) < 0.05
    assert set(sample(logits, 1.0, 0.85, torch.Generator().manual_seed(0)).tolist()) == {1, 2, 3}
    # low temperature sharpens towards the argmax
    assert (sample(logits, 0.05, 1.0, torch.Generator().manual_seed(0)) == 1).float().mean() > 0.99


@pytest.mark.parametrize("kw,match", [(dict(temperature=-1.0), "temperature"),
                                      (dict(temperature=float("nan")), "temperature"),
                                      (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_sample_rejects_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        sample(_logits(), **{"temperature": 1.0, "top_p": 1.0, **kw})
    with pytest.raises(ValueError, match="batch, vocab"):
        sample(torch.zeros(5), 1.0)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_through_three_worker_processes_equals_transformers(ckpts, arch):
    """The same greedy tokens as transformers when the model runs as three local worker processes."""
    import subprocess
    import sys
    ckpt = ckpts[arch]
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    prompt = _prompt(vocab, b=1, t=7, seed=3)
    want = _hf(ckpt).generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 7:].tolist()
    r = subprocess.run([sys.executable, "-m", "layerline.cli", "generate", "--checkpoint", str(ckpt),
                        "--local-stages", "3", "--input-ids", ",".join(map(str, prompt[0].tolist())),
                        "--max-new-tokens", "8", "--precision", "fp32", "--ignore-eos", "--threads", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["tokens"] == want and len(out["stage_seconds"]) == 3


def test_text_in_text_out_with_a_tokenizer(ckpts, tmp_path):
    """A checkpoint with tokenizer.json: --prompt text in, text out, through local workers."""
    import subprocess
    import sys
    from tokenizers import Tokenizer, models, pre_tokenizers
    ckpt = tmp_path / "with-tok"
    shutil.copytree(ckpts["llama"], ckpt)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(497)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    text = "w5 w17 w230 w9"
    ids = tok.encode(text).ids
    r = subprocess.run([sys.executable, "-m", "layerline.cli", "generate", "--checkpoint", str(ckpt),
                        "--local-stages", "2", "--prompt", text, "--max-new-tokens", "5", "--precision", "fp32",
                        "--ignore-eos", "--threads", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    want = _hf(ckpts["llama"]).generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                                        pad_token_id=0)[0, len(ids):].tolist()
    assert out["tokens"] == want
    assert out["text"] == [tok.decode(want)]
