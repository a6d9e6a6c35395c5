"""bench_decode --profile: which part of a decode step each profiled kernel's time counts for."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_decode import FRAMEWORK, PROFILE_BUCKETS, profile_bucket  # noqa: E402

GEMV, ATTN, ELEM = PROFILE_BUCKETS


@pytest.mark.parametrize("name, bucket", [
    # inductor's GEMM templates and extern oneDNN linears (bf16), its int8 weight-only template
    ("graph_0_gemm_m1n256k1024_kernel", GEMV), ("mkldnn::_linear_pointwise", GEMV), ("graph_1_kernel", GEMV),
    # eager: the ATen calls themselves
    ("aten::mm", GEMV), ("aten::_weight_int8pack_mm", GEMV), ("aten::_weight_int4pack_mm_for_cpu", GEMV),
    ("aten::bmm", ATTN), ("aten::index_copy_", ATTN), ("aten::_scaled_dot_product_flash_attention_for_cpu", ATTN),
    ("graph_0_cpp_fused__softmax__to_copy_arange_le_logical_not_masked_fill_mul_unbind", ATTN),
    # layerline's decode kernels, and the compiled step's attention op (its Python around the kernel)
    ("layerline_cpu::linear_bf16", GEMV), ("layerline_cpu::linear_int8", GEMV),
    ("layerline_cpu::decode_attention", ATTN), ("layerline::rows_attention", ATTN),
    # an elementwise kernel inductor names for the linear op before it is not a GEMV
    ("graph_0_cpp_fused_linear_bf16_mul_silu_split_with_sizes_1", ELEM),
    # RoPE fused with the KV write counts as RoPE; norms, sampling
    ("graph_0_cpp_fused__to_copy_add_cat_cos_index_copy_mul_neg_sin_split_transpose", ELEM),
    ("graph_1_cpp_fused__to_copy_add_mean_mul_pow_rsqrt_view_13", ELEM), ("aten::argmax", ELEM),
    # the graph's Python wrapper, dynamo's guards, allocation: framework
    ("## Call CompiledFxGraph abc ##", None), ("TorchDynamo Cache Lookup", None), ("Torch-Compiled Region: 0/0", None),
    ("aten::empty", None), ("aten::item", None),
])
def test_profile_buckets(name, bucket):
    assert profile_bucket(name) == bucket
    assert FRAMEWORK not in PROFILE_BUCKETS
