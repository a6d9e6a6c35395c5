"""The one-token step that compiles: the same numbers as the eager forward, and a compiled worker
that serves every batch and cache length without compiling again."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import chained_greedy, tiny_gguf
from layerline.checkpoint import read_index, write_demo_checkpoint
from layerline.errors import LayerlineError
from layerline.generate import generate
from layerline.model.blocks import BlockEmbedding
from layerline.model.loader import load_stage
from layerline.worker import control_endpoint
from stage_procs import control, start_workers


def _prefilled(stage, prompts: torch.Tensor, reserve: int):
    cache = stage.new_cache(prompts.shape[0], reserve)
    stage(prompts, start_pos=0, cache=cache)
    return cache


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_compiled_rows_equal_the_eager_rows(tmp_path, arch, one_thread):
    """Rows of several sequences, each at its own position in its own cache, through the compiled
    step (more than the largest bucket in parts, the last part padded to its bucket) give the
    eager forward_rows' numbers and leave the caches as it does; so do the steps of one sequence
    of two rows in a cache reserved far past its length (the graph attends over the filled keys
    only, row by row). A first stage (token ids) for llama, a last one (hidden states in) for
    mistral, whose small window (4) cuts keys off."""
    kw = {"sliding_window": 4} if arch == "mistral" else {}
    ck = write_demo_checkpoint(tmp_path / arch, layers=2, hidden=64, vocab=300, dtype="float32", seed=3,
                               arch=arch, **kw)
    n = read_index(ck).num_layers
    for first, last, lo, hi in ((True, False, 0, 1),) if arch == "llama" else ((False, True, 1, n),):
        eager = load_stage(str(ck), lo, hi, first, last, "fp32")
        fast = load_stage(str(ck), lo, hi, first, last, "fp32")
        fast.compile("default")
        g = torch.Generator().manual_seed(0)
        lens = [3, 5, 7, 2, 6, 4, 3, 8, 5, 1, 2]  # eleven rows: a bucket of 8, then 3 padded to 4
        ce, cf = [], []
        for length in lens:
            x = torch.randint(0, 300, (1, length), generator=g) if first else torch.randn(1, length, 64, generator=g)
            ce.append(_prefilled(eager, x, 16))
            cf.append(_prefilled(fast, x, 16))
        for rows in (11, 11):
            x = torch.randint(0, 300, (rows, 1), generator=g) if first else torch.randn(rows, 1, 64, generator=g)
            pos = [c.length for c in ce[:rows]]
            want = eager.forward_rows(x, pos, ce[:rows])
            got = fast.forward_rows(x, pos, cf[:rows])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        x = torch.randint(0, 300, (2, 6), generator=g) if first else torch.randn(2, 6, 64, generator=g)
        se, sf = _prefilled(eager, x, 64), _prefilled(fast, x, 64)
        for pos in range(6, 10):
            step = x[:, pos - 6:pos - 5] if first else torch.randn(2, 1, 64, generator=g)
            torch.testing.assert_close(fast(step, start_pos=pos, cache=sf), eager(step, start_pos=pos, cache=se),
                                       rtol=1e-5, atol=1e-5)
        assert fast.compiled, fast.compile_error
        for a, b in zip(ce + [se], cf + [sf]):
            assert a.length == b.length
            for la, lb in zip(a.layers, b.layers):
                torch.testing.assert_close(lb.k[:, :, :a.length], la.k[:, :, :a.length])
                torch.testing.assert_close(lb.v[:, :, :a.length], la.v[:, :, :a.length])


def test_a_compiled_step_that_fails_steps_eagerly_from_then_on(small_ckpt, monkeypatch, one_thread):
    """A compiled step that raises (out of memory, a compile error) falls back to the eager forward
    for good and says why; the step it failed gives the eager numbers."""
    n = read_index(small_ckpt).num_layers
    eager = load_stage(str(small_ckpt), 0, n, True, True, "fp32")
    stage = load_stage(str(small_ckpt), 0, n, True, True, "fp32")
    stage.compile("default")

    def broken(*a, **kw):
        raise RuntimeError("no memory for the rows graph\nmore")
    monkeypatch.setattr(stage, "_rows_step", broken)
    prompts = [[5, 17, 99], [3, 250, 7, 8]]
    ce = [_prefilled(eager, torch.tensor([p]), 8) for p in prompts]
    cs = [_prefilled(stage, torch.tensor([p]), 8) for p in prompts]
    x, pos = torch.tensor([[11], [12]]), [3, 4]
    torch.testing.assert_close(stage.forward_rows(x, pos, cs), eager.forward_rows(x, pos, ce))
    assert not stage.compiled
    assert stage.compile_error == "RuntimeError: no memory for the rows graph"
    torch.testing.assert_close(stage(x[:1], start_pos=4, cache=cs[0]), eager(x[:1], start_pos=4, cache=ce[0]))


def test_compile_mode_is_checked_and_moe_stays_eager(tmp_path, small_ckpt, one_thread):
    stage = load_stage(str(small_ckpt), 0, 2, True, False, "fp32")
    with pytest.raises(LayerlineError, match="--compile fast"):
        stage.compile("fast")
    ck = write_demo_checkpoint(tmp_path / "moe", layers=2, hidden=64, vocab=300, dtype="float32", seed=1,
                               arch="mixtral")
    moe = load_stage(str(ck), 0, 2, True, True, "fp32")
    moe.compile("default")
    assert moe._step is None  # routing is data-dependent: the MoE stage decodes eagerly
    cache = _prefilled(moe, torch.tensor([[1, 2, 3]]), 8)
    assert moe(torch.tensor([[4]]), start_pos=3, cache=cache).shape == (1, 1, 300)


@pytest.mark.step_timing  # reads the step time
def test_compiled_worker_serves_without_recompiling(tmp_path):
    """One worker with --compile default: ready only after its warm-up; then prompts of several
    lengths, batch 3 (never warmed up) and batch 1, give the eager tokens and add no compiled graph.
    One layer: what is compiled and when does not depend on depth, and compiling is the time here."""
    small_ckpt = write_demo_checkpoint(tmp_path / "ckpt", layers=1, hidden=64, vocab=500, dtype="float32", seed=0)
    w = start_workers(str(small_ckpt), [(0, read_index(small_ckpt).num_layers)], "fp32", kv_context=4096,
                      threads=None, extra=["--compile", "default", "--compile-cache", str(tmp_path / "inductor")],
                      timeout=600)
    first = w.first
    try:
        ready = w.info[0]
        assert ready["compile"] == "default" and ready["compile_s"] > 0 and ready["compiled"]
        before = control(control_endpoint(first), "stats")
        assert before["compiled_graphs"] >= 4  # steps of 1, 2, 4 and 8 rows
        # its compiled step, timed at warm-up: the launch keeps it as the mode's factor for the planner
        assert 0 < ready["step_s"] < 60 and before["step_s"] == ready["step_s"]
        # an fp32 stage has no use for the decode kernels (bf16 / int8 only) and says so
        assert ready["kernels"] == before["kernels"] and ready["kernels"].startswith("off: not loaded")
        prompts = [[1, 2, 3, 4], [9, 8, 7, 6], [5, 5, 5], [42], [3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 1, 2]]
        with w.pipeline(timeout_s=120) as pipe:
            g = generate(pipe, prompts, 6)
        # rows of different sequences, several and one: the same graphs
        c = w.client()
        try:
            rows = []
            for seq, p in (("r0", prompts[0]), ("r1", prompts[2])):
                h, t = c.call({"seq": seq, "pos": 0, "cache": True, "reserve": 16, "logits": "last"},
                              {"input_ids": torch.tensor([p])})
                rows.append([seq, len(p)])
            for step in (rows, rows[:1]):
                h, t = c.call({"rows": step, "cache": True, "logits": "last"},
                              {"input_ids": torch.tensor([[11]] * len(step))})
                assert h["op"] == "result", h.get("error")
                assert t["logits"].shape == (len(step), 1, 500)
                last = t["logits"]
                for r in step:
                    r[1] += 1
        finally:
            c.close()
        after = control(control_endpoint(first), "stats")
    finally:
        w.stop()
    assert after["compiled_graphs"] == before["compiled_graphs"], "serving compiled again"
    assert after["errors"] == 0 and after["rejected"] == 0
    full = load_stage(str(small_ckpt), 0, read_index(small_ckpt).num_layers, True, True, "fp32")
    for p, toks in zip(prompts, g.tokens):
        assert toks == chained_greedy([full], torch.tensor([p]), 6, len(p) + 7)[0, len(p):].tolist()
    # the last one-row step: r0 after its prompt and two 11s
    want = full(torch.tensor([prompts[0] + [11, 11]]))[0, -1]
    assert torch.allclose(last[0, -1], want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory) -> str:
    """A one-layer model: what a graph holds and when it compiles does not depend on depth, and a
    compile's CPU does (a bf16 step of 4 layers: 13 s of the C++ compiler's, of 1 layer 7 s)."""
    return str(write_demo_checkpoint(tmp_path_factory.mktemp("one_layer") / "ckpt", layers=1, hidden=128, vocab=500,
                                     dtype="float32", seed=0))


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_compiled_step_keeps_the_eager_numbers(one_layer, precision, one_thread):
    """The fast settings of bench (a): compiled bf16 and int8 steps stay within rounding of eager."""
    n = read_index(one_layer).num_layers
    eager = load_stage(one_layer, 0, n, True, True, precision)
    fast = load_stage(one_layer, 0, n, True, True, precision)
    fast.compile("default")
    prompt = torch.tensor([[5, 17, 99, 3, 250, 7]])
    # a reserve past the keys: the step attends over the filled ones only
    a, b = _prefilled(eager, prompt, 64), _prefilled(fast, prompt, 64)
    tok = torch.tensor([[11]])
    for pos in range(6, 10):
        want = eager(tok, start_pos=pos, cache=a)
        got = fast(tok, start_pos=pos, cache=b)
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= 0.03 * scale, precision
        tok = want[:, -1:].argmax(-1)
    assert fast._cpp_wrapper  # its kernels called from C++ (inductor's cpp_wrapper)


@pytest.fixture(scope="module")
def block_gguf(one_layer, tmp_path_factory) -> str:
    """A GGUF file whose token embedding is in blocks (a BlockEmbedding, as Q4_K_M files have)."""
    return str(tiny_gguf(Path(one_layer), tmp_path_factory.mktemp("gguf") / "m.gguf", qtype="Q8_0", embedding=True))


def test_an_eager_worker_never_imports_the_compiler(block_gguf):
    """torch._dynamo costs a process about 1 s of CPU to import: a worker that does not compile
    (the default) never imports it, loading a GGUF stage and stepping it included."""
    code = ("import sys, torch; import layerline.worker.cli, layerline.worker.serve, layerline.server.cli; "
            "from layerline.model.loader import load_stage; "
            "st = load_stage(sys.argv[1], 0, 1, True, False, 'gguf'); c = st.new_cache(1, 8); "
            "st(torch.tensor([[5, 17]]), start_pos=0, cache=c); st(torch.tensor([[3]]), start_pos=2, cache=c); "
            "print(type(st.embed_tokens).__name__, sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])")
    r = subprocess.run([sys.executable, "-c", code, block_gguf], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["BlockEmbedding", "[]"], r.stdout


def test_a_gguf_stage_compiles_around_its_block_embedding(block_gguf, one_thread):
    """A GGUF file's quantized token embedding (ggml's dequantizer through ctypes) runs in a compiled
    stage (outside its graph: blocks.keep_out_of_graphs, applied by compile, not at import); the
    compiled steps keep the eager numbers."""
    path = block_gguf
    n = read_index(path).num_layers
    eager = load_stage(path, 0, n, True, True, "gguf")
    fast = load_stage(path, 0, n, True, True, "gguf")
    assert isinstance(fast.embed_tokens, BlockEmbedding)
    fast.compile("default")
    prompt = torch.tensor([[5, 17, 99, 3]])
    a, b = _prefilled(eager, prompt, 16), _prefilled(fast, prompt, 16)
    tok = torch.tensor([[11]])
    for pos in range(4, 7):
        want = eager(tok, start_pos=pos, cache=a)
        got = fast(tok, start_pos=pos, cache=b)
        assert fast.compiled, fast.compile_error
        assert (got - want).abs().max().item() <= 0.03 * want.abs().max().item()
        tok = want[:, -1:].argmax(-1)


def test_a_graph_without_a_cpp_wrapper_runs_through_the_python_one(tmp_path, monkeypatch, one_thread):
    """Where inductor cannot give the graph a C++ wrapper, the stage stays compiled, through
    inductor's Python wrapper, with the eager numbers."""
    from torch._inductor.exc import CppWrapperCodegenError
    from torch._inductor.graph import GraphLowering

    def refuse(self):
        raise CppWrapperCodegenError("no C++ wrapper here")
    ck = write_demo_checkpoint(tmp_path / "m", layers=2, hidden=96, vocab=310, dtype="float32", seed=6)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # lowered here, not cached
    monkeypatch.setattr(GraphLowering, "validate_can_generate_cpp_wrapper", refuse)
    fast, eager = (load_stage(str(ck), 0, 2, True, True, "fp32") for _ in range(2))
    fast.compile("default")
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    a, b = _prefilled(eager, prompt, 8), _prefilled(fast, prompt, 8)
    for pos, tok in ((5, 9), (6, 2)):
        got = fast(torch.tensor([[tok]]), start_pos=pos, cache=b)
        torch.testing.assert_close(got, eager(torch.tensor([[tok]]), start_pos=pos, cache=a), rtol=1e-4, atol=1e-4)
    assert fast.compiled and fast.compile_error is None and not fast._cpp_wrapper


def test_a_stage_that_cannot_compile_decodes_eagerly_and_says_why(tmp_path, monkeypatch, one_thread):
    """Inductor needs a C++ compiler on the host; without one the stage keeps serving, eagerly."""
    import torch._inductor.config as inductor

    ck = write_demo_checkpoint(tmp_path / "m", layers=2, hidden=96, vocab=310, dtype="float32", seed=5)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing cached to fall back on
    fast, eager = (load_stage(str(ck), 0, 2, True, True, "fp32") for _ in range(2))
    fast.compile("default")
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    a, b = _prefilled(eager, prompt, 8), _prefilled(fast, prompt, 8)
    # inductor's own patch restores its config afterwards (monkeypatch would delete the key, and
    # every later compile in this process would fail)
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        got = fast(torch.tensor([[9]]), start_pos=5, cache=b)
    assert not fast.compiled and fast.compile_error
    torch.testing.assert_close(got, eager(torch.tensor([[9]]), start_pos=5, cache=a))
    assert b.length == 6
