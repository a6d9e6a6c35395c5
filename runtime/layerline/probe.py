"""NodeCaps: what this machine can do, measured rather than guessed.

``probe()`` is the host's self-report that the planner costs against (DESIGN.md,
"Contracts"). Everything it returns is JSON-serialisable; every speed in it is either
measured here or ``None``, never a made-up 0 (the reference design costed an unmeasured
disk as 1 MB/s).

It does no network traffic: the address comes from the interface table, and the only
files it touches are read (the checkpoint) or the cgroup/proc files that say how much of
the machine this process may use.
"""
from __future__ import annotations

import errno
import ipaddress
import math
import mmap
import os
import platform
import socket
import sys
import tempfile
import time

import psutil

from .endpoints import LOOPBACK
from .errors import LayerlineError

__all__ = ["probe", "machine_id", "NODECAPS_KEYS", "DEVICE_KEYS", "with_step_factor", "carry_step_factors"]

NODECAPS_KEYS = (
    "addr", "hostname", "machine_id", "os", "cores", "ram_total_bytes", "ram_available_bytes", "ram_capped",
    "disk_free_bytes", "disk_read_bytes_per_s", "disk_read_cached", "devices", "probe_seconds",
)
DEVICE_KEYS = ("name", "kind", "memory_bytes", "memory_free_bytes", "flops_per_s", "mem_bw_bytes_per_s")

# Reads faster than this did not come from a disk: the page cache answered.
CACHED_READ_BYTES_PER_S = 20e9
DISK_READ_MAX_BYTES = 256 * 1024 * 1024
DISK_READ_CHUNK = 8 * 1024 * 1024
SCRATCH_BYTES = 64 * 1024 * 1024  # what a host that holds no checkpoint yet writes to time its disk
_MiB = 1024 * 1024


def probe(checkpoint: str | None = None, device: str = "cpu", addr: str | None = None,
          budget_s: float = 0.5, measure_disk: bool = True) -> dict:
    """Measure this host and return its NodeCaps dict.

    checkpoint: checkpoint directory (or one file of it); sets the filesystem that
        ``disk_free_bytes`` describes and the file whose read speed is measured.
    device: the host's ``layerline_device`` (cpu | cuda | cuda:N | cuda+cpu); a CUDA
        device that is not there raises LayerlineError. Every visible CUDA device is
        reported whatever ``device`` says.
    addr: the address other nodes reach this one at; default the primary non-loopback
        IPv4 (from the interface table, no traffic), else 127.0.0.1.
    budget_s: seconds of measuring per device (half matmul, half memory copy) and for
        the disk read.
    measure_disk: False leaves ``disk_read_bytes_per_s`` null.
    """
    started = time.perf_counter()
    budget_s = float(budget_s)
    if not math.isfinite(budget_s) or budget_s <= 0:
        raise LayerlineError(f"budget_s is {budget_s!r}; give a positive number of seconds, e.g. 0.5")
    want_cuda = _parse_device(device)
    torch = _import_torch()
    cuda_count = _cuda_device_count(torch)
    if want_cuda is not None:
        _check_cuda_request(torch, device, want_cuda, cuda_count)

    ram_total, ram_available, ram_capped = _ram()
    devices = [_cpu_device(torch, ram_total, ram_available, budget_s)]
    for index in range(cuda_count):
        devices.append(_cuda_device(torch, index, budget_s))

    disk_path = _existing_ancestor(checkpoint) if checkpoint else os.getcwd()
    disk_rate, disk_cached = None, False
    if measure_disk and checkpoint:
        sample = _checkpoint_sample_file(checkpoint)
        if sample is not None:
            disk_rate, disk_cached = _measure_disk_read(sample, budget_s)
        elif _will_hold(checkpoint, disk_path):
            # nothing there yet (a host the checkpoint is staged to): measure the disk it will be on
            disk_rate, disk_cached = _scratch_disk_read(disk_path, budget_s)

    return {
        "addr": addr or primary_ipv4(),
        "hostname": socket.gethostname(),
        "machine_id": machine_id(),
        "os": platform.system(),
        "cores": usable_cores(),
        "ram_total_bytes": ram_total,
        "ram_available_bytes": ram_available,
        "ram_capped": ram_capped,
        "disk_free_bytes": _disk_free(disk_path),
        "disk_read_bytes_per_s": disk_rate,
        "disk_read_cached": disk_cached,
        "devices": devices,
        "probe_seconds": round(time.perf_counter() - started, 4),
    }


def with_step_factor(caps: dict, device: str, mode: str, factor: float) -> dict:
    """caps with `factor` kept for `mode` ("precision/compile", cost.step_mode) on `device`'s
    `step_factors`: what a worker's measured step said about the cost model there. A copy;
    caps without that device come back as they were."""
    out = dict(caps)
    out["devices"] = [dict(d, step_factors={**(d.get("step_factors") or {}), mode: factor})
                      if isinstance(d, dict) and d.get("name") == device else d
                      for d in caps.get("devices") or []]
    return out


def carry_step_factors(old: dict | None, new: dict) -> dict:
    """New measurements keep the step factors the old caps held per device: they were measured
    by workers, not by the probe, and stay this host's best word until a worker measures again."""
    if not isinstance(old, dict):
        return new
    kept = {d.get("name"): d["step_factors"] for d in old.get("devices") or []
            if isinstance(d, dict) and isinstance(d.get("step_factors"), dict)}
    for dev in new.get("devices") or []:
        if dev.get("name") in kept:
            dev["step_factors"] = {**kept[dev["name"]], **(dev.get("step_factors") or {})}
    return new


def machine_id() -> str | None:
    """The running kernel's boot id: the same for every host (namespace, container) that
    shares this machine's cores, whatever its hostname; None where there is none to read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


# --- devices -------------------------------------------------------------------------

def _parse_device(device: str) -> int | None:
    """None for cpu; otherwise the CUDA index the host's device needs (-1: any one)."""
    text = str(device or "").strip().lower()
    if text == "cpu":
        return None
    if text in ("cuda", "cuda+cpu"):
        return -1
    if text.startswith("cuda:"):
        rest = text[len("cuda:"):]
        if rest.endswith("+cpu"):
            rest = rest[: -len("+cpu")]
        if rest.isdigit():
            return int(rest)
    raise LayerlineError(
        f"layerline_device is {device!r}; use cpu, cuda, cuda:N (N = GPU index) or cuda+cpu")


def _import_torch():
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency
        raise LayerlineError(
            f"{sys.executable} cannot import torch ({exc}); install layerline's runtime there "
            "(the layerline_runtime role) or point ansible_python_interpreter at one that has it"
        ) from None
    return torch


def _cuda_device_count(torch) -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver reads as "no GPU", not as a failed probe
        return 0


def _check_cuda_request(torch, device: str, index: int, count: int) -> None:
    if count == 0:
        build = "a CPU-only torch build" if not getattr(torch.version, "cuda", None) else "no usable driver/GPU"
        raise LayerlineError(
            f"layerline_device is {device!r} but this host has no CUDA device (torch {torch.__version__}, "
            f"{build}); set layerline_device: cpu for this host, or install a CUDA build of torch and the "
            "NVIDIA driver")
    if index >= count:
        raise LayerlineError(
            f"layerline_device is {device!r} but this host has only {count} CUDA device(s) "
            f"(cuda:0..cuda:{count - 1}); set layerline_device to one of those or to cpu")


def _cpu_device(torch, ram_total: int, ram_available: int, budget_s: float) -> dict:
    # Source + destination stay well inside what is free: 64 MiB each normally.
    copy_bytes = 64 * _MiB if ram_available >= 2 * 1024 * _MiB else 16 * _MiB
    with torch.inference_mode():
        flops = _matmul_flops(torch, torch.device("cpu"), budget_s / 4, sizes=(512, 1024))
        copy = _copy_bandwidth(torch, torch.device("cpu"), budget_s / 4, copy_bytes)
        decode, layer_s = _decode_rates(torch, budget_s / 2)
    return {
        "name": "cpu",
        "kind": "cpu",
        "memory_bytes": ram_total,
        "memory_free_bytes": ram_available,
        "flops_per_s": flops,
        # what the planner divides a stage's weight bytes by: decode's weight-streaming rate
        "mem_bw_bytes_per_s": decode or copy,
        "layer_overhead_s": layer_s,  # and what it adds per layer (None: not measured)
        "copy_bw_bytes_per_s": copy,
    }


def _cuda_device(torch, index: int, budget_s: float) -> dict:
    dev = torch.device("cuda", index)
    total, free = _cuda_memory(torch, index)
    copy_bytes = 256 * _MiB
    if free is not None and free < 4 * copy_bytes:
        copy_bytes = max(_MiB, free // 8)
    with torch.inference_mode():
        flops = _matmul_flops(torch, dev, budget_s / 2, sizes=(1024, 4096))
        bandwidth = _copy_bandwidth(torch, dev, budget_s / 2, copy_bytes)
        torch.cuda.empty_cache()
    return {
        "name": f"cuda:{index}",
        "kind": "cuda",
        "memory_bytes": total,
        "memory_free_bytes": free,
        "flops_per_s": flops,
        "mem_bw_bytes_per_s": bandwidth,
    }


def _cuda_memory(torch, index: int) -> tuple[int | None, int | None]:
    try:
        free, total = torch.cuda.mem_get_info(index)
        return int(total), int(free)
    except Exception:
        pass
    try:  # NVML sees the same GPU by UUID, whatever CUDA_VISIBLE_DEVICES renumbered.
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return int(info.total), int(info.free)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    try:
        return int(torch.cuda.get_device_properties(index).total_memory), None
    except Exception:
        return None, None


def _sync_for(torch, dev):
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def _best_time(fn, sync, budget_s: float, min_reps: int = 3, max_reps: int = 50) -> float:
    """Best per-call seconds of fn: a warm-up, then reps of k calls until the budget is spent."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    single = max(time.perf_counter() - t0, 1e-7)
    # Aim each rep at ~1/6 of the budget so there are several to take the best of.
    k = max(1, min(1000, int((budget_s / 6) / single)))
    deadline = time.perf_counter() + budget_s
    best = single
    reps = 0
    while reps < min_reps or (time.perf_counter() < deadline and reps < max_reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / k)
        reps += 1
    return best


def _matmul_flops(torch, dev, budget_s: float, sizes: tuple[int, int]) -> float:
    """fp32 matmul FLOP/s: the big size when a single call fits the budget, else the small."""
    small, big = sizes
    sync = _sync_for(torch, dev)

    def timed(n: int, budget: float) -> float:
        a = torch.randn(n, n, device=dev, dtype=torch.float32)
        b = torch.randn(n, n, device=dev, dtype=torch.float32)
        c = torch.empty(n, n, device=dev, dtype=torch.float32)
        seconds = _best_time(lambda: torch.mm(a, b, out=c), sync, budget)
        return 2.0 * n ** 3 / seconds

    # Warm-up at the small size (thread pool / cuBLAS start) tells how long the big one takes.
    a = torch.randn(small, small, device=dev, dtype=torch.float32)
    torch.mm(a, a)
    sync()
    t0 = time.perf_counter()
    torch.mm(a, a)
    sync()
    small_s = max(time.perf_counter() - t0, 1e-7)
    n = big if small_s * (big / small) ** 3 * 4 <= budget_s else small
    return float(timed(n, budget_s * 0.9))


def _copy_bandwidth(torch, dev, budget_s: float, nbytes: int) -> float:
    """Device-memory bandwidth from tensor copies: bytes read + bytes written per second."""
    numel = max(1, nbytes // 4)
    src = torch.empty(numel, device=dev, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    sync = _sync_for(torch, dev)
    seconds = _best_time(lambda: dst.copy_(src), sync, budget_s, min_reps=3, max_reps=20)
    moved = 2 * numel * 4
    return float(moved / seconds)


def _llama_stage(torch, hidden: int, heads: int, kv_heads: int, inter: int, layers: int):
    """A bf16 Llama stage of random weights, fused as a loaded stage runs (q/k/v and gate/up as
    one matrix each)."""
    from .model.llama import ModelArgs, Stage
    args = ModelArgs.from_config({"model_type": "llama", "vocab_size": 256, "hidden_size": hidden,
                                  "intermediate_size": inter, "num_hidden_layers": layers,
                                  "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                                  "rms_norm_eps": 1e-5, "max_position_embeddings": 4096})
    stage = Stage(args, 0, layers, False, False, torch.bfloat16)
    for p in stage.parameters():
        p.data = torch.randn(p.shape, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
    stage.fuse()
    return stage


def _decode_step_s(torch, stage, hidden: int, budget_s: float) -> float:
    """Best seconds of one one-token decode step after a 32-token prefix (each step decodes
    token 33 again: the cache rewinds to its position)."""
    cache = stage.new_cache(1, 64)
    stage(torch.randn(1, 32, hidden, dtype=torch.bfloat16), 0, cache)
    x = torch.randn(1, 1, hidden, dtype=torch.bfloat16)
    return _best_time(lambda: stage(x, 32, cache), lambda: None, budget_s, min_reps=3, max_reps=20)


def _decode_rates(torch, budget_s: float) -> tuple[float | None, float | None]:
    """(weight bytes per second, seconds per layer) of one-token decode through layerline's own
    layers: a step costs its weight bytes at the first plus the second for each layer.

    A raw copy overstates what decode gets, and a layer's fixed cost (its dozen ops, norms,
    attention) does not shrink with its weights: it is most of a small layer's step and none of
    the LM head's one matrix, so one rate would price a stage's layers and its head alike wrong.
    Two bf16 layers of hidden 128 give the fixed cost (their weights stream in microseconds);
    two Llama-shaped layers of hidden 1024 less that cost give the rate. (None, None) if the
    model code cannot run here; (rate, None) if the two timings do not separate.
    """
    try:
        small = _decode_step_s(torch, _llama_stage(torch, 128, 2, 1, 256, 2), 128, budget_s / 3) / 2
        stage = _llama_stage(torch, 1024, 16, 4, 2816, 2)
        weights = sum(p.numel() * p.element_size() for p in stage.parameters())
        big = _decode_step_s(torch, stage, 1024, budget_s * 2 / 3)
    except Exception:  # noqa: BLE001 - a probe reports what it can measure
        return None, None
    streaming = big - 2 * small
    if streaming < big / 4:  # the fixed cost swamps the bytes: no rate to tell apart from it
        return float(weights / big), None
    return float(weights / streaming), float(small)


# --- memory, cores, address ------------------------------------------------------------

def _cgroup_dirs(controller: str) -> list[str]:
    """Candidate cgroup dirs of this process for a v1 controller ('' = the v2 unified tree)."""
    dirs = []
    try:
        with open("/proc/self/cgroup", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return dirs
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controller == "" and controllers == "":
            base = "/sys/fs/cgroup"
        elif controller and controller in controllers.split(","):
            base = f"/sys/fs/cgroup/{controller}"
        else:
            continue
        dirs.append(os.path.join(base, path.lstrip("/")))
        dirs.append(base)  # inside a cgroup namespace the path is relative to the mount
    return dirs


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().split()[0]
        return int(text)
    except (OSError, ValueError, IndexError):
        return None


def _cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup, or Nones when unlimited/unknown. The usage
    leaves out inactive file pages (page cache the kernel reclaims before it kills), so a host that
    has just been sent its stage is not read as full."""
    for d in _cgroup_dirs(""):
        limit = _read_int(os.path.join(d, "memory.max"))  # "max" reads as None
        if limit is not None:
            return limit, _working_set(d, "memory.current", "inactive_file")
    for d in _cgroup_dirs("memory"):
        limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
        if limit is not None and limit < (1 << 60):
            return limit, _working_set(d, "memory.usage_in_bytes", "total_inactive_file")
    return None, None


def _working_set(d: str, usage_file: str, inactive_key: str) -> int | None:
    usage = _read_int(os.path.join(d, usage_file))
    if usage is None:
        return None
    try:
        with open(os.path.join(d, "memory.stat"), encoding="ascii") as fh:
            stat = dict(line.split() for line in fh if len(line.split()) == 2)
        return max(0, usage - int(stat.get(inactive_key, 0)))
    except (OSError, ValueError):
        return usage


def _own_anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon), 0 where unreadable."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _ram() -> tuple[int, int, bool]:
    """(total, available, capped): capped when a memory cgroup holds this host below the machine's
    RAM, so the figures are its own, not a share of the machine's."""
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    limit, usage = _cgroup_memory()
    capped = limit is not None and limit < total
    if capped:
        total = limit
        if usage is not None:  # less the probe's own memory: it is gone when the worker starts
            available = min(available, max(0, limit - max(0, usage - _own_anon_bytes())))
    return total, min(available, total), capped


def usable_cores() -> int:
    """CPUs this process may run on: affinity mask, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = None
    for d in _cgroup_dirs(""):
        try:
            with open(os.path.join(d, "cpu.max"), encoding="ascii") as fh:
                q, period = fh.read().split()[:2]
            if q != "max":
                quota = int(q) / int(period)
            break
        except (OSError, ValueError):
            continue
    if quota is None:
        for d in _cgroup_dirs("cpu"):
            q = _read_int(os.path.join(d, "cpu.cfs_quota_us"))
            period = _read_int(os.path.join(d, "cpu.cfs_period_us"))
            if q is not None and period:
                if q > 0:
                    quota = q / period
                break
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _default_route_interfaces() -> list[str]:
    names = []
    try:
        with open("/proc/net/route", encoding="ascii") as fh:
            for line in fh.read().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
                    names.append(fields[0])
    except OSError:
        pass
    return names


_VIRTUAL_PREFIXES = ("docker", "veth", "br-", "virbr", "cni", "flannel", "cali", "vxlan", "tun", "tap", "lxc")


def primary_ipv4() -> str:
    """The host's primary non-loopback IPv4, from the interface table only; else 127.0.0.1."""
    try:
        addrs = psutil.net_if_addrs()
        stats = psutil.net_if_stats()
    except Exception:
        return LOOPBACK
    default_ifaces = _default_route_interfaces()
    candidates = []
    for name, entries in addrs.items():
        st = stats.get(name)
        if st is not None and not st.isup:
            continue
        for entry in entries:
            if entry.family != socket.AF_INET:
                continue
            try:
                ip = ipaddress.IPv4Address(entry.address)
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
                continue
            rank = (
                0 if name in default_ifaces else 1,
                1 if name.startswith(_VIRTUAL_PREFIXES) else 0,
                name,
            )
            candidates.append((rank, str(ip)))
    if not candidates:
        return LOOPBACK
    return min(candidates)[1]


# --- disk --------------------------------------------------------------------------------

def _existing_ancestor(path: str) -> str:
    """The path itself or its nearest existing parent: the filesystem it lives (or will) on."""
    current = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _disk_free(path: str) -> int | None:
    try:
        return int(psutil.disk_usage(path).free)
    except (OSError, ValueError):
        return None


def _checkpoint_sample_file(checkpoint: str) -> str | None:
    """The checkpoint's biggest weights file (a GGUF: the file itself), None when there is none."""
    from .checkpoint import CheckpointError, open_checkpoint
    try:
        files = open_checkpoint(os.path.abspath(os.path.expanduser(checkpoint))).source_files()
    except CheckpointError:
        return None
    best, best_size = None, 0
    for candidate in files:
        try:
            size = os.path.getsize(candidate)
        except OSError:
            continue
        if size > best_size and os.path.isfile(candidate):
            best, best_size = str(candidate), size
    return best


def _will_hold(checkpoint: str, existing: str) -> bool:
    """Whether `existing` is the checkpoint dir itself or its parent (not some far ancestor
    such as /, where a probe has no business writing), and has room for a scratch file."""
    path = os.path.abspath(os.path.expanduser(checkpoint))
    if existing not in (path, os.path.dirname(path)) or not os.path.isdir(existing):
        return False
    free = _disk_free(existing)
    return os.access(existing, os.W_OK) and free is not None and free > 4 * SCRATCH_BYTES


def _scratch_disk_read(directory: str, budget_s: float) -> tuple[float | None, bool]:
    """Read speed of the disk under `directory`: a scratch file written, synced, read back
    (page cache dropped, O_DIRECT where allowed) and removed."""
    try:
        fd, path = tempfile.mkstemp(prefix=".layerline-probe-", dir=directory)
    except OSError:
        return None, False
    try:
        block = os.urandom(_MiB)  # incompressible: a compressing filesystem must not flatter the disk
        with os.fdopen(fd, "wb") as fh:
            for _ in range(SCRATCH_BYTES // _MiB):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        return _measure_disk_read(path, budget_s)
    except OSError:
        return None, False
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def _read_loop(fd: int, buf: mmap.mmap, limit: int, deadline: float) -> int:
    total = 0
    while total < limit:
        n = os.readv(fd, [buf])
        if n <= 0:
            break
        total += n
        if n < len(buf) or time.perf_counter() >= deadline:
            break
    return total


def _measure_disk_read(path: str, budget_s: float) -> tuple[float | None, bool]:
    """(bytes/s, looked_cached) reading up to 256 MiB of path, or (None, False) if unreadable.

    The page cache is asked to drop the file first (POSIX_FADV_DONTNEED) and the read uses
    O_DIRECT with a page-aligned buffer where the filesystem allows it; a rate no disk
    reaches is still reported, marked as cached.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None, False
    buf = mmap.mmap(-1, DISK_READ_CHUNK)  # anonymous mmap: page aligned, as O_DIRECT wants
    try:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        read_limit = DISK_READ_MAX_BYTES
        # Pages that survive the fadvise (dirty, mapped by a running worker, or a tmpfs
        # whose pages are its storage) make the read a memory copy, O_DIRECT or not.
        resident = _resident_fraction(fd, read_limit)
        deadline_budget = max(budget_s, 0.05)
        direct = getattr(os, "O_DIRECT", 0)
        if direct:
            try:
                dfd = os.open(path, os.O_RDONLY | direct)
            except OSError:
                dfd = -1
            if dfd >= 0:
                try:
                    t0 = time.perf_counter()
                    total = _read_loop(dfd, buf, read_limit, t0 + deadline_budget)
                    elapsed = time.perf_counter() - t0
                    return _rate(total, elapsed, resident)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                        return None, False
                    # The filesystem refuses O_DIRECT reads: use the plain fd below.
                finally:
                    os.close(dfd)
        try:
            t0 = time.perf_counter()
            total = _read_loop(fd, buf, read_limit, t0 + deadline_budget)
            elapsed = time.perf_counter() - t0
        except OSError:
            return None, False
        return _rate(total, elapsed, resident)
    finally:
        buf.close()
        os.close(fd)


def _resident_fraction(fd: int, limit: int) -> float:
    """Share of the file's first `limit` bytes held in the page cache (0.0 when unknown)."""
    try:
        import ctypes
        import ctypes.util

        size = min(os.fstat(fd).st_size, limit)
        if size <= 0:
            return 0.0
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        # A private mapping is writable to ctypes yet never touches (or dirties) the pages.
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            anchor = ctypes.c_char.from_buffer(mm)
            try:
                rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
            finally:
                del anchor
        finally:
            mm.close()
        if rc != 0:
            return 0.0
        return sum(1 for v in vec if v & 1) / pages
    except Exception:
        return 0.0


def _rate(total: int, elapsed: float, resident: float) -> tuple[float | None, bool]:
    if total <= 0:
        return None, False
    rate = total / max(elapsed, 1e-9)
    return float(rate), rate > CACHED_READ_BYTES_PER_S or resident > 0.5


# --- the network between hosts ------------------------------------------------------------

def measure_rtt(peers: list[str], tries: int = 3, timeout_s: float = 0.5) -> dict[str, float | None]:
    """Round trip to each peer ("ADDR:PORT"): the best TCP handshake of a few. None when unreachable.

    Only the hosts of the inventory are asked (the play passes them), never anything else.
    """
    out: dict[str, float | None] = {}
    for peer in peers:
        host, _, port = peer.rpartition(":")
        best = None
        for _ in range(tries):
            t0 = time.perf_counter()
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                    pass
            except (OSError, ValueError):
                continue
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        out[peer] = best
    return out
