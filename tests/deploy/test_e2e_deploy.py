"""deploy.yml on the embedded default inventory, as a user runs it: plan, stage, launch, drive, re-run,
teardown. layerline_checkpoint_shared is false here (every other e2e run shares the checkpoint), so the
same deploys prove weight staging: each host gets only its own layers' tensors, once, and a staged file
corrupted after shipping is shipped again."""
from __future__ import annotations

import json
import os

import pytest

import signal
import subprocess
import time

from helpers import BIN, ROOT, ansible_env, playbook, recap


@pytest.fixture(scope="module")
def run_vars(tmp_path_factory):
    """A run of its own: small checkpoint, private state dirs, ports clear of a running demo."""
    from layerline.checkpoint import write_demo_checkpoint
    home = tmp_path_factory.mktemp("e2e")
    ckpt = write_demo_checkpoint(home / "ckpt", layers=6, hidden=256, vocab=2000, dtype="bfloat16", seed=3)
    # layerline_policy uniform: all three workers hold layers (2 each) whatever the probes measure;
    # under auto the planner may validly leave a host out of a model this small.
    extra = json.dumps({"layerline_home": str(home), "layerline_checkpoint": str(ckpt),
                        "layerline_demo_checkpoint": False, "layerline_policy": "uniform",
                        "layerline_checkpoint_shared": False,
                        "layerline_port_base": 29400, "layerline_prompt": "",  # random ids: no tokenizer
                        "layerline_seq": 12, "layerline_generate": 4, "layerline_sequences": 2,
                        "layerline_sampling": {"temperature": 0.8, "top_p": 0.9}})
    yield home, ["-e", extra]
    playbook("teardown.yml", "-e", extra, check=False)


def _pids(home):
    out = {}
    for h in ("w1", "w2", "w3", "server"):
        ready = home / "state" / h / "ready.json"
        out[h] = json.loads(ready.read_text())["pid"] if ready.exists() else None
    return out


def test_deploy_drive_idempotent_teardown(run_vars):
    home, extra = run_vars
    first = playbook("deploy.yml", *extra)
    plan = json.loads((home / "plan.json").read_text())
    actives = [s for s in plan["stages"] if s["role"] == "active"]
    assert [s["host"] for s in actives] == ["w1", "w2", "w3"], "three workers, in inventory order"
    assert [s["layers"] for s in actives] == [[0, 2], [2, 4], [4, 6]], "policy uniform: two layers each"
    assert actives[0]["layers"][0] == 0 and actives[-1]["layers"][1] == plan["num_layers"] == 6
    # the plan table and the drive report reach the user
    out = " ".join(first.stdout.split())  # the yaml callback folds long lines
    assert "pred/token" in out and "predicted token time" in out
    assert "max |logits - one-process forward|" in out and "matches" in out
    assert "DOES NOT MATCH" not in out
    # the drive also generated for two sequences together and saved what it did
    drive = json.loads((home / "drive.json").read_text())
    assert "for 2 sequence(s)" in out and len(drive["generate"]["new_tokens"]) == 2
    assert all(len(t) == 4 for t in drive["generate"]["new_tokens"]) and drive["generate"]["tokens_per_s"] > 0
    staged_only_own_layers(home, plan, out)
    # every worker runs with the plan's precision and layers
    pids = _pids(home)
    for s in actives:
        ready = json.loads((home / "state" / s["host"] / "ready.json").read_text())
        assert ready["precision"] == s["precision"] == plan["precision"]
        assert ready["layers"] == s["layers"]
        os.kill(ready["pid"], 0)
        argv = json.loads((home / "state" / s["host"] / "argv.json").read_text())
        assert argv[argv.index("--precision") + 1] == plan["precision"]
    # the deployed server answers the official OpenAI client with the one-process greedy tokens
    from openai import OpenAI
    import torch
    from layerline.model.loader import load_stage
    assert "serving at http://127.0.0.1:29490/v1" in out and "curl -s http://127.0.0.1:29490/v1/completions" in out
    client = OpenAI(base_url="http://127.0.0.1:29490/v1", api_key="unused", max_retries=0, timeout=60)
    [model] = [m.id for m in client.models.list().data]
    got = client.completions.create(model=model, prompt=[5, 17, 3, 99], max_tokens=4, temperature=0)
    ids = torch.tensor([[5, 17, 3, 99]])
    full = load_stage(str(home / "ckpt"), 0, 6, True, True, precision=plan["precision"])
    from layerline.model import cpu_kernels
    for s in actives:  # each worker says which decode kernels it runs: those of this machine
        assert json.loads((home / "state" / s["host"] / "ready.json").read_text())["kernels"] == cpu_kernels.status()
    with torch.no_grad():
        for _ in range(4):
            ids = torch.cat([ids, full(ids)[:, -1:].argmax(-1)], dim=1)
    assert got.choices[0].token_ids == ids[0, 4:].tolist() and got.usage.completion_tokens == 4
    # nothing changed: nothing restarts (workers nor server), the play reports no change
    second = playbook("deploy.yml", *extra)
    counts = recap(second.stdout)
    assert set(counts) == {"w1", "w2", "w3"}
    assert all(c["changed"] == 0 and c["failed"] == 0 for c in counts.values()), second.stdout[-3000:]
    assert "shipped 0 bytes to 3 hosts" in " ".join(second.stdout.split()), "staged once"
    assert _pids(home) == pids
    # teardown stops every worker and the server
    playbook("teardown.yml", *extra)
    for h, pid in pids.items():
        assert not (home / "state" / h / "ready.json").exists()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def staged_only_own_layers(home, plan: dict, out: str) -> None:
    """Each host holds only its own layers' tensors (the first the embedding, the last the head),
    its worker loads them, and the run reports the bytes shipped against the whole model."""
    from layerline.checkpoint import read_index
    # probed before staging, each host timed the disk its stage lands on (not "not measured")
    assert all(s["disk_read_bytes_per_s"] for s in plan["stages"]), plan["stages"]
    shipped = 0
    for s in plan["stages"]:
        staged = home / "state" / s["host"] / "checkpoint"
        idx = read_index(staged, check=False)  # one stage's tensors, not a whole model
        assert {t.layer for t in idx.tensors.values() if t.layer is not None} == set(range(*s["layers"]))
        assert ("model.embed_tokens.weight" in idx.tensors) == (s["layers"][0] == 0)
        assert ("lm_head.weight" in idx.tensors) == (s["layers"][1] == plan["num_layers"])
        argv = json.loads((home / "state" / s["host"] / "argv.json").read_text())
        assert argv[argv.index("--checkpoint") + 1] == str(staged)
        shipped += sum(p.stat().st_size for p in staged.iterdir())
    total = read_index(home / "ckpt").total_bytes
    assert f"shipped {shipped} bytes to 3 hosts; the whole model is {total} bytes" in out


def test_controller_killed_mid_deploy_then_run_again(run_vars):
    """The controller dies (SIGKILL) while the workers start; the next deploy.yml converges: every
    worker serves the plan, the drive matches, and no half-written file is left in layerline_home.
    Then a drive against other weights than the workers serve fails: the check can fail."""
    home, extra = run_vars
    p = subprocess.Popen([str(BIN / "ansible-playbook"), "deploy.yml", *extra], cwd=ROOT, env=ansible_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, deadline = [], time.monotonic() + 300
    try:
        for line in p.stdout:
            seen.append(line)
            if "Start the worker" in line or time.monotonic() > deadline:
                break
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
    assert any("Start the worker" in line for line in seen), "".join(seen)[-3000:]
    # a staged file corrupted after shipping: its SHA-1 differs, so it alone is shipped again
    w2 = home / "state" / "w2" / "checkpoint" / "model.safetensors"
    size = w2.stat().st_size
    with open(w2, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * 64)
    again = playbook("deploy.yml", *extra)
    out = " ".join(again.stdout.split())
    assert "matches" in out and "DOES NOT MATCH" not in out
    assert f"shipped {size} bytes to 3 hosts" in out, out[-3000:]
    assert w2.read_bytes() == (home / "stages" / "w2" / "model.safetensors").read_bytes(), "repaired"
    plan = json.loads((home / "plan.json").read_text())
    for s in plan["stages"]:
        assert json.loads((home / "state" / s["host"] / "ready.json").read_text())["layers"] == s["layers"]
    left = [str(f) for f in home.rglob("*") if ".tmp" in f.name or f.name.startswith(".ansible_tmp")]
    assert not left, left

    # the drive's check can fail: drive.yml on its own reads the saved plan, and its reference now
    # reads other weights than the workers serve
    from layerline.checkpoint import write_demo_checkpoint
    other = write_demo_checkpoint(home / "other", layers=6, hidden=256, vocab=2000, dtype="bfloat16", seed=4)
    r = playbook("playbooks/drive.yml", *extra, "-e", f"layerline_checkpoint={other}", check=False)
    assert r.returncode != 0
    out = " ".join(r.stdout.split())  # the yaml callback folds long lines
    assert "DOES NOT MATCH" in out and "over the bf16 tolerance" in out
