// GGUF Q8_0 rows as the file stores them (blocks of 34 bytes: an fp16 d, then 32 int8 codes)
// against x in fp32. A block's weights are dequantized in registers (an int8 code times an fp16 d is
// exact in fp32) and multiplied with x in fp32: the fp32 reference's product up to the order of the
// sums. ggml's vec_dot rounds x to 8 bits first; on Gemma 3's tied Q8_0 LM head that rounding
// changed 2% of the greedy next tokens (docs/kernels.md). A decode step streams the stored bytes
// once, which bounds it either way. Each (row, x row) sum runs over k in one order for any tile, so
// a row's bits do not depend on M or on the split over threads.
#pragma once

#include "common.h"

namespace {

constexpr int64_t Q8_BLOCK = 34;
constexpr int64_t PF8 = 8192;  // bytes ahead a row's stream is asked for (4096-8192 read a cold 170 MB head 1.27x faster than none)

__attribute__((target("f16c"))) inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

template <int R, int MB>
struct Q8Tile512 {
  __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
  static void run(const uint8_t* w, int64_t rb, const float* x, int64_t K, int64_t N, float* y) {
    __m512 acc[R][MB][2];  // two sums a (row, x row): the block's two halves, no chain of dependent FMAs
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
    for (int64_t b = 0, nb = K / 32; b < nb; ++b) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = w + r * rb + b * Q8_BLOCK;
        _mm_prefetch((const char*)blk + PF8, _MM_HINT_T0);
        const __m512 d = _mm512_set1_ps(fp16_at(blk));
        const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)))));
        const __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18)))));
        for (int m = 0; m < MB; ++m) {
          const float* xm = x + m * K + b * 32;
          acc[r][m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm), acc[r][m][0]);
          acc[r][m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + 16), acc[r][m][1]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) y[m * N + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
  }
};

template <int R, int MB>
struct Q8TileAvx2 {
  __attribute__((target("avx2,fma,f16c")))
  static void run(const uint8_t* w, int64_t rb, const float* x, int64_t K, int64_t N, float* y) {
    __m256 acc[R][MB][2];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m][0] = acc[r][m][1] = _mm256_setzero_ps();
    for (int64_t b = 0, nb = K / 32; b < nb; ++b) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = w + r * rb + b * Q8_BLOCK;
        _mm_prefetch((const char*)blk + PF8, _MM_HINT_T0);
        const __m256 d = _mm256_set1_ps(fp16_at(blk));
        for (int q = 0; q < 4; ++q) {  // the block's quarters of 8 codes
          const __m256 wq = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                 _mm_loadl_epi64((const __m128i*)(blk + 2 + 8 * q)))));
          for (int m = 0; m < MB; ++m)
            acc[r][m][q & 1] = _mm256_fmadd_ps(wq, _mm256_loadu_ps(x + m * K + b * 32 + 8 * q), acc[r][m][q & 1]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        const __m256 a = _mm256_add_ps(acc[r][m][0], acc[r][m][1]);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        y[m * N + r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
      }
  }
};

template <template <int, int> class Tile, int R, int MB>
void q8_rows(const uint8_t* w, int64_t rb, const float* x, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) Tile<R, MB>::run(w + n * rb, rb, x, K, N, y + n);
  for (; n < n1; ++n) Tile<1, MB>::run(w + n * rb, rb, x, K, N, y + n);
}

// x [..., K] (any float dtype, taken as fp32) against N rows of Q8_0 blocks, uint8 [N, 34 K / 32]; y in fp32,
// as ggml's ops give it
at::Tensor gguf_linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(g_isa > 0, "layerline_cpu: no kernel for this CPU (AVX2 + FMA or AVX-512 BF16 needed)");
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) == K && K % 32 == 0,
              "gguf_linear_q8: x must be a CPU tensor [..., K], K a multiple of 32");
  const int64_t rb = K / 32 * Q8_BLOCK;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * rb,
              "gguf_linear_q8: w must be contiguous uint8 [N, 34 * K / 32]");
  TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->numel() == N, "gguf_linear_q8: one bias per row");
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor x2 = xf.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  Out out(xf, M, N, at::kFloat, bias);
  const uint8_t* W = w.data_ptr<uint8_t>();
  const float* X = x2.data_ptr<float>();
  float* Y = out.sums.data_ptr<float>();
  over_rows(N, K, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {  // x in chunks of up to 4 rows; the task's rows of W stay in cache
      const float* xm = X + m0 * K;
      float* ym = Y + m0 * N;
      const int64_t mb = std::min<int64_t>(4, M - m0);
      if (g_isa == 2) switch (mb) {
        case 1: q8_rows<Q8Tile512, 4, 1>(W, rb, xm, K, N, n0, n1, ym); break;
        case 2: q8_rows<Q8Tile512, 4, 2>(W, rb, xm, K, N, n0, n1, ym); break;
        case 3: q8_rows<Q8Tile512, 2, 3>(W, rb, xm, K, N, n0, n1, ym); break;
        default: q8_rows<Q8Tile512, 2, 4>(W, rb, xm, K, N, n0, n1, ym);
      } else switch (mb) {  // AVX2's 16 registers: fewer sums a tile
        case 1: q8_rows<Q8TileAvx2, 2, 1>(W, rb, xm, K, N, n0, n1, ym); break;
        case 2: q8_rows<Q8TileAvx2, 2, 2>(W, rb, xm, K, N, n0, n1, ym); break;
        case 3: q8_rows<Q8TileAvx2, 1, 3>(W, rb, xm, K, N, n0, n1, ym); break;
        default: q8_rows<Q8TileAvx2, 1, 4>(W, rb, xm, K, N, n0, n1, ym);
      }
    }
    out.store_rows<float>(M, N, n0, n1, nullptr, nullptr);
  });
  return out.y;
}

}  // namespace
