"""Bad inputs through deploy.yml, as users make them: each run fails with one line that names the
field and the fix, prints no traceback and starts no worker. One case for each play that can
refuse (checkpoint, runtime, plan, stage) and a host that cannot be reached; the planner's other refusals (ports, layer
ranges, bytes short) go through the same plan_for_hosts and are in tests/test_bad_inputs.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import playbook

PORT_BASE = 29700  # clear of the demo (29100), test_cluster (29500), molecule (29600)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    from layerline.checkpoint import write_demo_checkpoint
    home = tmp_path_factory.mktemp("baddeploy")
    write_demo_checkpoint(home / "ckpt", layers=4, hidden=64, vocab=300, dtype="float32", seed=4)
    yield home
    # every test here asserts that no worker started: teardown.yml only where one did (a failure)
    if list((home / "state").glob("*/ready.json")):
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


def test_kept_files_cut_short_or_missing(home):
    """route.json (drained hosts, the workers' slot) and plan.json, each read through one filter:
    cut short, or missing where a play needs it, a play stops with the file and the fix before
    touching a host."""
    def refused(book: str, *more: str, says: tuple[str, ...]) -> None:
        r = playbook(book, "-e", json.dumps(_vars(home)), *more, check=False)
        out = " ".join(r.stdout.split())
        assert r.returncode != 0 and all(x in out for x in says), out[-3000:]
        assert "Traceback" not in r.stdout + r.stderr

    route, plan = home / "route.json", home / "plan.json"
    route.write_text('{"slot": 1, "drained": [')
    try:
        refused("drain.yml", "-e", "layerline_drain=w2", says=(f"layerline_route: {route}: not valid JSON (",
                                                                "; remove it to start from slot 0 with no drained hosts"))
    finally:
        route.unlink()
    for book in ("playbooks/serve.yml", "playbooks/drive.yml"):
        refused(book, says=(f"layerline_saved_plan: {plan}: no plan was kept here; run deploy.yml first",))
    plan.write_text("{")
    try:
        refused("playbooks/serve.yml", says=(f"{plan}: not valid JSON (", "; run deploy.yml again to plan anew"))
    finally:
        plan.unlink()
    assert not list((home / "state").glob("*/ready.json")), "nothing started"


def test_a_host_whose_python_lacks_torch(home, tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    inv = _host_vars(home, "bare", {"w2": {"ansible_python_interpreter": str(venv / "bin" / "python")}})
    out = _fails(home, "-i", "inventory", "-i", inv, says="w2: ")
    assert "lacks layerline's dependencies" in out and "torch" in out and "pip install" in out


@pytest.mark.parametrize("bad, says", [
    ({"layerline_precision": "int3"}, "w1: layerline_precision 'int3' is not one of fp32, bf16, fp16, int8, int4"),
    ({"layerline_objective": {"optimize": "fastest"}}, "layerline_objective.optimize: 'fastest' is not one of"),
    ({"layerline_compile": "turbo"}, "w1: layerline_compile 'turbo' must be one of"),
])
def test_a_bad_variable_fails_before_anything_is_measured(home, bad, says):
    out = _fails(home, says=says, **bad)
    assert not any(t in out for t in ("TASK [Read each host's cached probe]", "TASK [Probe]",
                                      "TASK [Read the tensor index")), "checked first"


def test_an_unreachable_host(home):
    # 192.0.2.0/24 is TEST-NET-1: nothing answers there
    inv = _host_vars(home, "gone", {"w9": {"ansible_connection": "ssh", "ansible_host": "192.0.2.1",
                                           "ansible_ssh_common_args": "-o ConnectTimeout=2",
                                           "layerline_runtime_connect_timeout": 4, "layerline_port": PORT_BASE + 40}})
    out = _fails(home, "-i", "inventory", "-i", inv, says="w9: unreachable over ssh at 192.0.2.1 within 4 s")
    assert "check ansible_host" in out


def test_a_disk_that_fills_while_staging(home, tmp_path):
    """w2's stage dir is a 32 KiB tmpfs: its copy fails, the partial file is removed, no worker starts."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(small)], check=True)
    try:
        inv = _host_vars(home, "small", {"w2": {"layerline_stage_dir": str(small)}})
        r = playbook("deploy.yml", "-e", json.dumps(_vars(home, layerline_checkpoint_shared=False)),
                     "-i", "inventory", "-i", inv, check=False)
        out = " ".join(r.stdout.split())
        assert r.returncode != 0 and "Traceback" not in r.stdout + r.stderr, out[-3000:]
        [stage] = list(small.iterdir())   # the stage dir of w2's layers, under its stage root
        assert f"w2: could not write its stage to {stage} ([Errno 28] No space left on device" in out, out[-3000:]
        assert out.count("could not write its stage") <= 2, "one line, for w2 only"   # the task and its recap
        needs = int(out.split("the stage needs ")[1].split()[0])
        assert needs > 32 * 1024 and "set layerline_stage_dir to a disk with room" in out
        # what was copied whole stays (the next run's SHA-1 check keeps it); nothing partial does
        left = sorted(p.name for p in stage.iterdir())
        assert "model.safetensors" not in left and not [n for n in left if n.startswith(".")], left
        assert not list((home / "state").glob("*/ready.json")), "no worker starts"
    finally:
        subprocess.run(["umount", str(small)], check=False)
