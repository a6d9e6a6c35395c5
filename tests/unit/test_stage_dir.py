"""A host's stage dir holds only its current stage (layerline.staging.prune_stage / finish_stage, what the
layerline_stage module runs there), and open_checkpoint reads a stage dir's format and files from its
manifest: a dir that once held a Hugging Face stage and is then given a GGUF stage opens as the GGUF,
and a staging that did not finish is refused, never opened as the model that was there before."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import tiny_gguf

from layerline.checkpoint import (STAGE_MANIFEST, CheckpointError, GGUFCheckpoint, HFCheckpoint, open_checkpoint,
                                  write_demo_checkpoint)
from layerline.errors import LayerlineError
from layerline.staging import files_to_send, finish_stage, install_files, prune_stage, stage_checkpoint
from layerline.planner import Plan


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    hf = write_demo_checkpoint(root / "hf", layers=2, hidden=64, vocab=100, dtype="float32", seed=1)
    return {"hf": hf, "gguf": tiny_gguf(hf, root / "model.gguf")}


def ship(src: Path, host_dir: Path, manifest: dict, landing: Path | None = None) -> list[str]:
    """What layerline_stage's state shipped does on a host: prune, send each file the dir lacks into a
    temporary dir (`landing`; Ansible's on the host), install them, finish."""
    removed = prune_stage(host_dir, manifest)
    landing = landing or host_dir.parent / f"{host_dir.name}-landing"
    landing.mkdir(exist_ok=True)
    sent = {}
    for name in files_to_send(host_dir, manifest)[0]:
        sent[name] = str(shutil.copyfile(src / name, landing / name))
    install_files(host_dir, manifest, sent)
    finish_stage(host_dir, manifest)
    return removed


@pytest.mark.parametrize("landing", ["same filesystem", "another filesystem"])
def test_installing_checks_each_file_and_never_leaves_part_of_one(models, tmp_path, landing, monkeypatch):
    """install_files moves what was sent into the stage dir, 0600, after checking its size and SHA-1
    against the manifest (a file that arrived other than listed is refused and not installed); from
    another filesystem (/dev/shm here) it goes through a temporary file in the dir, which a failure
    removes, and the files installed before the failure stay whole."""
    import tempfile
    cut = tmp_path / "cut"
    man = stage_checkpoint(str(models["hf"]), 0, 2, True, True, str(cut))
    host = tmp_path / "host"
    host.mkdir(mode=0o700)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if landing == "another filesystem" else tmp_path) as d:
        land = Path(d)
        bad = bytearray((cut / "model.safetensors").read_bytes())
        bad[100] ^= 1
        (land / "model.safetensors").write_bytes(bytes(bad))
        with pytest.raises(LayerlineError, match="arrived as .* with another SHA-1"):
            install_files(host, man, {"model.safetensors": str(land / "model.safetensors")})
        assert not (host / "model.safetensors").exists()
        with pytest.raises(LayerlineError, match="not a file of this stage"):
            install_files(host, man, {"other.bin": str(land / "model.safetensors")})
        assert ship(cut, host, man, land) == []
        assert files_to_send(host, man) == ({}, [])
        assert all((host / n).stat().st_mode & 0o777 == 0o600 for n in man["files"])
        assert open_checkpoint(str(host)).index.num_layers == 2
        if os.geteuid() == 0:   # sent as the login user, installed through become: the file is root's, as a copy's
            (host / "config.json").unlink()
            shutil.copyfile(cut / "config.json", land / "config.json")
            os.chown(land / "config.json", 65534, 65534)
            install_files(host, man, {"config.json": str(land / "config.json")})
            assert (host / "config.json").stat().st_uid == 0
        if landing == "another filesystem":   # a copy that fails part-way (a full disk) leaves nothing partial
            (host / "model.safetensors").unlink()
            shutil.copyfile(cut / "model.safetensors", land / "model.safetensors")
            real = shutil.copyfile

            def full(a, b):
                real(a, b)
                raise OSError(28, "No space left on device")
            with monkeypatch.context() as m, pytest.raises(OSError, match="No space left"):
                m.setattr(shutil, "copyfile", full)
                install_files(host, man, {"model.safetensors": str(land / "model.safetensors")})
            assert sorted(p.name for p in host.iterdir()) == sorted(n for n in [*man["files"], STAGE_MANIFEST]
                                                                    if n != "model.safetensors")


def test_the_copy_sends_only_the_files_the_dir_lacks_whole(models, tmp_path):
    """A rerun sends nothing; a file missing, cut short, of other bytes at its size, or not a file is
    sent again; a whole file of another mode is made 0600 (not in a dry run) and not sent."""
    cut = tmp_path / "cut"
    man = stage_checkpoint(str(models["hf"]), 0, 2, True, True, str(cut))
    host = tmp_path / "host"
    host.mkdir()
    assert files_to_send(host, man) == (man["files"], [])
    ship(cut, host, man)
    assert files_to_send(host, man) == ({}, [])
    w = host / "model.safetensors"
    w.chmod(0o644)
    assert files_to_send(host, man, dry_run=True) == ({}, ["model.safetensors"]) and w.stat().st_mode & 0o777 == 0o644
    assert files_to_send(host, man) == ({}, ["model.safetensors"]) and w.stat().st_mode & 0o777 == 0o600
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0xFF
    w.write_bytes(bytes(data))                                     # its size, other bytes
    (host / "config.json").write_bytes((host / "config.json").read_bytes()[:-1])   # cut short
    assert files_to_send(host, man)[0] == {n: man["files"][n] for n in ("config.json", "model.safetensors")}
    ship(cut, host, man)
    w.unlink()
    w.mkdir()                                                      # not a file
    (w / "x").write_text("x")
    assert list(files_to_send(host, man)[0]) == ["model.safetensors"]
    ship(cut, host, man)                                           # the dir goes, the file takes its place
    assert w.is_file() and files_to_send(host, man) == ({}, [])


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


# -- one stage dir per layer range (layerline.settings.stage_name), swept once a plan commits -------------------


def _plan(stages: list[tuple[str, str, list[int], str | None]], slot: int = 0) -> Plan:
    """A 6-layer plan of (host, role, layers, standby_for) stages, on the ports of `slot`."""
    return Plan.from_dict({
        "precision": "fp32", "objective": "throughput", "policy": "uniform", "num_layers": 6,
        "kv": {"context": 64, "dtype": "fp32", "bytes_per_token": 0}, "predicted_token_s": 0.0, "bottleneck_s": 0.0,
        "stages": [{"host": h, "role": role, "layers": ls, "device": "cpu", "precision": "fp32", "weight_bytes": 0,
                    "kv_bytes": 0, "kv_dtype": "fp32", "mem_budget_bytes": 0, "predicted_s": 0.0, "standby_for": sb,
                    "endpoint": f"tcp://127.0.0.1:{29800 + 10 * i + 50 * slot}"}
                   for i, (h, role, ls, sb) in enumerate(stages)]})


def _hvars(slot: int, shared: bool = False) -> dict:
    return {"ansible_connection": "local", "layerline_checkpoint": "/srv/ckpt", "layerline_state_dir": "/s/w4",
            "layerline_checkpoint_shared": shared, "layerline_slot": slot}


def _opens(plan, host: str, slot: int, shared: bool = False) -> str:
    from layerline.spec import worker_spec
    argv = list(worker_spec(plan, host, _hvars(slot, shared)).argv)
    return argv[argv.index("--checkpoint") + 1]


def test_a_drain_that_moves_a_hosts_layers_stages_them_beside_the_ones_its_worker_opened():
    """The bug: a drain that gave a host (a standby among them) new layers in slot 1 staged them into the one
    stage dir its slot-0 worker had opened, so a failed drain left that worker's stage holding the new layers
    (one of its restarts then could not load what it ran). Now each layer range has its own dir: the two
    slots' workers of a re-planned host open different dirs, and a host whose layers stay opens the one it has
    (a drain copies nothing to it)."""
    from layerline.spec import stage_dir, stages_kept
    before = _plan([("w1", "active", [0, 2], None), ("w2", "active", [2, 4], None), ("w3", "active", [4, 6], None),
                    ("w4", "standby", [4, 6], "w3")])
    after = _plan([("w1", "active", [0, 3], None), ("w3", "active", [3, 6], None), ("w4", "standby", [3, 6], "w3")],
                  slot=1)
    old, new = _opens(before, "w4", 0), _opens(after, "w4", 1)
    assert old == "/s/w4/checkpoint/layers-4-6-of-6" and new == "/s/w4/checkpoint/layers-3-6-of-6"
    assert stage_dir(after, "w4", _hvars(1)) == new, "staging ships where the worker opens"
    kept = _plan([("w1", "active", [0, 3], None), ("w4", "active", [3, 6], None)], slot=1)
    assert _opens(kept, "w4", 1) == new, "the same layers in the other slot: the same stage"
    # once the drain committed, the root keeps the new stage alone; a host out of the plan keeps none
    assert stages_kept(after, "w4", _hvars(1)) == {"root": "/s/w4/checkpoint", "keep": ["layers-3-6-of-6"],
                                                    "sweep": True}
    assert stages_kept(after, "w2", _hvars(1))["keep"] == []
    # a shared checkpoint: every worker opens the model itself, and no stage root is swept
    assert _opens(after, "w4", 1, shared=True) == "/srv/ckpt"
    assert stages_kept(after, "w4", _hvars(1, shared=True))["sweep"] is False


def test_sweeping_a_stage_root_keeps_only_the_stages_named(tmp_path):
    from layerline.staging import sweep_stages
    root = tmp_path / "checkpoint"
    for name in ("layers-4-6-of-6", "layers-3-6-of-6"):
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_bytes(b"x")
    for name in ("model.safetensors", STAGE_MANIFEST):   # an older layerline's stage, in the root itself
        (root / name).write_bytes(b"{}")
    gone = ["layers-4-6-of-6", STAGE_MANIFEST, "model.safetensors"]
    assert sweep_stages(root, ["layers-3-6-of-6"], dry_run=True) == sorted(gone)
    assert len(list(root.iterdir())) == 4, "a dry run removes nothing"
    assert sweep_stages(root, ["layers-3-6-of-6"]) == sorted(gone)
    assert [p.name for p in root.iterdir()] == ["layers-3-6-of-6"]
    assert (root / "layers-3-6-of-6" / "model.safetensors").read_bytes() == b"x"
    assert sweep_stages(root, ["layers-3-6-of-6"]) == [], "swept already: nothing to do"
    assert sweep_stages(tmp_path / "none", []) == []
    with pytest.raises(LayerlineError, match="'../x' is not a stage dir name"):
        sweep_stages(root, ["../x"])
