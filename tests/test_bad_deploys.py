"""Bad inputs through deploy.yml, as users make them: each run fails with one line that names the
field and the fix, prints no traceback, starts no worker and writes no plan. One case for each
play that can refuse (checkpoint, runtime, plan); the planner's other refusals (ports, layer
ranges, bytes short) go through the same plan_for_hosts and are in tests/test_bad_inputs.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import playbook

# tier: e2e (tests/conftest.py marks by module)

PORT_BASE = 29700  # clear of the demo (29100), test_drain (29300), test_e2e_deploy (29400), test_cluster (29500)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    from layerline.checkpoint import write_demo_checkpoint
    home = tmp_path_factory.mktemp("baddeploy")
    write_demo_checkpoint(home / "ckpt", layers=4, hidden=64, vocab=300, dtype="float32", seed=4)
    yield home
    playbook("teardown.yml", "-e", json.dumps(_vars(home)), check=False)


def _vars(home, **more) -> dict:
    return {"layerline_home": str(home), "layerline_checkpoint": str(home / "ckpt"), "layerline_demo_checkpoint": False,
            "layerline_policy": "uniform", "layerline_port_base": PORT_BASE, "layerline_prompt": "",
            "layerline_seq": 4, "layerline_generate": 0, **more}


def _host_vars(home, name: str, hosts: dict) -> str:
    """A second inventory source that sets some hosts' variables over the embedded inventory's."""
    p = home / f"{name}.yml"
    p.write_text(json.dumps({"layerline": {"hosts": hosts}}))
    return str(p)


def _fails(home, *args, says: str, **more) -> str:
    r = playbook("deploy.yml", "-e", json.dumps(_vars(home, **more)), *args, check=False)
    out = " ".join(r.stdout.split())
    assert r.returncode != 0, out[-2000:]
    assert says in out, out[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert not (home / "plan.json").exists(), "a failed run writes no plan"
    assert not list((home / "state").glob("*/ready.json")), "a failed run starts no worker"
    return out


def test_corrupt_config_json(home, tmp_path):
    bad = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(home / "ckpt"), str(bad)], check=True)
    (bad / "config.json").write_text("{not json")
    _fails(home, says="config.json: not valid JSON", layerline_checkpoint=str(bad))


def test_a_host_whose_python_lacks_torch(home, tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    inv = _host_vars(home, "bare", {"w2": {"ansible_python_interpreter": str(venv / "bin" / "python")}})
    out = _fails(home, "-i", "inventory", "-i", inv, says="w2: ")
    assert "lacks layerline's dependencies" in out and "torch" in out and "pip install" in out


def test_unknown_precision(home):
    _fails(home, says="int3", layerline_precision="int3")
