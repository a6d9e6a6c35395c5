"""ggml's CPU library built for this host's CPU, for precision gguf (`gguf_blocks`).

The `libggml-python` wheel is built for any x86-64 with AVX2 + FMA + F16C (GGML_NATIVE off); on
a CPU with more (AVX-512, VNNI) ggml's kernels built for it take other instructions. `layerline
build-ggml` (`build()`) builds the very version of the wheel that is installed from its sdist
(`pip wheel --no-binary libggml-python`, GGML_NATIVE on, OpenMP off as the wheel's: layerline
calls the kernels from torch's threads), checks the result against the wheel's arithmetic, and
keeps libggml-base and libggml-cpu in a cache: `LAYERLINE_GGML_CACHE`, else ~/.cache/layerline/ggml,
one directory per wheel version and CPU (its feature flags). `gguf_blocks` loads them from there
in place of the wheel's (`built()`); `LAYERLINE_GGML_LIB` still names another directory, and
`LAYERLINE_GGML_NATIVE=off` ignores the cache. A worker never builds (minutes, with a C++ compiler,
cmake and the package index): the build is a step of its own, once per host.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..files import user_cache_dir

PACKAGE = "libggml-python"
LIBS = ("libggml-base", "libggml-cpu")
BUILD_TIMEOUT_S = 1800
# what the build passes to the sdist's cmake (scikit-build-core reads SKBUILD_CMAKE_DEFINE)
CMAKE_DEFINES = "GGML_NATIVE=ON;GGML_OPENMP=OFF"


def _suffix() -> str:
    return ".dylib" if sys.platform == "darwin" else ".so"


def wheel_version() -> str | None:
    """The installed libggml-python's version, None without it."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return None


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """This CPU's feature flags (the first processor's in /proc/cpuinfo; none where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted(val.split())
    return []


def key(version: str, flags: list[str], machine: str | None = None) -> str:
    """A build's name: the wheel version and a hash of the machine type and CPU flags, so another
    CPU (or wheel) never loads a library built for this one."""
    h = hashlib.sha256("\0".join([machine or platform.machine(), *flags]).encode()).hexdigest()[:12]
    return f"{version}-{h}"


def cache_root() -> Path:
    return Path(user_cache_dir("LAYERLINE_GGML_CACHE", "ggml"))


def target_dir() -> Path | None:
    """Where this host's build goes (whether made or not); None without the wheel installed."""
    v = wheel_version()
    return cache_root() / key(v, cpu_flags()) if v else None


def built() -> Path | None:
    """This host's build, when made and not turned off (LAYERLINE_GGML_NATIVE=off); else None."""
    if os.environ.get("LAYERLINE_GGML_NATIVE", "auto").strip().lower() == "off":
        return None
    d = target_dir()
    if d is None or not all((d / f"{lib}{_suffix()}").exists() for lib in LIBS):
        return None
    return d


# run in a fresh interpreter with LAYERLINE_GGML_LIB at a candidate build: its kernels must load and
# give the numbers the dequantized weight gives (the repacked ones included), else it is not kept
_CHECK = r"""
import ctypes, sys, torch
from layerline.model import gguf_blocks as g
if not g.load():
    sys.exit("does not load: " + g.status())
gen = torch.Generator().manual_seed(0)
for name, bt in g.BLOCK_TYPES.items():
    n, k = 64, 512
    w = torch.randn(n, k, generator=gen)
    raw = torch.empty(n, k // bt.block * bt.block_bytes, dtype=torch.uint8)
    getattr(g._S.cpu, f"quantize_row_{name}_ref")(ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(raw.data_ptr()),
                                                 ctypes.c_int64(w.numel()))
    lin = g.BlockLinear(raw, name, n, k)
    x = torch.randn(3, k, generator=gen)
    want = x @ lin.dequantize().T
    err = float((lin(x) - want).abs().max() / want.abs().max())
    if not err < 0.05:
        sys.exit(f"{name}: off by {err:.3g} of the largest output")
print(g.status())
"""


def check(lib_dir: Path, python: str = sys.executable) -> str:
    """Load `lib_dir`'s ggml in a fresh interpreter and compare its products with the dequantized
    weights' on random blocks of each type; its status line, or RuntimeError saying what failed."""
    # LAYERLINE_GGUF_OWN=off: Q4_0, Q4_1 and Q8_0 through ggml's kernels too, not layerline's own
    env = dict(os.environ, LAYERLINE_GGML_LIB=str(lib_dir), LAYERLINE_GGUF_OWN="off")
    r = subprocess.run([python, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"the build in {lib_dir} failed its check: {lines[-1] if lines else f'rc {r.returncode}'}")
    return r.stdout.strip().splitlines()[-1]


def build(jobs: int | None = None, python: str = sys.executable, log=print) -> Path:
    """Build this host's ggml unless it is there (one builder at a time); its directory.
    RuntimeError with one line when it cannot be built or fails its check."""
    d = target_dir()
    if d is None:
        raise RuntimeError(f"{PACKAGE} is not installed: it is what is built (pip install {PACKAGE})")
    if built() == d:
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if built() == d:
            return d
        version = wheel_version()
        with tempfile.TemporaryDirectory(dir=d.parent) as tmp:
            env = dict(os.environ, SKBUILD_CMAKE_DEFINE=CMAKE_DEFINES,
                       CMAKE_BUILD_PARALLEL_LEVEL=str(jobs or os.cpu_count() or 1))
            cmd = [python, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--no-binary", PACKAGE,
                   f"{PACKAGE}=={version}", "-w", tmp]
            log(f"layerline: building ggml {version} for this CPU into {d} (once; minutes)")
            try:
                r = subprocess.run(["nice", "-n", "19", *cmd] if shutil.which("nice") else cmd,
                                   capture_output=True, text=True, env=env, timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"pip wheel {PACKAGE}=={version} took over {BUILD_TIMEOUT_S} s") from None
            if r.returncode != 0:
                lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
                first = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else f"rc {r.returncode}")
                raise RuntimeError(f"pip wheel {PACKAGE}=={version} --no-binary {PACKAGE} failed: {first.strip()} "
                                   f"(it needs a C++ compiler, cmake and the package index)")
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"pip wheel {PACKAGE}=={version} made {len(wheels)} wheels, not one")
            staged = Path(tmp) / "lib"
            staged.mkdir()
            with zipfile.ZipFile(wheels[0]) as z:
                for name in z.namelist():
                    base = name.rsplit("/", 1)[-1]
                    if any(base == f"{lib}{_suffix()}" or base.startswith(f"{lib}{_suffix()}.") for lib in LIBS):
                        (staged / base).write_bytes(z.read(name))
            missing = [lib for lib in LIBS if not (staged / f"{lib}{_suffix()}").exists()]
            if missing:
                raise RuntimeError(f"the {PACKAGE} wheel built here has no {', '.join(missing)}")
            log(f"layerline: ggml built; {check(staged, python)}")
            shutil.rmtree(d, ignore_errors=True)
            os.replace(staged, d)
    return d
