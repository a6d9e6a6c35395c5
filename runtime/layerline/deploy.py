"""From inventory variables to planner input and worker argv: what the filter plugins call.

The inventory speaks DESIGN's variable names (layerline_*); this module turns one host's
variables into a planner Node, a whole play into a plan, and a plan into each host's argv.
Looking hosts up by name (never by position) keeps standbys and drained hosts from shifting
anyone's layers.
"""
from __future__ import annotations

import ipaddress
import os

from .cost import COMPILE_MODES, CostOptions, ModelCost
from .errors import LayerlineError
from .planner import PlanError, Node, make_plan, parse_layers

DEFAULT_PORT = 9100


def host_addr(hvars: dict, host: str) -> str:
    """The address other hosts reach this one at."""
    if hvars.get("layerline_addr"):
        return str(hvars["layerline_addr"])
    if hvars.get("ansible_connection") == "local":
        return "127.0.0.1"
    return str(hvars.get("ansible_host") or host)


def host_endpoint(hvars: dict, host: str) -> str:
    port = hvars.get("layerline_port", DEFAULT_PORT)
    try:
        port = int(port)
        assert 1 <= port <= 65534
    except (TypeError, ValueError, AssertionError):
        raise LayerlineError(f"{host}: layerline_port {port!r} must be an integer in 1..65534 "
                             "(the next port is the control socket)") from None
    return f"tcp://{host_addr(hvars, host)}:{port}"


def _gb(hvars: dict, key: str, host: str) -> int | None:
    v = hvars.get(key)
    if v in (None, ""):
        return None
    try:
        return int(float(v) * 2**30)
    except (TypeError, ValueError):
        raise LayerlineError(f"{host}: {key} {v!r} must be a number of GiB") from None


def node_from_vars(host: str, hvars: dict, caps: dict | None) -> Node:
    if not isinstance(caps, dict):
        raise LayerlineError(f"{host}: no layerline_caps facts; run the probe play (playbooks/probe.yml) first")
    device = str(hvars.get("layerline_device") or "cpu")
    if device == "cuda+cpu":
        device = "cuda:0"  # spill is planned as the GPU's budget; the worker spills the rest to RAM
    return Node(host=host, caps=caps, device=device,
                role=str(hvars.get("layerline_role") or "active"),
                layers=parse_layers(hvars.get("layerline_layers"), host),
                precision=hvars.get("layerline_precision") or None,
                standby_for=hvars.get("layerline_standby_for") or None,
                max_ram_bytes=_gb(hvars, "layerline_max_ram_gb", host),
                endpoint=host_endpoint(hvars, host))


def plan_for_hosts(host_vars: dict[str, dict], cost: dict | ModelCost, objective: dict | None = None,
                   policy: str | None = None, reserve_ram_gb: float | None = None) -> dict:
    """The plan for a play's hosts (in pipeline order); caps come from each one's layerline_caps."""
    if not host_vars:
        raise PlanError("inventory: no hosts to plan for (put the workers in group layerline)")
    nodes = [node_from_vars(h, v, v.get("layerline_caps")) for h, v in host_vars.items()]
    taken: dict[tuple[str, int], str] = {}
    for n in nodes:  # each worker takes its port and the next (control)
        addr, port = n.endpoint.rsplit(":", 1)
        for p in (int(port), int(port) + 1):
            other = taken.get((addr, p))
            if other:
                raise PlanError(f"{n.host}: layerline_port {port} on {addr[6:]} collides with {other}'s ports; "
                                "give each worker on one address its own port, at least 2 apart")
            taken[(addr, p)] = n.host
    mc = cost if isinstance(cost, ModelCost) else ModelCost.from_dict(cost)
    opts = CostOptions.from_vars(objective, reserve_ram_gb)
    hop_source = "layerline_objective.hop_secs"
    if (objective or {}).get("hop_secs") is None:
        rtts = sorted(v for n in nodes for v in (n.caps.get("rtt_s") or {}).values() if isinstance(v, (int, float)))
        hop_source = "default"
        if rtts:  # the hosts' measured round trips: the median is the hop cost
            opts.hop_s, hop_source = rtts[len(rtts) // 2], f"measured ({len(rtts)} round trips)"
    plan = make_plan(nodes, mc, opts, policy or "auto")
    plan["hop"] = {"s": opts.hop_s, "source": hop_source}
    place_threads(plan, host_vars)
    return plan


SPIN_SHARED = 10_000    # OpenMP spins before sleeping: short, so an idle stage frees the cores
SPIN_ALONE = 300_000    # libgomp's own default: a stage alone on its machine may spin


def place_threads(plan: dict, host_vars: dict[str, dict]) -> None:
    """Each stage's CPU threads, spin policy and compile mode, from where the plan put it.

    Stages on one machine (same probed machine_id, the kernel's boot id; else the same
    hostname) take turns on a token, so each may use all its cores, but an idle one must
    sleep at once rather than spin on cores a busy one needs.
    """
    machine = {}
    for st in plan["stages"]:
        caps = host_vars[st["host"]].get("layerline_caps") or {}
        machine[st["host"]] = (caps.get("machine_id") or caps.get("hostname")
                               or host_addr(host_vars[st["host"]], st["host"]))
    sharing: dict[str, int] = {}
    for st in plan["stages"]:
        if not str(st["device"]).startswith("cuda"):
            sharing[machine[st["host"]]] = sharing.get(machine[st["host"]], 0) + 1
    for st in plan["stages"]:
        hv = host_vars[st["host"]]
        mode = str(hv.get("layerline_compile") or "off")
        if mode not in COMPILE_MODES:
            raise PlanError(f"{st['host']}: layerline_compile {mode!r} must be one of {', '.join(COMPILE_MODES)}")
        cores = int((hv.get("layerline_caps") or {}).get("cores") or 1)
        threads = hv.get("layerline_threads")
        try:
            threads = int(threads) if threads not in (None, "") else cores
            assert threads >= 1
        except (TypeError, ValueError, AssertionError):
            raise PlanError(f"{st['host']}: layerline_threads {threads!r} must be a positive integer") from None
        st["compile"] = mode
        st["threads"] = threads
        st["shares_cores_with"] = sharing.get(machine[st["host"]], 1) - 1
        st["spin"] = SPIN_SHARED if st["shares_cores_with"] else SPIN_ALONE


def peers_of(host_vars: dict[str, dict], me: str) -> list[str]:
    """The other hosts as ADDR:PORT (their ssh port), for the probe's round-trip measurement.

    Hosts on this machine (local connection) are left out: their hop is loopback."""
    out = []
    for h, v in host_vars.items():
        if h == me or v.get("ansible_connection") == "local":
            continue
        out.append(f"{host_addr(v, h)}:{int(v.get('ansible_port') or 22)}")
    return out


def _is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr.strip("[]"))
        return True
    except ValueError:
        return False


def _truthy(v) -> bool:
    return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")


def stage_dir(hvars: dict, host: str) -> str:
    """Where a host keeps its staged checkpoint when the model's path is not shared."""
    state = str(hvars.get("layerline_state_dir") or f"/tmp/layerline-{host}")
    return str(hvars.get("layerline_stage_dir") or os.path.join(state, "checkpoint"))


def stage_of(plan: dict, host: str) -> dict | None:
    return next((s for s in plan.get("stages", []) if s["host"] == host), None)


def next_endpoint(plan: dict, stage: dict) -> str | None:
    """The active stage that takes this stage's output (standbys feed the same next hop)."""
    end = stage["layers"][1]
    return next((s["endpoint"] for s in plan["stages"] if s["role"] == "active" and s["layers"][0] == end), None)


def worker_argv(plan: dict, host: str, hvars: dict, python: str = "python3") -> list[str]:
    """This host's worker command line, from its stage of the plan (looked up by host name)."""
    s = stage_of(plan, host)
    if s is None:
        raise LayerlineError(f"{host}: not in the plan (role {hvars.get('layerline_role', 'active')}); "
                             "only planned hosts start workers")
    ckpt = hvars.get("layerline_checkpoint")
    if not ckpt:
        raise LayerlineError(f"{host}: layerline_checkpoint is not set; point it at a Hugging Face model dir")
    state = str(hvars.get("layerline_state_dir") or f"/tmp/layerline-{host}")
    if not _truthy(hvars.get("layerline_checkpoint_shared", True)):
        ckpt = stage_dir(hvars, host)  # only this stage's tensors, staged there by playbooks/stage.yml
    port = int(str(s["endpoint"]).rsplit(":", 1)[1])
    # zmq binds IP addresses, not names: a host known by name listens on every interface
    # (off loopback, so CURVE is on)
    bind_host = str(hvars.get("layerline_bind_addr") or host_addr(hvars, host))
    if not _is_ip(bind_host):
        bind_host = "*"
    argv = [python, "-m", "layerline.worker",
            "--checkpoint", str(ckpt),
            "--layers", f"{s['layers'][0]}:{s['layers'][1]}",
            "--device", s["device"],
            "--precision", s["precision"],
            "--kv-context", str(plan["kv"]["context"]),
            "--kv-dtype", str(s.get("kv_dtype") or plan["kv"]["dtype"]),
            "--rng-seed", str(hvars.get("layerline_rng_seed", 0)),
            "--bind", f"tcp://{bind_host}:{port}",
            "--name", host,
            "--ready-file", os.path.join(state, "ready.json"),
            "--keys", str(hvars.get("layerline_keys_dir") or os.path.join(state, "keys"))]
    if s.get("kv_bytes"):  # what the plan reserved for this stage's KV caches
        argv += ["--kv-bytes", str(int(s["kv_bytes"]))]
    if s.get("experts_paged"):
        argv += ["--expert-cache-bytes", str(int(s["expert_cache_bytes"]))]
    nxt = next_endpoint(plan, s)
    if nxt:
        argv += ["--next", nxt]
        # whose public key the next hop must hold under CURVE: its host name in KEYS/peers/
        end = s["layers"][1]
        nxt_host = next(t["host"] for t in plan["stages"] if t["role"] == "active" and t["layers"][0] == end)
        argv += ["--next-key", str(nxt_host)]
    curve = hvars.get("layerline_curve")
    if curve not in (None, "", "auto"):
        if curve not in ("on",):
            raise LayerlineError(f"{host}: layerline_curve {curve!r} must be auto (CURVE off loopback) or on")
        argv += ["--curve", str(curve)]
    if s["layers"][0] == 0:
        argv.append("--first")
    if s["layers"][1] == plan["num_layers"]:
        argv.append("--last")
    if s.get("threads"):
        argv += ["--threads", str(int(s["threads"]))]
    if s.get("spin") is not None:
        argv += ["--spin", str(int(s["spin"]))]
    if s.get("compile", "off") != "off":
        argv += ["--compile", s["compile"], "--compile-cache", os.path.join(state, "inductor")]
    return argv


def drive_argv(plan: dict, hvars: dict, python: str = "python3") -> list[str]:
    """The controller's `layerline drive` command line for a plan and the play's variables."""
    first = next((s for s in plan.get("stages", []) if s["role"] == "active"), None)
    if first is None:
        raise LayerlineError("plan: no active stage to drive; run playbooks/plan.yml first")
    home = str(hvars.get("layerline_home") or ".")
    last = [s for s in plan["stages"] if s["role"] == "active"][-1]
    reply = str(hvars.get("layerline_driver_addr") or "127.0.0.1")
    if reply.startswith("127.") and not last["endpoint"].startswith("tcp://127."):
        raise LayerlineError(f"layerline_driver_addr: results go to {reply}, but the last stage ({last['host']}) is "
                             "not on this machine; set it to an address of the controller that host can reach")
    argv = [python, "-m", "layerline.cli", "drive", "--first", first["endpoint"],
            "--checkpoint", str(hvars["layerline_checkpoint"]), "--precision", plan["precision"],
            "--seq", str(int(hvars.get("layerline_seq", 16))), "--seed", str(int(hvars.get("layerline_rng_seed", 0))),
            "--generate", str(int(hvars.get("layerline_generate", 0))),
            "--reply-host", reply,
            "--keys", str(hvars.get("layerline_keys_controller_dir") or os.path.join(home, "keys", "controller")),
            "--first-key", first["host"], "--curve", str(hvars.get("layerline_curve") or "auto"), "--json"]
    # the reference loads the whole model in one process: only where that fits (the demo)
    if _truthy(hvars.get("layerline_drive_reference", False)):
        argv.append("--reference")
    ids = hvars.get("layerline_prompt_ids")
    if ids:  # one prompt [1, 2, 3] or several [[1, 2], [3, 4]]
        for p in (ids if isinstance(ids[0], list) else [ids]):
            argv += ["--input-ids", ",".join(str(int(t)) for t in p)]
    texts = hvars.get("layerline_prompt")
    for t in ([texts] if isinstance(texts, str) else texts or []):
        argv += ["--prompt", str(t)]
    if hvars.get("layerline_sequences"):
        argv += ["--sequences", str(int(hvars["layerline_sequences"]))]
    sampling = hvars.get("layerline_sampling") or {}
    for key, flag in (("temperature", "--temperature"), ("top_p", "--top-p")):
        if key in sampling:
            argv += [flag, str(float(sampling[key]))]
    if sampling.get("ignore_eos"):
        argv.append("--ignore-eos")
    return argv


def stage_checkpoint_argv(plan: dict, host: str, hvars: dict, python: str = "python3") -> list[str]:
    """The controller's command that cuts this host's tensors out of the checkpoint."""
    s = stage_of(plan, host)
    if s is None:
        raise LayerlineError(f"{host}: not in the plan; nothing to stage")
    home = str(hvars.get("layerline_home") or ".")
    argv = [python, "-m", "layerline.cli", "stage-checkpoint", str(hvars["layerline_checkpoint"]),
            "--layers", f"{s['layers'][0]}:{s['layers'][1]}", "--out", os.path.join(home, "stages", host), "--json"]
    argv += ["--first"] if s["layers"][0] == 0 else []
    argv += ["--last"] if s["layers"][1] == plan["num_layers"] else []
    return argv
