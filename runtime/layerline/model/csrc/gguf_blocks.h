// GGUF's quantized blocks run by ggml's own CPU functions (layerline.model.gguf_blocks): the
// functions come from ggml's shared library as pointers (its vec_dot / from_float / repacked
// GEMV and GEMM, by their C names); these ops quantize x once, split W's rows over torch's threads
// and call them. No ISA code of its own. Part of the one translation unit layerline_cpu.cpp.
#pragma once

#include "common.h"

namespace {

constexpr int64_t GGUF_MIN_BYTES = 32 << 10;  // of W a thread's share at least: less goes to one thread

typedef void (*ggml_vec_dot_t)(int n, float* s, size_t bs, const void* x, size_t bx, const void* y, size_t by,
                          int nrc);
typedef void (*ggml_from_float_t)(const float* x, void* y, int64_t k);

// Y [M, N] = x [M, K] @ W.T (+ bias, fp32 or null), x fp32 contiguous, W's N rows of `row_bytes`
// stored blocks each: x's rows quantized once by ggml's from_float into its vec_dot_type, then each
// weight row dotted with every x row while its blocks are in L1 (one pass over W for all M rows);
// rows split over torch's threads. In place, no tensor made.
void gguf_into(const float* x, int64_t M, const uint8_t* W, int64_t N, int64_t K, int64_t row_bytes, int64_t xrow_bytes,
               int64_t vec_dot, int64_t from_float, float* Y, const float* bias) {
  thread_local Scratch<uint8_t> xq;
  uint8_t* X = xq.get(M * xrow_bytes);  // by pointer: in the tasks a thread_local's name is that thread's own
  reinterpret_cast<ggml_from_float_t>(from_float)(x, X, M * K);
  const ggml_vec_dot_t dot = reinterpret_cast<ggml_vec_dot_t>(vec_dot);
  // at least GGUF_MIN_BYTES of W a thread (smaller shares cost more to hand out than they take)
  const int64_t grain = std::max<int64_t>(std::max<int64_t>(1, GGUF_MIN_BYTES / (row_bytes * std::max<int64_t>(1, M))),
                                          N / std::max<int64_t>(1, at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m)
        dot((int)K, Y + m * N + n, 0, W + n * row_bytes, 0, X + m * xrow_bytes, 0, 1);
    add_bias(Y, M, N, n0, n1, bias);
  });
  xq.done();
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, int64_t row_bytes,
                  int64_t xrow_bytes, int64_t vec_dot, int64_t from_float, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) == K, "gguf_linear: x must be a CPU tensor [..., K]");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * row_bytes,
              "gguf_linear: w must be contiguous uint8 [N, row_bytes]");
  const uint8_t* W = w.data_ptr<uint8_t>();
  return over_fp32_rows(x, N, K, bias, [&](const float* xr, int64_t M, float* y, const float* b) {
    gguf_into(xr, M, W, N, K, row_bytes, xrow_bytes, vec_dot, from_float, y, b);
  });
}

typedef void (*ggml_gemx_t)(int n, float* s, size_t bs, const void* vx, const void* vy, int nr, int nc);

// ggml's repacked layout for x86's q4_0 / q4_K GEMV and GEMM (ggml-cpu/repack.cpp, interleave 8):
// each run of 8 rows becomes, block column by block column, one 8-row block: the 8 blocks' fp16
// scales side by side, then their quant bytes interleaved 8 at a time (q4_0's nibbles xor 0x88), and
// q4_K's 6-bit scales and mins regrouped by sub-block. Same size, every bit kept.
at::Tensor gguf_repack_x8(const at::Tensor& raw, int64_t type, int64_t N, int64_t K) {
  TORCH_CHECK(type == 2 || type == 12, "gguf_repack_x8: q4_0 (2) or q4_K (12)");
  TORCH_CHECK(N % 8 == 0, "gguf_repack_x8: rows must be a multiple of 8");
  const int64_t QK = type == 2 ? 32 : 256, BB = type == 2 ? 18 : 144, nb = K / QK;
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == N * nb * BB, "gguf_repack_x8: bytes");
  at::Tensor out = at::empty({N, nb * BB}, at::kByte);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / 8, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t x = 0; x < nb; ++x) {
        const uint8_t* in[8];
        for (int i = 0; i < 8; ++i) in[i] = src + ((g * 8 + i) * nb + x) * BB;
        uint8_t* o = dst + (g * nb + x) * 8 * BB;
        if (type == 2) {
          for (int i = 0; i < 8; ++i) std::memcpy(o + 2 * i, in[i], 2);
          for (int i = 0; i < 16; ++i) {  // 128 quant bytes, 8 at a time from each block in turn
            uint64_t e;
            std::memcpy(&e, in[i % 8] + 2 + (i / 8) * 8, 8);
            e ^= 0x8888888888888888ULL;
            std::memcpy(o + 16 + i * 8, &e, 8);
          }
        } else {
          for (int i = 0; i < 8; ++i) std::memcpy(o + 2 * i, in[i], 2);       // d
          for (int i = 0; i < 8; ++i) std::memcpy(o + 16 + 2 * i, in[i] + 2, 2);  // dmin
          uint8_t* sc = o + 32;
          uint8_t* qs = o + 128;
          for (int i = 0; i < 128; ++i) std::memcpy(qs + i * 8, in[i % 8] + 16 + (i / 8) * 8, 8);
          for (int half = 0; half < 2; ++half)
            for (int i = 0; i < 4; ++i) {
              uint8_t s[8], m[8];
              for (int j = 0; j < 8; ++j) {
                const uint8_t* q = in[j] + 4;  // the block's 12 scale bytes
                if (half == 0) { s[j] = q[i] & 63; m[j] = q[i + 4] & 63; }
                else { s[j] = ((q[i] & 192) >> 2) | (q[i + 8] & 15); m[j] = ((q[i + 4] & 192) >> 2) | ((q[i + 8] & 240) >> 4); }
              }
              uint8_t* b = sc + half * 48 + i * 12;
              for (int j = 0; j < 4; ++j) {
                b[j] = (s[j] & 63) + ((s[j + 4] & 48) << 2);
                b[j + 4] = (m[j] & 63) + ((m[j + 4] & 48) << 2);
                b[j + 8] = (s[j + 4] & 15) + ((m[j + 4] & 15) << 4);
              }
            }
        }
      }
  });
  return out;
}

// Y [M, N] = x [M, K] @ W.T (+ bias, fp32 or null), x fp32 contiguous, W in repack_x8's layout, by
// ggml's GEMM (4 rows of x at a time, quantized together by quant4; gemm 0: none) and GEMV (the
// rest); W's 8-row groups split over torch's threads. In place, no tensor made.
void x8_into(const float* x, int64_t M, const uint8_t* W, int64_t N, int64_t K, int64_t row_bytes, int64_t xrow_bytes,
             int64_t gemv, int64_t gemm, int64_t quant4, int64_t from_float, float* Y, const float* bias) {
  const int64_t M4 = gemm ? M - M % 4 : 0;
  thread_local Scratch<uint8_t> xq;
  uint8_t* XQ = xq.get(M * xrow_bytes);  // by pointer: in the tasks a thread_local's name is that thread's own
  for (int64_t m = 0; m < M4; m += 4) reinterpret_cast<ggml_from_float_t>(quant4)(x + m * K, XQ + m * xrow_bytes, K);
  if (M > M4) reinterpret_cast<ggml_from_float_t>(from_float)(x + M4 * K, XQ + M4 * xrow_bytes, (M - M4) * K);
  const int64_t groups = N / 8;
  const int64_t grain = std::max<int64_t>(std::max<int64_t>(1, GGUF_MIN_BYTES / (8 * row_bytes)),
                                          groups / std::max<int64_t>(1, at::get_num_threads()));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * 8, nc = (g1 - g0) * 8;
    if (M4) reinterpret_cast<ggml_gemx_t>(gemm)((int)K, Y + n0, N, W + n0 * row_bytes, XQ, (int)M4, (int)nc);
    for (int64_t m = M4; m < M; ++m)
      reinterpret_cast<ggml_gemx_t>(gemv)((int)K, Y + m * N + n0, N, W + n0 * row_bytes, XQ + m * xrow_bytes, 1, (int)nc);
    add_bias(Y, M, N, n0, n0 + nc, bias);
  });
  xq.done();
}

at::Tensor gguf_linear_x8(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, int64_t row_bytes,
                     int64_t xrow_bytes, int64_t gemv, int64_t gemm, int64_t quant4, int64_t from_float,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) == K && N % 8 == 0, "gguf_linear_x8: x must be a CPU tensor [..., K]");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * row_bytes,
              "gguf_linear_x8: w must be contiguous uint8 [N, row_bytes]");
  const uint8_t* W = w.data_ptr<uint8_t>();
  return over_fp32_rows(x, N, K, bias, [&](const float* xr, int64_t M, float* y, const float* b) {
    x8_into(xr, M, W, N, K, row_bytes, xrow_bytes, gemv, gemm, quant4, from_float, y, b);
  });
}

// shapes only (torch.compile traces through the op)
at::Tensor gguf_linear_meta(const at::Tensor& x, const at::Tensor&, int64_t N, int64_t, int64_t, int64_t, int64_t,
                       int64_t, const c10::optional<at::Tensor>&) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  return at::empty(shape, x.options().dtype(at::kFloat));
}
at::Tensor gguf_linear_x8_meta(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, int64_t rb, int64_t xb,
                          int64_t, int64_t, int64_t, int64_t, const c10::optional<at::Tensor>& bias) {
  return gguf_linear_meta(x, w, N, K, rb, xb, 0, 0, bias);
}

}  // namespace
