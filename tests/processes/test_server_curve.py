"""The server over stages that speak only CURVE: the controller's keys for the data path and for
every stage's health op (stage names learnt by following each worker's next hop)."""
from __future__ import annotations

import os
import shutil
import sys

import httpx
import pytest

from layerline.checkpoint import write_demo_checkpoint
from layerline.cli import local_stages, stop_local

sys.path.insert(0, os.path.dirname(__file__))
from test_server import Server  # noqa: E402


@pytest.fixture(scope="module")
def curve_stages(tmp_path_factory):
    ckpt = write_demo_checkpoint(tmp_path_factory.mktemp("curve") / "m", layers=2, hidden=64, vocab=300,
                                 dtype="float32", seed=2)
    procs, first, tmp, _ = local_stages(str(ckpt), 2, "fp32", threads=1, curve="on")
    try:
        yield ckpt, first, os.path.join(tmp, "keys", "controller")
    finally:
        stop_local(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def test_serve_over_curve(curve_stages, tmp_path):
    ckpt, first, keys = curve_stages
    srv = Server(["--first", first, "--first-key", "stage0", "--keys", keys, "--curve", "on",
                  "--checkpoint", str(ckpt), "--model-name", "m"], tmp_path)
    try:
        srv.wait()
        h = httpx.get(srv.url + "/health", timeout=20)
        assert h.status_code == 200 and [s["name"] for s in h.json()["stages"]] == ["stage0", "stage1"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4,
                                                          "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text[:500]
        assert len(r.json()["choices"][0]["token_ids"]) == 4
    finally:
        srv.stop()


def test_curve_without_keys_is_one_line(curve_stages, tmp_path):
    import subprocess
    _, first, _ = curve_stages
    r = subprocess.run([sys.executable, "-m", "layerline.server", "--first", first, "--curve", "on"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--keys" in r.stderr, r.stderr
