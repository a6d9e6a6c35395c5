// linear_bf16 and linear_int8: a few rows of x against a bf16 or int8 W, each weight read once.
#pragma once

#include "common.h"
#include "simd.h"

namespace {

constexpr int64_t PF = 4096;  // bytes ahead of each row that a core asks for early
constexpr int64_t PF_AVX2 = 8192;  // AVX2's: further ahead was faster on Zen 3 (docs/kernels.md)

// bf16: vdpbf16ps, pairs of bf16 products added into fp32 lanes. With several rows of x, each row
// of W's next lines are asked for PF bytes ahead (as int8's): the longer loop body otherwise
// keeps too few loads in flight (docs/kernels.md)
template <int R, int MB>
struct Bf16Tile {
  __attribute__((target("avx512f,avx512bw,avx512bf16")))
  static void run(const uint16_t* w, const uint16_t* x, int64_t K, int64_t N, float* y) {
    __m512 a[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) a[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh wv[R];
      for (int r = 0; r < R; ++r) {
        if (MB > 1) _mm_prefetch((const char*)(w + r * K + k) + PF, _MM_HINT_T0);
        wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
      }
      for (int m = 0; m < MB; ++m) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < R; ++r) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv[r], xv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) y[m * N + r] = _mm512_reduce_add_ps(a[r][m]);
  }
};

// int8 weights against x quantized to int16 (`quantize_rows` below), vpdpwssd: exact int32 sums, so
// any order gives the same bits. Each row's next cache lines are asked for PF bytes ahead: with a
// widening per vector, too few of a core's loads are in flight otherwise.
template <int R, int MB>
struct Int8Tile {
  __attribute__((target("avx512f,avx512bw,avx512vnni")))
  static void run(const int8_t* w, const int16_t* x, int64_t K, int64_t N, int32_t* y) {
    __m512i a[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) a[r][m] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 32) {
      __m512i wv[R];
      for (int r = 0; r < R; ++r) {
        if ((k & 63) == 0) _mm_prefetch((const char*)(w + r * K + k) + PF, _MM_HINT_T0);
        wv[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + r * K + k)));
      }
      for (int m = 0; m < MB; ++m) {
        __m512i xv = _mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < R; ++r) a[r][m] = _mm512_dpwssd_epi32(a[r][m], wv[r], xv);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) y[m * N + r] = _mm512_reduce_add_epi32(a[r][m]);
  }
};

// AVX2 bf16: each 32-bit lane's two bf16 values made fp32 (the even one shifted up, the odd one
// masked) and summed with FMA into one fp32 accumulator per (row of W, row of x); x's halves are
// made once per step of 16 for all R rows of W. W's next lines asked for early up to 4 rows of x
// (at 8 the tile keeps enough loads in flight, and the prefetches slowed it)
template <int R, int MB>
struct Bf16Avx2Tile {
  __attribute__((target("avx2,fma")))
  static void run(const uint16_t* w, const uint16_t* x, int64_t K, int64_t N, float* y) {
    __m256 a[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) a[r][m] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = 0; k < K; k += 16) {
      __m256 we[R], wo[R];
      for (int r = 0; r < R; ++r) {
        if (MB <= 4 && (k & 31) == 0) _mm_prefetch((const char*)(w + r * K + k) + PF_AVX2, _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + r * K + k));
        we[r] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        wo[r] = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
      }
      for (int m = 0; m < MB; ++m) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(x + m * K + k));
        const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xo = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
        for (int r = 0; r < R; ++r) a[r][m] = _mm256_fmadd_ps(wo[r], xo, _mm256_fmadd_ps(we[r], xe, a[r][m]));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(a[r][m]), _mm256_extractf128_ps(a[r][m], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        y[m * N + r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
      }
  }
};

// AVX2 int8: x's int16 codes (`quantize_rows`), vpmaddwd sums as the AVX-512 tile's
template <int R, int MB>
struct Int8Avx2Tile {
  __attribute__((target("avx2,fma")))
  static void run(const int8_t* w, const int16_t* x, int64_t K, int64_t N, int32_t* y) {
    __m256i a[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) a[r][m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 16) {
      __m256i wv[R];
      for (int r = 0; r < R; ++r) {
        if ((k & 63) == 0) _mm_prefetch((const char*)(w + r * K + k) + PF_AVX2, _MM_HINT_T0);
        wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + r * K + k)));
      }
      for (int m = 0; m < MB; ++m) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + m * K + k));
        for (int r = 0; r < R; ++r) a[r][m] = _mm256_add_epi32(a[r][m], _mm256_madd_epi16(wv[r], xv));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) y[m * N + r] = hsum256i(a[r][m]);
  }
};

// Each row of x [M, K] as int16 codes and one float scale: x ~ code * s, |code| <= cmax, where cmax
// keeps every int32 lane's sum of (int8 weight x code) products from overflowing (each lane sums at
// most K / 8 of them, each below 127 * cmax): 32767 up to K = 4096, 14 bits at K = 16384.
template <typename T>
__attribute__((target("avx2,fma,f16c")))
void quantize_rows(const T* x, int64_t M, int64_t K, int16_t* q, float* s) {
  const float cmax = (float)std::min(32767.0, std::floor(2147483647.0 / (127.0 * (double)(K / 8 + 1))));
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    const T* xm = x + m * K;
    __m256 mx = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(xm + k)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float amax = _mm_cvtss_f32(h);
    float sc = amax > 0.f ? amax / cmax : 1.f;
    const __m256 inv = _mm256_set1_ps(1.f / sc), hi = _mm256_set1_ps(cmax), lo = _mm256_set1_ps(-cmax);
    for (int64_t k = 0; k < K; k += 8) {
      __m256 v = _mm256_round_ps(_mm256_mul_ps(load8(xm + k), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
      __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
      _mm_storeu_si128((__m128i*)(q + m * K + k), p);
    }
    s[m] = sc;
  }
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  int64_t N = w.size(0), K = w.size(1);
  check(x, w, K, bias);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "linear_bf16: bf16 x and w");
  auto wc = w.contiguous();
  auto x2 = x.reshape({-1, K}).contiguous();
  int64_t M = x2.size(0);
  Out out(x, M, N, at::kFloat, bias);
  auto W = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto X = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
  float* Y = out.sums.data_ptr<float>();
  over_rows(N, K, [&](int64_t n0, int64_t n1) {
    if (g_isa == 2) tiles<Bf16Tile, 1, 4, 2, 2>(W, X, K, M, N, n0, n1, Y);
    else tiles<Bf16Avx2Tile, 1, 2, 2, 1>(W, X, K, M, N, n0, n1, Y);
    out.store_rows<float>(M, N, n0, n1, nullptr, nullptr);
  });
  return out.y;
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  int64_t N = q.size(0), K = q.size(1);
  check(x, q, K, bias);
  TORCH_CHECK(q.scalar_type() == at::kChar, "linear_int8: int8 weights");
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == at::kFloat, "linear_int8: one float32 scale per row");
  auto st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "linear_int8: x fp32, bf16 or fp16");
  auto qc = q.contiguous();
  auto sc = scale.contiguous();
  auto x2 = x.reshape({-1, K}).contiguous();
  int64_t M = x2.size(0);
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M);
  if (st == at::kBFloat16) quantize_rows(x2.data_ptr<at::BFloat16>(), M, K, xq.data(), xs.data());
  else if (st == at::kHalf) quantize_rows(x2.data_ptr<at::Half>(), M, K, xq.data(), xs.data());
  else quantize_rows(x2.data_ptr<float>(), M, K, xq.data(), xs.data());
  Out out(x, M, N, at::kInt, bias);
  const int8_t* W = qc.data_ptr<int8_t>();
  const int16_t* X = xq.data();
  int32_t* Y = out.sums.data_ptr<int32_t>();
  const float* S = sc.data_ptr<float>();
  over_rows(N, K, [&](int64_t n0, int64_t n1) {
    if (g_isa == 2) tiles<Int8Tile, 1, 4, 4, 2>(W, X, K, M, N, n0, n1, Y);
    else tiles<Int8Avx2Tile, 1, 2, 2, 1>(W, X, K, M, N, n0, n1, Y);
    out.store_rows<int32_t>(M, N, n0, n1, xs.data(), S);
  });
  return out.y;
}

}  // namespace
