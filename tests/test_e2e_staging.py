"""deploy.yml with layerline_checkpoint_shared false on the embedded default inventory: each host
gets only its own layers' tensors, once, and a staged file corrupted after shipping is shipped again.
A file of its own so that `make test` runs it beside tests/test_e2e_deploy.py's deploys."""
from __future__ import annotations

import json

from helpers import playbook

# tier: e2e (tests/conftest.py marks by module)


def test_weight_staging_ships_only_each_stage(tmp_path_factory):
    """layerline_checkpoint_shared false: each host gets only its own layers' tensors, once."""
    from layerline.checkpoint import read_index, write_demo_checkpoint
    home = tmp_path_factory.mktemp("staged")
    ckpt = write_demo_checkpoint(home / "ckpt", layers=6, hidden=256, vocab=2000, dtype="bfloat16", seed=5)
    extra = ["-e", json.dumps({"layerline_home": str(home), "layerline_checkpoint": str(ckpt),
                               "layerline_checkpoint_shared": False, "layerline_demo_checkpoint": False,
                               "layerline_policy": "uniform",  # every host gets a stage to ship
                               "layerline_port_base": 29460, "layerline_seq": 8, "layerline_generate": 0,
                               "layerline_prompt": ""})]
    try:
        first = playbook("deploy.yml", *extra)
        out = " ".join(first.stdout.split())
        plan = json.loads((home / "plan.json").read_text())
        shipped = 0
        # probed before staging, each host timed the disk its stage lands on (not "not measured")
        assert all(s["disk_read_bytes_per_s"] for s in plan["stages"]), plan["stages"]
        for s in plan["stages"]:
            staged = home / "state" / s["host"] / "checkpoint"
            idx = read_index(staged, check=False)  # one stage's tensors, not a whole model
            layers = {t.layer for t in idx.tensors.values() if t.layer is not None}
            assert layers == set(range(*s["layers"])), f"{s['host']} holds only its own layers"
            assert ("model.embed_tokens.weight" in idx.tensors) == (s["layers"][0] == 0)
            assert ("lm_head.weight" in idx.tensors) == (s["layers"][1] == plan["num_layers"])
            argv = json.loads((home / "state" / s["host"] / "argv.json").read_text())
            assert argv[argv.index("--checkpoint") + 1] == str(staged)
            shipped += sum(p.stat().st_size for p in staged.iterdir())
        total = read_index(ckpt).total_bytes
        assert f"shipped {shipped} bytes to 3 hosts; the whole model is {total} bytes" in out
        assert "matches" in out and "DOES NOT MATCH" not in out
        # a staged file corrupted after shipping: its SHA-1 differs, so it alone is shipped again
        w2 = home / "state" / "w2" / "checkpoint" / "model.safetensors"
        size = w2.stat().st_size
        with open(w2, "r+b") as f:
            f.seek(size // 2)
            f.write(b"\xff" * 64)
        again = playbook("deploy.yml", *extra)
        out = " ".join(again.stdout.split())
        assert f"shipped {size} bytes to 3 hosts" in out, out[-3000:]
        assert "matches" in out and "DOES NOT MATCH" not in out
        assert w2.read_bytes() == (home / "stages" / "w2" / "model.safetensors").read_bytes(), "repaired"
    finally:
        playbook("teardown.yml", *extra, check=False)
