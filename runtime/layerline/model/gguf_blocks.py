"""Linear layers over GGUF's own quantized blocks, run as stored by layerline's or ggml's CPU kernels.

`BlockLinear(raw, ggml_type, out_features, in_features)` holds a matrix as the file stores it (rows
of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K blocks, uint8) and computes x @ W.T in float32
for a few rows of x without ever making W in floats. On ggml's kernels the arithmetic is llama.cpp's
CPU backend's for the same file: each x row is quantized to 8 bits by ggml's
`quantize_row_q8_{0,1,K}` (the type's `vec_dot_type`), and each (weight row, x row) product is
`ggml_vec_dot_<type>_q8_<...>`, integer sums a block, then scaled. A matrix is held in one of four
layouts (`LAYOUTS`), each the file's bits (`stored()` gives its blocks back):
- "int4": Q4_0 and Q4_1 (SmolLM2's file, most of a Q4_0 one) where layerline's own int4 kernel loads
  (csrc/int4.h: AVX-512 VNNI or AVX2): each row's code bytes as the blocks hold them, then its
  groups' scales as the blocks hold them (Q4_1's fp16 (d, m), Q4_0's fp16 d), the same bytes
  regrouped, run by that kernel; x is quantized to int8 a group of 32 as for q8_0, with an fp32
  scale (ggml's is fp16). It costs less CPU than ggml's vec_dot (docs/kernels.md);
- "x16": Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (the rest of a Q4_K_M, Q5_K_M or Q8_0 file) where
  layerline's CPU kernels load: the blocks as stored, run by layerline's kernel (csrc/x16.h), which
  holds x at 16 bits a group of 32 values, a K-quant's block of 256 (int16 codes of the group's
  largest magnitude) where ggml rounds it to 8: within 1/65534 of each group's largest value of the
  fp32 reference's product;
- "x8": Q4_K and Q4_0 where layerline's kernels do not load, repacked into ggml's 8-row
  interleaved layout for its x86 GEMV (`repack_x8`);
- "file": the blocks as stored, run by ggml's vec_dot.
`LAYERLINE_GGUF_OWN=exact` in the environment holds Q4_0 and Q4_1 in "x16" too (no input held at
8 bits anywhere; their decode steps cost more CPU); `LAYERLINE_GGUF_OWN=off` keeps every type on
ggml's kernels (`own_layout`).
A row's result has the same bits whatever rows it is called with.

ggml's functions come from a shared library: `LAYERLINE_GGML_LIB` (a directory holding
libggml-base.so and libggml-cpu.so, e.g. a `GGML_NATIVE=ON` build of the ggml in llama-cpp-python's
sdist), else this host's own build of the wheel's ggml where `layerline build-ggml` made one
(`ggml_native`), else the `libggml-python` wheel's prebuilt one (x86: AVX2 + FMA + F16C). They are called
by their C names, which the GGUF block formats fix. ggml's graph and thread pool are not used:
ops of layerline's CPU kernels (csrc/gguf_blocks.h, built with them) take the function pointers
and split W's rows over torch's intra-op threads, so torch.get_num_threads() holds and no second
pool spins beside torch's; a call is one torch op.

`status()` says whether the kernels are in use and why not; `BlockLinear` raises a one-line error
where they are not (the caller picks another layout then).
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import cpu_kernels, ggml_native

# The block types the kernels take: ggml's names and type ids (gguf.GGMLQuantizationType's values),
# their blocks' shapes, and the block type ggml quantizes x to for them
@dataclass(frozen=True)
class BlockType:
    name: str
    id: int
    block: int        # weights a block
    block_bytes: int  # bytes a block
    dot_with: str     # the activations' block type (ggml's vec_dot_type)


BLOCK_TYPES: dict[str, BlockType] = {t.name: t for t in (
    BlockType("q4_0", 2, 32, 18, "q8_0"),
    BlockType("q4_1", 3, 32, 20, "q8_1"),
    BlockType("q5_0", 6, 32, 22, "q8_0"),
    BlockType("q5_1", 7, 32, 24, "q8_1"),
    BlockType("q8_0", 8, 32, 34, "q8_0"),
    BlockType("q4_K", 12, 256, 144, "q8_K"),
    BlockType("q5_K", 13, 256, 176, "q8_K"),
    BlockType("q6_K", 14, 256, 210, "q8_K"),
)}
BY_ID = {t.id: t for t in BLOCK_TYPES.values()}
# bytes a block of the activations' types: q8_0 (fp16 d, 32 int8), q8_1 (+ fp16 s), q8_K (fp32 d,
# 256 int8, 16 int16 sums)
DOT_BLOCK = {"q8_0": (32, 34), "q8_1": (32, 36), "q8_K": (256, 292)}



class _State:
    tried = False
    lib_dir: Path | None = None
    cpu: ctypes.CDLL | None = None
    why_off: str | None = None


_S = _State()


def ggml_lib_dir() -> Path:
    """Where libggml-base.so and libggml-cpu.so are: LAYERLINE_GGML_LIB, else this host's native build
    (`ggml_native.built()`), else the libggml-python wheel's."""
    d = os.environ.get("LAYERLINE_GGML_LIB")
    if d:
        return Path(d)
    native = ggml_native.built()
    if native is not None:
        return native
    try:
        import libggml  # the libggml-python wheel: prebuilt ggml
    except ImportError as e:
        raise RuntimeError("no ggml library: pip install libggml-python, or set LAYERLINE_GGML_LIB to a "
                           "directory with libggml-base.so and libggml-cpu.so") from e
    root = Path(libggml.__file__).parent
    return next((d for d in (root / "lib64", root / "lib") if d.is_dir()), root / "lib64")


def _lib_name(stem: str) -> str:
    return f"{stem}.dylib" if sys.platform == "darwin" else f"{stem}.so"


def load() -> bool:
    """Load layerline's CPU kernels (the ops) and ggml's CPU library (once); whether both are in use.
    Never raises."""
    if _S.tried:
        return _S.cpu is not None
    _S.tried = True
    if os.environ.get("LAYERLINE_CPU_KERNELS", "auto").strip().lower() == "off":
        _S.why_off = "LAYERLINE_CPU_KERNELS=off"
        return False
    if not cpu_kernels.load():  # the ops are layerline_cpu's (csrc/gguf_blocks.h)
        _S.why_off = f"layerline's CPU kernels are {cpu_kernels.status()}"
        return False
    try:
        d = ggml_lib_dir()
        # RTLD_GLOBAL: libggml-cpu finds libggml-base's symbols whatever its rpath says
        ctypes.CDLL(str(d / _lib_name("libggml-base")), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(d / _lib_name("libggml-cpu")), mode=ctypes.RTLD_GLOBAL)
        cpu.ggml_cpu_init()  # fp16 tables, CPU feature state
    except (OSError, AttributeError, RuntimeError) as e:
        _S.why_off = str(e).splitlines()[0] if str(e) else type(e).__name__
        return False
    _S.lib_dir, _S.cpu = d, cpu
    return True


def status() -> str:
    """"ggml <dir> (<features>)" when in use, else "off: why"."""
    if not load():
        return f"off: {_S.why_off}"
    feats = [f for f in ("avx2", "fma", "f16c", "avx512", "avx512_vnni", "avx512_bf16")
             if getattr(_S.cpu, f"ggml_cpu_has_{f}")()]
    return f"ggml {_S.lib_dir} ({', '.join(feats)})"


def block_type(t: object) -> BlockType:
    """A BlockType from a name ("q4_K", "Q4_K"), a ggml type id, or a gguf.GGMLQuantizationType."""
    if isinstance(t, BlockType):
        return t
    name = getattr(t, "name", None)
    value = getattr(t, "value", t)
    if isinstance(value, int) and value in BY_ID:
        return BY_ID[value]
    key = str(name if name is not None else t)
    for n, bt in BLOCK_TYPES.items():
        if n.lower() == key.lower():
            return bt
    raise ValueError(f"GGUF block type {t!r} has no kernel here; known: {', '.join(BLOCK_TYPES)}")


def _fn(name: str) -> int:
    return ctypes.cast(getattr(_S.cpu, name), ctypes.c_void_p).value


# ggml's repacked GEMV/GEMM on x86 (AVX2 code in ggml-cpu/arch/x86/repack.cpp); its other types'
# repacked kernels there are the scalar fallbacks, so they stay on vec_dot
REPACKED = {"q4_0": ("ggml_gemv_q4_0_8x8_q8_0", "ggml_gemm_q4_0_8x8_q8_0", "ggml_quantize_mat_q8_0_4x8"),
            "q4_K": ("ggml_gemv_q4_K_8x8_q8_K", "ggml_gemm_q4_K_8x8_q8_K", "ggml_quantize_mat_q8_K_4x8")}
_repack_ok: dict[str, bool] = {}
# the layouts and each one's op in csrc/ (csrc/layer.h's LayerLinear runs the same op for the layout's name)
LAYOUT_OPS = {"file": "gguf_linear", "x8": "gguf_linear_x8", "int4": "gguf_linear_q4", "x16": "gguf_linear_x16"}
LAYOUTS = tuple(LAYOUT_OPS)


def layout_op(layout: str):
    """The op that multiplies x by weights held in `layout`: op(x, raw, *ints, bias) (`BlockLinear.call`)."""
    return getattr(torch.ops.layerline_cpu, LAYOUT_OPS[layout])


# blocks of 32 four-bit codes and fp16 scales, layerline's int4 kernel's groups: gguf_linear_q4's reading of
# a group's scales (csrc/int4.h Int4Kind)
INT4_KIND = {"q4_1": 1, "q4_0": 2}
INT4_TYPES = tuple(INT4_KIND)
# the block types layerline's x16 kernel runs (csrc/x16.h), and the layout each is held in by default
# for layerline's own kernels: Q4_0 / Q4_1 on the int4 kernel, which costs less (docs/kernels.md)
X16_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K")
OWN_LAYOUT = {t: "int4" if t in INT4_KIND else "x16" for t in X16_TYPES}
# LAYERLINE_GGUF_OWN: "on" (OWN_LAYOUT), "exact" (every type x16: no matrix's input held at 8
# bits), "off" (every type on ggml's kernels)
OWN_MODES = ("on", "exact", "off")


def to_int4(raw: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    """Q4_0 / Q4_1 blocks (uint8 [n, row_bytes]) in the int4 layout, the same size: each row's blocks'
    code bytes (`cpu_kernels.int4_hold`), then their scale bytes (Q4_1's d and m, Q4_0's d),
    block by block."""
    bt, nb = BLOCK_TYPES[name], k // 32
    head = bt.block_bytes - 16
    b = raw.reshape(n, nb, bt.block_bytes)
    out = np.empty((n, nb * bt.block_bytes), dtype=np.uint8)
    out[:, :16 * nb] = cpu_kernels.int4_hold(torch.from_numpy(b[:, :, head:].reshape(n, 16 * nb))).numpy()
    out[:, 16 * nb:] = b[:, :, :head].reshape(n, head * nb)
    return out


def from_int4(held: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    """The stored blocks back from `to_int4`'s layout: its exact inverse."""
    bt, nb = BLOCK_TYPES[name], k // 32
    head = bt.block_bytes - 16
    h = held.reshape(n, nb * bt.block_bytes)
    out = np.empty((n, nb, bt.block_bytes), dtype=np.uint8)
    codes = cpu_kernels.int4_unhold(torch.from_numpy(np.ascontiguousarray(h[:, :16 * nb])))
    out[:, :, head:] = codes.numpy().reshape(n, nb, 16)
    out[:, :, :head] = h[:, 16 * nb:].reshape(n, nb, head)
    return out.reshape(n, nb * bt.block_bytes)


def own_mode() -> str:
    """LAYERLINE_GGUF_OWN from the environment, read as each matrix is loaded: one of `OWN_MODES`."""
    mode = os.environ.get("LAYERLINE_GGUF_OWN", "").strip().lower() or "on"
    if mode not in OWN_MODES:
        raise ValueError(f"LAYERLINE_GGUF_OWN={mode!r}: one of {', '.join(OWN_MODES)} (unset: on)")
    return mode


def own_can(name: str, k: int, layout: str | None = None) -> bool:
    """Whether layerline's kernel for `layout` ("int4" or "x16"; default `OWN_LAYOUT`'s for `name`)
    can run rows of k `name` weights here."""
    layout = layout or OWN_LAYOUT.get(name)
    types = INT4_TYPES if layout == "int4" else X16_TYPES if layout == "x16" else ()
    return (name in types and k % (64 if layout == "int4" else BLOCK_TYPES[name].block) == 0
            and cpu_kernels.ready())


def own_layout(name: str, k: int) -> str | None:
    """The layout of layerline's own kernel that rows of k `name` weights are held in by default
    (`own_mode`): `OWN_LAYOUT`'s, "x16" under "exact"; None (ggml's kernels) under "off" or where
    it cannot run here."""
    mode = own_mode()
    layout = None if mode == "off" else "x16" if mode == "exact" else OWN_LAYOUT.get(name)
    return layout if layout is not None and own_can(name, k, layout) else None


def unrepack_x8(packed: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    """The stored blocks back from `repack_x8`'s layout (uint8 [n, row_bytes]): its exact inverse."""
    bt = BLOCK_TYPES[name]
    nb, bb = k // bt.block, bt.block_bytes
    p = packed.reshape(n // 8, nb, 8 * bb)
    out = np.empty((n // 8, 8, nb, bb), dtype=np.uint8)  # [group, row in group, block, byte]
    if name == "q4_0":
        out[..., :2] = p[..., :16].reshape(n // 8, nb, 8, 2).transpose(0, 2, 1, 3)
        chunks = (p[..., 16:].reshape(n // 8, nb, 2, 8, 8) ^ 0x88).transpose(0, 3, 1, 2, 4)
        out[..., 2:] = chunks.reshape(n // 8, 8, nb, 16)
        return out.reshape(n, nb * bb)
    out[..., 0:2] = p[..., 0:16].reshape(n // 8, nb, 8, 2).transpose(0, 2, 1, 3)
    out[..., 2:4] = p[..., 16:32].reshape(n // 8, nb, 8, 2).transpose(0, 2, 1, 3)
    out[..., 16:] = p[..., 128:].reshape(n // 8, nb, 16, 8, 8).transpose(0, 3, 1, 2, 4).reshape(n // 8, 8, nb, 128)
    b = p[..., 32:128].reshape(n // 8, nb, 8, 12).astype(np.int32)  # [.., sub-block t, 12 bytes]
    sc = np.empty((n // 8, nb, 8, 8), dtype=np.int32)  # [.., sub-block t, row j]
    mn = np.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[..., j], mn[..., j] = b[..., j] & 63, b[..., j + 4] & 63
        else:
            sc[..., j] = (b[..., j + 4] & 15) | ((b[..., j - 4] >> 6) << 4)
            mn[..., j] = (b[..., j + 4] >> 4) | ((b[..., j] >> 6) << 4)
    sc, mn = sc.transpose(0, 3, 1, 2), mn.transpose(0, 3, 1, 2)  # [group, row, block, t]
    q = np.empty(sc.shape[:3] + (12,), dtype=np.int32)
    for t in range(4):
        q[..., t] = sc[..., t] | ((sc[..., t + 4] >> 4) << 6)
        q[..., t + 4] = mn[..., t] | ((mn[..., t + 4] >> 4) << 6)
        q[..., t + 8] = (sc[..., t + 4] & 15) | ((mn[..., t + 4] & 15) << 4)
    out[..., 4:16] = q.astype(np.uint8)
    return out.reshape(n, nb * bb)


def repack_works(name: str) -> bool:
    """Whether this ggml's repacked kernels for `name` agree with its vec_dot ones on a small random
    matrix (the repacked layout is ggml's internal one, not a file format: checked once a process)."""
    if name not in _repack_ok:
        ok = False
        if (name in REPACKED and load() and all(hasattr(_S.cpu, f) for f in REPACKED[name])
                and _S.cpu.ggml_cpu_has_avx2()):
            g = torch.Generator().manual_seed(0)
            bt = BLOCK_TYPES[name]
            n, k = 16, 512
            raw = torch.randint(0, 256, (n, k // bt.block, bt.block_bytes), dtype=torch.uint8, generator=g)
            scales = (torch.rand(n, k // bt.block, 2, generator=g) * 0.02).half().view(torch.uint8)
            raw[..., :4] = scales.reshape(n, k // bt.block, 4)
            x = torch.randn(5, k, generator=g)
            plain = BlockLinear(raw, name, n, k, layout="file")
            packed = BlockLinear(raw, name, n, k, layout="x8")
            ok = bool(torch.allclose(plain(x), packed(x), rtol=1e-4, atol=1e-3)) and np.array_equal(
                unrepack_x8(packed.raw.numpy(), name, n, k), plain.raw.numpy())
        _repack_ok[name] = ok
    return _repack_ok[name]


class BlockLinear:
    """x @ W.T over W's stored GGUF blocks: raw uint8 [out_features * row_bytes] (any shape with
    that many bytes, rows in file order), computed in float32 by layerline's or ggml's kernels.

    layout: None (default) picks layerline's own kernel's (`own_layout`: "int4" for q4_0 / q4_1, "x16" for
    the other types) where it runs, else "x8" for q4_0 / q4_K
    where ggml's 8-row kernels pass `repack_works`, else "file"; a name forces it. batch_invariant
    (default): each row's result has the same bits whatever rows it is called with (False lets 4-row
    groups of "x8" go through ggml's GEMM)."""

    def __init__(self, raw: torch.Tensor, ggml_type: object, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None, layout: str | None = None, batch_invariant: bool = True,
                 packed: bool = False):
        """packed: `raw` is already in `layout` (given then), e.g. another BlockLinear's `.raw` or rows
        of several concatenated: it is taken as is."""
        bt = block_type(ggml_type)
        if in_features % bt.block:
            raise ValueError(f"BlockLinear: in_features {in_features} is not a multiple of {bt.name}'s "
                             f"block of {bt.block} weights")
        self.type, self.out_features, self.in_features = bt, out_features, in_features
        self.row_bytes = in_features // bt.block * bt.block_bytes
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"BlockLinear: layout {layout!r}; one of {', '.join(LAYOUTS)}")
        if packed and layout is None:
            raise ValueError("BlockLinear: packed=True needs the layout raw is in")
        if raw.dtype != torch.uint8 or raw.numel() != out_features * self.row_bytes:
            raise ValueError(f"BlockLinear: raw must be uint8 with {out_features * self.row_bytes} bytes "
                             f"({out_features} rows of {self.row_bytes} {bt.name} bytes), got "
                             f"{raw.dtype} with {raw.numel()}")
        if not load():
            raise RuntimeError(f"GGUF block kernels unavailable ({_S.why_off})")
        raw = raw.reshape(out_features, self.row_bytes).contiguous()
        self.bias = bias
        dot_block, dot_bytes = DOT_BLOCK[bt.dot_with]
        self.xrow_bytes = in_features // dot_block * dot_bytes
        self._vec_dot = _fn(f"ggml_vec_dot_{bt.name}_{bt.dot_with}")
        self._from_float = _fn(f"quantize_row_{bt.dot_with}")
        self._dequant = getattr(_S.cpu, f"dequantize_row_{bt.name}")
        can = bt.name in REPACKED and out_features % 8 == 0
        if layout == "x8" and not can:
            raise ValueError(f"BlockLinear: no repacked kernel for {bt.name} with {out_features} rows "
                             f"(types {', '.join(REPACKED)}, rows a multiple of 8)")
        if layout in ("int4", "x16") and not own_can(bt.name, in_features, layout):
            types = INT4_TYPES if layout == "int4" else X16_TYPES
            raise ValueError(f"BlockLinear: no {layout} kernel for {bt.name} rows of {in_features} weights here "
                             f"({', '.join(types)}; int4 a multiple of 64 weights; layerline's CPU kernels "
                             f"{cpu_kernels.status()})")
        if layout is None:  # layerline's own kernel, else ggml's x86 GEMV / GEMM where they pass their checks
            layout = own_layout(bt.name, in_features) or ("x8" if can and repack_works(bt.name) else "file")
        self.layout = layout
        if layout == "int4":
            self.raw = raw if packed else torch.from_numpy(to_int4(raw.numpy(), bt.name, out_features, in_features))
            self._args = (out_features, in_features, INT4_KIND[bt.name])
        elif layout == "x16":
            self.raw = raw
            self._args = (out_features, in_features, bt.id)
        elif layout == "x8":
            gemv, gemm, quant4 = (_fn(f) for f in REPACKED[bt.name])
            self.raw = raw if packed else torch.ops.layerline_cpu.gguf_repack_x8(raw, bt.id, out_features,
                                                                                 in_features)
            # ggml's GEMM takes 4 rows of x together, and its sums' order differs from its GEMV's: a
            # row's bits would depend on the rows beside it, so it is used only when asked for
            self._args = (out_features, in_features, self.row_bytes, self.xrow_bytes, gemv,
                          0 if batch_invariant else gemm, quant4, self._from_float)
        else:
            self.raw = raw
            self._args = (out_features, in_features, self.row_bytes, self.xrow_bytes, self._vec_dot,
                          self._from_float)
        self._op = layout_op(layout)

    @property
    def repacked(self) -> bool:
        """Held in a layout of a kernel's, not the file's (`stored()` converts back)."""
        return self.layout in ("x8", "int4")  # "x16" holds the file's bytes as they are

    @property
    def stored_bytes(self) -> int:
        """Bytes held: the file's, in every layout."""
        return self.raw.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in_features] float32/bf16/fp16 -> [..., out_features] float32."""
        return self._op(x, self.raw, *self._args, self.bias)

    def call(self, raw: torch.Tensor, bias: torch.Tensor | None = None) -> tuple:
        """What `run(x, raw, bias)` calls, for a C++ caller (csrc/layer.h's LayerLinear): (kind, raw, ints, bias)."""
        return self.layout, raw, list(self._args), bias

    def run(self, x: torch.Tensor, raw: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`__call__` over `raw` (bytes in this one's layout: a module's buffer holding them) and `bias`."""
        return self._op(x, raw, *self._args, bias)

    def quantize_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] as the call quantizes it: uint8 [rows, xrow_bytes] of `type.dot_with`
        blocks (ggml's quantize_row_q8_*), for tests that check the products exactly (layouts "file"
        and "x8"; "int4" quantizes x as csrc/int4.h does)."""
        xf = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.empty(xf.shape[0], self.xrow_bytes, dtype=torch.uint8)
        ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(self._from_float)(
            xf.data_ptr(), out.data_ptr(), xf.numel())
        return out

    def stored(self) -> torch.Tensor:
        """The blocks as the file stores them, uint8 [out_features, row_bytes] (un-repacked if need be)."""
        return torch.from_numpy(self.file_rows(self.raw.numpy(), self.out_features))

    def file_rows(self, held: np.ndarray, n: int) -> np.ndarray:
        """n rows held in this one's layout (whole 8-row groups for "x8") as the file's blocks."""
        if self.layout == "x8":
            return unrepack_x8(held, self.type.name, n, self.in_features)
        if self.layout == "int4":
            return from_int4(held, self.type.name, n, self.in_features)
        return held

    def dequantize(self) -> torch.Tensor:
        """W as float32 [out_features, in_features], by ggml's dequantize_row_<type> (tests, fallbacks)."""
        return self._dequantize(self.stored())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as float32 [*ids.shape, in_features] (an embedding lookup over a tied
        LM head's blocks), dequantized from those rows' blocks alone."""
        flat = ids.reshape(-1).long()
        if self.layout != "x8":  # each row's bits are its own row of raw
            picked = self.raw.index_select(0, flat).numpy()
            return self._dequantize(torch.from_numpy(self.file_rows(picked, len(flat)))).view(
                *ids.shape, self.in_features)
        groups, inner = torch.unique(flat // 8, return_inverse=True)
        packed = self.raw.view(self.out_features // 8, -1).index_select(0, groups).numpy()
        blocks = torch.from_numpy(unrepack_x8(packed, self.type.name, 8 * len(groups), self.in_features))
        return self._dequantize(blocks.view(len(groups), 8, -1)[inner, flat % 8]).view(*ids.shape, self.in_features)

    def _dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        blocks = blocks.contiguous()
        out = torch.empty(blocks.shape[0], self.in_features, dtype=torch.float32)
        self._dequant(ctypes.c_void_p(blocks.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                      ctypes.c_int64(out.numel()))
        return out

    def __repr__(self) -> str:
        return (f"BlockLinear({self.type.name}, out={self.out_features}, in={self.in_features}"
                f"{', ' + self.layout if self.repacked else ''})")
