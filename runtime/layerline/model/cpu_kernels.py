"""CPU kernels for decode steps, built from the C++ in csrc/ at first use and loaded as torch ops.

  layerline_cpu::linear_bf16(x, w, bias?)         x bf16 [..., K] @ w bf16 [N, K].T
  layerline_cpu::linear_int8(x, q, scale, bias?)  x [..., K] @ (q int8 [N, K] * scale f32 [N]).T
  layerline_cpu::linear_int4(x, codes, sz, bias?) x [..., K] @ int4 W in groups of 32 (any rows)
  layerline_cpu::decode_attention, rms_norm, rope one new token's attention in its KV cache; norms

A decode step reads every weight once per token; these kernels stream it at close to the memory's
speed where torch's GEMMs reach about half, for up to `MAX_ROWS` rows (prefills stay with torch).
A row's bits do not depend on what it is batched with. The ISA is chosen at run time: AVX-512 with
BF16 and VNNI, else AVX2 + FMA. Design and measurements: docs/kernels.md.

csrc/layerline_cpu.cpp (one translation unit that includes the other files) is built with the host's
C++ compiler (`CXX`, else g++) against torch's headers into a cache (`LAYERLINE_KERNEL_CACHE`, else
~/.cache/layerline/kernels), once per source contents, torch version, compiler and flags. A host without
a compiler, a CPU with neither ISA, or `LAYERLINE_CPU_KERNELS=off` decodes with torch's kernels;
`status()` says which and why. `LAYERLINE_CPU_KERNELS=avx2` caps the ISA.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.resources
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.resources.abc import Traversable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..files import user_cache_dir

MAX_ROWS = 8     # rows per call the kernels take; more (a prefill) go to torch's GEMMs
K_MULTIPLE = 32  # the kernels' step along K
ISAS = {"avx2": 1, "avx512-bf16": 2}  # the C++ side's numbers
BUILD_TIMEOUT_S = 300
MAIN = "layerline_cpu.cpp"      # the translation unit; the headers beside it are its parts
SOURCE_SUFFIXES = (".cpp", ".h")


class _State:
    tried = False
    isa: str | None = None    # the ISA in use, None when the kernels are off
    why_off: str | None = None


_S = _State()


def status() -> str:
    """The kernels' state in a word or a line: "avx512-bf16", "avx2", or "off: why"."""
    if not _S.tried:
        return "off: not loaded (only CPU stages at bf16, int8 or int4 load them)"
    return _S.isa or f"off: {_S.why_off}"


def enabled() -> bool:
    return _S.isa is not None


def cache_dir() -> Path:
    return Path(user_cache_dir("LAYERLINE_KERNEL_CACHE", "kernels"))


def compiler() -> tuple[str, list[str]]:
    """The C++ compiler and the flags that build `MAIN` into a library torch can load."""
    cxx = os.environ.get("CXX") or "g++"
    if not shutil.which(cxx):
        raise RuntimeError(f"no C++ compiler ({cxx}) on PATH; install g++ or set CXX")
    torch_dir = Path(torch.__file__).parent
    return cxx, ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-w",
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                 f"-I{torch_dir / 'include'}", f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu"]


def sources(root: Traversable | None = None) -> dict[str, str]:
    """The kernels' C++ files by name, sorted: `MAIN` and the headers it includes, read from the
    package's csrc/ (package data, so an installed wheel has them) or from `root`."""
    d = root if root is not None else importlib.resources.files(__package__).joinpath("csrc")
    files = {f.name: f.read_text(encoding="utf-8") for f in d.iterdir()
             if f.is_file() and f.name.endswith(SOURCE_SUFFIXES)}
    if MAIN not in files:
        fix = "; this layerline install lacks its package data, reinstall it" if root is None else ""
        raise RuntimeError(f"{d}: no {MAIN} (the kernels' C++){fix}")
    return dict(sorted(files.items()))


def build_key(srcs: dict[str, str], cxx: str, flags: list[str]) -> str:
    """What names a built library: every source file's name and contents, torch's version, the
    compiler and its flags, so an edit to any file, or another torch, builds anew."""
    parts = [p for name, text in srcs.items() for p in (name, text)]
    return hashlib.sha256("\0".join([*parts, torch.__version__, cxx, *flags]).encode()).hexdigest()[:16]


def compile_library(srcs: dict[str, str], lib: Path) -> None:
    """Compile `srcs` (written to a scratch dir beside `lib`, so what is built is what was hashed)
    into `lib`, replacing it at once; RuntimeError with the compiler's first error line."""
    cxx, flags = compiler()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        for name, text in srcs.items():
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        out = Path(tmp) / "layerline_cpu.so"
        r = subprocess.run([cxx, str(Path(tmp) / MAIN), "-o", str(out), *flags], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S)
        if r.returncode != 0:
            # the first error line (the last is often a caret line under the source)
            lines = r.stderr.strip().splitlines()
            first = next((ln for ln in lines if "error" in ln), lines[-1] if lines else f"rc {r.returncode}")
            raise RuntimeError(f"{cxx} failed: {first.strip()}")
        os.replace(out, lib)


def _build() -> Path:
    """The compiled library, built into the cache unless already there (one builder at a time)."""
    srcs = sources()
    cxx, flags = compiler()
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    lib = d / f"layerline_cpu-{build_key(srcs, cxx, flags)}.so"
    if lib.exists():
        return lib
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same one: wait for it
        if lib.exists():
            return lib
        print(f"layerline: building CPU kernels into {d} (once, about 10 s)", file=sys.stderr, flush=True)
        compile_library(srcs, lib)
    return lib


def load() -> bool:
    """Build (once per cache) and load the kernels; whether they are in use. Never raises: a host
    that cannot have them decodes with torch's kernels, and `status()` says why."""
    if _S.tried:
        return enabled()
    _S.tried = True
    want = os.environ.get("LAYERLINE_CPU_KERNELS", "auto").strip().lower()
    if want == "off":
        _S.why_off = "LAYERLINE_CPU_KERNELS=off"
        return False
    if want not in ("auto", *ISAS):
        _S.why_off = f"LAYERLINE_CPU_KERNELS={want}: not auto, off, {', '.join(ISAS)}"
        print(f"layerline: {_S.why_off}; decoding with torch's kernels", file=sys.stderr, flush=True)
        return False
    try:
        torch.ops.load_library(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _S.why_off = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"layerline: CPU kernels unavailable ({_S.why_off}); decoding with torch's kernels",
              file=sys.stderr, flush=True)
        return False
    return use_isa("avx512-bf16" if want == "auto" else want)


def use_isa(cap: str) -> bool:
    """Use the best ISA this CPU has up to `cap` ("off", "avx2" or "avx512-bf16"); whether any. Tests
    use it to run the AVX2 kernels on an AVX-512 CPU, or torch's kernels ("off") beside them."""
    got = int(torch.ops.layerline_cpu.use_isa(ISAS.get(cap, 0)))
    _S.isa = {v: k for k, v in ISAS.items()}.get(got)
    if _S.isa is None:
        _S.why_off = "turned off" if cap == "off" else "this CPU has neither AVX2 + FMA nor AVX-512 BF16 + VNNI"
    return enabled()


def _takes(x: torch.Tensor, k: int) -> bool:
    return _S.isa is not None and x.device.type == "cpu" and k % K_MULTIPLE == 0 and x.numel() <= MAX_ROWS * k


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `linear_bf16` for a few bf16 rows where the kernels are loaded."""
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and _takes(x, w.shape[1]):
        return torch.ops.layerline_cpu.linear_bf16(x, w, bias)
    return F.linear(x, w, bias)


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`linear_int8` of a few rows, or None where the kernels do not apply (the caller's path)."""
    if (x.dtype in (torch.bfloat16, torch.float32, torch.float16) and scale.dtype == torch.float32
            and _takes(x, q.shape[1])):
        return torch.ops.layerline_cpu.linear_int8(x, q, scale, bias)
    return None


def ready() -> bool:
    """Whether the kernels are loaded and in use here (AVX2 or AVX-512), so the ops that need them
    (`linear_int4`, `gguf_linear_q4`, `gguf_linear_x16`) can run. Loads them (once) if nothing has yet."""
    return load() and enabled()


INT4_BLOCK = 16  # groups of 32 codes a block of csrc/int4.h's code order


@functools.lru_cache(maxsize=64)
def int4_code_order(groups: int) -> torch.Tensor:
    """Where each held code byte of an int4 row comes from: held[i] = plain[order[i]] over a row's
    16 * groups code bytes, plain being each group's 16 bytes in turn (GGUF's Q4_0 / Q4_1 blocks' own
    order). csrc/int4.h reads each whole block of 16 groups as 4 slices, slice j the j-th 4 bytes of
    each of its groups, so that one 32-bit lane holds one group's products throughout; the groups
    after the last whole block stay in turn (int64 [16 * groups])."""
    whole = groups // INT4_BLOCK * INT4_BLOCK
    g = torch.arange(whole).view(-1, INT4_BLOCK, 1, 1)        # [block, group, slice, byte]
    plain = g * 16 + torch.arange(4).view(1, 1, 4, 1) * 4 + torch.arange(4).view(1, 1, 1, 4)
    return torch.cat([plain.transpose(1, 2).reshape(-1), torch.arange(whole * 16, groups * 16)])


def int4_hold(plain: torch.Tensor) -> torch.Tensor:
    """Rows of int4 code bytes (uint8 [n, 16 * groups], each group's 16 bytes in turn) in the order
    csrc/int4.h reads them (`int4_code_order`)."""
    return plain[:, int4_code_order(plain.shape[1] // 16)].contiguous()


def int4_unhold(held: torch.Tensor) -> torch.Tensor:
    """`int4_hold`'s exact inverse: each group's 16 code bytes in turn again."""
    plain = torch.empty_like(held)
    plain[:, int4_code_order(held.shape[1] // 16)] = held
    return plain


def linear_int4(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`linear_int4` of any number of rows (it beats torch's int4 kernel at 128 rows too), or None
    where it does not apply (the caller dequantizes)."""
    if _S.isa is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32, torch.float16):
        return torch.ops.layerline_cpu.linear_int4(x, codes, sz, bias)
    return None


def _applies(x: torch.Tensor) -> bool:
    """Whether the attention, RoPE and RMSNorm ops take x: kernels loaded, a CPU bf16/fp32 tensor."""
    return _S.isa is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: list[torch.Tensor],
                     vc: list[torch.Tensor], pos: list[int], lo: list[int], scale: float) -> torch.Tensor | None:
    """One new token per row (q [B, nh, 1, hd], k/v [B, nkv, 1, hd]): for each of the first n =
    len(kc) rows, its k/v written at pos[i] of its caches kc[i], vc[i] ([1, nkv, max_len, hd] or
    [nkv, max_len, hd]) and its attention over keys lo[i]..pos[i] there; [B, 1, nh * hd], zeros
    past n. None where the kernel does not apply (the caller's path)."""
    if not _applies(q) or not (k.dtype == v.dtype == kc[0].dtype == q.dtype) or q.shape[-1] % 16:
        return None
    return torch.ops.layerline_cpu.decode_attention(q, k, v, kc, vc, pos, lo, scale)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm (`llama.RMSNorm`'s numbers) in one call, or None where it does not apply (the
    caller's path): kernels off, not a CPU tensor, or not bf16/fp32 of the weight's dtype."""
    if not _applies(x) or w.dtype != x.dtype:
        return None
    return torch.ops.layerline_cpu.rms_norm(x, w, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x * cos + rotate_half(x) * sin (`llama.Attention`'s numbers, bit for bit) in one call, or
    None where it does not apply (the caller's path)."""
    if not _applies(x) or cos.dtype != x.dtype or x.stride(-1) != 1:
        return None
    return torch.ops.layerline_cpu.rope(x, cos, sin)


def argmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row of logits x [B, V]: (int64 [B] the lowest index of its largest value, uint8 [B] 1
    where every value is finite) in one pass; None where the kernels do not apply (the caller's path)."""
    if _S.isa is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not x.shape[1]:
        return None
    return torch.ops.layerline_cpu.argmax_rows(x)
