"""A host's stage dir holds only its current stage (layerline.staging.prune_stage / finish_stage, what the
layerline_stage module runs there), and open_checkpoint reads a stage dir's format and files from its
manifest: a dir that once held a Hugging Face stage and is then given a GGUF stage opens as the GGUF,
and a staging that did not finish is refused, never opened as the model that was there before."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import tiny_gguf

from layerline.checkpoint import (STAGE_MANIFEST, CheckpointError, GGUFCheckpoint, HFCheckpoint, open_checkpoint,
                                  write_demo_checkpoint)
from layerline.errors import LayerlineError
from layerline.staging import finish_stage, prune_stage, stage_checkpoint


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    hf = write_demo_checkpoint(root / "hf", layers=2, hidden=64, vocab=100, dtype="float32", seed=1)
    return {"hf": hf, "gguf": tiny_gguf(hf, root / "model.gguf")}


def ship(src: Path, host_dir: Path, manifest: dict) -> list[str]:
    """What playbooks/tasks/stage.yml does on a host: prune, copy each listed file, finish."""
    removed = prune_stage(host_dir, manifest)
    for name in manifest["files"]:
        shutil.copyfile(src / name, host_dir / name)
    finish_stage(host_dir, manifest)
    return removed


def test_a_dir_staged_hf_then_gguf_holds_and_opens_as_the_gguf(models, tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    hf_man = stage_checkpoint(str(models["hf"]), 0, 2, True, True, str(tmp_path / "cut-hf"))
    assert ship(tmp_path / "cut-hf", host, hf_man) == []
    assert isinstance(open_checkpoint(host), HFCheckpoint)
    (host / ".ansible_tmp1234model.safetensors").write_bytes(b"partial")  # what a failed copy leaves

    gg_man = stage_checkpoint(str(models["gguf"]), 0, 2, True, True, str(tmp_path / "cut-gguf"))
    removed = ship(tmp_path / "cut-gguf", host, gg_man)
    assert "config.json" in removed and "model.safetensors" in removed and STAGE_MANIFEST in removed
    assert ".ansible_tmp1234model.safetensors" in removed
    assert sorted(p.name for p in host.iterdir()) == sorted(["model.gguf", STAGE_MANIFEST])
    ck = open_checkpoint(host)
    assert isinstance(ck, GGUFCheckpoint) and ck.path == host / "model.gguf"
    assert json.loads((host / STAGE_MANIFEST).read_text())["format"] == "gguf"
    # the same stage again: nothing to remove, nothing written
    assert prune_stage(host, gg_man) == [] and finish_stage(host, gg_man) is False


def test_the_manifest_decides_the_format_whatever_else_lies_there(models, tmp_path):
    """Stale Hugging Face files beside a GGUF stage (a dir pruned by hand, an older layerline) do not
    make it open as the old model; a Hugging Face stage reads only the safetensors files it lists."""
    host = tmp_path / "host"
    host.mkdir()
    gg_man = stage_checkpoint(str(models["gguf"]), 0, 2, True, True, str(tmp_path / "cut-gguf"))
    ship(tmp_path / "cut-gguf", host, gg_man)
    for f in models["hf"].iterdir():
        shutil.copyfile(f, host / f.name)
    assert isinstance(open_checkpoint(host), GGUFCheckpoint)

    host2 = tmp_path / "host2"
    host2.mkdir()
    hf_man = stage_checkpoint(str(models["hf"]), 1, 2, False, True, str(tmp_path / "cut-hf"))
    ship(tmp_path / "cut-hf", host2, hf_man)
    shutil.copyfile(host2 / "model.safetensors", host2 / "old-model-00001-of-00002.safetensors")
    ck = open_checkpoint(host2, check=False)
    assert isinstance(ck, HFCheckpoint) and [p.name for p in ck.source_files()] == ["model.safetensors"]


def test_an_unfinished_staging_is_refused_not_opened_as_the_old_model(models, tmp_path):
    host = tmp_path / "host"
    host.mkdir()
    hf_man = stage_checkpoint(str(models["hf"]), 0, 2, True, True, str(tmp_path / "cut-hf"))
    ship(tmp_path / "cut-hf", host, hf_man)
    (host / "model.safetensors").unlink()   # the copy of the new stage failed after the prune ...
    with pytest.raises(CheckpointError, match="lacks model.safetensors .* stage it again"):
        open_checkpoint(host)
    with pytest.raises(LayerlineError, match="missing after the copy"):
        finish_stage(host, hf_man)
    gg_man = stage_checkpoint(str(models["gguf"]), 0, 2, True, True, str(tmp_path / "cut-gguf"))
    prune_stage(host, gg_man)                # ... or before: the old manifest goes with the old files
    assert not (host / STAGE_MANIFEST).exists()


def test_a_manifest_with_a_path_for_a_name_is_refused(tmp_path):
    (tmp_path / "keep").write_text("x")
    with pytest.raises(LayerlineError, match="not a plain file name"):
        prune_stage(tmp_path, {"files": {"../etc/passwd": {"bytes": 1}}})
    assert (tmp_path / "keep").exists()
