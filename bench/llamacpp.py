"""llama.cpp, built once for the benchmarks' baselines: `python bench/llamacpp.py [--version V]`.

The source is the vendor/llama.cpp tree inside PyPI's llama-cpp-python sdist (pip downloads
it); cmake builds llama-bench, llama-server, ggml-rpc-server and llama-quantize for this CPU
(GGML_NATIVE, GGML_RPC, Release, static, no TLS/HTTPS, no web UI download) into
.cache/llamacpp/<version>/bin. A second call finds the binaries and builds nothing. The
build runs under `nice -n 19`: the machine is shared. Never used by the tests.

`build_ggml()` (`--ggml`) builds the same tree's ggml alone as shared libraries for this CPU
(GGML_NATIVE, no OpenMP: layerline calls its kernels from torch's threads, never ggml's pool)
into .cache/llamacpp/<version>/ggml-native: libggml-base.so and libggml-cpu.so, the directory
LAYERLINE_GGML_LIB names for layerline's precision gguf (runtime/layerline/model/gguf_blocks.py).

Every tool started from here binds 127.0.0.1 only (llama-server and ggml-rpc-server both
default to it; callers pass `-H/--host 127.0.0.1` anyway).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.3.36"  # llama-cpp-python; its sdist pins the llama.cpp commit it vendors
CACHE = ROOT / ".cache" / "llamacpp"
# cmake target -> the name callers use. The RPC server's target is ggml-rpc-server in this
# tree (older trees: rpc-server); both names are looked up.
TARGETS = ("llama-bench", "llama-server", "ggml-rpc-server", "llama-quantize")
TOOLS_NEEDED = {"cmake": "cmake", "g++": "build-essential", "make": "build-essential"}


def log(msg: str) -> None:
    print(f"llamacpp: {msg}", file=sys.stderr, flush=True)


def home(version: str = VERSION) -> Path:
    return CACHE / version


def bin_dir(version: str = VERSION) -> Path:
    return home(version) / "bin"


def source_dir(version: str = VERSION) -> Path:
    """The vendored llama.cpp tree (also holds convert_hf_to_gguf.py and gguf-py)."""
    return home(version) / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def binary(name: str, version: str = VERSION) -> Path:
    """Path of a built tool; 'rpc-server' finds ggml-rpc-server and the other way round."""
    names = [name] + {"rpc-server": ["ggml-rpc-server"], "ggml-rpc-server": ["rpc-server"]}.get(name, [])
    for n in names:
        p = bin_dir(version) / n
        if os.access(p, os.X_OK):
            return p
    raise FileNotFoundError(f"{name}: not built under {bin_dir(version)}; run `python bench/llamacpp.py`")


def built(version: str = VERSION) -> bool:
    return all(os.access(bin_dir(version) / t, os.X_OK) for t in TARGETS)


def ensure_tools() -> None:
    """cmake and a C++ toolchain, from apt-get when missing (as scripts/testhosts.py does sshd)."""
    missing = sorted({pkg for tool, pkg in TOOLS_NEEDED.items() if not shutil.which(tool)})
    if not missing:
        return
    if not shutil.which("apt-get"):
        raise SystemExit(f"llamacpp: {', '.join(missing)} missing and apt-get is not here; install them")
    log(f"installing {' '.join(missing)} (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], check=True, env=env)
    still = [t for t in TOOLS_NEEDED if not shutil.which(t)]
    if still:
        raise SystemExit(f"llamacpp: apt-get ran but {', '.join(still)} still missing")


def fetch_source(version: str = VERSION) -> Path:
    """pip download the sdist (no wheel: the source is the point) and unpack it once."""
    src = source_dir(version)
    if (src / "CMakeLists.txt").exists():
        return src
    dl = home(version) / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    sdist = dl / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        log(f"pip download llama-cpp-python=={version} (sdist)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(dl)], check=True)
    log(f"unpacking {sdist.name}")
    with tarfile.open(sdist) as tf:
        tf.extractall(home(version) / "src", filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise SystemExit(f"llamacpp: {sdist.name} has no vendor/llama.cpp tree; pick another --version")
    return src


# every build here: native for this CPU, no GPU backends, none of llama.cpp's UI, tests or examples
COMMON_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
                "-DGGML_VULKAN=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]


def cmake(src: Path, bld: Path, flags: list[str], targets, jobs: int) -> None:
    """Configure `src` into `bld` with COMMON_FLAGS + `flags`, then build `targets` (nice 19: a
    benchmark's build must not starve the machine's other work)."""
    nice = ["nice", "-n", "19"]
    log(f"cmake configure {src} -> {bld} ({' '.join(flags)})")
    subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(bld), *COMMON_FLAGS, *flags], check=True)
    log(f"cmake build {' '.join(targets)} (-j {jobs}, nice 19; a few minutes on 2 cores)")
    subprocess.run([*nice, "cmake", "--build", str(bld), "--config", "Release", "-j", str(jobs),
                    "--target", *targets], check=True)


def build(version: str = VERSION, jobs: int = 2) -> Path:
    """Build the tools unless they are there; returns the bin dir."""
    out = bin_dir(version)
    if built(version):
        log(f"built already: {out}")
        return out
    ensure_tools()
    src = fetch_source(version)
    bld = home(version) / "build"
    t0 = time.time()
    cmake(src, bld, ["-DGGML_RPC=ON", "-DBUILD_SHARED_LIBS=OFF"], TARGETS, jobs)
    out.mkdir(parents=True, exist_ok=True)
    for t in TARGETS:
        found = next((p for p in (bld / "bin" / t, bld / t) if p.exists()), None)
        if found is None:
            raise SystemExit(f"llamacpp: the build made no {t} under {bld}")
        shutil.copy2(found, out / t)
    log(f"built in {time.time() - t0:.0f} s: {out}")
    return out


GGML_LIBS = ("libggml-base.so", "libggml-cpu.so")


def ggml_dir(version: str = VERSION) -> Path:
    """The native shared ggml's directory (LAYERLINE_GGML_LIB's value)."""
    return home(version) / "ggml-native"


def build_ggml(version: str = VERSION, jobs: int = 2) -> Path:
    """Build ggml's base and CPU libraries natively, shared, unless they are there; returns their
    directory. The soname links (libggml-base.so.0, ...) are copied as links beside the files."""
    out = ggml_dir(version)
    if all((out / lib).exists() for lib in GGML_LIBS):
        log(f"ggml built already: {out}")
        return out
    ensure_tools()
    src = fetch_source(version)  # the whole tree: the sdist lacks ggml's standalone ggml.pc.in
    bld = home(version) / "build-ggml-native"
    t0 = time.time()
    cmake(src, bld, ["-DBUILD_SHARED_LIBS=ON", "-DGGML_OPENMP=OFF", "-DGGML_BACKEND_DL=OFF", "-DGGML_RPC=OFF",
                     "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"],
          ("ggml-base", "ggml-cpu"), jobs)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for lib in GGML_LIBS:
        found = sorted(bld.rglob(lib + "*"))
        if not any(p.name == lib for p in found):
            raise SystemExit(f"llamacpp: the ggml build made no {lib} under {bld}")
        for p in found:  # the file and its soname links, as they are
            shutil.copy2(p, tmp / p.name, follow_symlinks=False)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"ggml built in {time.time() - t0:.0f} s: {out}")
    return out


# --- the tools as processes (rpc-servers, llama-server), stopped on every way out ------------------

def stop(p: subprocess.Popen) -> None:
    """Stop a process started here (in its own session) and whatever it started: INT first, so
    a `layerline generate` stops its workers and removes its temp dir, then TERM, then KILL."""
    for sig, grace in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, None)):
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_listening(p: subprocess.Popen, port: int, what: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        if p.poll() is not None:
            raise RuntimeError(f"{what} on port {port} exited with {p.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"{what} on port {port} did not listen within {timeout:.0f} s") from None
            time.sleep(0.2)


def _start(cmd: list[str], log_to) -> subprocess.Popen:
    log("$ " + " ".join(cmd) + " &")
    return subprocess.Popen(cmd, stdout=log_to, stderr=subprocess.STDOUT, start_new_session=True)


class RpcServers:
    """n local ggml-rpc-servers on 127.0.0.1 (`with RpcServers(3, threads=2) as r: r.endpoints()`)."""

    def __init__(self, n: int, threads: int, version: str = VERSION):
        self.n, self.threads, self.version = n, threads, version
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []

    def __enter__(self) -> "RpcServers":
        self.ports = free_ports(self.n)
        try:
            for port in self.ports:
                self.procs.append(_start([str(binary("rpc-server", self.version)), "-H", "127.0.0.1",
                                          "-p", str(port), "-t", str(self.threads)], subprocess.DEVNULL))
            for port, p in zip(self.ports, self.procs):
                _wait_listening(p, port, "rpc-server", 30)
        except BaseException:
            self.__exit__()
            raise
        return self

    def endpoints(self) -> str:
        """--rpc's value."""
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            stop(p)
        self.procs = []


class LlamaServer:
    """llama-server on 127.0.0.1 (OpenAI API at .url + "/v1"), `slots` parallel sequences with
    continuous batching, ready once /health answers 200; rpc: endpoints to spread it over
    rpc-servers (-ngl 99). Its log goes to log_path."""

    def __init__(self, model: str | os.PathLike, log_path: str | os.PathLike, slots: int = 16,
                 threads: int = 2, ctx_per_slot: int = 4096, rpc: str | None = None, version: str = VERSION):
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary("llama-server", version)), "-m", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), "-np", str(slots), "-cb", "-c", str(slots * ctx_per_slot),
                    "-t", str(threads), "--no-webui"]
        if rpc:
            self.cmd += ["-ngl", "99", "--rpc", rpc]
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        self._log = open(self.log_path, "wb")
        self.proc = _start(self.cmd, self._log)
        try:
            deadline = time.time() + 300
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {self.log_path}")
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                        if r.status == 200:
                            return self
                except OSError:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"llama-server not healthy within 300 s; see {self.log_path}")
                time.sleep(0.5)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None
        self._log.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default=VERSION, help="llama-cpp-python sdist version")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ggml", action="store_true",
                    help="also build ggml natively as shared libraries (LAYERLINE_GGML_LIB's directory)")
    a = ap.parse_args(argv)
    if a.ggml:
        print(build_ggml(a.version, a.jobs))
    out = build(a.version, a.jobs)
    for t in TARGETS:
        print(out / t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
