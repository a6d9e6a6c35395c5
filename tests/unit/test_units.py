"""layerline.units: the systemd units of a plan's workers and of the server, checked by systemd itself
(`systemd-analyze verify`: a unit it would refuse or a setting it would ignore fails here), and the
choice of service manager."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layerline.errors import LayerlineError
from layerline.units import quote_arg, server_unit, service_manager, service_unit, worker_unit

pytestmark = pytest.mark.unit


def verify(tmp: Path, unit) -> str:
    """systemd-analyze verify's complaints about the unit ('' when it has none)."""
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: .ci/run installs Debian's systemd package"
    path = tmp / unit.name
    path.write_text(unit.text)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True,
                       timeout=60)
    return (r.stdout + r.stderr).strip() + ("" if r.returncode == 0 else f" (rc {r.returncode})")


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    from layerline.checkpoint import write_demo_checkpoint
    from layerline.local import local_plan
    tmp = tmp_path_factory.mktemp("units")
    ckpt = write_demo_checkpoint(tmp / "ck", layers=4, hidden=64, vocab=100, dtype="float32", seed=1)
    hv = {h: {"ansible_connection": "local", "layerline_port": 29990 + 2 * i, "layerline_checkpoint": str(ckpt),
              "layerline_state_dir": str(tmp / h), "layerline_keys_dir": str(tmp / "keys" / h), "layerline_nice": 5}
          for i, h in enumerate(("w1", "w2"))}
    for v in hv.values():
        Path(v["layerline_state_dir"]).mkdir()
    return local_plan(str(ckpt), 2, "fp32", hv), hv, tmp


def test_worker_units_of_a_plan_pass_systemd_analyze_verify(plan, tmp_path):
    p, hv, _ = plan
    for host in ("w1", "w2"):
        u = worker_unit(p, host, hv[host], python=sys.executable, start_at_boot=host == "w1")
        assert u.name == f"layerline-worker-{host}.service"
        assert verify(tmp_path, u) == ""
        st = p.stage(host)
        assert f"MemoryMax={st.mem_budget_bytes}" in u.text and "Restart=on-failure" in u.text
        assert f"--layers {st.layers[0]}:{st.layers[1]}" in u.text and "--nice 5" in u.text
        assert ("WantedBy=multi-user.target" in u.text) == (host == "w1")


def test_the_server_unit_passes_verify(plan, tmp_path):
    _, hv, tmp = plan
    u = server_unit({**hv["w1"], "layerline_home": str(tmp / "home")}, sys.executable)
    assert u.name == "layerline-server-controller.service" and "layerline.cli serve" in u.text
    assert verify(tmp_path, u) == ""


def test_odd_arguments_and_environment_are_quoted_for_systemd(tmp_path):
    argv = [sys.executable, "-m", "layerline.worker", "--name", "a b%c$d", "--x", 'q"\\z', ""]
    u = service_unit("worker", "odd", argv, description="odd", working_dir=str(tmp_path),
                     environment={"X": 'a "b" %n $HOME'})
    assert verify(tmp_path, u) == ""
    assert 'ExecStart=' + sys.executable + ' -m layerline.worker --name "a b%%c$$d" --x "q\\"\\\\z" ""' in u.text
    assert quote_arg("plain-arg") == "plain-arg"


def test_verify_does_fail_on_a_bad_unit(tmp_path):
    """The check above can fail: an ignored setting and a missing interpreter are both reported."""
    u = service_unit("worker", "bad", [sys.executable, "-V"], description="bad", working_dir=str(tmp_path))
    bad = type(u)(u.name, u.text.replace("Restart=on-failure", "Restart=sometimes"))
    assert "sometimes" in verify(tmp_path, bad)
    gone = type(u)(u.name, u.text.replace(f"ExecStart={sys.executable}", "ExecStart=/nonexistent/python"))
    assert "not executable" in verify(tmp_path, gone)


def test_refused_inputs_name_the_field():
    with pytest.raises(LayerlineError, match="absolute path"):
        service_unit("worker", "w1", ["python3", "-V"], description="d", working_dir="/tmp")
    with pytest.raises(LayerlineError, match="rename the inventory host"):
        service_unit("worker", "w 1", ["/usr/bin/python3"], description="d", working_dir="/tmp")
    with pytest.raises(LayerlineError, match="newline"):
        quote_arg("a\nb")


@pytest.mark.parametrize("setting, pid1, want", [("auto", "systemd\n", "systemd"), ("auto", "bash", "supervisor"),
                                                 ("auto", None, "supervisor"), ("systemd", "bash", "systemd"),
                                                 ("supervisor", "systemd", "supervisor")])
def test_service_manager(setting, pid1, want):
    assert service_manager(setting, pid1) == want


def test_service_manager_refuses_an_unknown_setting():
    with pytest.raises(LayerlineError, match="layerline_service_manager: 'launchd' is not one of"):
        service_manager("launchd", "systemd")


# -- layerline_service_manager: what the roles decide and write (layerline.units.worker_launch / server_launch) ---

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
SYSTEMD_HOST = {"pid1": "systemd", "booted": True, "pid1_ns": True, "systemctl": True, "root": True, "units": [],
                "inputs": "d1"}


def _load(name: str, path: Path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def filters():
    """The filters the roles call, as Ansible loads them."""
    return _load("ll_filters_units", ROOT / "modules" / "filter_plugins" / "layerline.py").FilterModule().filters()


def role_writes(role: str, spec: dict) -> str:
    """What the role's template task writes for this launch: roles/ROLE/templates/layerline.service.j2 rendered
    as ansible.builtin.template does (trim_blocks, the template's trailing newline dropped)."""
    import jinja2
    import yaml
    tasks = yaml.safe_load((ROOT / "roles" / role / "tasks" / "unit.yml").read_text())
    (task,) = [t for t in tasks if "ansible.builtin.template" in t]
    var = f"{role}_spec"
    assert task["ansible.builtin.template"]["src"] == "layerline.service.j2"
    assert task["ansible.builtin.template"]["dest"] == "{{ %s.unit.path }}" % var
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=False, undefined=jinja2.StrictUndefined)
    src = (ROOT / "roles" / role / "templates" / "layerline.service.j2").read_text()
    return env.from_string(src).render({var: spec})


def host_facts(hv: dict, host: str, filters, slots=None) -> dict:
    """What the worker role's probe task prints on this machine (the real command, run here)."""
    argv = filters["layerline_worker_probe"](hv, host, slots)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(r.stdout)


def test_a_systemd_host_gets_the_unit_the_role_writes_and_systemd_accepts_it(plan, filters, tmp_path):
    p, hv, _ = plan
    forced = {**hv["w1"], "layerline_service_manager": "systemd", "layerline_start_at_boot": True,
              "ansible_python_interpreter": sys.executable}
    launch = filters["layerline_worker_launch"](p.to_dict(), "w1", forced, json.dumps(SYSTEMD_HOST))
    assert launch["manager"] == "systemd" and launch["planned"] and launch["stop_units"] == []
    unit = launch["unit"]
    assert unit["name"] == "layerline-worker-w1.service" and unit["path"] == "/etc/systemd/system/" + unit["name"]
    assert unit["enabled"] is True and unit["exists"] is False
    text = role_writes("layerline_worker", launch)
    assert text == unit["text"]
    from layerline.units import Unit
    assert verify(tmp_path, Unit(unit["name"], text)) == ""
    # the very argv the supervisor would run; the ready file removed around every run; the keys' digest kept
    assert "ExecStart=" + " ".join(quote_arg(a) for a in launch["argv"]) in text
    for step in ("ExecStartPre=", "ExecStopPost="):
        assert re.search(rf"^{step}.*unlink.* {re.escape(launch['ready_file'])}$", text, re.M), step
    assert "digest d1" in text and "WantedBy=multi-user.target" in text
    # new keys (another digest) change the text, so the role restarts the unit; without start at boot it is
    # written the same way and left disabled
    again = filters["layerline_worker_launch"](p.to_dict(), "w1", {**forced, "layerline_start_at_boot": False},
                                               json.dumps({**SYSTEMD_HOST, "inputs": "d2"}))
    assert again["unit"]["text"] == text.replace("digest d1", "digest d2") and again["unit"]["enabled"] is False
    held = {**SYSTEMD_HOST, "units": [{"name": unit["name"], "path": unit["path"]}]}
    assert filters["layerline_worker_launch"](p.to_dict(), "w1", forced, json.dumps(held))["unit"]["exists"] is True


def test_the_other_slot_has_its_own_unit(plan, filters, tmp_path):
    p, hv, tmp = plan
    vars1 = {**hv["w2"], "layerline_service_manager": "systemd", "layerline_slot": 1,
             "layerline_state_dir": str(tmp / "w2")}
    launch = filters["layerline_worker_launch"](p.to_dict(), "w2", vars1, json.dumps(SYSTEMD_HOST))
    assert launch["unit"]["name"] == "layerline-worker-w2.1.service"
    assert launch["state_dir"] == str(tmp / "w2") + ".1"
    Path(launch["state_dir"]).mkdir(exist_ok=True)
    from layerline.units import Unit
    assert verify(tmp_path, Unit(launch["unit"]["name"], launch["unit"]["text"])) == ""
    # the stop asks the host for the files each slot's launch writes
    launch0 = filters["layerline_worker_launch"](p.to_dict(), "w2", {**vars1, "layerline_slot": 0},
                                                 json.dumps(SYSTEMD_HOST))
    assert filters["layerline_worker_unit_files"]("w2", [0, 1]) == [launch0["unit"]["path"], launch["unit"]["path"]]


def test_this_machine_and_the_test_hosts_resolve_to_the_supervisor(plan, filters):
    """The probe command the role runs, run here (no systemd PID 1): auto is the supervisor, no unit; and its
    digest of the keys is the layerline_worker module's, so both managers restart on the same change."""
    p, hv, tmp = plan
    host = {**hv["w1"], "ansible_python_interpreter": sys.executable}
    keys = Path(host["layerline_keys_dir"])
    keys.mkdir(parents=True, exist_ok=True)
    (keys / "peer.key").write_text("k1")
    facts = host_facts(host, "w1", filters)
    assert facts["pid1"] != "systemd" and facts["units"] == []
    launch = filters["layerline_worker_launch"](p.to_dict(), "w1", host, json.dumps(facts))
    assert launch["manager"] == "supervisor" and launch["unit"] is None and launch["argv"]
    module = _load("ll_worker_module", ROOT / "modules" / "library" / "layerline_worker.py")
    assert facts["inputs"] == module.inputs_digest([str(keys)], {})
    (keys / "peer.key").write_text("k2")
    assert host_facts(host, "w1", filters)["inputs"] != facts["inputs"]
    with pytest.raises(Exception, match="layerline_service_manager is systemd, but its PID 1 is .*set it to auto"):
        filters["layerline_worker_launch"](p.to_dict(), "w1", {**host, "layerline_service_manager": "systemd"},
                                           json.dumps(facts))


@pytest.mark.parametrize("change, why", [({"root": False}, "root"), ({"booted": False}, "did not boot"),
                                         ({"systemctl": False}, "systemctl"), ({"pid1_ns": False}, "namespace host")])
def test_auto_needs_a_usable_systemctl(change, why, plan, filters):
    """A systemd host the play cannot drive (not root, not booted by systemd, no systemctl, or a namespace host
    on a systemd machine): auto is the supervisor, and a leftover unit of this slot is handed to the role to stop;
    `systemd` says why not."""
    from layerline.units import HostFacts, resolve
    p, hv, _ = plan
    facts = {**SYSTEMD_HOST, **change, "units": [{"name": "layerline-worker-w1.service", "path": "/x"}]}
    launch = filters["layerline_worker_launch"](p.to_dict(), "w1", hv["w1"], json.dumps(facts))
    assert launch["manager"] == "supervisor" and launch["stop_units"] == facts["units"]
    with pytest.raises(LayerlineError, match=f"w1: layerline_service_manager is systemd, but .*{why}"):
        resolve("systemd", HostFacts.parse(json.dumps(facts), "w1"), "w1")


def test_a_host_the_plan_left_out_stops_its_unit(plan, filters):
    p, hv, tmp = plan
    out = {"layerline_port": 29980, "layerline_state_dir": str(tmp / "w9"), "layerline_checkpoint": "/x"}
    units = [{"name": "layerline-worker-w9.service", "path": "/etc/systemd/system/layerline-worker-w9.service"}]
    launch = filters["layerline_worker_launch"](p.to_dict(), "w9", out, json.dumps({**SYSTEMD_HOST, "units": units}))
    assert launch == {"planned": False, "manager": "systemd", "unit": None, "stop_units": units}


def test_the_server_role_writes_a_unit_systemd_accepts(plan, filters, tmp_path):
    _, hv, tmp = plan
    forced = {**hv["w1"], "layerline_home": str(tmp / "home"), "layerline_service_manager": "systemd"}
    launch = filters["layerline_server_launch"](forced, sys.executable, "localhost", json.dumps(SYSTEMD_HOST))
    assert launch["manager"] == "systemd" and launch["unit"]["name"] == "layerline-server-localhost.service"
    assert launch["ready_file"] == os.path.join(launch["state_dir"], "ready.json")
    Path(launch["state_dir"]).mkdir(parents=True, exist_ok=True)
    text = role_writes("layerline_server", launch)
    from layerline.units import Unit
    assert text == launch["unit"]["text"] and verify(tmp_path, Unit(launch["unit"]["name"], text)) == ""
    probe = filters["layerline_server_probe"](forced, sys.executable, "localhost")
    facts = json.loads(subprocess.run(probe, capture_output=True, text=True, timeout=60, check=True).stdout)
    assert filters["layerline_server_launch"](forced | {"layerline_service_manager": "auto"}, sys.executable,
                                              "localhost", json.dumps(facts))["manager"] == "supervisor"


def test_a_changed_unit_or_new_weights_restart_and_nothing_else_does():
    """The roles' start task asks what this decides (supervised workers pass unit_changed false: the module
    compares argv and inputs itself); the filter the roles call gives the same."""
    from layerline.units import service_state
    import importlib.util
    from helpers import ROOT
    assert service_state(False, 0) == service_state(False) == "started"
    assert service_state(True, 0) == service_state(False, 1) == service_state(True, 10) == "restarted"
    spec = importlib.util.spec_from_file_location("_filters", ROOT / "modules" / "filter_plugins" / "layerline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f = mod.FilterModule().filters()["layerline_service_state"]
    assert [f(c, s) for c, s in ((False, 0), (True, 0), (False, "4096"), (False, None))] == \
        ["started", "restarted", "restarted", "started"]
