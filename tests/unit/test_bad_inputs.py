"""A matrix of bad inputs through the command line, as users make them: each ends in one line on
stderr that names the field (and what to do), exit status 2, no traceback, nothing written.
deploy.yml's cases live in tests/test_bad_deploys.py."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from layerline.checkpoint import write_demo_checkpoint
from layerline.cli import main


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("good") / "ck", layers=4, hidden=64, vocab=300,
                                 dtype="float32", seed=2)


def caps(name: str, ram: int = 8 << 30) -> dict:
    return {"addr": "127.0.0.1", "hostname": name, "os": "linux", "cores": 2, "ram_total_bytes": ram,
            "ram_available_bytes": ram, "disk_free_bytes": 10**12, "disk_read_bytes_per_s": None,
            "devices": [{"name": "cpu", "kind": "cpu", "memory_bytes": ram, "memory_free_bytes": ram,
                         "flops_per_s": 1e11, "mem_bw_bytes_per_s": 2e10}], "probe_seconds": 0.1}


def _ckpt(good: Path, tmp: Path, mutate) -> Path:
    out = tmp / "ck"
    shutil.copytree(good, out)
    mutate(out)
    return out


def _config(d: Path, **change) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in change.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _weights(d: Path) -> Path:
    return next(d.glob("*.safetensors"))


def _truncate(d: Path) -> None:
    w = _weights(d)
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])


def _bad_header(d: Path) -> None:
    w = _weights(d)
    data = w.read_bytes()
    w.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])


def _wrong_shape(d: Path) -> None:
    from safetensors.torch import load_file, save_file
    w = _weights(d)
    t = load_file(str(w))
    name = next(k for k in t if k.endswith("layers.0.mlp.down_proj.weight"))
    t[name] = t[name][:, :-1].contiguous()
    save_file(t, str(w), metadata={"format": "pt"})


def _gguf_text(d: Path) -> None:
    (d / "model.gguf").write_text("this is not a GGUF file\n")


CHECKPOINT_CASES = {
    "missing config.json": (lambda d: (d / "config.json").unlink(), "config.json"),
    "corrupt config.json": (lambda d: (d / "config.json").write_text("{not json"), "config.json"),
    "config.json without hidden_size": (lambda d: _config(d, hidden_size=None), "hidden_size"),
    "unknown architecture": (lambda d: _config(d, model_type="gpt9", architectures=["Gpt9ForCausalLM"]), "gpt9"),
    "truncated safetensors": (_truncate, ".safetensors"),
    "safetensors header that lies": (_bad_header, ".safetensors"),
    "a tensor shape the config does not give": (_wrong_shape, "down_proj"),
    "no weights at all": (lambda d: _weights(d).unlink(), "safetensors"),
    "layer count beyond the weights": (lambda d: _config(d, num_hidden_layers=9), "layer"),
}


def run(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"exit {code}: {err}"
    assert err and "\n" not in err, f"not one line: {err!r}"
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_bad_checkpoint_is_one_line(case, good, tmp_path, capsys):
    mutate, field = CHECKPOINT_CASES[case]
    ck = _ckpt(good, tmp_path, mutate)
    before = sorted(p.name for p in ck.iterdir())
    # the index (headers only) and the planner both refuse it
    for argv in (["index", ck], ["plan", "--caps", _caps_file(tmp_path, [caps("a"), caps("b")]), "--checkpoint", ck]):
        err = run(capsys, *argv)
        assert field in err, f"{case}: {err}"
    assert sorted(p.name for p in ck.iterdir()) == before, "nothing written beside the checkpoint"


def test_missing_checkpoint_and_a_gguf_that_is_not_one(tmp_path, capsys):
    assert "layerline_checkpoint" in run(capsys, "index", tmp_path / "nowhere")
    (tmp_path / "x.gguf").write_text("this is not a GGUF file\n")
    assert "x.gguf" in run(capsys, "index", tmp_path / "x.gguf")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 10, 10) + b"\x00" * 20)
    assert "cut.gguf" in run(capsys, "index", tmp_path / "cut.gguf")


def _caps_file(tmp: Path, data) -> Path:
    p = tmp / "caps.json"
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def _vars_file(tmp: Path, data: dict) -> Path:
    p = tmp / "vars.json"
    p.write_text(json.dumps(data))
    return p


TWO = {"a": {"layerline_port": 9100}, "b": {"layerline_port": 9110}}
PLAN_CASES = {
    "two hosts on one port": ({"a": {"layerline_port": 9100}, "b": {"layerline_port": 9101}}, [], "layerline_port"),
    "overlapping layerline_layers": ({"a": {"layerline_layers": "0:3"}, "b": {"layerline_layers": "2:4"}},
                                     ["--policy", "manual"], "layerline_layers"),
    "layers out of the model": ({"a": {"layerline_layers": "0:2"}, "b": {"layerline_layers": "2:9"}},
                                ["--policy", "manual"], "layerline_layers"),
    "manual policy without layers": (TWO, ["--policy", "manual"], "layerline_layers"),
    "unknown precision": ({"a": {"layerline_precision": "int3"}, "b": {}}, [], "int3"),
    "a port that is not a number": ({"a": {"layerline_port": "http"}, "b": {}}, [], "layerline_port"),
    "zero threads": ({"a": {}, "b": {"layerline_threads": 0}}, [], "layerline_threads"),
    "an unknown role": ({"a": {}, "b": {"layerline_role": "boss"}}, [], "layerline_role"),
    "a standby for nobody": ({"a": {}, "b": {"layerline_role": "standby", "layerline_standby_for": "zz"}}, [],
                             "layerline_standby_for"),
    "a RAM cap that is not a number": ({"a": {}, "b": {"layerline_max_ram_gb": "lots"}}, [], "layerline_max_ram_gb"),
    "every host draining": ({"a": {"layerline_role": "draining"}, "b": {"layerline_role": "draining"}}, [],
                            "no active hosts"),
}


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_bad_plan_input_is_one_line(case, good, tmp_path, capsys):
    hv, extra, field = PLAN_CASES[case]
    err = run(capsys, "plan", "--caps", _caps_file(tmp_path, [caps("a"), caps("b")]), "--checkpoint", good,
              "--vars", _vars_file(tmp_path, hv), *extra)
    assert field in err, f"{case}: {err}"


def test_unfit_model_says_the_bytes_short(good, tmp_path, capsys):
    err = run(capsys, "plan", "--caps", _caps_file(tmp_path, [caps("a", 1 << 20), caps("b", 1 << 20)]),
              "--checkpoint", good)
    assert "bytes short" in err


@pytest.mark.parametrize("data,field", [("{not json", "--caps"), ('{"a": {"cores": 2}}', "a"),
                                        ("[]", "--caps")])
def test_bad_caps_file_is_one_line(data, field, good, tmp_path, capsys):
    assert field in run(capsys, "plan", "--caps", _caps_file(tmp_path, data), "--checkpoint", good)


@pytest.mark.parametrize("argv,field", [
    (["--local-stages", "0", "--input-ids", "1,2"], "--local-stages"),
    (["--input-ids", "1,x"], "--input-ids"),
    (["--input-ids", "1,100000"], "--input-ids"),
    (["--precision", "int3", "--input-ids", "1,2"], "int3"),
    (["--max-new-tokens", "-1", "--input-ids", "1,2"], "--max-new-tokens"),
    (["--temperature", "-1", "--input-ids", "1,2"], "--temperature"),
    (["--top-p", "0", "--input-ids", "1,2"], "--top-p"),
    (["--prompt", "hello"], "tokenizer"),
    ([], "--input-ids"),
])
def test_bad_generate_flags_are_one_line(argv, field, good, capsys):
    """Refused before any worker starts."""
    assert field in run(capsys, "generate", "--checkpoint", good, *argv)
