"""The one precision table (layerline.precision): what the cost model, the loader, the stage and the
worker each read from it agree, and the layering holds (cost stays torch-free; the model does not
import the cost model)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from layerline import cost, precision
from layerline.errors import LayerlineError
from layerline.model import COMPILE_MODES
from layerline.model.llama import ModelArgs, Stage
from layerline.model.loader import precision_name, resolve_precision


def test_the_table():
    t = precision.PRECISIONS
    assert list(t) == ["fp32", "bf16", "fp16", "int8", "int4", "gguf"]
    assert {n: (p.compute, p.weight_bytes, p.quantized, p.kv, p.row_bytes, p.edge_precision)
            for n, p in t.items() if not p.stored} == {
        "fp32": ("float32", 4.0, False, "fp32", 0, "fp32"), "bf16": ("bfloat16", 2.0, False, "bf16", 0, "bf16"),
        "fp16": ("float16", 2.0, False, "fp16", 0, "fp16"), "int8": ("bfloat16", 1.0, True, "bf16", 4, "int8"),
        # int4: two weights a byte + a bf16 scale and zero per 32; embedding and head held at int8
        "int4": ("bfloat16", 0.625, True, "bf16", 0, "int8")}
    # gguf: the file's own blocks, whose bytes the cost model takes from the index
    assert [n for n, p in t.items() if p.stored] == ["gguf"] and t["gguf"].quantized
    # computed in float32 as llama.cpp does; its KV cache in the activations' dtype (the decode kernel's)
    assert (t["gguf"].compute, t["gguf"].kv) == ("float32", "fp32")
    assert cost.PRECISION_BYTES == {n: p.weight_bytes for n, p in t.items()}
    assert cost.KV_DTYPE_BYTES == {"fp32": 4, "bf16": 2, "fp16": 2, "float32": 4, "bfloat16": 2, "float16": 2}
    assert COMPILE_MODES == ("off", "default", "max-autotune") and not hasattr(cost, "COMPILE_MODES")


@pytest.mark.parametrize("name,dtype,kv", [("fp32", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.bfloat16),
                                           ("half", torch.float16, torch.float16), ("int8", torch.bfloat16, torch.bfloat16),
                                           ("int4", torch.bfloat16, torch.bfloat16)])
def test_loader_stage_and_worker_read_the_same_row(name, dtype, kv):
    assert resolve_precision(name) == dtype
    p = precision.precision(name)
    assert precision_name(name) == p.name
    assert precision.torch_dtype(precision.kv_name(name)) == kv
    args = ModelArgs(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None, max_position_embeddings=32,
                     attention_bias=False, tie_word_embeddings=False)
    with torch.device("meta"):
        st = Stage(args, 0, 1, True, True, dtype, quant=p.name if p.quantized else None)
    assert st.kv_dtype == kv  # int8 and int4 are weight-only: a bf16 KV cache


def test_kv_rule_and_overrides():
    assert precision.kv_name("int8") == "bf16"
    assert precision.kv_name("int8", "float32") == "fp32"
    with pytest.raises(LayerlineError, match="--kv-dtype int4: must be one of fp32, bf16, fp16"):
        precision.kv_name("bf16", "int4")
    with pytest.raises(LayerlineError, match="--precision fp8: unknown; choose one of fp32, bf16, fp16, int8, int4, gguf$"):
        precision.precision("fp8")
    c = cost.ModelCost(num_layers=1, stored_precision="bf16", dense_params=[100], expert_params=[0], rows=[10],
                       embed_params=0, head_params=0, kv_width=8)
    assert cost.kv_profile(c, cost.CostOptions(), "int8").dtype == "bf16"
    assert cost.kv_profile(c, cost.CostOptions(), "fp32").bytes_per_token == 8 * 4
    assert cost.weight_bytes(c, 0, "int8") == 100 + 10 * precision.QUANT_ROW_BYTES
    assert cost.weight_bytes(c, 0, "bf16") == 200
    assert cost.weight_bytes(c, 0, "int4") == 62  # 100 x 0.625: group scales inside, nothing per row
    c.embed_params, c.head_params, c.tied_embeddings = 1000, 10, False
    assert cost.edge_bytes(c, "int4", True, True) == cost.edge_bytes(c, "int8", True, True) == 1010


def test_cost_is_torch_free_and_the_model_does_not_import_it():
    checks = ("import sys, layerline.cost, layerline.precision, layerline.model; "
              "assert 'torch' not in sys.modules, 'cost or the precision table loads torch'",
              "import sys, layerline.model.llama, layerline.model.loader; "
              "assert 'layerline.cost' not in sys.modules, 'the model imports the cost model'")
    for code in checks:  # each in a fresh interpreter
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
