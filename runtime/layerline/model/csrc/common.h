// What every op shares: the ISA switch, the tile drivers, argument checks, the split of W's rows
// over torch's threads and the output. Part of the one translation unit layerline_cpu.cpp.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

int64_t g_isa = 0;            // 0: none, 1: AVX2 + FMA, 2: AVX-512 with BF16

int64_t cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni"))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

// Every kernel: rows [n0, n1) of W, each dotted with the M rows of x, into y [M, N] (fp32 or int32
// sums). A tile, Tile<R, MB>::run, is R rows of W against MB rows of x with R x MB sums in
// registers: each weight vector is loaded once for all MB rows of x, so a step of several sequences
// streams W once. Each (row, x row) sum runs over k in the same order for any R and MB, so a row's
// bits do not depend on M or on how the rows are split across threads.
template <template <int, int> class Tile, int R, int MB, typename W, typename X, typename Y>
void tile_rows(const W* w, const X* x, int64_t K, int64_t N, int64_t n0, int64_t n1, Y* y) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) Tile<R, MB>::run(w + n * K, x, K, N, y + n);
  for (; n < n1; ++n) Tile<1, MB>::run(w + n * K, x, K, N, y + n);
}

// x in chunks of up to 8 rows; R1 rows of W a tile for 1 row of x, R3 for 2-3, R4 for 4, R8 for 5-8.
// AVX-512 (32 registers): 4, 4, 4, 2 (16 sums at most); bf16 takes R4 = 2: its 4 x 4 tile read
// slower (docs/kernels.md), int8's not. AVX2 (16 registers): 4, 2, 2, 1, so the sums and
// W's and x's vectors stay in registers
template <template <int, int> class Tile, int R1, int R3, int R4, int R8, typename W, typename X, typename Y>
void tiles(const W* w, const X* x, int64_t K, int64_t M, int64_t N, int64_t n0, int64_t n1, Y* y) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const X* xm = x + m0 * K;
    Y* ym = y + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: tile_rows<Tile, R1, 1>(w, xm, K, N, n0, n1, ym); break;
      case 2: tile_rows<Tile, R3, 2>(w, xm, K, N, n0, n1, ym); break;
      case 3: tile_rows<Tile, R3, 3>(w, xm, K, N, n0, n1, ym); break;
      case 4: tile_rows<Tile, R4, 4>(w, xm, K, N, n0, n1, ym); break;
      case 5: tile_rows<Tile, R8, 5>(w, xm, K, N, n0, n1, ym); break;
      case 6: tile_rows<Tile, R8, 6>(w, xm, K, N, n0, n1, ym); break;
      case 7: tile_rows<Tile, R8, 7>(w, xm, K, N, n0, n1, ym); break;
      default: tile_rows<Tile, R8, 8>(w, xm, K, N, n0, n1, ym);
    }
  }
}

void check(const at::Tensor& x, const at::Tensor& w, int64_t K, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(g_isa > 0, "layerline_cpu: no kernel for this CPU (AVX2 + FMA or AVX-512 BF16 needed)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "layerline_cpu: CPU tensors only");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == K, "layerline_cpu: x [..., K] and w [N, K] expected");
  TORCH_CHECK(K % 32 == 0, "layerline_cpu: K must be a multiple of 32");
  TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->numel() == w.size(0), "layerline_cpu: one bias per row of w");
}

// rows [0, N) in blocks of 4, split over torch's threads; a block streams 4 * K weights. body(n0, n1)
// computes rows [n0, n1) and writes their outputs, while they are in cache.
template <typename F>
void over_rows(int64_t N, int64_t K, F body) {
  int64_t blocks = (N + 3) / 4;
  int64_t grain = std::max<int64_t>(1, 16384 / K);  // at least ~64K weights a task
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { body(b0 * 4, std::min(N, b1 * 4)); });
}

// out[m, n] = sums[m, n] (* xs[m] * ws[n]) (+ bias[n]) in the output's dtype, for n in [n0, n1)
template <typename S, typename T>
void store(const S* sums, int64_t M, int64_t N, int64_t n0, int64_t n1, const float* xs, const float* ws,
           const float* bias, T* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float v = static_cast<float>(sums[m * N + n]);
      if (xs) v = v * xs[m] * ws[n];
      if (bias) v = v + bias[n];
      out[m * N + n] = static_cast<T>(v);
    }
}

// A thread's scratch buffer, kept from call to call while small (a decode step's x codes: no
// allocation a step) and given back after a large one (a prefill's), which the plan does not count
template <typename T>
struct Scratch {
  static constexpr size_t KEEP_BYTES = 1 << 20;
  std::vector<T> v;
  T* get(size_t n) {
    v.resize(n);
    return v.data();
  }
  void done() {
    if (v.capacity() * sizeof(T) > KEEP_BYTES) std::vector<T>().swap(v);
  }
};

// y[m, n] += bias[n] for n in [n0, n1) (no bias: nothing)
inline void add_bias(float* y, int64_t M, int64_t N, int64_t n0, int64_t n1, const float* bias) {
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
}

// y [..., N] in x's dtype, sums [M, N] (the kernels' scratch: y itself where their types agree),
// bias as float (or undefined)
struct Out {
  at::Tensor y, sums, bias;
  Out(const at::Tensor& x, int64_t M, int64_t N, at::ScalarType sum_type, const c10::optional<at::Tensor>& b) {
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    y = at::empty(sizes, x.options());
    sums = x.scalar_type() == sum_type ? y.view({M, N}) : at::empty({M, N}, x.options().dtype(sum_type));
    if (b.has_value() && b->defined()) bias = b->to(at::kFloat).contiguous();
  }
  // y once the kernel left its sums (bias added) in `sums`: converted to y's dtype where it is another
  template <typename S>
  at::Tensor finish(int64_t M, int64_t N) {
    if (sums.data_ptr() != y.data_ptr()) {
      const S* s = sums.data_ptr<S>();
      switch (y.scalar_type()) {
        case at::kBFloat16: store(s, M, N, 0, N, nullptr, nullptr, nullptr, y.data_ptr<at::BFloat16>()); break;
        case at::kHalf: store(s, M, N, 0, N, nullptr, nullptr, nullptr, y.data_ptr<at::Half>()); break;
        default: store(s, M, N, 0, N, nullptr, nullptr, nullptr, y.data_ptr<float>());
      }
    }
    return y;
  }
  const float* b() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  template <typename S>
  void store_rows(int64_t M, int64_t N, int64_t n0, int64_t n1, const float* xs, const float* ws) {
    const S* s = sums.data_ptr<S>();
    switch (y.scalar_type()) {
      case at::kBFloat16: store(s, M, N, n0, n1, xs, ws, b(), y.data_ptr<at::BFloat16>()); break;
      case at::kHalf: store(s, M, N, n0, n1, xs, ws, b(), y.data_ptr<at::Half>()); break;
      default: store(s, M, N, n0, n1, xs, ws, b(), y.data_ptr<float>());
    }
  }
};

// An op over an in-place fp32 core: x [..., K] taken as fp32 rows [M, K], y [..., N] fp32, bias as
// float; core(x, M, y, bias) writes y (the GGUF block ops: gguf_linear, gguf_linear_x8, gguf_linear_x16)
template <typename F>
at::Tensor over_fp32_rows(const at::Tensor& x, int64_t N, int64_t K, const c10::optional<at::Tensor>& bias, F core) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor x2 = xf.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  Out out(xf, M, N, at::kFloat, bias);
  core(x2.data_ptr<float>(), M, out.sums.data_ptr<float>(), out.b());
  return out.finish<float>(M, N);
}

}  // namespace
