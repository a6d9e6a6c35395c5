"""layerline.probe (NodeCaps self-report) and the layerline_probe Ansible module."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from layerline.errors import LayerlineError
from layerline.probe import NODECAPS_KEYS, DEVICE_KEYS, primary_ipv4, probe

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
BUDGET = 0.2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_file({"w": torch.zeros(1024, 1024)}, str(ckpt / "model-00001-of-00002.safetensors"))  # 4 MiB
    save_file({"b": torch.zeros(16)}, str(ckpt / "model-00002-of-00002.safetensors"))
    (ckpt / "config.json").write_text("{}")
    return ckpt


@pytest.fixture(scope="module")
def caps(checkpoint) -> dict:
    return probe(str(checkpoint), budget_s=BUDGET)


def test_probe_reports_every_nodecaps_key_with_sane_values(caps):
    for key in NODECAPS_KEYS:
        assert key in caps, key
    json.dumps(caps)  # the worker's --probe prints exactly this
    assert isinstance(caps["addr"], str) and caps["addr"] == primary_ipv4()
    assert caps["hostname"] and caps["os"]
    with open("/proc/sys/kernel/random/boot_id") as fh:  # one kernel: one machine's cores
        assert caps["machine_id"] == fh.read().strip()
    assert isinstance(caps["cores"], int) and caps["cores"] >= 1
    assert 0 < caps["ram_available_bytes"] <= caps["ram_total_bytes"]
    assert isinstance(caps["disk_free_bytes"], int) and caps["disk_free_bytes"] > 0
    rate = caps["disk_read_bytes_per_s"]
    assert rate is None or rate > 0
    assert isinstance(caps["disk_read_cached"], bool)
    assert 0 < caps["probe_seconds"] < 30

    cpu = caps["devices"][0]
    assert set(DEVICE_KEYS) <= set(cpu)
    assert (cpu["name"], cpu["kind"]) == ("cpu", "cpu")
    assert cpu["memory_bytes"] == caps["ram_total_bytes"]
    assert cpu["memory_free_bytes"] == caps["ram_available_bytes"]
    # a decode layer's fixed cost, measured on CPUs; None where a busy machine's timings of the small
    # and the large layers did not separate (probe._decode_rates says so rather than guess)
    assert cpu["layer_overhead_s"] is None or 0 < cpu["layer_overhead_s"] < 0.01, cpu
    for dev in caps["devices"]:
        assert dev["flops_per_s"] > 1e6, dev
        assert dev["mem_bw_bytes_per_s"] > 1e6, dev
        if dev["kind"] == "cuda":
            assert dev["name"].startswith("cuda:")


def test_disk_speed_is_null_not_zero_when_unmeasured(tmp_path):
    nothing = probe(None, budget_s=0.05, addr="10.1.2.3")
    assert nothing["disk_read_bytes_per_s"] is None
    assert nothing["addr"] == "10.1.2.3"
    off = probe(str(tmp_path), budget_s=0.05, measure_disk=False)
    assert off["disk_read_bytes_per_s"] is None and off["disk_free_bytes"] > 0
    # A checkpoint whose parent is not there either: free space of the filesystem it will
    # land on, but no scratch file written into some far ancestor.
    later = probe(str(tmp_path / "not" / "yet"), budget_s=0.05)
    assert later["disk_free_bytes"] > 0 and later["disk_read_bytes_per_s"] is None
    assert list(tmp_path.iterdir()) == []


def test_a_host_without_the_checkpoint_times_the_disk_it_will_land_on(tmp_path):
    """With layerline_checkpoint_shared false the probe runs before staging: the stage dir is
    not there yet, its parent (the state dir) is. A scratch file there is timed, then removed."""
    for target in (tmp_path / "checkpoint", tmp_path):  # not made yet; made but empty
        caps = probe(str(target), budget_s=0.1)
        assert caps["disk_read_bytes_per_s"] is not None and caps["disk_read_bytes_per_s"] > 0
        assert list(tmp_path.iterdir()) == [], "the scratch file must not stay behind"


def test_disk_speed_measured_on_checkpoint_file(checkpoint, caps):
    from layerline.probe import _checkpoint_sample_file

    assert _checkpoint_sample_file(str(checkpoint)).endswith("model-00001-of-00002.safetensors")
    assert caps["disk_read_bytes_per_s"] is not None and caps["disk_read_bytes_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3", "cuda+cpu"])
def test_missing_cuda_device_raises(device):
    with pytest.raises(LayerlineError, match="layerline_device"):
        probe(device=device, budget_s=0.05)


def test_cuda_index_beyond_count_raises():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(LayerlineError, match=r"layerline_device.*cpu"):
        probe(device=f"cuda:{count}", budget_s=0.05)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu:0"])
def test_unknown_device_names_the_field(device):
    with pytest.raises(LayerlineError, match="layerline_device"):
        probe(device=device, budget_s=0.05)


# --- the Ansible module, run for real ---------------------------------------------------

def _ansible_env() -> dict:
    env = dict(os.environ)
    env.update(
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_STDOUT_CALLBACK="ansible.builtin.minimal",
        ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
        ANSIBLE_CALLBACK_RESULT_FORMAT="json",
        ANSIBLE_DEPRECATION_WARNINGS="0",
        ANSIBLE_NOCOLOR="1",
    )
    return env


def _run_module(args: str, check: bool = True) -> tuple[int, dict]:
    proc = subprocess.run(
        [str(VENV_BIN / "ansible"), "localhost", "-i", "localhost,", "-c", "local",
         "-m", "layerline_probe", "-a", args,
         "-e", f"ansible_python_interpreter={sys.executable}"],
        cwd=REPO, env=_ansible_env(), capture_output=True, text=True, timeout=120,
    )
    _, sep, payload = proc.stdout.partition("=>")
    assert sep, f"no result in ansible output:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(payload)
    if check:
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return proc.returncode, result


def test_module_returns_caps_and_uses_its_cache(checkpoint, tmp_path):
    cache = tmp_path / "state" / "caps.json"
    args = f"checkpoint={checkpoint} cache_file={cache} budget_s={BUDGET}"
    _, first = _run_module(args)
    assert first["changed"] is False and first["cached"] is False
    caps = first["ansible_facts"]["layerline_caps"]
    for key in NODECAPS_KEYS:
        assert key in caps, key
    assert caps["devices"][0]["flops_per_s"] > 0
    assert caps["disk_read_bytes_per_s"] is None or caps["disk_read_bytes_per_s"] > 0
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    # the cache's dir is the host's state dir: made 0700, and made private again on a cached run
    assert stat.S_IMODE(cache.parent.stat().st_mode) == 0o700
    cache.parent.chmod(0o755)

    _, second = _run_module(args)
    assert second["cached"] is True and stat.S_IMODE(cache.parent.stat().st_mode) == 0o700
    assert second["ansible_facts"]["layerline_caps"]["probe_seconds"] == caps["probe_seconds"]

    # measure=false only reads: a matching cache's facts, else cached false, no facts and nothing written
    # (the probe play reads every host's cache at once, then measures in turn where none matched)
    code, read = _call_module({"checkpoint": str(checkpoint), "cache_file": str(cache), "budget_s": BUDGET,
                               "measure": False})
    assert code == 0 and read["cached"] is True
    assert read["ansible_facts"]["layerline_caps"]["probe_seconds"] == caps["probe_seconds"]
    for other in ({"budget_s": 0.05}, {"budget_s": BUDGET, "refresh": True}):
        before = cache.read_bytes()
        code, miss = _call_module({"checkpoint": str(checkpoint), "cache_file": str(cache), **other, "measure": False})
        assert code == 0 and miss["cached"] is False and "ansible_facts" not in miss, miss
        assert cache.read_bytes() == before
    code, none = _call_module({"cache_file": str(tmp_path / "none" / "caps.json"), "measure": False})
    assert code == 0 and none["cached"] is False and not (tmp_path / "none" / "caps.json").exists()

    # refresh=true measures again; so do different options (in-process, to keep this fast).
    code, third = _call_module({"checkpoint": str(checkpoint), "cache_file": str(cache), "budget_s": BUDGET,
                                "refresh": True})
    assert code == 0 and third["cached"] is False
    assert third["ansible_facts"]["layerline_caps"]["probe_seconds"] != caps["probe_seconds"]
    code, fourth = _call_module({"checkpoint": str(checkpoint), "cache_file": str(cache), "budget_s": 0.05,
                                 "measure_disk": False})
    assert code == 0 and fourth["cached"] is False
    assert fourth["ansible_facts"]["layerline_caps"]["disk_read_bytes_per_s"] is None
    # Check mode still returns facts but leaves the cache file alone.
    before = cache.read_bytes()
    code, fifth = _call_module({"cache_file": str(cache), "budget_s": 0.05, "_ansible_check_mode": True})
    assert code == 0 and "layerline_caps" in fifth["ansible_facts"]
    assert cache.read_bytes() == before
    # a shared dir (sticky, as /tmp) is never narrowed: the module says so and leaves it
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    code, sixth = _call_module({"cache_file": str(shared / "caps.json"), "budget_s": 0.05})
    assert code == 1 and "is a shared dir (mode 1777); give a dir of its own" in sixth["msg"]
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and not (shared / "caps.json").exists()


def _load_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("layerline_probe_module", REPO / "modules/library/layerline_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _call_module(args: dict) -> tuple[int, dict]:
    """Run the module's main() in this process, as Ansible's unit tests do."""
    import contextlib
    import io

    from ansible.module_utils.testing import patch_module_args

    mod = _load_module()
    out = io.StringIO()
    with patch_module_args(args), contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        mod.main()
    return exit_info.value.code, json.loads(out.getvalue())


def test_module_fails_with_the_fix_for_a_missing_gpu():
    if torch.cuda.is_available():
        pytest.skip("host has CUDA")
    code, result = _call_module({"device": "cuda:0"})
    assert code != 0 and result["failed"] is True
    assert "layerline_device" in result["msg"] and "cpu" in result["msg"]


def test_module_names_the_interpreter_when_layerline_is_missing(monkeypatch):
    mod = _load_module()
    monkeypatch.setattr(mod, "LAYERLINE_IMPORT_ERROR", "ModuleNotFoundError: No module named 'layerline'")
    import contextlib
    import io

    from ansible.module_utils.testing import patch_module_args

    out = io.StringIO()
    with patch_module_args({}), contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        mod.main()
    msg = json.loads(out.getvalue())["msg"]
    assert sys.executable in msg and "layerline_runtime" in msg and "ansible_python_interpreter" in msg


def test_ansible_doc_renders():
    proc = subprocess.run(
        [str(VENV_BIN / "ansible-doc"), "-M", "modules/library", "--json", "layerline_probe"],
        cwd=REPO, env=_ansible_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)["layerline_probe"]
    assert set(doc["doc"]["options"]) >= {"checkpoint", "device", "addr", "budget_s", "cache_file", "refresh"}
    assert doc["examples"] and doc["return"]


def test_step_factors_are_recorded_in_the_cache_and_survive_a_new_probe(checkpoint, tmp_path):
    from layerline.probe import carry_step_factors, with_step_factor
    caps = {"addr": "x", "devices": [{"name": "cpu"}, {"name": "cuda:0"}]}
    one = with_step_factor(caps, "cpu", "int8/off", 0.7)
    two = with_step_factor(one, "cpu", "bf16/default", 0.4)
    assert caps["devices"][0] == {"name": "cpu"}, "a copy"
    assert two["devices"][0]["step_factors"] == {"int8/off": 0.7, "bf16/default": 0.4}
    assert "step_factors" not in two["devices"][1]
    assert with_step_factor(caps, "cuda:3", "bf16/off", 1.0) == caps
    fresh = carry_step_factors(two, {"devices": [{"name": "cpu", "step_factors": {"int8/off": 0.9}}]})
    assert fresh["devices"][0]["step_factors"] == {"int8/off": 0.9, "bf16/default": 0.4}
    assert carry_step_factors(None, {"devices": []}) == {"devices": []}

    # the module: record_step writes measured / (predicted / factor) into the cached caps
    cache = tmp_path / "caps.json"
    step = {"precision": "int8", "compile": "default", "measured_s": "0.006", "predicted_s": 0.02, "factor": 2.0}
    code, none = _call_module({"cache_file": str(cache), "record_step": step})
    assert code == 0 and none["step_factor"] is None and not cache.exists(), "nothing to record into yet"
    args = {"checkpoint": str(checkpoint), "cache_file": str(cache), "budget_s": 0.05, "measure_disk": False}
    code, first = _call_module(args)
    assert code == 0
    code, rec = _call_module({"cache_file": str(cache), "record_step": step})
    assert code == 0 and rec["changed"] is False and rec["step_factor"] == 0.6
    code, bad = _call_module({"cache_file": str(cache), "record_step": dict(step, measured_s=None)})
    assert code == 0 and bad["step_factor"] is None
    code, again = _call_module(args)
    assert again["cached"] is True
    assert again["ansible_facts"]["layerline_caps"]["devices"][0]["step_factors"] == {"int8/default": 0.6}
    code, fresh = _call_module(dict(args, refresh=True))
    assert fresh["cached"] is False
    assert fresh["ansible_facts"]["layerline_caps"]["devices"][0]["step_factors"] == {"int8/default": 0.6}
