"""The decode kernels (`layerline.model.cpu_kernels`), built with the host's g++ as a worker builds
them. For each ISA this CPU has (AVX2 + FMA; AVX-512 BF16 + VNNI): bf16, int8 and int4 linear
layers of 1-8 rows (int4: any) agree with a float64 product, with and without bias, for widths that
are not a multiple of the kernels' blocks and K that is 32 times an odd number; a row's result is
bit for bit the same whatever else is in the call and whatever the thread count (a greedy request's
tokens do not depend on its batch). More than 8 rows, fp32, or K not a multiple of 32 go to torch's
kernels. A bf16 and an int8 stage decode with them to logits close to torch's kernels'; an fp32
stage steps each layer as one call (`DecodeLayer`), through its modules once the kernels are off. Where they
cannot be built (no compiler, `LAYERLINE_CPU_KERNELS=off`) a stage still loads and decodes, and
`status()` says why.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from layerline.model import cpu_kernels
from layerline.model.quant import _pack_rows, dequantize_int4_rows, quantize_groups, quantize_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split()}
    except OSError:
        return set()


FLAGS = _cpu_flags()
ISAS = [isa for isa, need in (("avx2", {"avx2", "fma"}),
                              ("avx512-bf16", {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}))
        if need <= FLAGS]
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not ISAS,
                                reason="the kernels are x86-64 (AVX2 or AVX-512)")


@pytest.fixture(params=ISAS)
def isa(request):
    assert cpu_kernels.load(), cpu_kernels.status()  # this machine has g++: the build must work
    cpu_kernels.use_isa(request.param)
    assert cpu_kernels.status() == request.param
    yield request.param
    cpu_kernels.use_isa("avx512-bf16")  # the best this CPU has again


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (y.double() - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err} of {ref.abs().max().item()}"


@pytest.mark.parametrize("m,n,k", [(1, 100, 64), (2, 36, 128), (3, 1027, 96), (4, 1027, 512), (8, 258, 1024),
                                   (5, 4, 32), (7, 33, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_equal_the_float64_product(isa, m, n, k, bias):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    y = torch.ops.layerline_cpu.linear_bf16(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    _close(y, ref, 0.01)  # the output's bf16 rounding
    q, s = quantize_rows(torch.randn(n, k, generator=g))
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        ref8 = F.linear(x.double(), q.double() * s.double()[:, None], None if b is None else b.double())
        y8 = torch.ops.layerline_cpu.linear_int8(x.to(dt), q, s, b)
        assert y8.dtype == dt and y8.shape == (m, n)
        _close(y8, ref8, 2e-4 if dt == torch.float32 else 0.01)  # x as int16 codes: about 1/30000


@pytest.mark.parametrize("m,n,k", [(1, 100, 64), (2, 37, 128), (3, 1027, 576), (4, 258, 1024), (40, 36, 2816),
                                   (33, 37, 960)])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_kernel_equals_the_float64_product_of_its_weights(isa, m, n, k, bias):
    """int4 in layerline's layout (any rows: a prefill's too, whose tiles take 3 rows of W at a time,
    37 leaving one over; K = 64 and 128 only groups past the last whole block of 16, 576 two past
    it, 960 fourteen, 1024 none) against x @ the dequantized weight in float64."""
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.1, 2, k)  # groups of different scales
    codes, sz = _pack_rows(*quantize_groups(w))
    deq = dequantize_int4_rows(codes, sz, torch.float64)
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(m, k, generator=g)
    x[:, :32] *= 50  # one group far larger than the rest: x is quantized per group, not per row
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        ref = F.linear(x.to(dt).double(), deq, None if b is None else b.double())
        y = torch.ops.layerline_cpu.linear_int4(x.to(dt), codes, sz, b)
        assert y.dtype == dt and y.shape == (m, n)
        _close(y, ref, 0.02)  # x as int8 codes per group of 32 (each within 1/254 of its group's largest)


def test_a_row_has_the_same_bits_in_any_batch_and_thread_count(isa):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 1, 512, generator=g).bfloat16()
    w = torch.randn(4099, 512, generator=g).bfloat16()  # rows in blocks of 4 and a tail of 3
    q, s = quantize_rows(w.float())
    threads = torch.get_num_threads()
    try:
        for op, args in ((torch.ops.layerline_cpu.linear_int8, (q, s)), (torch.ops.layerline_cpu.linear_bf16, (w,)),
                         (torch.ops.layerline_cpu.linear_int4, _pack_rows(*quantize_groups(w.float())))):
            torch.set_num_threads(2)
            batch = op(x, *args)
            assert batch.shape == (8, 1, 4099)
            torch.set_num_threads(1)
            for i in range(8):
                assert torch.equal(op(x[i:i + 1], *args)[0], batch[i]), (op, i)
            assert torch.equal(op(x[2:6], *args), batch[2:6])
    finally:
        torch.set_num_threads(threads)


def test_dispatch_takes_a_few_bf16_rows_and_leaves_the_rest_to_torch(isa, monkeypatch):
    calls = []
    real_bf16, real_int8 = torch.ops.layerline_cpu.linear_bf16, torch.ops.layerline_cpu.linear_int8

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return {"linear_bf16": real_bf16, "linear_int8": real_int8}[name]

    monkeypatch.setattr(torch.ops, "layerline_cpu", Spy())
    w = torch.randn(64, 96).bfloat16()
    q, s = quantize_rows(w.float())
    for x, used in ((torch.randn(1, 96), False),                   # fp32: torch's
                    (torch.randn(2, 4, 96).bfloat16(), True),       # 8 rows: the kernel
                    (torch.randn(9, 96).bfloat16(), False),         # 9 rows (a prefill): torch's
                    (torch.randn(1, 80).bfloat16(), False)):        # K not a multiple of 32: torch's
        calls.clear()
        ww = w if x.shape[-1] == 96 else torch.randn(64, 80).bfloat16()
        y = cpu_kernels.linear(x, ww.to(x.dtype))
        assert calls == (["linear_bf16"] if used else []), (x.shape, x.dtype)
        torch.testing.assert_close(y.float(), F.linear(x.float(), ww.to(x.dtype).float()), rtol=0.02, atol=0.1)
        if x.shape[-1] == 96:
            calls.clear()
            y8 = cpu_kernels.linear_int8(x, q, s)
            rows = x.numel() // 96
            assert (y8 is not None) == (rows <= cpu_kernels.MAX_ROWS)
            assert calls == (["linear_int8"] if rows <= cpu_kernels.MAX_ROWS else [])


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_stage_decodes_with_the_kernels_close_to_torchs(tmp_path, isa, precision):
    from layerline.checkpoint import write_demo_checkpoint
    from layerline.model.loader import load_stage
    ck = str(write_demo_checkpoint(tmp_path / "m", layers=2, hidden=256, vocab=512, dtype="float32"))
    stage = load_stage(ck, 0, 2, True, True, precision)
    ids = torch.tensor([[5, 17, 3, 99, 42]])

    def decode():
        cache = stage.new_cache(2, 16)
        out = [stage(ids.expand(2, -1), 0, cache)[:, -1]]
        for i in range(3):  # one-token steps of two rows: the kernels (prefill: torch's)
            out.append(stage(torch.tensor([[7 + i], [9 + i]]), 5 + i, cache)[:, -1])
        return torch.stack(out)

    ours = decode()
    cpu_kernels.use_isa("off")  # torch's kernels for the same stage
    try:
        theirs = decode()
    finally:
        cpu_kernels.use_isa(isa)
    assert not torch.equal(ours[1:], theirs[1:])  # the steps did go through other kernels
    assert torch.equal(ours[0], theirs[0])        # the prefill did not
    _close(ours, theirs.double(), 0.03)


def _attention_ref(q, k, v, kc, vc, pos, lo, scale):
    """float64 SDPA of each row over its keys lo..pos, the new k/v in place: [n, 1, nh * hd]."""
    outs = []
    for i in range(q.shape[0]):
        kk, vv = kc[i].double().clone(), vc[i].double().clone()
        kk[:, pos[i]], vv[:, pos[i]] = k[i, :, 0].double(), v[i, :, 0].double()
        o = F.scaled_dot_product_attention(q[i:i + 1].double(), kk[None, :, lo[i]:pos[i] + 1],
                                           vv[None, :, lo[i]:pos[i] + 1], scale=scale, enable_gqa=True)
        outs.append(o.transpose(1, 2).reshape(1, 1, -1))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nh,nkv,hd", [(16, 4, 64), (6, 6, 32), (4, 1, 128), (9, 3, 64), (4, 2, 256)])
def test_decode_attention_equals_the_float64_attention_and_writes_the_cache(isa, dtype, nh, nkv, hd):
    g = torch.Generator().manual_seed(nh * hd)
    n, max_len = 4, 300
    caches = [(torch.randn(nkv, max_len, hd, generator=g).to(dtype), torch.randn(nkv, max_len, hd, generator=g).to(dtype))
              for _ in range(n)]
    q = torch.randn(n, nh, 1, hd, generator=g).to(dtype)
    k, v = (torch.randn(n, nkv, 1, hd, generator=g).to(dtype) for _ in range(2))
    pos, lo = [0, 17, 299, 130], [0, 0, 40, 130]  # one key, a few, a sliding window, only the new one
    before = [(c.clone(), d.clone()) for c, d in caches]
    ref = _attention_ref(q, k, v, [c for c, _ in before], [d for _, d in before], pos, lo, hd ** -0.5)
    kc, vc = [c[None] for c, _ in caches[:2]] + [c for c, _ in caches[2:]], [d for _, d in caches]
    out = cpu_kernels.decode_attention(q, k, v, kc, vc, pos, lo, hd ** -0.5)  # [1, nkv, ...] or [nkv, ...]
    assert out.dtype == dtype and out.shape == (n, 1, nh * hd)
    _close(out, ref, 0.01 if dtype == torch.bfloat16 else 1e-5)
    for i, ((c, d), (c0, d0)) in enumerate(zip(caches, before)):
        c0[:, pos[i]], d0[:, pos[i]] = k[i, :, 0], v[i, :, 0]
        assert torch.equal(c, c0) and torch.equal(d, d0), i  # the new k/v, and nothing else, written
    # a row's bits alone, in any batch and thread count
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for i in range(n):
            one = cpu_kernels.decode_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], [caches[i][0]], [caches[i][1]],
                                               pos[i:i + 1], lo[i:i + 1], hd ** -0.5)
            assert torch.equal(one[0], out[i]), i
    finally:
        torch.set_num_threads(threads)
    # rows past the caches given (a compiled step's padding) come out as zeros
    part = cpu_kernels.decode_attention(q, k, v, kc[:2], vc[:2], pos[:2], lo[:2], hd ** -0.5)
    assert part.shape == out.shape and torch.equal(part[:2], out[:2]) and not part[2:].any()


def test_decode_attention_leaves_what_it_does_not_take_to_torch(isa):
    q = torch.randn(1, 4, 1, 64)
    k = v = torch.randn(1, 2, 1, 64)
    kc, vc = [torch.zeros(2, 8, 64)], [torch.zeros(2, 8, 64)]
    assert cpu_kernels.decode_attention(q.half(), k.half(), v.half(), [kc[0].half()], [vc[0].half()],
                                        [3], [0], 0.125) is None            # fp16
    assert cpu_kernels.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), kc, vc, [3], [0], 0.125) is None
    q24, k24 = torch.randn(1, 4, 1, 24), torch.randn(1, 2, 1, 24)          # head_dim not a multiple of 16
    assert cpu_kernels.decode_attention(q24, k24, k24, [torch.zeros(2, 8, 24)], [torch.zeros(2, 8, 24)], [3], [0],
                                        0.125) is None
    with pytest.raises(RuntimeError, match="0 <= lo <= pos < max_len"):
        cpu_kernels.decode_attention(q, k, v, kc, vc, [8], [0], 0.125)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_and_rms_norm_give_the_torch_modules_numbers(isa, dtype):
    """The eager step's fused RoPE and RMSNorm: RoPE bit for bit torch's three ops (q as the
    transposed view of the fused projection, one row of cos/sin for all or one per row, prefill
    and decode shapes); RMSNorm within an fp32 rounding of the module's torch ops (bf16: the same
    bits on this data), a row's bits its own; what they do not take goes back to the caller."""
    from layerline.model.llama import RMSNorm, rotate_half
    g = torch.Generator().manual_seed(3)
    for P, T in ((1, 7), (5, 1)):
        q = torch.randn(5, T, 12 * 32, generator=g).to(dtype).reshape(5, T, 12, 32).transpose(1, 2)
        ang = torch.randn(P, 1, T, 16, generator=g)
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        assert torch.equal(cpu_kernels.rope(q, cos, sin), q * cos + rotate_half(q) * sin), (P, T)
    norm = RMSNorm(320, 1e-5, dtype)
    norm.weight.data = torch.randn(320, generator=g).to(dtype)
    x = (torch.randn(6, 3, 320, generator=g) * 4).to(dtype)
    got = cpu_kernels.rms_norm(x, norm.weight, 1e-5)
    xf = x.float()
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert (got.float() - ref.float()).abs().max() <= (1e-6 * ref.abs().max() if dtype == torch.float32 else 0)
    assert torch.equal(cpu_kernels.rms_norm(x[2:3, 1:2], norm.weight, 1e-5), got[2:3, 1:2])
    assert torch.equal(norm(x), got), "the module runs the kernel eagerly"
    assert cpu_kernels.rms_norm(x.half(), norm.weight.half(), 1e-5) is None
    assert cpu_kernels.rope(q.half(), cos.half(), sin.half()) is None



@pytest.mark.parametrize("v", [1, 7, 8, 9, 100, 32003])
def test_argmax_rows_picks_the_lowest_index_of_the_largest_and_flags_rows_not_finite(isa, v):
    g = torch.Generator().manual_seed(v)
    x = torch.randint(-3, 4, (7, 2, v), generator=g).float()[:, -1]  # rows strided, as out[:, -1]; many ties
    x[1] = -float("inf")
    x[2, v // 2] = float("nan")
    x[3, v - 1] = float("inf")
    x[4, -1] = 9.0  # the largest in the row's last (tail) value
    x[5, 0] = -float("inf")
    idx, fin = cpu_kernels.argmax_rows(x)
    assert idx.dtype == torch.int64 and fin.dtype == torch.uint8 and idx.shape == fin.shape == (7,)
    assert fin.tolist() == [int(bool(torch.isfinite(r).all())) for r in x]
    for r in range(7):
        if fin[r]:  # a finite row: the first index of its largest value, as torch's argmax
            assert idx[r].item() == int(torch.nonzero(x[r] == x[r].max())[0]) == int(x[r].argmax())
    assert cpu_kernels.argmax_rows(x.double()) is None and cpu_kernels.argmax_rows(x[0]) is None


def test_gemmas_offset_norm_runs_the_kernel_at_fp32_and_follows_its_weight(isa):
    """Gemma's (1 + w) RMSNorm at fp32 through rms_norm with 1 + w made once: the module's torch
    numbers (within an fp32 rounding), also after its weight changes in place, and for weights made
    in inference mode (no version counter); bf16 keeps the module's one rounding at the end."""
    from layerline.model.llama import OffsetRMSNorm

    def torch_numbers(m, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + m.eps)
        return (y * (1.0 + m.weight.detach().float())).to(x.dtype)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 2, 640, generator=g) * 3
    norm = OffsetRMSNorm(640, 1e-6, torch.float32)
    norm.weight.data = torch.randn(640, generator=g)
    for _ in range(2):
        want = torch_numbers(norm, x)
        assert (norm(x) - want).abs().max() <= 1e-6 * want.abs().max()
        with torch.no_grad():
            norm.weight.mul_(-0.5)  # in place, as a load does: the next call must see it
    with torch.inference_mode():
        frozen = OffsetRMSNorm(640, 1e-6, torch.float32)
        frozen.weight.data = torch.randn(640, generator=g)
        want = torch_numbers(frozen, x)
        assert (frozen(x) - want).abs().max() <= 1e-6 * want.abs().max()
    xb = x.bfloat16()
    assert torch.equal(norm(xb), torch_numbers(norm, xb))

def _status_in_subprocess(tmp_path, **env) -> dict:
    code = ("import json, torch; from layerline.checkpoint import write_demo_checkpoint;"
            "from layerline.model.loader import load_stage; from layerline.model import cpu_kernels;"
            f"ck = write_demo_checkpoint({str(tmp_path / 'm')!r}, layers=1, hidden=64, vocab=100, dtype='float32');"
            "s = load_stage(str(ck), 0, 1, True, True, 'bf16'); c = s.new_cache(1, 8); s(torch.tensor([[1, 2]]), 0, c);"
            "y = s(torch.tensor([[3]]), 2, c);"
            "print(json.dumps({'status': cpu_kernels.status(), 'finite': bool(torch.isfinite(y).all())}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LAYERLINE_KERNEL_CACHE": str(tmp_path / "kernels"), **env})
    assert r.returncode == 0, r.stderr
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "stderr": r.stderr}


def test_without_a_compiler_a_stage_decodes_with_torchs_kernels_and_says_why(tmp_path):
    out = _status_in_subprocess(tmp_path, CXX="/nonexistent/g++")
    assert out["status"] == "off: no C++ compiler (/nonexistent/g++) on PATH; install g++ or set CXX"
    assert out["finite"] and "CPU kernels unavailable (no C++ compiler" in out["stderr"]
    assert "Traceback" not in out["stderr"]
    out = _status_in_subprocess(tmp_path, LAYERLINE_CPU_KERNELS="off")
    assert out["status"] == "off: LAYERLINE_CPU_KERNELS=off" and out["finite"]
    out = _status_in_subprocess(tmp_path, LAYERLINE_CPU_KERNELS="sse9")
    assert out["status"].startswith("off: LAYERLINE_CPU_KERNELS=sse9: not auto, off") and out["finite"]


def test_an_fp32_stage_steps_each_layer_in_one_call_and_without_kernels_through_its_modules(tmp_path, isa,
                                                                                            monkeypatch):
    """An fp32 stage's one-token steps go through each layer's `DecodeLayer` (the same bits as its
    modules); with the kernels turned off after those were built, through the modules again."""
    from layerline.checkpoint import write_demo_checkpoint
    from layerline.model.loader import load_stage
    ck = str(write_demo_checkpoint(tmp_path / "m", layers=2, hidden=256, vocab=512, dtype="float32"))
    stage = load_stage(ck, 0, 2, True, True, "fp32")
    ids = torch.tensor([[5, 17, 3, 99, 42]])

    def decode(steps: bool):
        stage.decode_steps = steps
        cache = stage.new_cache(2, 16)
        out = [stage(ids.expand(2, -1), 0, cache)[:, -1]]
        out += [stage(torch.tensor([[7 + i], [9 + i]]), 5 + i, cache)[:, -1] for i in range(3)]
        return torch.stack(out)

    from layerline.model.llama import DecoderLayer
    forwards = []
    module_forward = DecoderLayer.forward
    monkeypatch.setattr(DecoderLayer, "forward", lambda self, x, *a: forwards.append(x.shape[1]) or
                        module_forward(self, x, *a))
    ours = decode(True)
    assert stage._steps and forwards == [5, 5]  # the prefill through the modules, the steps not
    assert torch.equal(ours, decode(False)) and forwards[2:] == [5, 5] + [1, 1] * 3
    forwards.clear()
    cpu_kernels.use_isa("off")
    try:
        theirs = decode(True)  # the steps built before stand aside: torch's ops, through the modules
    finally:
        cpu_kernels.use_isa(isa)
    assert forwards == [5, 5] + [1, 1] * 3
    _close(ours, theirs.double(), 1e-4)


def test_the_layers_in_one_call_keep_each_layers_window_and_rope_table(tmp_path, isa):
    """Gemma 3 with window and global layers taking turns, each kind its own RoPE base: the stage's
    one call over its layers (`DecodeStack`) gives each layer its own window's first keys and its own
    table, so the logits and caches equal the modules' bit for bit, past the window, for one
    sequence of two rows and for rows of two sequences at different positions."""
    transformers = pytest.importorskip("transformers")
    from layerline.model.loader import load_stage
    torch.manual_seed(7)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=20,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(tmp_path / "g")
    stage = load_stage(str(tmp_path / "g"), 0, 4, True, True, "fp32")
    assert len(stage.windows) == 2
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))

    def run(steps: bool) -> list[torch.Tensor]:
        stage.decode_steps = steps
        cache = stage.new_cache(2, 16)
        stage(ids[:, :3], 0, cache)
        out = [stage(ids[:, p:p + 1], p, cache) for p in range(3, 10)]
        caches = [stage.new_cache(1, 16), stage.new_cache(1, 16)]
        stage(ids[:1, :2], 0, caches[0])
        stage(ids[1:, :7], 0, caches[1])
        out += [stage.forward_rows(torch.stack([ids[0, 2 + j:3 + j], ids[1, 7 + j:8 + j]]), [2 + j, 7 + j], caches)
                for j in range(5)]
        return out + [t for c in (cache, *caches) for layer in c.layers for t in (layer.k, layer.v)]

    fast = run(True)
    assert stage._stack is not None
    assert all(torch.equal(a, b) for a, b in zip(fast, run(False)))


def test_a_prompt_in_chunks_runs_the_layers_in_one_call_with_the_modules_bits(tmp_path, isa, monkeypatch):
    """A one-row sequence's prompt chunks (`DecodeStack.chunk`: each chunk's tokens as the rows, ATen's
    attention under the modules' mask) give the modules' logits and caches bit for bit, chunks past
    a sliding window (4) and at later positions included, with no module's forward called; a
    sequence of two rows still prefills through the modules."""
    from layerline.checkpoint import write_demo_checkpoint
    from layerline.model.llama import DecoderLayer
    from layerline.model.loader import load_stage
    ck = write_demo_checkpoint(tmp_path / "m", layers=2, hidden=128, vocab=300, dtype="float32", seed=5,
                               arch="mistral", sliding_window=4)
    stage = load_stage(str(ck), 0, 2, True, True, "fp32")
    ids = torch.randint(0, 300, (2, 14), generator=torch.Generator().manual_seed(4))
    forwards = []
    module_forward = DecoderLayer.forward
    monkeypatch.setattr(DecoderLayer, "forward", lambda self, x, *a: forwards.append(tuple(x.shape[:2])) or
                        module_forward(self, x, *a))

    def run(steps: bool) -> list[torch.Tensor]:
        stage.decode_steps = steps
        cache = stage.new_cache(1, 16)
        out = [stage(ids[:1, a:b], a, cache) for a, b in ((0, 3), (3, 8), (8, 11))]
        out.append(stage(ids[:1, 11:12], 11, cache))
        out.append(stage(ids[:1, 12:14], 12, cache, last_only=True))
        return out + [t for layer in cache.layers for t in (layer.k, layer.v)]

    fast = run(True)
    assert stage._stack is not None and forwards == []
    slow = run(False)
    assert forwards == [(1, 3)] * 2 + [(1, 5)] * 2 + [(1, 3)] * 2 + [(1, 1)] * 2 + [(1, 2)] * 2
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    forwards.clear()
    stage.decode_steps = True
    stage(ids[:, :4], 0, stage.new_cache(2, 16))
    assert forwards == [(2, 4)] * 2


def test_a_layers_linear_kinds_are_the_layouts_by_name(isa):
    """`DecodeLayer.linear` takes each projection's kind by the name Python holds (every gguf_blocks
    layout, and llama.DENSE) and refuses any other, naming the kinds; the numbers live in C++ only."""
    from layerline.model import gguf_blocks, llama
    layer = torch.classes.layerline_cpu.DecodeLayer(4, 2, 32, 96, 1.0, 1e-6, False, False)
    for kind in (*gguf_blocks.LAYOUTS, llama.DENSE):  # known: only the ints' count is wrong here
        with pytest.raises(RuntimeError, match=f"o kind {kind} takes"):
            layer.linear("o", kind, torch.zeros(2, 2), [1] * 9, None)
    with pytest.raises(RuntimeError, match="linear kind 'int5' is not int4, x16, x8, file or dense"):
        layer.linear("o", "int5", torch.zeros(2, 2), [], None)


def test_a_layer_refuses_what_does_not_fit_when_described_and_stepped(isa):
    """A projection's blocks are checked against its N and K when the layer is described (its step then
    writes into buffers it sized from them), and each step checks the projections against the hidden
    size and the caches against the heads: a bad one is refused by name, nothing written."""
    layer = torch.classes.layerline_cpu.DecodeLayer(4, 2, 32, 96, 1.0, 1e-6, False, False)
    with pytest.raises(RuntimeError, match=r"contiguous uint8 blocks \[N, 36\] for N = 64, K = 64"):
        layer.linear("o", "int4", torch.zeros(64 * 36 - 1, dtype=torch.uint8), [64, 64, 2], None)
    with pytest.raises(RuntimeError, match="int4 kind 1 \\(Q4_1\\) or 2 \\(Q4_0\\)"):
        layer.linear("o", "int4", torch.zeros(64 * 36, dtype=torch.uint8), [64, 64, 7], None)
    with pytest.raises(RuntimeError, match="a dense matrix is fp32"):
        layer.linear("o", "dense", torch.zeros(64, 128, dtype=torch.bfloat16), [], None)
    hidden = 64
    for name, n, k in (("qkv", (4 + 2 * 2) * 32, hidden), ("o", hidden, 4 * 32), ("gate_up", 2 * 96, hidden),
                       ("down", hidden, 96)):
        layer.linear(name, "dense", torch.randn(n, k), [], None)
    for name in ("input", "post_attention"):
        layer.norm(name, torch.ones(hidden))
    assert layer.ready()
    kc, vc = [torch.zeros(2, 8, 32)], [torch.zeros(2, 8, 32)]
    cos, sin = torch.ones(1, 1, 1, 32), torch.zeros(1, 1, 1, 32)
    y = layer.step(torch.randn(1, 1, hidden), cos, sin, kc, vc, [3], [0])
    assert y.shape == (1, 1, hidden) and torch.isfinite(y).all() and kc[0][:, 3].abs().sum() > 0
    with pytest.raises(RuntimeError, match="do not fit hidden size 96"):
        layer.step(torch.randn(1, 1, 96), cos, sin, kc, vc, [4], [0])
    with pytest.raises(RuntimeError, match=r"caches \[nkv, max_len, hd\] of fp32"):
        layer.step(torch.randn(1, 1, hidden), cos, sin, [torch.zeros(3, 8, 32)], [torch.zeros(3, 8, 32)], [4], [0])
    with pytest.raises(RuntimeError, match="0 <= lo <= pos < max_len"):
        layer.step(torch.randn(1, 1, hidden), cos, sin, kc, vc, [8], [0])
    assert kc[0][:, 4:].abs().sum() == 0  # the refused steps wrote nothing
