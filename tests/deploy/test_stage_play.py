"""playbooks/stage.yml on one local host (no workers, no probe): a stage dir that held a Hugging Face
stage (config.json, model.safetensors) and is then staged a GGUF keeps nothing of the old model and
opens as the GGUF; a re-run changes nothing (three runs of stage.yml, about 55 s on two busy cores).
The Python it calls (layerline.staging.prune_stage / finish_stage, the opener) has its
unit tests in tests/unit/test_stage_dir.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import playbook, recap, tiny_gguf

from layerline.checkpoint import STAGE_MANIFEST, GGUFCheckpoint, open_checkpoint, write_demo_checkpoint


def _plan(layers: int) -> dict:
    """One active stage on w1, the whole model (what plan.yml would hand stage.yml)."""
    return {"precision": "fp32", "objective": "throughput", "policy": "uniform", "num_layers": layers,
            "kv": {"context": 64, "dtype": "fp32", "bytes_per_token": 0},
            "predicted_token_s": 0.0, "bottleneck_s": 0.0,
            "stages": [{"host": "w1", "role": "active", "layers": [0, layers], "device": "cpu", "precision": "fp32",
                        "weight_bytes": 0, "kv_bytes": 0, "kv_dtype": "fp32", "mem_budget_bytes": 0,
                        "predicted_s": 0.0, "endpoint": "tcp://127.0.0.1:29790"}]}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stageplay")
    hf = write_demo_checkpoint(root / "hf", layers=2, hidden=64, vocab=100, dtype="float32", seed=2)
    return {"root": root, "hf": hf, "gguf": tiny_gguf(hf, root / "model.gguf")}


def _stage(root: Path, ckpt: Path) -> tuple[dict, Path]:
    """stage.yml for w1's one stage (layers 0:2 of 2); the host's stage dir of those layers."""
    stage_root = root / "host-w1-checkpoint"
    extra = {"layerline_home": str(root / "home"), "layerline_checkpoint": str(ckpt),
             "layerline_checkpoint_shared": False, "layerline_demo_checkpoint": False,
             "layerline_stage_dir": str(stage_root), "layerline_plan": _plan(2)}
    r = playbook("playbooks/stage.yml", "-l", "w1", "-e", json.dumps(extra))
    return recap(r.stdout)["w1"], stage_root / "layers-0-2-of-2"


def test_staging_another_model_leaves_nothing_of_the_old_one(models):
    root = models["root"]
    _, d = _stage(root, models["hf"])
    assert {"config.json", "model.safetensors"} <= {p.name for p in d.iterdir()}
    _stage(root, models["gguf"])
    assert sorted(p.name for p in d.iterdir()) == sorted(["model.gguf", STAGE_MANIFEST])
    assert isinstance(open_checkpoint(d), GGUFCheckpoint)
    again, _ = _stage(root, models["gguf"])
    assert again["changed"] == 0 and again["failed"] == 0, again

