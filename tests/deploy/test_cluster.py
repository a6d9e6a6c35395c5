"""layerline.Cluster over ansible-runner: the default inventory's three local workers, end to end.

The end-to-end flow runs real ansible-runner with a small checkpoint, a private
layerline_home and ports clear of the demo (29100) and molecule (29600).
The rest are fast checks of the parts that need no Ansible.
"""
from __future__ import annotations

import io
import json
import os
import time

import pytest

from helpers import ROOT

from layerline import Cluster, LayerlineError
from layerline.cluster import ClusterError, _failure_msg, _Run

PORT_BASE = 29500  # the demo 29100, molecule default 29600


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from layerline.checkpoint import write_demo_checkpoint
    home = tmp_path_factory.mktemp("cluster")
    ckpt = write_demo_checkpoint(home / "ckpt", layers=6, hidden=128, vocab=500, dtype="float32", seed=5)
    extra = {"layerline_home": str(home), "layerline_checkpoint": str(ckpt), "layerline_demo_checkpoint": False,
             "layerline_port_base": PORT_BASE, "layerline_seq": 10,
             "layerline_policy": "uniform"}  # every host holds layers, whatever the probes measured
    progress = io.StringIO()
    c = Cluster.from_path(ROOT / "inventory", extravars=extra, stream=progress)
    yield c, home, ckpt, progress
    try:
        if list((home / "state").glob("*/ready.json")):   # the test's own teardown did not run to its end
            c.teardown()
    except LayerlineError:
        pass
    c.close()


def test_probe_plan_launch_drive_teardown(cluster):
    c, home, ckpt, progress = cluster

    caps = c.probe()
    assert sorted(caps) == ["w1", "w2", "w3"]
    for cap in caps.values():
        assert cap["cores"] >= 1 and cap["devices"][0]["name"] == "cpu"
        assert cap["disk_read_bytes_per_s"] is None or cap["disk_read_bytes_per_s"] > 0
    assert "[probe] w1 ok" in progress.getvalue()

    plan = c.plan()
    actives = [s for s in plan["stages"] if s["role"] == "active"]
    assert [s["host"] for s in actives] == c.active_nodes() == ["w1", "w2", "w3"]
    assert actives[0]["layers"][0] == 0 and actives[-1]["layers"][1] == plan["num_layers"] == 6
    assert all(a["layers"][1] == b["layers"][0] for a, b in zip(actives, actives[1:]))
    assert json.loads((home / "plan.json").read_text()) == plan
    # `layerline plan` over the same facts and inventory variables makes the very same plan
    (home / "caps.json").write_text(json.dumps(caps))
    (home / "vars.json").write_text(json.dumps({h: {"ansible_connection": "local", "layerline_port": PORT_BASE + 10 * i}
                                                for i, h in enumerate(["w1", "w2", "w3"])}))
    import subprocess
    import sys
    cli = subprocess.run([sys.executable, "-m", "layerline.cli", "plan", "--caps", str(home / "caps.json"),
                          "--vars", str(home / "vars.json"), "--checkpoint", str(ckpt), "--policy", "uniform",
                          "--context", "4096", "--reserve-ram-gb", "1", "--json"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == plan
    table = c.plan_table()
    assert all(h in table for h in ("w1", "w2", "w3")) and "pred/token" in table
    kv = c.kv_profile()
    assert (kv.context, kv.dtype, kv.bytes_per_token) == (plan["kv"]["context"], plan["kv"]["dtype"],
                                                         plan["kv"]["bytes_per_token"])
    argv2 = c.worker_argv("w2")
    assert argv2[argv2.index("--layers") + 1] == "{}:{}".format(*actives[1]["layers"])
    assert argv2[argv2.index("--precision") + 1] == plan["precision"]
    assert c.worker_argv(1) == argv2  # stage index 1 is w2 here

    started = c.launch()
    assert set(started) == {"w1", "w2", "w3"}
    assert (home / "keys" / "controller").is_dir()  # the keys play ran before the workers
    for s in actives:
        recorded = json.loads((home / "state" / s["host"] / "argv.json").read_text())
        assert c.worker_argv(s["host"]) == recorded
    pids = {h: json.loads((home / "state" / h / "ready.json").read_text())["pid"] for h in ("w1", "w2", "w3")}

    import torch
    from layerline.model.loader import load_stage
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(1))
    r = c.drive(ids, generate=3)
    assert [t["stage"] for t in r.stages] == ["w1", "w2", "w3"]
    assert [t["layers"] for t in r.stages] == [s["layers"] for s in actives]
    assert all(t["s"] > 0 for t in r.stages) and r.wall_s >= sum(t["s"] for t in r.stages)
    assert r.logits_shape == [1, 9, 500]
    with torch.no_grad():
        ref = load_stage(str(ckpt), 0, 6, True, True, precision=plan["precision"])(ids)
    assert torch.equal(r.logits.argmax(-1), ref.argmax(-1))
    assert float((r.logits - ref).abs().max()) < 1e-3
    assert len(r.generate["new_tokens"][0]) == 3
    assert r.generate["new_tokens"][0][0] == int(ref[0, -1].argmax())
    # one result shape and one report for the CLI, the drive play and Cluster.drive
    from layerline.driver import drive_report
    report = drive_report(r)
    print(report)
    assert "generated 3 tokens for 1 sequence(s)" in report and report == drive_report(r.to_dict())
    assert json.loads(json.dumps(r.to_dict()))["generate"]["new_tokens"] == r.generate["new_tokens"]
    # the server in front of the same workers, from Python; it answers as the drive generated
    url = c.serve()
    assert url == f"http://127.0.0.1:{PORT_BASE + 90}/v1" == c.endpoint
    from openai import OpenAI
    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    got = client.completions.create(model=client.models.list().data[0].id, prompt=ids[0].tolist(), max_tokens=3,
                                    temperature=0)
    assert got.choices[0].token_ids == r.generate["new_tokens"][0]
    # default inputs: layerline_seq ids drawn with layerline_rng_seed, as the drive play does
    assert c.drive().logits_shape == [1, 10, 500]

    # a failing play: one line naming the host, the task and the field, not a traceback
    c.extravars["layerline_policy"] = "bogus"
    try:
        with pytest.raises(ClusterError) as err:
            c.plan()
    finally:
        c.extravars["layerline_policy"] = "uniform"
    e = err.value
    # checked before anything is measured (playbooks/checkpoint.yml), not at the plan
    assert e.host == "w1" and e.task == "Check every host's layerline variables" and "layerline_policy" in e.msg \
        and "bogus" in e.msg
    assert "\n" not in str(e) and "Traceback" not in str(e)
    assert c.active_nodes() == ["w1", "w2", "w3"]  # the last good plan stays

    stopped = c.teardown()
    assert set(stopped) == {"w1", "w2", "w3"}
    deadline = time.time() + 10
    for h, pid in pids.items():
        assert not (home / "state" / h / "ready.json").exists()
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --- no Ansible below ----------------------------------------------------------------------------

def _fake(plan_stages, tmp_path) -> Cluster:
    c = Cluster.from_path(ROOT / "inventory", data_dir=tmp_path / "data", quiet=True)
    c._plan = {"precision": "bf16", "objective": "throughput", "policy": "manual", "num_layers": 6,
               "kv": {"context": 64, "dtype": "bf16", "bytes_per_token": 512, "source": "index"},
               "stages": plan_stages, "predicted_token_s": 0.01, "bottleneck_s": 0.005}
    c._report = {s["host"]: {"argv": ["python", "-m", "layerline.worker", "--layers",
                                      f"{s['layers'][0]}:{s['layers'][1]}", "--name", s["host"]]}
                 for s in plan_stages}
    return c


def _stage(host, a, b, role="active", standby_for=None):
    return {"host": host, "role": role, "layers": [a, b], "device": "cpu", "precision": "bf16",
            "weight_bytes": 1, "kv_bytes": 1, "mem_budget_bytes": 2, "predicted_s": 0.001,
            "standby_for": standby_for, "endpoint": "tcp://127.0.0.1:1", "disk_read_bytes_per_s": None}


def test_worker_argv_looks_up_by_host_name_not_position(tmp_path):
    # inventory order w1 w2 w3, but w2 is a standby for w3: stage 1 is w3, never "the second host"
    c = _fake([_stage("w1", 0, 3), _stage("w3", 3, 6), _stage("w2", 3, 6, "standby", "w3")], tmp_path)
    assert c.active_nodes() == ["w1", "w3"]
    assert "3:6" in c.worker_argv("w3") and c.worker_argv("w3")[-1] == "w3"
    assert c.worker_argv(1) == c.worker_argv("w3")
    assert c.worker_argv("w2")[-1] == "w2"
    with pytest.raises(LayerlineError, match="w4: not in the plan"):
        c.worker_argv("w4")
    with pytest.raises(LayerlineError, match="the plan has 3 stages"):
        c.worker_argv(3)
    kv = c.kv_profile()
    assert (kv.context, kv.dtype, kv.bytes_per_token, kv.source) == (64, "bf16", 512, "index")


def test_no_plan_yet_says_what_to_call(tmp_path):
    c = Cluster.from_path(ROOT / "inventory", data_dir=tmp_path, quiet=True)
    for call in (c.plan_table, c.active_nodes, lambda: c.worker_argv("w1"), c.drive, c.kv_profile):
        with pytest.raises(LayerlineError, match=r"no plan yet: call plan\(\)"):
            call()


def test_drive_rejects_bad_inputs(tmp_path):
    c = _fake([_stage("w1", 0, 6)], tmp_path)
    c._index = {"cost": {"vocab_size": 100}}
    for bad, match in (([1.5, 2.0], "integer token ids"), ([], r"shape \[1, 0\]"), ([5, 100], "0..99"),
                       ("abc", "token ids")):
        with pytest.raises(LayerlineError, match=match):
            c.drive(bad)


def test_from_config_writes_the_inventory_and_checks_it(tmp_path):
    with pytest.raises(LayerlineError, match="no group 'layerline'"):
        Cluster.from_config({"workers": {"hosts": {"a": {}}}}, data_dir=tmp_path / "x")
    with pytest.raises(LayerlineError, match="set layerline_checkpoint"):
        Cluster.from_config({"layerline": {"hosts": {"a": {}}}}, data_dir=tmp_path / "y")
    c = Cluster.from_config({"layerline": {"hosts": {"a": {"ansible_connection": "local"}},
                                           "vars": {"layerline_checkpoint": "/models/m"}}},
                            data_dir=tmp_path / "z", quiet=True)
    import yaml
    inv = yaml.safe_load(c.inventory.read_text())
    assert c.inventory.parent == tmp_path / "z" / "inventory"
    assert inv["layerline"]["hosts"] == {"a": {"ansible_connection": "local"}}
    assert inv["all"]["vars"]["layerline_home"] == str(tmp_path / "z" / "home")
    assert "layerline_checkpoint" not in inv["all"]["vars"]  # the group's own value stands


def test_from_path_errors_are_one_line(tmp_path):
    with pytest.raises(LayerlineError, match="no such file or directory"):
        Cluster.from_path(tmp_path / "nope")
    with pytest.raises(LayerlineError, match="project_dir .*no deploy.yml"):
        Cluster.from_path(ROOT / "inventory", project_dir=tmp_path)


def test_temp_data_dir_is_removed_on_close():
    c = Cluster.from_path(ROOT / "inventory", quiet=True)
    d = c.data_dir
    assert d.is_dir()
    c.close()
    assert not d.exists()


def test_progress_lines_and_failure_messages():
    out = io.StringIO()
    run = _Run("probe", out, "/x/plays/001-probe.yml")
    run.handler({"event": "playbook_on_task_start",
                 "event_data": {"task": "Probe", "task_uuid": "u1", "task_path": "/r/playbooks/probe.yml:12"}})
    run.handler({"event": "runner_on_ok", "event_data": {"host": "w1", "task": "Probe", "task_uuid": "u1",
                                                          "task_action": "layerline_probe",
                                                          "res": {"changed": False, "ansible_facts": {
                                                              "layerline_caps": {"cores": 2}}}}})
    keep = run.handler({"event": "runner_on_failed", "event_data": {
        "host": "w2", "task": "Probe", "task_uuid": "u1", "task_action": "layerline_probe",
        "res": {"msg": "--device cuda:3: this host has 0 CUDA device(s); use one of them or cpu"}}})
    run.handler({"event": "runner_on_ok", "event_data": {"host": "w3", "task": "Report", "task_uuid": "u2",
                                                          "task_path": "/x/plays/001-probe.yml:9", "res": {}}})
    assert out.getvalue().splitlines() == ["[probe] Probe", "[probe] w1 ok", "[probe] w2 failed", "[cluster] w3 ok"]
    assert keep is True  # failures stay in the artifacts
    assert run.facts("layerline_caps") == {"w1": {"cores": 2}}
    assert run.failures[0].host == "w2" and "cuda:3" in run.failures[0].msg
    # Ansible's template wrapping is peeled off; a command's stderr stands in for "non-zero return code"
    wrapped = ("Task failed: Finalization of task args for 'ansible.builtin.set_fact' failed: Error while "
               "resolving value for 'layerline_plan': The filter plugin 'layerline_plan' failed: "
               "layerline_plan: layerline_policy: 'bogus' is not one of auto")
    assert _failure_msg({"msg": wrapped}) == "layerline_plan: layerline_policy: 'bogus' is not one of auto"
    assert _failure_msg({"msg": "non-zero return code", "stderr": "Traceback\n...\nlayerline index: /m: no config.json"}) \
        == "non-zero return code: layerline index: /m: no config.json"
    assert _failure_msg({"results": [{"failed": False}, {"failed": True, "msg": "item two"}]}) == "item two"
