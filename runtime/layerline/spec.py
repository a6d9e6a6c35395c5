"""WorkerSpec: how one planned stage is launched, built from the plan in one place.

The worker's argv, its state dir, ready file, keys dir and how long to wait for it to be ready
are decided here and nowhere else: the Ansible filter (`layerline_worker_spec`), the local
pipelines of `layerline generate --local-stages` and the Python API all build a WorkerSpec.
The stage checkpoint argv (weight staging) is decided here too, from the same stage.
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
from dataclasses import asdict, dataclass

from .errors import LayerlineError
from .planner import Plan, StagePlan

READY_TIMEOUT_S = 300.0           # load the checkpoint, bind, answer: minutes at most
COMPILE_READY_TIMEOUT_S = 1800.0  # a compiling worker is ready only after its warm-up compile


def truthy(v) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


def _is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr.strip("[]"))
        return True
    except ValueError:
        return False


def host_addr(hvars: dict, host: str) -> str:
    """The address other hosts reach this one at."""
    if hvars.get("layerline_addr"):
        return str(hvars["layerline_addr"])
    if hvars.get("ansible_connection") == "local":
        return "127.0.0.1"
    return str(hvars.get("ansible_host") or host)


# A drain or rejoin starts the new route's workers beside the old ones, in the other slot: their
# ports are SLOT_PORT_STEP above the host's layerline_port and their state dir is STATE.1.
SLOTS = (0, 1)
SLOT_PORT_STEP = 50


def slot_of(hvars: dict, host: str = "") -> int:
    """Which of the two side-by-side worker slots a host's workers use now (layerline_slot)."""
    v = hvars.get("layerline_slot", 0)
    try:
        v = int(v)
        assert v in SLOTS
    except (TypeError, ValueError, AssertionError):
        raise LayerlineError(f"{host}: layerline_slot {v!r} must be 0 or 1 (drain.yml sets it; "
                             "see layerline_home/route.json)") from None
    return v


def state_dir(hvars: dict, host: str, slot: int | None = None) -> str:
    base = str(hvars.get("layerline_state_dir") or f"/tmp/layerline-{host}")
    slot = slot_of(hvars, host) if slot is None else slot
    return base if slot == 0 else f"{base}.{slot}"


def stage_dir(hvars: dict, host: str) -> str:
    """Where a host keeps its staged checkpoint when the model's path is not shared."""
    return str(hvars.get("layerline_stage_dir") or os.path.join(state_dir(hvars, host, 0), "checkpoint"))


def ready_timeout(stage: StagePlan, hvars: dict) -> float:
    """Seconds to wait for the worker's ready file: layerline_worker_ready_timeout, at least the
    compile wait when the plan compiles this stage."""
    try:
        t = float(hvars.get("layerline_worker_ready_timeout") or READY_TIMEOUT_S)
        assert t > 0
    except (TypeError, ValueError, AssertionError):
        raise LayerlineError(f"{stage.host}: layerline_worker_ready_timeout "
                             f"{hvars.get('layerline_worker_ready_timeout')!r} must be a positive number of seconds") from None
    return max(t, COMPILE_READY_TIMEOUT_S) if stage.compile != "off" else t


@dataclass(frozen=True)
class WorkerSpec:
    host: str
    argv: tuple[str, ...]
    state_dir: str
    ready_file: str
    keys_dir: str
    ready_timeout: float
    endpoint: str

    def to_dict(self) -> dict:
        return asdict(self) | {"argv": list(self.argv)}


def worker_spec(plan: Plan | dict, host: str, hvars: dict, python: str = "python3") -> WorkerSpec:
    """This host's worker launch, from its stage of the plan (looked up by host name)."""
    plan = Plan.from_dict(plan)
    s = plan.stage(host)
    if s is None:
        raise LayerlineError(f"{host}: not in the plan (role {hvars.get('layerline_role', 'active')}); "
                             "only planned hosts start workers")
    ckpt = hvars.get("layerline_checkpoint")
    if not ckpt:
        raise LayerlineError(f"{host}: layerline_checkpoint is not set; point it at a Hugging Face model dir "
                             "or a .gguf file")
    if not s.endpoint:
        raise LayerlineError(f"{host}: the plan has no endpoint for this stage; re-plan")
    state = state_dir(hvars, host)
    if not truthy(hvars.get("layerline_checkpoint_shared", True)):
        ckpt = stage_dir(hvars, host)  # only this stage's tensors, staged there by playbooks/stage.yml
    port = int(s.endpoint.rsplit(":", 1)[1])
    # zmq binds IP addresses, not names: a host known by name listens on every interface
    # (off loopback, so CURVE is on)
    bind_host = str(hvars.get("layerline_bind_addr") or host_addr(hvars, host))
    if not _is_ip(bind_host):
        bind_host = "*"
    ready = os.path.join(state, "ready.json")
    home = state_dir(hvars, host, 0)  # keys, staged tensors and compile cache serve both slots
    keys = str(hvars.get("layerline_keys_dir") or os.path.join(home, "keys"))
    argv = [python, "-m", "layerline.worker",
            "--checkpoint", str(ckpt),
            "--layers", f"{s.layers[0]}:{s.layers[1]}",
            "--device", s.device,
            "--precision", s.precision,
            "--kv-context", str(plan.kv.context),
            "--kv-dtype", str(s.kv_dtype or plan.kv.dtype),
            "--rng-seed", str(hvars.get("layerline_rng_seed", 0)),
            "--bind", f"tcp://{bind_host}:{port}",
            "--name", host,
            "--ready-file", ready,
            "--keys", keys]
    if s.kv_bytes:  # what the plan reserved for this stage's KV caches
        argv += ["--kv-bytes", str(int(s.kv_bytes))]
    if s.experts_paged:
        argv += ["--expert-cache-bytes", str(int(s.expert_cache_bytes))]
    nxt = plan.next_of(s)
    if nxt is not None:
        # whose public key the next hop must hold under CURVE: its host name in KEYS/peers/
        argv += ["--next", str(nxt.endpoint), "--next-key", nxt.host]
    curve = hvars.get("layerline_curve")
    if curve not in (None, "", "auto"):
        if curve != "on":
            raise LayerlineError(f"{host}: layerline_curve {curve!r} must be auto (CURVE off loopback) or on")
        argv += ["--curve", "on"]
    if s.layers[0] == 0:
        argv.append("--first")
    if s.layers[1] == plan.num_layers:
        argv.append("--last")
    if s.threads:
        argv += ["--threads", str(int(s.threads))]
    if s.spin is not None:
        argv += ["--spin", str(int(s.spin))]
    if s.shares_cores_with:
        argv += shared_cores_argv(plan)
    nice = str(hvars.get("layerline_nice") or 0)  # str: 2.5 and True are not nice values
    if not (nice.isdigit() and int(nice) <= 19):
        raise LayerlineError(f"{host}: layerline_nice {hvars.get('layerline_nice')!r} must be an integer "
                             "0-19 (19 yields the most; a worker may only lower its priority)")
    if int(nice):
        argv += ["--nice", str(int(nice))]
    if s.compile != "off":
        cache = str(hvars.get("layerline_compile_cache") or os.path.join(home, "inductor"))
        argv += ["--compile", s.compile, "--compile-cache", cache]
    return WorkerSpec(host=host, argv=tuple(argv), state_dir=state, ready_file=ready, keys_dir=keys,
                      ready_timeout=ready_timeout(s, hvars), endpoint=str(s.endpoint))


def shared_cores_argv(plan: Plan) -> list[str]:
    """The worker flags of a stage that shares its machine's cores with other stages of `plan`."""
    # no idle-priority spinners (layerline.awake) where another stage needs these cores: each
    # worker is its own scheduling group (its own session), and across groups idle priority is
    # not idle: the spinners would take turns with the busy stage. And each times its step alone,
    # not while another loads, compiles or times (timing_lock)
    return ["--awake-ms", "0", "--time-alone", timing_lock_name(plan)]


def timing_lock_name(plan: Plan) -> str:
    """The lock (a file in each machine's timing_lock.LOCK_DIR) the plan's co-located stages time
    their steps under: one per deployment, named by its stages' endpoints, so the workers of two
    deployments (or two tests) on one machine never wait on each other's."""
    key = ",".join(sorted(str(s.endpoint) for s in plan.stages))
    return f"layerline-timing-{hashlib.sha256(key.encode()).hexdigest()[:16]}.lock"


def stage_checkpoint_argv(plan: Plan | dict, host: str, hvars: dict, python: str = "python3") -> list[str]:
    """The controller's command that cuts this host's tensors out of the checkpoint."""
    plan = Plan.from_dict(plan)
    s = plan.stage(host)
    if s is None:
        raise LayerlineError(f"{host}: not in the plan; nothing to stage")
    home = str(hvars.get("layerline_home") or ".")
    argv = [python, "-m", "layerline.cli", "stage-checkpoint", str(hvars["layerline_checkpoint"]),
            "--layers", f"{s.layers[0]}:{s.layers[1]}", "--out", os.path.join(home, "stages", host), "--json"]
    argv += ["--first"] if s.layers[0] == 0 else []
    argv += ["--last"] if s.layers[1] == plan.num_layers else []
    return argv
