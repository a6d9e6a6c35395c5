// The layerline_cpu ops: registration, shape-only (Meta) versions for torch.compile, the ISA switch.
// One translation unit: each op's file is included here rather than compiled alone, since every
// translation unit re-parses ATen's headers, which take longer to compile than the kernels.
#include "common.h"
#include "simd.h"
#include "linear.h"
#include "int4.h"
#include "x16.h"
#include "attention.h"
#include "norm_rope.h"
#include "gguf_blocks.h"
#include "layer.h"
#include "pick.h"

namespace {

at::Tensor rope_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&) {
  return at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor&, double) {
  return at::empty_like(x, x.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& w) {
  auto sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return at::empty(sizes, x.options());
}
at::Tensor linear_bf16_meta(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>&) {
  return linear_meta(x, w);
}
at::Tensor linear_int8_meta(const at::Tensor& x, const at::Tensor& q, const at::Tensor&,
                            const c10::optional<at::Tensor>&) {
  return linear_meta(x, q);
}
at::Tensor linear_int4_meta(const at::Tensor& x, const at::Tensor& codes, const at::Tensor&,
                            const c10::optional<at::Tensor>&) {
  return linear_meta(x, codes);
}
at::Tensor gguf_linear_q4_meta(const at::Tensor& x, const at::Tensor&, int64_t N, int64_t, int64_t,
                               const c10::optional<at::Tensor>&) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return at::empty(sizes, x.options().dtype(at::kFloat));
}
at::Tensor gguf_linear_x16_meta(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, int64_t,
                                 const c10::optional<at::Tensor>& bias) {
  return gguf_linear_q4_meta(x, w, N, K, 0, bias);
}

// the ISA the kernels use: the best this CPU has, capped at `cap`
int64_t use_isa(int64_t cap) {
  g_isa = std::min(cap, cpu_isa());
  return g_isa;
}

}  // namespace

TORCH_LIBRARY(layerline_cpu, m) {
  m.def("linear_bf16(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("linear_int8(Tensor x, Tensor q, Tensor scale, Tensor? bias=None) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor codes, Tensor sz, Tensor? bias=None) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!)[] kc, Tensor(b!)[] vc, int[] pos, int[] lo, "
        "float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("use_isa(int cap) -> int", &use_isa);
  m.def("gguf_linear(Tensor x, Tensor w, int N, int K, int row_bytes, int xrow_bytes, int vec_dot, "
        "int from_float, Tensor? bias=None) -> Tensor");
  m.def("gguf_linear_x8(Tensor x, Tensor w, int N, int K, int row_bytes, int xrow_bytes, int gemv, int gemm, "
        "int quant4, int from_float, Tensor? bias=None) -> Tensor");
  m.def("gguf_repack_x8(Tensor raw, int type, int N, int K) -> Tensor");
  m.def("gguf_linear_q4(Tensor x, Tensor w, int N, int K, int kind, Tensor? bias=None) -> Tensor");
  m.def("gguf_linear_x16(Tensor x, Tensor w, int N, int K, int type, Tensor? bias=None) -> Tensor");
  m.def("argmax_rows(Tensor x) -> (Tensor, Tensor)");
  m.class_<DecodeLayer>("DecodeLayer")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double, bool, bool>())
      .def("norm", &DecodeLayer::norm)
      .def("linear", &DecodeLayer::linear)
      .def("ready", &DecodeLayer::ready)
      .def("step", &DecodeLayer::step);
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add", &DecodeStack::add)
      .def("step", &DecodeStack::step)
      .def("chunk", &DecodeStack::chunk);
}
TORCH_LIBRARY_IMPL(layerline_cpu, CPU, m) {
  m.impl("linear_bf16", linear_bf16);
  m.impl("linear_int8", linear_int8);
  m.impl("linear_int4", linear_int4);
  m.impl("decode_attention", decode_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("rope", rope);
  m.impl("gguf_linear", gguf_linear);
  m.impl("gguf_linear_x8", gguf_linear_x8);
  m.impl("gguf_repack_x8", gguf_repack_x8);
  m.impl("gguf_linear_q4", gguf_linear_q4);
  m.impl("gguf_linear_x16", gguf_linear_x16);
  m.impl("argmax_rows", argmax_rows);
}
TORCH_LIBRARY_IMPL(layerline_cpu, Meta, m) {
  m.impl("linear_bf16", linear_bf16_meta);
  m.impl("linear_int8", linear_int8_meta);
  m.impl("linear_int4", linear_int4_meta);
  m.impl("rms_norm", rms_norm_meta);
  m.impl("rope", rope_meta);
  m.impl("gguf_linear", gguf_linear_meta);
  m.impl("gguf_linear_x8", gguf_linear_x8_meta);
  m.impl("gguf_linear_q4", gguf_linear_q4_meta);
  m.impl("gguf_linear_x16", gguf_linear_x16_meta);
}
