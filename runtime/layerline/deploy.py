"""From inventory variables to planner input: what the filter plugins and `layerline plan` call.

The inventory speaks DESIGN's variable names (layerline_*); this module turns one host's
variables into a planner Node and a whole play into a plan. The CLI's `layerline plan --vars`
goes through the same function, so the two plan alike for the same facts. Looking hosts up by
name (never by position) keeps standbys and drained hosts from shifting anyone's layers.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

from .caps import NodeCaps
from .cost import CostOptions, ModelCost
from .errors import LayerlineError
from .planner import Node, Plan, PlanError, check_nodes, make_plan, parse_layers
from .spec import SLOT_PORT_STEP, host_addr, slot_of, truthy

DEFAULT_PORT = 9100
PLAN_FILE = "plan.json"   # in layerline_home: the plan the Plan play kept, which later plays run


def load_plan(home: str | os.PathLike, required: bool = True) -> dict:
    """The plan kept in layerline_home/plan.json, the one place it is read ({} when there is none
    and required is false). Its contents are checked by whoever runs it (Plan.from_dict)."""
    path = os.path.join(os.fspath(home), PLAN_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        if not required:
            return {}
        raise LayerlineError(f"{path}: no plan was kept here; run deploy.yml first, or set layerline_home "
                             "to the deployment's") from None
    except OSError as e:
        raise LayerlineError(f"{path}: cannot be read ({e.strerror}); fix its permissions") from None
    try:
        plan = json.loads(raw)
    except ValueError as e:
        raise LayerlineError(f"{path}: not valid JSON ({e}); run deploy.yml again to plan anew") from None
    if not isinstance(plan, dict):
        raise LayerlineError(f"{path}: not a JSON object; run deploy.yml again to plan anew")
    return plan


def host_endpoint(hvars: dict, host: str) -> str:
    port = hvars.get("layerline_port", DEFAULT_PORT)
    try:
        port = int(port)
        assert 1 <= port <= 65534
    except (TypeError, ValueError, AssertionError):
        raise LayerlineError(f"{host}: layerline_port {port!r} must be an integer in 1..65534 "
                             "(the next port is the control socket)") from None
    port += SLOT_PORT_STEP * slot_of(hvars, host)   # the other slot's workers run beside this one's
    return f"tcp://{host_addr(hvars, host)}:{port}"


def _gb(hvars: dict, key: str, host: str) -> int | None:
    v = hvars.get(key)
    if v in (None, ""):
        return None
    try:
        return int(float(v) * 2**30)
    except (TypeError, ValueError):
        raise LayerlineError(f"{host}: {key} {v!r} must be a number of GiB") from None


def _threads(hvars: dict, host: str) -> int | None:
    v = hvars.get("layerline_threads")
    if v in (None, ""):
        return None
    try:
        v = int(v)
        assert v >= 1
    except (TypeError, ValueError, AssertionError):
        raise PlanError(f"{host}: layerline_threads {hvars.get('layerline_threads')!r} must be a positive integer") from None
    return v


def node_from_vars(host: str, hvars: dict, caps: dict | NodeCaps | None) -> Node:
    if not isinstance(caps, (dict, NodeCaps)):
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
                endpoint=host_endpoint(hvars, host),
                threads=_threads(hvars, host),
                compile=str(hvars.get("layerline_compile") or "off"))


def plan_for_hosts(host_vars: dict[str, dict], cost: dict | ModelCost, objective: dict | None = None,
                   policy: str | None = None, reserve_ram_gb: float | None = None) -> Plan:
    """The plan for a play's hosts (in pipeline order); caps come from each one's layerline_caps."""
    nodes = _nodes(host_vars, lambda v: v.get("layerline_caps"))
    mc = cost if isinstance(cost, ModelCost) else ModelCost.from_dict(cost)
    return make_plan(nodes, mc, CostOptions.from_vars(objective, reserve_ram_gb), policy or "auto")


def check_vars(host_vars: dict[str, dict], objective: dict | None = None, policy: str | None = None,
               reserve_ram_gb: float | None = None) -> None:
    """LayerlineError naming the first variable no plan can take: what plan_for_hosts checks before it
    needs the probes' facts and the model, so a typo fails in seconds, before anything is measured."""
    nodes = _nodes(host_vars, lambda v: NodeCaps())   # not measured yet
    check_nodes(nodes, policy or "auto")
    CostOptions.from_vars(objective, reserve_ram_gb)


def _nodes(host_vars: dict[str, dict], caps_of) -> list[Node]:
    """The planner's nodes for a play's hosts, in pipeline order; each worker's two ports its own."""
    if not host_vars:
        raise PlanError("inventory: no hosts to plan for (put the workers in group layerline)")
    nodes = [node_from_vars(h, v, caps_of(v)) for h, v in host_vars.items()]
    drained = {n.host for n in nodes if n.role == "draining"}
    # a standby whose principal is drained serves in its own right (drain.yml promoted it, or a re-plan does)
    nodes = [replace(n, role="active", standby_for=None) if n.role == "standby" and n.standby_for in drained else n
             for n in nodes]
    taken: dict[tuple[str, int], str] = {}
    for n in nodes:  # each worker takes its port and the next (control)
        addr, port = n.endpoint.rsplit(":", 1)
        for p in (int(port), int(port) + 1):
            other = taken.get((addr, p))
            if other:
                raise PlanError(f"{n.host}: layerline_port {port} on {addr[6:]} collides with {other}'s ports; "
                                "give each worker on one address its own port, at least 2 apart")
            taken[(addr, p)] = n.host
    return nodes


def peers_of(host_vars: dict[str, dict], me: str) -> list[str]:
    """The other hosts as ADDR:PORT (their ssh port), for the probe's round-trip measurement.

    Hosts on this machine (local connection) are left out: their hop is loopback."""
    out = []
    for h, v in host_vars.items():
        if h == me or v.get("ansible_connection") == "local":
            continue
        out.append(f"{host_addr(v, h)}:{int(v.get('ansible_port') or 22)}")
    return out


def drive_argv(plan: Plan | dict, hvars: dict, python: str = "python3") -> list[str]:
    """The controller's `layerline drive` command line for a plan and the play's variables."""
    plan = Plan.from_dict(plan)
    if not plan.actives:
        raise LayerlineError("plan: no active stage to drive; run playbooks/plan.yml first")
    first, last = plan.actives[0], plan.actives[-1]
    home = str(hvars.get("layerline_home") or ".")
    reply = str(hvars.get("layerline_driver_addr") or "127.0.0.1")
    if reply.startswith("127.") and not str(last.endpoint).startswith("tcp://127."):
        raise LayerlineError(f"layerline_driver_addr: results go to {reply}, but the last stage ({last.host}) is "
                             "not on this machine; set it to an address of the controller that host can reach")
    argv = [python, "-m", "layerline.cli", "drive", "--first", str(first.endpoint),
            "--checkpoint", str(hvars["layerline_checkpoint"]), "--precision", plan.precision,
            "--seq", str(int(hvars.get("layerline_seq", 16))), "--seed", str(int(hvars.get("layerline_rng_seed", 0))),
            "--generate", str(int(hvars.get("layerline_generate", 0))),
            "--reply-host", reply,
            "--keys", str(hvars.get("layerline_keys_controller_dir") or os.path.join(home, "keys", "controller")),
            "--first-key", first.host, "--curve", str(hvars.get("layerline_curve") or "auto"), "--json"]
    # the reference loads the whole model in one process: only where that fits (the demo)
    if truthy(hvars.get("layerline_drive_reference", False)):
        argv.append("--reference")
    ids = hvars.get("layerline_prompt_ids")
    if ids:  # one prompt [1, 2, 3] or several [[1, 2], [3, 4]]
        for p in (ids if isinstance(ids[0], list) else [ids]):
            argv += ["--input-ids", ",".join(str(int(t)) for t in p)]
    texts = hvars.get("layerline_prompt")
    for t in ([texts] if isinstance(texts, str) else texts or []):  # chat turns: the template applies
        if not str(t):
            continue
        argv += ["--chat", str(t)]
    if hvars.get("layerline_sequences"):
        argv += ["--sequences", str(int(hvars["layerline_sequences"]))]
    sampling = hvars.get("layerline_sampling") or {}
    for key, flag in (("temperature", "--temperature"), ("top_p", "--top-p")):
        if key in sampling:
            argv += [flag, str(float(sampling[key]))]
    if sampling.get("ignore_eos"):
        argv.append("--ignore-eos")
    return argv
