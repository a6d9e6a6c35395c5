"""Filters over layerline's planner: thin adapters, no logic of their own.

    {{ hostvars | layerline_plan(ansible_play_hosts, cost, objective, policy, reserve_ram_gb) }}
    {{ plan | layerline_worker_spec(inventory_hostname, hostvars[inventory_hostname], python) }}
    {{ plan | layerline_argv(inventory_hostname, hostvars[inventory_hostname], python) }}
    {{ plan | layerline_plan_table }}
    {{ plan | layerline_drive_argv(hostvars[inventory_hostname], ansible_playbook_python) }}
    {{ drive_result | layerline_drive_report }}
    {{ saved_route | layerline_route(ansible_play_hosts, layerline_drain, layerline_rejoin) }}
    {{ hostvars[inventory_hostname] | layerline_state_dir(inventory_hostname, slot) }}
"""
from __future__ import annotations

import json

from ansible.errors import AnsibleFilterError

try:
    from layerline import LayerlineError
    from layerline.deploy import check_vars, drive_argv, load_plan, peers_of, plan_for_hosts
    from layerline.planner import plan_table
    from layerline.routes import host_order, load_route, next_route, promote_in_place
    from layerline.spec import stage_checkpoint_argv, stage_dir, state_dir, worker_spec
    IMPORT_ERROR = None
except ImportError as e:  # the controller's interpreter lacks the package
    IMPORT_ERROR = e

# Host variables the planner reads; everything else stays untemplated.
_KEYS = ("ansible_connection", "ansible_host", "ansible_port")
# Plans are JSON here; the runtime reads them into its typed Plan (layerline.planner.Plan).


def _need_runtime():
    if IMPORT_ERROR is not None:
        raise AnsibleFilterError(f"layerline filters: cannot import layerline on the controller ({IMPORT_ERROR}); "
                                 "run ansible-playbook from the venv made by `make setup`")


def _plain(value):
    """Plain JSON data: Ansible hands over tagged and lazy types that the runtime need not know."""
    return json.loads(json.dumps(value))


def _host_vars(hostvars, host: str) -> dict:
    hv = hostvars[host]
    return _plain({k: hv[k] for k in hv if k.startswith("layerline_") or k in _KEYS})


def layerline_plan(hostvars, hosts, cost, objective=None, policy=None, reserve_ram_gb=None):
    _need_runtime()
    try:
        return plan_for_hosts({h: _host_vars(hostvars, h) for h in hosts}, _plain(cost), _plain(objective),
                              _plain(policy), _plain(reserve_ram_gb)).to_dict()
    except LayerlineError as e:
        raise AnsibleFilterError(f"layerline_plan: {e}") from None


def layerline_check_vars(hostvars, hosts, objective=None, policy=None, reserve_ram_gb=None):
    """True, or the first layerline_* variable no plan can take (checked before anything is measured)."""
    _need_runtime()
    try:
        check_vars({h: _host_vars(hostvars, h) for h in hosts}, _plain(objective), _plain(policy),
                   _plain(reserve_ram_gb))
    except LayerlineError as e:
        raise AnsibleFilterError(f"layerline_check_vars: {e}") from None
    return True


def layerline_worker_spec(plan, host, hvars, python="python3", ready_timeout=None):
    """The host's WorkerSpec as a dict: argv, state_dir, ready_file, keys_dir, ready_timeout, endpoint.

    ready_timeout: the role's layerline_worker_ready_timeout (the spec raises it for compiling stages)."""
    _need_runtime()
    try:
        hv = _plain({k: hvars[k] for k in hvars if k.startswith("layerline_") or k in _KEYS})
        if ready_timeout is not None:
            hv["layerline_worker_ready_timeout"] = _plain(ready_timeout)
        return worker_spec(_plain(plan), str(host), hv, python=str(python)).to_dict()
    except LayerlineError as e:
        raise AnsibleFilterError(f"layerline_worker_spec: {e}") from None


def layerline_argv(plan, host, hvars, python="python3"):
    return layerline_worker_spec(plan, host, hvars, python)["argv"]


def layerline_drive_argv(plan, hvars, python="python3"):
    _need_runtime()
    try:
        hv = _plain({k: hvars[k] for k in hvars if k.startswith("layerline_")})
        return drive_argv(_plain(plan), hv, python=str(python))
    except (LayerlineError, KeyError, TypeError, ValueError) as e:
        raise AnsibleFilterError(f"layerline_drive_argv: {e}") from None


def layerline_stage_argv(plan, host, hvars, python="python3"):
    _need_runtime()
    try:
        hv = _plain({k: hvars[k] for k in hvars if k.startswith("layerline_")})
        return stage_checkpoint_argv(_plain(plan), str(host), hv, python=str(python))
    except (LayerlineError, KeyError) as e:
        raise AnsibleFilterError(f"layerline_stage_argv: {e}") from None


def layerline_stage_dir(hvars, host):
    _need_runtime()
    return stage_dir(_plain({k: hvars[k] for k in hvars if k.startswith("layerline_")}), str(host))


def layerline_state_dir(hvars, host, slot=None):
    """A host's worker state dir in a slot (default: the slot its layerline_slot names)."""
    _need_runtime()
    try:
        return state_dir(_plain({k: hvars[k] for k in hvars if k.startswith("layerline_")}), str(host),
                         None if slot in (None, "") else int(slot))
    except (LayerlineError, ValueError) as e:
        raise AnsibleFilterError(f"layerline_state_dir: {e}") from None


def layerline_saved_plan(home, required=True):
    """The plan kept in layerline_home `home` (layerline.deploy.load_plan); {} when there is none
    and required is false."""
    _need_runtime()
    try:
        return load_plan(str(home), bool(required))
    except LayerlineError as e:
        raise AnsibleFilterError(f"layerline_saved_plan: {e}") from None


def layerline_route(home, hosts, drain=None, rejoin=None, plan=None):
    """The route after a drain or rejoin of the one kept in layerline_home `home` (layerline.routes):
    {slot, drained, promoted, changed, moves, plan, order, before}. changed: the server must
    switch; moves: workers start in the other slot (else `plan` is the running plan with standbys
    promoted in place); order: the hosts in the order to plan them."""
    _need_runtime()
    try:
        before = load_route(str(home))
        hosts = [str(h) for h in hosts]
        after, changed = next_route(before, hosts, _plain(drain), _plain(rejoin))
        inplace = promote_in_place(_plain(plan), before, after) if changed and plan else None
        if inplace:
            plan, after = inplace
    except LayerlineError as e:
        raise AnsibleFilterError(f"layerline_route: {e}") from None
    return after.to_dict() | {"changed": changed, "moves": changed and not inplace,
                              "plan": plan if inplace else None, "order": host_order(hosts, after),
                              "before": before.to_dict()}


def layerline_peers(hostvars, hosts, me):
    _need_runtime()
    return peers_of({h: _host_vars(hostvars, h) for h in hosts}, str(me))


def layerline_plan_table(plan):
    _need_runtime()
    return plan_table(_plain(plan))


def layerline_drive_report(result):
    _need_runtime()
    from layerline.driver import drive_report  # imports torch: only when a drive report is made
    return drive_report(_plain(result))


class FilterModule:
    def filters(self):
        return {"layerline_plan": layerline_plan, "layerline_check_vars": layerline_check_vars,
                "layerline_argv": layerline_argv,
                "layerline_worker_spec": layerline_worker_spec,
                "layerline_plan_table": layerline_plan_table,
                "layerline_drive_argv": layerline_drive_argv, "layerline_peers": layerline_peers,
                "layerline_stage_argv": layerline_stage_argv, "layerline_stage_dir": layerline_stage_dir, "layerline_drive_report": layerline_drive_report,
                "layerline_route": layerline_route, "layerline_state_dir": layerline_state_dir,
                "layerline_saved_plan": layerline_saved_plan}
