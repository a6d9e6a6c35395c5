"""Filters over layerline's runtime: thin adapters, no logic of their own.

    {{ hostvars | layerline_check_vars(ansible_play_hosts) }}
    {{ hostvars | layerline_plan(ansible_play_hosts, cost) }}
    {{ hostvars | layerline_route_plan(ansible_play_hosts, cost, layerline_route) }}
    {{ hostvars[inventory_hostname] | layerline_settings(inventory_hostname) }}   (layerline.settings)
    {{ groups | layerline_server_host }}
    {{ layerline_home | layerline_home_paths(inventory_hostname) }}              (layerline.home)
    {{ plan | layerline_worker_spec(inventory_hostname, hostvars[inventory_hostname]) }}
    {{ plan | layerline_argv(inventory_hostname, hostvars[inventory_hostname]) }}
    {{ hostvars[inventory_hostname] | layerline_server_spec(ansible_playbook_python) }}
    {{ hostvars[inventory_hostname] | layerline_worker_probe(inventory_hostname, slots) }}          (layerline.units)
    {{ plan | layerline_worker_launch(inventory_hostname, hostvars[inventory_hostname], probe.stdout) }}
    {{ hostvars[inventory_hostname] | layerline_server_probe(ansible_playbook_python, server_host) }}
    {{ hostvars[inventory_hostname] | layerline_server_launch(ansible_playbook_python, server_host, probe.stdout) }}
    {{ hostvars[inventory_hostname] | layerline_host_report(inventory_hostname, plan) }}
    {{ hostvars[inventory_hostname] | layerline_demo_checkpoint_argv(ansible_playbook_python) }}
    {{ hostvars[inventory_hostname] | layerline_index_argv(ansible_playbook_python) }}
    {{ hostvars[inventory_hostname] | layerline_keys_spec(inventory_hostname, hosts, ansible_playbook_python) }}
    {{ hostvars[inventory_hostname] | layerline_keys_place_argv(inventory_hostname, public_keys) }}
    {{ layerline_runtime_source | layerline_wheel_dir(layerline_home | default(none)) }}
    {{ ansible_playbook_python | layerline_version }}
    {{ hostvars[inventory_hostname] | layerline_runtime_spec(inventory_hostname, deps, python, role_path, source, wheels) }}
    {{ hostvars[inventory_hostname] | layerline_runtime_install_argv(inventory_hostname, wheel) }}
    {{ plan | layerline_drive_argv(hostvars[inventory_hostname], ansible_playbook_python) }}
    {{ plan | layerline_plan_table }}
    {{ drive_result | layerline_drive_report }}
    {{ layerline_home | layerline_route(ansible_play_hosts, layerline_drain, layerline_rejoin) }}
    {{ hostvars[inventory_hostname] | layerline_state_dir(inventory_hostname, slot) }}
    {{ hostvars | layerline_host_errors(ansible_play_hosts, 'layerline_stage_error') }}
    {{ copied | layerline_stage_copy_error(inventory_hostname, stage_dir, stage_bytes) }}  (layerline.staging)
    {{ plan | layerline_stage_dir(inventory_hostname, hostvars[inventory_hostname]) }}
    {{ (unit_file is changed) | layerline_service_state(layerline_stage_shipped) }}   (layerline.units)
    {{ plan | layerline_stages_kept(inventory_hostname, hostvars[inventory_hostname]) }}
    {{ hostvars | layerline_drain_outcome(ansible_play_hosts_all, layerline_drain) }}    (layerline.operations)
    {{ layerline_route | layerline_drain_stops(inventory_hostname, failed) }}
"""
from __future__ import annotations

import json

from ansible.errors import AnsibleFilterError

try:
    from layerline import LayerlineError
    from layerline import version
    from layerline.home import ControllerHome, wheel_dir
    from layerline.inventory import check_vars, host_errors, known_addresses, peers_of, plan_for_hosts, plan_for_route
    from layerline.operations import HOST_ERROR, RESTORE_ERROR, SWITCH_ERROR, drain_outcome, drain_stops
    from layerline.planner import Plan, plan_table
    from layerline.routes import begin, commit, decide, load_pending, load_route, plan_to_keep
    from layerline.settings import ANSIBLE_KEYS, PREFIX, HostSettings, server_host
    from layerline.units import (server_launch, server_probe_argv, service_state, worker_launch, worker_probe_argv,
                                 worker_unit_files)
    from layerline.spec import (demo_checkpoint_argv, drive_argv, host_report, index_argv, keys_place_argv,
                                keys_spec, planned_worker, runtime_install_argv, runtime_spec, server_spec,
                                ships_stage, stage_checkpoint_argv, stage_dir, stages_kept,
                                worker_spec)
    IMPORT_ERROR = None
except ImportError as e:  # the controller's interpreter lacks the package
    IMPORT_ERROR = e


def _need_runtime():
    if IMPORT_ERROR is not None:
        raise AnsibleFilterError(f"layerline filters: cannot import layerline on the controller ({IMPORT_ERROR}); "
                                 "run ansible-playbook from the venv made by `make setup`")


def _plain(value):
    """Plain JSON data: Ansible hands over tagged and lazy types that the runtime need not know."""
    return json.loads(json.dumps(value))


def _plan(value):
    """The plan as layerline.planner.Plan (JSON only at this boundary); None where none is given."""
    return Plan.from_dict(_plain(value)) if value else None


def _vars(hv) -> dict:
    """A host's layerline_* variables and how it is reached; everything else stays untemplated."""
    return _plain({k: hv[k] for k in hv if k.startswith(PREFIX) or k in ANSIBLE_KEYS})


def _host_vars(hostvars, host: str) -> dict:
    return _vars(hostvars[host])


def _adapt(name: str, fn, *args, **kw):
    _need_runtime()
    try:
        return fn(*args, **kw)
    except LayerlineError as e:
        raise AnsibleFilterError(f"{name}: {e}") from None


def layerline_plan(hostvars, hosts, cost, objective=None, policy=None, reserve_ram_gb=None):
    _need_runtime()
    return _adapt("layerline_plan", lambda: plan_for_hosts(
        {h: _host_vars(hostvars, h) for h in hosts}, _plain(cost), _plain(objective), _plain(policy),
        _plain(reserve_ram_gb)).to_dict())


def layerline_route_plan(hostvars, hosts, cost, route):
    """The plan the route asks for (layerline.inventory.plan_for_route): the in-place plan, else a new plan of
    these hosts in the route's order, drained hosts left out."""
    _need_runtime()
    return _adapt("layerline_route_plan", plan_for_route, {h: _host_vars(hostvars, h) for h in hosts}, _plain(cost),
                  _plain(route))


def layerline_check_vars(hostvars, hosts, objective=None, policy=None, reserve_ram_gb=None):
    """True, or the first layerline_* variable no plan can take (checked before anything is measured)."""
    _need_runtime()
    _adapt("layerline_check_vars", check_vars, {h: _host_vars(hostvars, h) for h in hosts}, _plain(objective),
           _plain(policy), _plain(reserve_ram_gb))
    return True


def layerline_settings(hvars, host):
    """The host's HostSettings: its variables with defaults filled in, and what follows from them."""
    _need_runtime()
    return _adapt("layerline_settings", lambda: _plain(HostSettings.from_vars(str(host), _vars(hvars)).facts()))


def layerline_server_host(groups):
    _need_runtime()
    return server_host(_plain(dict(groups)))


def layerline_home_paths(home, host=None):
    """The controller's paths (layerline.home.ControllerHome); `stage`: the host's staged tensors."""
    _need_runtime()

    def paths():
        h = ControllerHome.of(str(home) if home else None)
        out = {"root": h.root, "plan": h.plan, "route": h.route, "drive": h.drive, "request": h.request,
               "keys_store": h.keys_store, "keys_controller": h.keys_controller, "api_keys": h.api_keys,
               "admin_key": h.admin_key, "server_state": h.server_state, "wheels": h.wheels}
        return out | ({"stage": h.stages(str(host))} if host else {})
    return _adapt("layerline_home_paths", paths)


def layerline_worker_spec(plan, host, hvars, python=None):
    """The host's worker launch (layerline.spec.planned_worker): {"planned": false} where the plan holds
    no stage on it, else the WorkerSpec as a dict (argv, python, state_dir, ready_file, keys_dir, ready_timeout,
    endpoint, step) with "planned": true. python: default the host's layerline_worker_python (layerline.settings)."""
    _need_runtime()
    return _adapt("layerline_worker_spec", lambda: planned_worker(_plan(plan), str(host), _vars(hvars),
                                                                  python=None if python is None else str(python)))


def layerline_worker_probe(hvars, host, slots=None):
    """The host's command that reports what runs its processes and which of the worker units of `slots` (default:
    the route's slot) it holds (layerline.units.worker_probe_argv)."""
    _need_runtime()
    return _adapt("layerline_worker_probe", lambda: worker_probe_argv(
        str(host), _vars(hvars), None if slots is None else [int(x) for x in _plain(slots)]))


def layerline_worker_unit_files(host, slots):
    """The paths of the host's worker units of `slots` (layerline.units.worker_unit_files): what the stop's
    layerline_worker run reports the host holds."""
    _need_runtime()
    return _adapt("layerline_worker_unit_files", lambda: worker_unit_files(str(host), [int(x) for x in _plain(slots)]))


def layerline_worker_launch(plan, host, hvars, facts):
    """layerline_worker_spec plus the service manager the host resolves to and, with systemd, its unit
    (layerline.units.worker_launch); facts: what layerline_worker_probe's command printed."""
    _need_runtime()
    return _adapt("layerline_worker_launch", lambda: worker_launch(_plan(plan), str(host), _vars(hvars), str(facts)))


def layerline_server_probe(hvars, python, server_host, stop=False):
    """The serving host's command that reports what runs its processes and whether it holds the server's unit
    (layerline.units.server_probe_argv; stop: the unit only)."""
    _need_runtime()
    return _adapt("layerline_server_probe", lambda: server_probe_argv(_vars(hvars), str(python), str(server_host),
                                                                      stop=bool(stop)))


def layerline_server_launch(hvars, python, server_host, facts):
    """layerline_server_spec plus the service manager and, with systemd, the server's unit (layerline.units)."""
    _need_runtime()
    return _adapt("layerline_server_launch", lambda: server_launch(_vars(hvars), str(python), str(server_host),
                                                                   str(facts)))


def layerline_service_state(unit_changed, shipped_bytes=0):
    """restarted or started: what starting a worker or the server asks, given whether its unit changed and
    the bytes staged for it this run (layerline.units.service_state)."""
    _need_runtime()
    return _adapt("layerline_service_state", lambda: service_state(bool(unit_changed), int(shipped_bytes or 0)))


def layerline_ships_stage(plan, host, hvars):
    """Whether staging ships this host its own tensors (layerline.spec.ships_stage)."""
    _need_runtime()
    return _adapt("layerline_ships_stage", lambda: ships_stage(_plan(plan), str(host), _vars(hvars)))


def layerline_argv(plan, host, hvars, python=None):
    _need_runtime()
    return _adapt("layerline_argv", lambda: list(worker_spec(_plan(plan), str(host), _vars(hvars),
                                                             python=None if python is None else str(python)).argv))


def layerline_host_report(hvars, host, plan=None):
    """A host's settings, the controller's keys dir and its worker argv, for layerline.Cluster."""
    _need_runtime()
    return _adapt("layerline_host_report", lambda: _plain(host_report(_plan(plan), str(host), _vars(hvars))))


def layerline_demo_checkpoint_argv(hvars, python="python3"):
    """The controller's command that writes the demo checkpoint (layerline.spec.demo_checkpoint_argv)."""
    _need_runtime()
    return _adapt("layerline_demo_checkpoint_argv", lambda: demo_checkpoint_argv(_vars(hvars), python=str(python)))


def layerline_index_argv(hvars, python="python3"):
    """The controller's command that prints the checkpoint's index and cost (layerline.spec.index_argv)."""
    _need_runtime()
    return _adapt("layerline_index_argv", lambda: index_argv(_vars(hvars), python=str(python)))


def layerline_keys_spec(hvars, host, hosts, python="python3"):
    """The keys role's commands and files for a host (layerline.spec.KeysSpec as a dict)."""
    _need_runtime()
    return _adapt("layerline_keys_spec", lambda: keys_spec(str(host), _vars(hvars), [str(h) for h in hosts],
                                                           python=str(python)).to_dict())


def layerline_keys_place_argv(hvars, host, public):
    """The host's command that lays out the public half of its keys dir (layerline.spec.keys_place_argv)."""
    _need_runtime()
    return _adapt("layerline_keys_place_argv", lambda: keys_place_argv(str(host), _vars(hvars), _plain(public)))


def layerline_wheel_dir(source, home=None):
    """Where the runtime role builds the wheel (layerline.home.wheel_dir: HOME/wheels, else SOURCE/.cache/wheels)."""
    _need_runtime()
    return _adapt("layerline_wheel_dir", lambda: wheel_dir(None if home in (None, "") else str(home), str(source)))


def layerline_runtime_spec(hvars, host, dependencies, controller_python, role_path, source, wheel_dir):
    """The runtime role's commands for a host (layerline.spec.RuntimeSpec as a dict)."""
    _need_runtime()
    return _adapt("layerline_runtime_spec", lambda: runtime_spec(
        str(host), _vars(hvars), _plain(dependencies), str(controller_python), str(role_path), str(source),
        str(wheel_dir)).to_dict())


def layerline_runtime_install_argv(hvars, host, wheel):
    """The host's pip install of the wheel (layerline.spec.runtime_install_argv)."""
    _need_runtime()
    return _adapt("layerline_runtime_install_argv", runtime_install_argv, str(host), _vars(hvars), str(wheel))


def layerline_version(python=None):
    """The layerline version the controller runs (layerline.version.full(): package version + content hash):
    these filters run in ansible_playbook_python, the `python` given, so its layerline is this one."""
    _need_runtime()
    return version.full()


def layerline_runtime_needs_install(found, controller_version):
    """Whether a host's interpreter needs the controller's layerline: `found` is the registered result of
    asking it (rc, stdout); layerline.version.needs_install decides."""
    _need_runtime()
    found = found if isinstance(found, dict) else {}
    return version.needs_install(found.get("rc", 1), found.get("stdout", ""), str(controller_version))


def layerline_server_spec(hvars, python="python3"):
    """The server's launch (layerline.spec.ServerSpec as a dict): argv, state_dir, url, key files, banner."""
    _need_runtime()
    return _adapt("layerline_server_spec", lambda: server_spec(_vars(hvars), python=str(python)).to_dict())


def layerline_drive_argv(plan, hvars, python="python3"):
    _need_runtime()
    return _adapt("layerline_drive_argv", lambda: drive_argv(_plan(plan), _vars(hvars), python=str(python)))


def layerline_stage_argv(plan, host, hvars, python="python3"):
    _need_runtime()
    return _adapt("layerline_stage_argv", lambda: stage_checkpoint_argv(_plan(plan), str(host), _vars(hvars),
                                                                        python=str(python)))


def layerline_stage_dir(plan, host, hvars):
    """The dir on the host that holds its stage of the plan (layerline.spec.stage_dir: one per layer range)."""
    _need_runtime()
    return _adapt("layerline_stage_dir", lambda: stage_dir(_plan(plan), str(host), _vars(hvars)))


def layerline_stages_kept(plan, host, hvars):
    """What the host's stage root keeps once `plan` runs (layerline.spec.stages_kept): {root, keep, sweep}."""
    _need_runtime()
    return _adapt("layerline_stages_kept", lambda: stages_kept(_plan(plan), str(host), _vars(hvars)))


def layerline_stage_copy_error(copied, host, stage_dir, stage_bytes):
    """The one line for a host whose stage copy failed or was cut off (layerline.staging.copy_failure)."""
    _need_runtime()
    from layerline.staging import copy_failure
    return _adapt("layerline_stage_copy_error", copy_failure, str(host), str(stage_dir), int(stage_bytes),
                  _plain(copied))


def layerline_state_dir(hvars, host, slot=None):
    """A host's worker state dir in a slot (default: the slot its layerline_slot names)."""
    _need_runtime()
    return _adapt("layerline_state_dir", lambda: HostSettings.from_vars(str(host), _vars(hvars)).state_dir_in(
        None if slot in (None, "") else int(slot)))


def layerline_saved_plan(home, required=True):
    """The plan kept in layerline_home `home` (ControllerHome.load_plan); {} when there is none and
    required is false."""
    _need_runtime()
    return _adapt("layerline_saved_plan", lambda: ControllerHome.of(str(home)).load_plan(bool(required)))


def layerline_route(home, hosts, drain=None, rejoin=None, plan=None):
    """The route after a drain or rejoin of the one kept in layerline_home `home`, or the pending change a
    stopped run left there, resumed (layerline.routes.decide): {slot, drained, promoted, changed, moves, plan,
    order, before, plan_before, resumed}. plan: the running plan, read by the caller."""
    _need_runtime()
    return _adapt("layerline_route", lambda: decide(load_route(str(home)), load_pending(str(home)),
                                                    [str(h) for h in hosts], _plain(drain), _plain(rejoin),
                                                    _plain(plan) or None))


def layerline_route_begin(route, plan, plan_before=None):
    """route.json before the switch: the change as `pending` (layerline.routes.begin)."""
    _need_runtime()
    return _adapt("layerline_route_begin", begin, _plain(route), _plain(plan), _plain(plan_before) or None)


def layerline_route_commit(route):
    """route.json once the server routes through the new stages (layerline.routes.commit)."""
    _need_runtime()
    return _adapt("layerline_route_commit", commit, _plain(route))


def layerline_plan_to_keep(route, plan, plan_before=None):
    """plan.json before the switch: the running plan while a change is under way (layerline.routes.plan_to_keep)."""
    _need_runtime()
    return _adapt("layerline_plan_to_keep", plan_to_keep, _plain(route), _plain(plan), _plain(plan_before) or None)


def layerline_host_errors(hostvars, hosts, fact):
    """The messages the hosts noted in fact (set in a rescue), in play order."""
    _need_runtime()
    return host_errors({str(h): _plain(hostvars[h].get(fact)) for h in hosts})


def layerline_drain_outcome(hostvars, hosts, drain=None):
    """What failed in drain.yml so far, from the facts its rescues noted (layerline.operations.drain_outcome):
    {errors, failed, msg}."""
    _need_runtime()
    facts = (HOST_ERROR, SWITCH_ERROR, RESTORE_ERROR)
    return _adapt("layerline_drain_outcome", drain_outcome,
                  {str(h): {f: _plain(hostvars[h].get(f)) for f in facts} for h in hosts}, _plain(drain))


def layerline_drain_stops(route, host, failed=False):
    """The slots whose worker on this host stops once drain.yml switched or went back
    (layerline.operations.drain_stops)."""
    _need_runtime()
    return _adapt("layerline_drain_stops", drain_stops, _plain(route), str(host), bool(failed))


def layerline_known_addresses(hostvars, hosts):
    """Names and addresses of these hosts (layerline_discover skips them)."""
    _need_runtime()
    return _adapt("layerline_known_addresses", known_addresses, {str(h): _host_vars(hostvars, h) for h in hosts})


def layerline_peers(hostvars, hosts, me):
    _need_runtime()
    return _adapt("layerline_peers", peers_of, {h: _host_vars(hostvars, h) for h in hosts}, str(me))


def layerline_plan_table(plan):
    _need_runtime()
    return plan_table(_plan(plan))


def layerline_drive_report(result):
    _need_runtime()
    from layerline.drive_report import drive_report
    return drive_report(_plain(result))


class FilterModule:
    def filters(self):
        return {f.__name__: f for f in (
            layerline_plan, layerline_route_plan, layerline_check_vars, layerline_settings, layerline_server_host, layerline_home_paths,
            layerline_worker_spec, layerline_ships_stage, layerline_argv, layerline_worker_unit_files, layerline_host_report,
            layerline_server_spec, layerline_drive_argv, layerline_worker_probe, layerline_worker_launch, layerline_server_probe,
            layerline_server_launch, layerline_service_state,
            layerline_demo_checkpoint_argv, layerline_index_argv, layerline_keys_spec, layerline_keys_place_argv,
            layerline_wheel_dir, layerline_version, layerline_runtime_spec,
            layerline_runtime_install_argv, layerline_runtime_needs_install,
            layerline_stage_argv, layerline_stage_dir, layerline_stages_kept, layerline_stage_copy_error,
            layerline_state_dir, layerline_saved_plan,
            layerline_route, layerline_route_begin, layerline_route_commit, layerline_plan_to_keep,
            layerline_host_errors, layerline_drain_outcome, layerline_drain_stops,
            layerline_known_addresses, layerline_peers, layerline_plan_table, layerline_drive_report)}
