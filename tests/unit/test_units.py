"""layerline.units: the systemd units of a plan's workers and of the server, checked by systemd itself
(`systemd-analyze verify`: a unit it would refuse or a setting it would ignore fails here), and the
choice of service manager."""
from __future__ import annotations

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
