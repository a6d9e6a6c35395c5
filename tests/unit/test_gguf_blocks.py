"""gguf_blocks.BlockLinear against gguf.quants, the GGUF package's numpy reference, for every block type.

BlockLinear quantizes x's rows to 8 bits (q8_0 / q8_1 / q8_K blocks, as llama.cpp does) and sums
each block's integer products exactly before scaling them, so its result is checked against the
float64 product of the blocks it actually multiplied: x as ggml quantized it (decoded here) and W as
gguf.quants dequantizes it. Tolerance: |y - ref| <= 1e-5 * (|x_q| @ |W|.T) + 1e-6 elementwise, a
float32 summation's error over a few thousand terms. Against unquantized x the result is within the
8-bit rounding of x (checked loosely, 2% of the same magnitude).

Weights: random float matrices quantized by gguf.quants where it quantizes the type (q4_0, q4_1, q5_0,
q5_1, q8_0) and by ggml's reference quantizer for the K types (gguf.quants only dequantizes those),
plus blocks of random bytes (every code pattern). Q4_0 / Q4_K are also checked repacked: the file's
bytes come back exactly and the products agree with the same reference. Q4_0 / Q4_1 in layerline's int4
layout (its own kernel, where it loads): the file's bytes come back exactly, and the products are checked
against the float64 product of x quantized as that kernel does (int8 a group of 32, fp32 scale) and W
decoded exactly from the blocks. Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K in the "x16" layout (layerline's
kernel): the file's bytes as they are, and the product against x itself (no 8-bit rounding of x),
within a float32 summation's error.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

from layerline.model import cpu_kernels, gguf_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not gguf_blocks.load(), reason=f"GGUF block kernels: {gguf_blocks.status()}")

TYPES = list(gguf_blocks.BLOCK_TYPES)
# gguf.quants quantizes these; the K types it only dequantizes, so their blocks come from ggml's
# reference quantizer (quantize_row_<type>_ref), the one llama.cpp's converter runs
GGUF_QUANTIZES = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0"}
# byte offsets of each block's fp16 fields (d, and m / dmin where there is one)
HALF_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
               "q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208,)}


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name.upper()]


def make_blocks(name: str, w: np.ndarray) -> np.ndarray:
    """w [N, K] float32 quantized into `name` blocks, uint8 [N, row_bytes]."""
    if name in GGUF_QUANTIZES:
        return quants.quantize(w, qtype(name))
    bt = gguf_blocks.BLOCK_TYPES[name]
    out = np.empty((w.shape[0], w.shape[1] // bt.block * bt.block_bytes), dtype=np.uint8)
    fn = getattr(gguf_blocks._S.cpu, f"quantize_row_{name}_ref")
    src = np.ascontiguousarray(w, dtype=np.float32)
    fn(ctypes.c_void_p(src.ctypes.data), ctypes.c_void_p(out.ctypes.data), ctypes.c_int64(src.size))
    return out


def random_blocks(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of random bytes (every code pattern) with finite, small fp16 scales."""
    bt = gguf_blocks.BLOCK_TYPES[name]
    raw = rng.integers(0, 256, size=(n * k // bt.block, bt.block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[name]:
        halves = rng.uniform(-0.05, 0.05, size=raw.shape[0]).astype(np.float16)
        raw[:, off:off + 2] = halves.view(np.uint8).reshape(-1, 2)
    if name == "q8_0":  # ggml's q8_0 codes are -127..127 (its AVX2 dot product takes |q|)
        codes = raw[:, 2:].view(np.int8)
        codes[codes == -128] = -127
    return raw.reshape(n, -1)


def decode_x(xq: np.ndarray, dot_with: str, k: int) -> tuple[np.ndarray, np.ndarray | None]:
    """ggml's activation blocks as float64 [rows, k], and q8_1's stored sums s [rows, k / 32]."""
    block, nbytes = gguf_blocks.DOT_BLOCK[dot_with]
    b = xq.reshape(xq.shape[0], k // block, nbytes)
    if dot_with == "q8_K":
        d = b[..., :4].copy().view(np.float32).astype(np.float64)
        q = b[..., 4:4 + 256].copy().view(np.int8).astype(np.float64)
        return (d * q).reshape(xq.shape[0], k), None
    head = 4 if dot_with == "q8_1" else 2
    d = b[..., :2].copy().view(np.float16).astype(np.float64)
    q = b[..., head:].copy().view(np.int8).astype(np.float64)
    s = b[..., 2:4].copy().view(np.float16).astype(np.float64)[..., 0] if dot_with == "q8_1" else None
    return (d * q).reshape(xq.shape[0], k), s


def int4_reference(raw: np.ndarray, name: str, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The float64 product layerline's int4 kernel computes: x quantized a group of 32 to int8 (scale
    amax / 127 in fp32, codes rounded to nearest even from x * (127 / amax)), W = d * code + m from the
    blocks (Q4_0: m = -8 d), each term exact; and its magnitude."""
    k = x.shape[-1]
    b = raw.reshape(raw.shape[0], k // 32, -1)
    head = 4 if name == "q4_1" else 2
    d = b[..., :2].copy().view(np.float16).astype(np.float64)
    m = b[..., 2:4].copy().view(np.float16).astype(np.float64) if name == "q4_1" else -8 * d
    qs = b[..., head:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64)  # [n, groups, 32]
    w = (codes * d + m).reshape(raw.shape[0], k)
    xg = x.float().numpy().reshape(x.shape[0], k // 32, 32)
    amax = np.abs(xg).max(-1, keepdims=True).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.clip(np.rint(xg * inv), -127, 127)
    xd = (xq * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape[0], k)
    return xd @ w.T, np.abs(xd) @ np.abs(w).T


def x16(x: torch.Tensor, name: str) -> np.ndarray:
    """x as the x16 kernel holds it for blocks of type `name` (csrc/x16.h's XHeld): each 32 values (a
    K-quant's 256) int16 codes of their largest magnitude / 32767, in float64."""
    xf = x.float().numpy()
    g = xf.reshape(xf.shape[0], -1, 256 if name.endswith("_K") else 32)
    amax = np.abs(g).max(-1, keepdims=True)
    inv = np.float32(32767) / np.where(amax > 0, amax, np.float32(1))
    codes = np.where(amax > 0, np.rint(g * inv), 0)
    return (codes * (amax / np.float32(32767)).astype(np.float64)).reshape(xf.shape)


def reference(bl: gguf_blocks.BlockLinear, raw: np.ndarray, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The float64 product the kernel computes (ggml's: its quantized x, gguf's dequantized W) and its
    magnitude."""
    name, k = bl.type.name, bl.in_features
    if bl.layout == "int4":
        return int4_reference(raw, name, x)
    if bl.layout == "x16":  # x at 16 bits a 32 values, W dequantized
        xhat = x16(x, name)
        w = quants.dequantize(raw, qtype(name)).astype(np.float64)
        return xhat @ w.T, np.abs(xhat) @ np.abs(w).T
    w = quants.dequantize(raw, qtype(name)).astype(np.float64)
    xd, s = decode_x(bl.quantize_activations(x).numpy(), bl.type.dot_with, k)
    ref = xd @ w.T
    if s is not None:
        # q4_1 / q5_1: ggml adds each block's m times x's stored sum s (fp16), not m * sum(x_q)
        m = raw.reshape(raw.shape[0], k // 32, -1)[..., 2:4].copy().view(np.float16).astype(np.float64)[..., 0]
        ref += (s - xd.reshape(xd.shape[0], k // 32, 32).sum(-1)) @ m.T
    return ref, np.abs(xd) @ np.abs(w).T


def checked_product(bl: gguf_blocks.BlockLinear, raw: np.ndarray, x: torch.Tensor, what: str):
    """bl(x), checked: float32 [rows, out], within a float32 summation's error of `reference`; (y, magnitude)."""
    y = bl(x)
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], bl.out_features)
    ref, mag = reference(bl, raw, x)
    err = np.abs(y.numpy().astype(np.float64) - ref)
    if bl.layout == "x16":  # the blocks' mins meet x's own sum, not its rounded one's: at most a row's
        # largest weight times what the rounding moved x by
        xhat = x16(x, bl.type.name)
        w = np.abs(quants.dequantize(raw, qtype(bl.type.name))).max(-1)
        err = np.maximum(err - np.abs(xhat - x.double().numpy()).sum(-1, keepdims=True) * w[None, :], 0)
    assert (err <= 1e-5 * mag + 1e-6).all(), f"{what}: worst {err.max()} at magnitude {mag.max()}"
    return y, mag


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_equals_gguf(name: str) -> None:
    rng = np.random.default_rng(1)
    n, k = 8, 512
    for raw in (make_blocks(name, rng.standard_normal((n, k)).astype(np.float32)),
                random_blocks(name, n, k, rng)):
        bl = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), qtype(name), n, k)
        got = bl.dequantize().numpy()
        want = quants.dequantize(raw, qtype(name))
        assert got.shape == want.shape
        assert np.array_equal(got, want), f"{name}: {np.abs(got - want).max()}"


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("name", TYPES)
def test_linear_equals_product_of_blocks(name: str, rows: int) -> None:
    rng = np.random.default_rng(2)
    n, k = 48, 1024
    raw = make_blocks(name, rng.standard_normal((n, k)).astype(np.float32))
    bl = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), qtype(name), n, k)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    y, mag = checked_product(bl, raw, x, name)
    # against x itself: within x's 8-bit rounding
    exact = x.double().numpy() @ bl.dequantize().double().numpy().T
    assert (np.abs(y.numpy() - exact) <= 0.02 * mag + 1e-4).all()


@pytest.mark.parametrize("name", ["q4_K", "q6_K", "q8_0", "q4_0", "q4_1"])
def test_rows_independent_of_batch_bf16_and_threads(name: str) -> None:
    rng = np.random.default_rng(3)
    n, k = 40, 512
    raw = make_blocks(name, rng.standard_normal((n, k)).astype(np.float32))
    bl = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), qtype(name), n, k)
    x = torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32)).to(torch.bfloat16)
    y = bl(x)
    assert torch.equal(y[2:3], bl(x[2:3])), "a row's result depends on the rows beside it"
    assert torch.equal(y, bl(x.float())), "bf16 x is not the same as its float32 values"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(y, bl(x))
    finally:
        torch.set_num_threads(threads)
    assert bl(x.view(1, 5, k)).shape == (1, 5, n)


def test_bias_and_errors() -> None:
    rng = np.random.default_rng(4)
    raw = make_blocks("q8_0", rng.standard_normal((4, 64)).astype(np.float32))
    bias = torch.arange(4, dtype=torch.float32)
    x = torch.ones(2, 64)
    plain = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), "Q8_0", 4, 64)
    biased = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), 8, 4, 64, bias=bias)
    assert torch.equal(biased(x), plain(x) + bias)
    with pytest.raises(ValueError, match="not a multiple of q4_K"):
        gguf_blocks.BlockLinear(torch.zeros(4 * 144, dtype=torch.uint8), "q4_K", 4, 128)
    with pytest.raises(ValueError, match="bytes"):
        gguf_blocks.BlockLinear(torch.zeros(10, dtype=torch.uint8), "q4_0", 4, 64)
    with pytest.raises(ValueError, match="no kernel"):
        gguf_blocks.block_type("q3_K")


@pytest.mark.parametrize("name", sorted(gguf_blocks.REPACKED))
def test_repack_is_lossless_and_computes_the_same(name: str) -> None:
    if not gguf_blocks.repack_works(name):
        pytest.skip(f"this ggml's repacked {name} kernels are not in use")
    rng = np.random.default_rng(5)
    n, k = 32, 512
    for raw in (make_blocks(name, rng.standard_normal((n, k)).astype(np.float32)), random_blocks(name, n, k, rng)):
        packed = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), name, n, k, layout="x8")
        assert packed.repacked and packed.stored_bytes == raw.size
        assert not np.array_equal(packed.raw.numpy(), raw)
        assert np.array_equal(packed.stored().numpy(), raw), "repacking lost or moved bits"
        assert np.array_equal(packed.dequantize().numpy(), quants.dequantize(raw, qtype(name)))
        for invariant in (True, False):
            bl = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), name, n, k, layout="x8",
                                         batch_invariant=invariant)
            for rows in (1, 4, 7):
                x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
                ref, mag = reference(bl, raw, x)
                err = np.abs(bl(x).numpy().astype(np.float64) - ref)
                assert (err <= 1e-5 * mag + 1e-6).all(), f"{name} rows {rows}: worst {err.max()}"
            if invariant:
                assert torch.equal(bl(x)[3:4], bl(x[3:4]))
    with pytest.raises(ValueError, match="no repacked kernel"):
        gguf_blocks.BlockLinear(torch.zeros(12 * 144, dtype=torch.uint8), "q4_K", 12, 256, layout="x8")


own_here = pytest.mark.skipif(not gguf_blocks.own_can("q4_0", 64),
                              reason="layerline's CPU kernels do not load here (AVX2 or AVX-512 VNNI)")


@own_here
@pytest.mark.parametrize("name", gguf_blocks.INT4_TYPES)
def test_int4_layout_is_lossless_and_computes_the_product(name: str) -> None:
    rng = np.random.default_rng(8)
    n, k = 24, 640
    for raw in (make_blocks(name, rng.standard_normal((n, k)).astype(np.float32)), random_blocks(name, n, k, rng)):
        bl = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), name, n, k)
        assert bl.layout == "int4" and bl.stored_bytes == raw.size
        assert not np.array_equal(bl.raw.numpy(), raw), "not regrouped"
        assert np.array_equal(bl.stored().numpy(), raw), "the int4 layout lost or moved bits"
        assert np.array_equal(bl.dequantize().numpy(), quants.dequantize(raw, qtype(name)))
        ids = torch.tensor([[5, 0], [23, 5]])
        assert np.array_equal(bl.rows(ids).numpy(), quants.dequantize(raw, qtype(name))[ids.numpy()])
        plain = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), name, n, k, layout="file")
        for rows in (1, 4, 9, 130):  # decode steps and a prefill chunk
            x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
            y, mag = checked_product(bl, raw, x, f"{name} rows {rows}")
            # ggml's vec_dot over the file's blocks: the same products but for x's fp16 scales
            assert (np.abs(y.numpy() - plain(x).numpy()) <= 2e-3 * mag + 1e-5).all()
    # the held bytes fuse by rows, as fuse_blocks concatenates q/k/v: a kernel over them gives each part's rows
    other = gguf_blocks.BlockLinear(torch.from_numpy(raw[:8].copy()), name, 8, k)
    both = gguf_blocks.BlockLinear(torch.cat([bl.raw, other.raw]), name, n + 8, k, layout="int4", packed=True)
    assert torch.equal(both(x), torch.cat([bl(x), other(x)], dim=-1))
    with pytest.raises(ValueError, match="no int4 kernel for q4_1 rows of 96"):
        gguf_blocks.BlockLinear(torch.zeros(8 * 60, dtype=torch.uint8), "q4_1", 8, 96, layout="int4")


@pytest.fixture(params=["avx2", "avx512-bf16"])
def kernel_isa(request):
    """Each of layerline's kernels' ISAs this CPU has (an AVX-512 CPU runs the AVX2 ones too)."""
    cpu_kernels.use_isa(request.param)
    try:
        if cpu_kernels.status() != request.param:
            pytest.skip(f"this CPU has no {request.param}")
        yield request.param
    finally:
        cpu_kernels.use_isa("avx512-bf16")  # the best this CPU has again


@own_here
@pytest.mark.parametrize("name", gguf_blocks.X16_TYPES)
def test_x16_layout_keeps_the_blocks_and_multiplies_x_at_16_bits(name: str, kernel_isa: str) -> None:
    rng = np.random.default_rng(9)
    n, k = 21, 768
    for raw in (make_blocks(name, rng.standard_normal((n, k)).astype(np.float32)), random_blocks(name, n, k, rng)):
        if name == "q8_0":
            raw[0, 2:34] = np.int8(-128).view(np.uint8)  # ggml's quantizer never writes -128; the format holds it
        bl = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), name, n, k, layout="x16")
        assert not bl.repacked and np.array_equal(bl.raw.numpy(), raw)
        assert np.array_equal(bl.stored().numpy(), raw)
        ids = torch.tensor([[5, 0], [20, 5]])
        assert np.array_equal(bl.rows(ids).numpy(), quants.dequantize(raw, qtype(name))[ids.numpy()])
        plain = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), name, n, k, layout="file")
        for rows in (1, 2, 3, 4, 9, 130):  # decode steps, every tile, a prefill chunk
            x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
            y, mag = checked_product(bl, raw, x, f"{name} rows {rows}")
            # ggml's vec_dot: the same blocks against x rounded to 8 bits
            assert (np.abs(y.numpy() - plain(x).numpy()) <= 0.02 * mag + 1e-4).all()
        assert torch.equal(bl(x)[7:8], bl(x[7:8])), "a row's result depends on the rows beside it"
    other = gguf_blocks.BlockLinear(torch.from_numpy(raw[:3].copy()), name, 3, k, layout="x16")
    both = gguf_blocks.BlockLinear(torch.cat([bl.raw, other.raw]), name, n + 3, k, layout="x16", packed=True)
    assert torch.equal(both(x), torch.cat([bl(x), other(x)], dim=-1))


@own_here
def test_layerline_gguf_own_picks_the_layouts(monkeypatch) -> None:
    """on (unset): Q4_0 / Q4_1 on the int4 kernel, the other types on x16; exact: every type on x16;
    off: ggml's; anything else: an error naming the variable."""
    rng = np.random.default_rng(10)
    raws = {name: random_blocks(name, 8, 256, rng) for name in ("q4_0", "q4_1", "q6_K", "q8_0")}

    def layouts() -> dict[str, str]:
        return {name: gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), name, 8, 256).layout
                for name, raw in raws.items()}

    assert layouts() == {"q4_0": "int4", "q4_1": "int4", "q6_K": "x16", "q8_0": "x16"}
    monkeypatch.setenv("LAYERLINE_GGUF_OWN", "exact")
    assert set(layouts().values()) == {"x16"}
    monkeypatch.setenv("LAYERLINE_GGUF_OWN", "off")
    assert set(layouts().values()) <= {"file", "x8"}
    monkeypatch.setenv("LAYERLINE_GGUF_OWN", "fast")
    with pytest.raises(ValueError, match="LAYERLINE_GGUF_OWN='fast': one of on, exact, off"):
        layouts()
    with pytest.raises(ValueError, match="no int4 kernel for q8_0"):
        gguf_blocks.BlockLinear(torch.from_numpy(raws["q8_0"].copy()), "q8_0", 8, 256, layout="int4")


@pytest.mark.parametrize("name", ["q4_0", "q6_K"])
def test_meta_shapes_for_torch_compile(name: str) -> None:
    bt = gguf_blocks.BLOCK_TYPES[name]
    bl = gguf_blocks.BlockLinear(torch.from_numpy(random_blocks(name, 16, 256, np.random.default_rng(6))), name, 16, 256)
    out = bl._op(torch.empty(2, 3, 256, dtype=torch.bfloat16, device="meta"), bl.raw.to("meta"), *bl._args, None)
    assert out.shape == (2, 3, 16) and out.dtype == torch.float32 and bt.block_bytes


@pytest.mark.parametrize("name", ["q4_K", "q6_K", "q8_0", "q4_0"])
def test_rows_are_the_dequantized_rows(name: str) -> None:
    rng = np.random.default_rng(7)
    n, k = 32, 256
    raw = make_blocks(name, rng.standard_normal((n, k)).astype(np.float32))
    want = quants.dequantize(raw, qtype(name))
    ids = torch.tensor([[3, 31, 0], [9, 9, 16]])
    for layout in ("file", "x8") if name in gguf_blocks.REPACKED else ("file",):
        bl = gguf_blocks.BlockLinear(torch.from_numpy(raw.copy()), name, n, k, layout=layout)
        got = bl.rows(ids)
        assert got.shape == (2, 3, k) and np.array_equal(got.numpy(), want[ids.numpy()])
