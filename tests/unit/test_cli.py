"""The command line as users call it: index and plan read headers only, errors are one line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def cli(*args, ok=True):
    r = subprocess.run([sys.executable, "-m", "layerline.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def caps(name, ram, flops, bw=2e10, disk=None):
    return {"addr": "127.0.0.1", "hostname": name, "os": "linux", "cores": 2, "ram_total_bytes": ram,
            "ram_available_bytes": ram, "disk_free_bytes": 10**12, "disk_read_bytes_per_s": disk,
            "devices": [{"name": "cpu", "kind": "cpu", "memory_bytes": ram, "memory_free_bytes": ram,
                         "flops_per_s": flops, "mem_bw_bytes_per_s": bw}], "probe_seconds": 0.1}


@pytest.fixture
def caps_file(tmp_path):
    def write(data):
        p = tmp_path / "caps.json"
        p.write_text(json.dumps(data))
        return p
    return write


def test_index_json_matches_the_files(small_ckpt):
    out = json.loads(cli("index", small_ckpt, "--json").stdout)
    cfg = json.loads((small_ckpt / "config.json").read_text())
    assert out["num_layers"] == cfg["num_hidden_layers"]
    assert out["cost"]["kv_width"] == 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    size = sum(p.stat().st_size for p in small_ckpt.glob("*.safetensors"))
    assert 0 < out["total_bytes"] < size  # tensor bytes: the files less their headers


def test_plan_from_caps_list_and_object(small_ckpt, caps_file):
    fast, slow = caps("fast", 8 * 2**30, 4e11, 8e10), caps("slow", 8 * 2**30, 1e11, 2e10)
    by_list = json.loads(cli("plan", "--caps", caps_file([fast, slow]), "--checkpoint", small_ckpt,
                             "--json").stdout)
    by_obj = json.loads(cli("plan", "--caps", caps_file({"fast": fast, "slow": slow}), "--checkpoint", small_ckpt,
                            "--json").stdout)
    assert by_list["stages"] == by_obj["stages"]
    layers = {s["host"]: s["layers"][1] - s["layers"][0] for s in by_list["stages"]}
    assert sum(layers.values()) == 4 and layers["fast"] > layers.get("slow", 0), "the fast host takes more"
    uniform = json.loads(cli("plan", "--caps", caps_file([fast, slow]), "--checkpoint", small_ckpt,
                             "--policy", "uniform", "--json").stdout)
    assert [s["layers"] for s in uniform["stages"]] == [[0, 2], [2, 4]]
    assert uniform["bottleneck_s"] >= by_list["bottleneck_s"]
    table = cli("plan", "--caps", caps_file([fast, slow]), "--checkpoint", small_ckpt).stdout
    assert "fast" in table and "not measured" in table and "bottleneck" in table


def test_unfit_plan_is_one_line_with_bytes_short(small_ckpt, caps_file):
    r = cli("plan", "--caps", caps_file([caps("tiny", 10_000, 1e11)]), "--checkpoint", small_ckpt, ok=False)
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line and "bytes short" in line and "Traceback" not in line


@pytest.mark.parametrize("args,field", [
    (["index", "/nonexistent/ckpt"], "layerline_checkpoint"),
    (["plan", "--caps", "/nonexistent.json", "--checkpoint", "."], "--caps"),
    (["demo-checkpoint", "/tmp/x", "--layers", "0"], "--layers"),
])
def test_user_mistakes_are_one_line(args, field):
    r = cli(*args, ok=False)
    assert r.returncode == 2 and field in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0


def test_the_drive_report_filter_does_not_import_torch():
    """deploy.yml's "Show per-stage times" runs the filter in the controller's Ansible process: it reads the
    drive's JSON and prints its lines, and never imports torch (a second a run, layerline.driver's)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('f', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "r = {'stages': [{'stage': 'w1', 'layers': [0, 2], 's': 0.001}], 'tokens': 4, 'wall_s': 0.01, "
            "'hop_s': 0.002, 'max_abs_diff': 0.0, 'tolerance': 1e-3, 'ok': True, 'precision': 'fp32'}; "
            "print(m.FilterModule().filters()['layerline_drive_report'](r)); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(root / "modules" / "filter_plugins" / "layerline.py")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    *lines, imported = r.stdout.strip().splitlines()
    assert lines[0].split() == ["w1", "layers", "0:2", "1.00", "ms"] and lines[-1].endswith(": matches"), lines
    assert imported == "False"


def test_what_the_modules_import_on_a_host_stays_light():
    """Each module run on a host starts an interpreter that imports layerline's part of it: staging (the stage
    module, three runs a host and deploy), probe and cost (the probe module), supervise (the worker module's
    command). None loads numpy, torch, safetensors or gguf (a checkpoint reader's, 0.15 s and more a run), nor
    importlib.metadata and tomllib (the version's, 0.1 s): the package and the checkpoint package load those
    only when asked for."""
    import subprocess
    import sys
    heavy = ("numpy", "torch", "safetensors", "gguf", "tomllib", "importlib.metadata")
    code = ("import sys; import layerline.errors, layerline.staging, layerline.files, layerline.cost, layerline.probe, "
            "layerline.supervise; from layerline.checkpoint import STAGE_MANIFEST, CheckpointIndex; "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
    # and what loads them lazily still answers
    code = ("import layerline; from layerline.checkpoint import HFCheckpoint, GGUFCheckpoint, open_checkpoint; "
            "from layerline.version import package_version; print(layerline.__version__ == package_version())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stdout + r.stderr
