// int4 weights in groups of 32 (layerline's layout, `quant.Int4Linear` with rows=True): codes
// uint8 [N, K / 2], 16 bytes a group (byte j: code j in its low nibble, code j + 16 in its high one,
// as GGUF's Q4_0 / Q4_1 blocks), the groups' bytes regrouped in blocks of 16 groups as the tiles read
// them (below; `cpu_kernels.int4_code_order`), and sz [N, K / 32] pairs of bf16 (s, z):
// w = (code - 8) * s + z. x is quantized per group of 32 to int8 (one scale a group, as llama.cpp's
// q8_0), so a group's sum of code * x is exact in int32 (vpdpbusd); it is scaled by s * dx in fp32,
// and the zeros add (z - 8 s) * (the group's sum of x).
//
// The same tiles run GGUF's Q4_0 / Q4_1 blocks without loss (`gguf_linear_q4`): each row holds its
// groups' code bytes (the blocks' own 16 bytes, regrouped as above), then each group's scales as the
// blocks store them. KIND says how a group's scales read: Q4_BF16 a pair of bf16 (s, z), w = (code - 8) s + z
// (layerline's int4); Q4_1 a pair of fp16 (d, m), w = code d + m; Q4_0 one fp16 d, w = (code - 8) d.
// Rows are `ws` bytes of codes and `ss` bytes of scales apart.
#pragma once

#include "common.h"
#include "simd.h"

namespace {

enum Int4Kind { Q4_BF16 = 0, Q4_1 = 1, Q4_0 = 2 };
constexpr int64_t scale_bytes(int kind) { return kind == Q4_0 ? 2 : 4; }  // a group's scales

constexpr int64_t PF4 = 8192;  // the same for int4's codes (their scales: a quarter of it); 4096 was slower
#define LL_VNNI __attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl,avx512vnni,avx512dq")))

// Blocks of 16 groups. A weight row's code bytes are held a block at a time as 4 slices j, each the
// j-th 4 bytes of every group of the block (64 bytes, group l's at l * 4); the groups past the last
// whole block (a tail of 2 to 14) keep their 16 bytes each in turn. `cpu_kernels.int4_code_order`
// makes this order. Within a block one 32-bit lane holds one group throughout: vpdpbusd sums a group's
// 32 products over the 4 slices in its own lane, and a block costs one conversion and one FMA per pair
// of rows (of W and of x); a tail costs that per 4 groups (a 128-bit block a group) and a permutation
// of their scales, as the whole row once did (docs/kernels.md). x's codes are laid out to match: a
// block's 512 bytes hold slice j's codes 0..15 part at j * 128 (lane l: the group's x codes
// 4j..4j+3) and its 16..31 part at j * 128 + 64; then the tail in quads of 128 bytes, the 4 groups'
// codes 0..15 (16 bytes a group), then their 16..31, zeros past the last group.
constexpr int64_t XBLOCK = 512;
constexpr int64_t full_groups(int64_t G) { return G / 16 * 16; }
constexpr int64_t x_stride(int64_t K) {
  return K / 32 / 16 * XBLOCK + (K / 32 % 16 + 3) / 4 * 128;
}

// the 32 int8 x codes of group g (of G) where the tiles read them
inline void put_x_codes(int8_t* row, int64_t g, int64_t G, const int8_t* q32) {
  const int64_t GF = full_groups(G);
  if (g < GF) {
    int8_t* out = row + (g / 16) * XBLOCK + (g % 16) * 4;
    for (int j = 0; j < 4; ++j) {
      std::memcpy(out + j * 128, q32 + 4 * j, 4);
      std::memcpy(out + j * 128 + 64, q32 + 16 + 4 * j, 4);
    }
  } else {
    int8_t* out = row + GF / 16 * XBLOCK + (g - GF) / 4 * 128 + (g - GF) % 4 * 16;
    std::memcpy(out, q32, 16);
    std::memcpy(out + 64, q32 + 16, 16);
  }
}

template <typename T>
LL_VNNI void quantize_groups_x(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xsum) {
  const int64_t G = K / 32, XS = x_stride(K);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* row = xq + m * XS;
    if (G % 4) std::memset(row + XS - 128, 0, 128);
    for (int64_t g = 0; g < G; ++g) {
      const T* p = x + m * K + g * 32;
      const __m512 a = load16(p), b = load16(p + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      alignas(16) int8_t q32[32];
      _mm_store_si128((__m128i*)q32, _mm512_cvtsepi32_epi8(qa));
      _mm_store_si128((__m128i*)(q32 + 16), _mm512_cvtsepi32_epi8(qb));
      put_x_codes(row, g, G, q32);
      dx[m * G + g] = amax / 127.f;
      xsum[m * G + g] = amax / 127.f * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
  }
}

// a row's scales for up to 16 groups (mask mk) as fp32 (s, z8): each group's weight is code * s + z8
template <int KIND>
LL_VNNI inline void int4_scales(const uint8_t* sr, __mmask16 mk, __m512& s, __m512& z8) {
  if constexpr (KIND == Q4_0) {
    s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, sr));
    z8 = _mm512_mul_ps(s, _mm512_set1_ps(-8.f));
  } else if constexpr (KIND == Q4_1) {
    const __m512i v = _mm512_maskz_loadu_epi32(mk, sr);
    s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
    z8 = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  } else {
    const __m512i v = _mm512_maskz_loadu_epi32(mk, sr);
    s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    z8 = _mm512_fmadd_ps(s, _mm512_set1_ps(-8.f), _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u))));
  }
}

// R rows of W against MB rows of x: a block's slices (one 64-byte vector of a row's code bytes each,
// its low nibbles against x's codes 0..15 and its high ones against 16..31) summed in int32 over the
// block, then scaled by s * dx; the zeros add (z - 8 s) * sum(x). The scale rows are a stream of their
// own, asked for early as the codes are (without it the kernel read memory slower than torch's int4
// kernel).
template <int R, int MB, int KIND>
struct Int4Tile {
  LL_VNNI static void run(const uint8_t* w, int64_t ws, const uint8_t* sz, int64_t ss, const int8_t* xq,
                          const float* dx, const float* xsum, int64_t K, int64_t N, float* y) {
    const int64_t G = K / 32, XS = x_stride(K), GF = full_groups(G);
    __m512 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int64_t g0 = 0; g0 < GF; g0 += 16) {
      const int8_t* xb = xq + g0 / 16 * XBLOCK;
      __m512i D[R][MB];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) D[r][m] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        __m512i wl[R], wh[R];
        for (int r = 0; r < R; ++r) {
          const uint8_t* p = w + r * ws + g0 * 16 + j * 64;
          _mm_prefetch((const char*)p + PF4, _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(p);
          wl[r] = _mm512_and_si512(v, lo4);
          wh[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* xm = xb + m * XS + j * 128;
          const __m512i xl = _mm512_loadu_si512(xm), xh = _mm512_loadu_si512(xm + 64);
          for (int r = 0; r < R; ++r) D[r][m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(D[r][m], wl[r], xl), wh[r], xh);
        }
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* sr = sz + r * ss + g0 * scale_bytes(KIND);
        _mm_prefetch((const char*)sr + PF4 / 4, _MM_HINT_T0);
        __m512 s, z8;
        int4_scales<KIND>(sr, (__mmask16)0xFFFF, s, z8);
        for (int m = 0; m < MB; ++m) {
          const __m512 c = _mm512_mul_ps(s, _mm512_loadu_ps(dx + m * G + g0));
          acc[r][m] = _mm512_fmadd_ps(z8, _mm512_loadu_ps(xsum + m * G + g0), acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D[r][m]), c, acc[r][m]);
        }
      }
    }
    if (GF < G) {  // the tail: 4 groups a vector, a 128-bit block a group
      const int nt = (int)(G - GF);
      const __mmask16 mk = (__mmask16)((1u << nt) - 1);
      const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // lane -> group of 4
      __m512 C[R][MB];
      for (int r = 0; r < R; ++r) {
        __m512 s, z8;
        int4_scales<KIND>(sz + r * ss + GF * scale_bytes(KIND), mk, s, z8);
        for (int m = 0; m < MB; ++m) {
          C[r][m] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mk, dx + m * G + GF));
          acc[r][m] = _mm512_fmadd_ps(z8, _mm512_maskz_loadu_ps(mk, xsum + m * G + GF), acc[r][m]);
        }
      }
      for (int q = 0; q < (nt + 3) / 4; ++q) {
        const __m512i idx = _mm512_add_epi32(quad, _mm512_set1_epi32(4 * q));
        const int64_t off = (GF + 4 * q) * 16;
        const bool whole = nt - 4 * q >= 4;
        __m512i wl[R], wh[R];
        for (int r = 0; r < R; ++r) {
          const __m512i v = whole ? _mm512_loadu_si512(w + r * ws + off)
                                  : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w + r * ws + off);
          wl[r] = _mm512_and_si512(v, lo4);
          wh[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* xm = xq + m * XS + GF / 16 * XBLOCK + q * 128;
          const __m512i xl = _mm512_loadu_si512(xm), xh = _mm512_loadu_si512(xm + 64);
          for (int r = 0; r < R; ++r) {
            const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wl[r], xl), wh[r], xh);
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(idx, C[r][m]), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
};

// AVX2: the same x codes, sums and weight order; a block in halves (8 groups, 8 lanes), a tail a pair
// of groups at a time. A group's code bytes times its x codes by vpmaddubsw (unsigned codes 0..15
// times signed x: each int16 pair sum at most 2 * 15 * 127, the low and high nibbles' added at most
// twice that, never saturating), then vpmaddwd into int32 lanes.
template <typename T>
__attribute__((target("avx2,fma,f16c")))
void quantize_groups_x_avx2(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xsum) {
  const int64_t G = K / 32, XS = x_stride(K);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' lane-wise order undone
  for (int64_t m = 0; m < M; ++m) {
    int8_t* row = xq + m * XS;
    if (G % 4) std::memset(row + XS - 128, 0, 128);
    for (int64_t g = 0; g < G; ++g) {
      const T* p = x + m * K + g * 32;
      const __m256 a = load8(p), b = load8(p + 8), c = load8(p + 16), d = load8(p + 24);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a), _mm256_andnot_ps(sign, b)),
                                _mm256_max_ps(_mm256_andnot_ps(sign, c), _mm256_andnot_ps(sign, d)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m256i qa = _mm256_cvtps_epi32(_mm256_mul_ps(a, inv)), qb = _mm256_cvtps_epi32(_mm256_mul_ps(b, inv)),
                    qc = _mm256_cvtps_epi32(_mm256_mul_ps(c, inv)), qd = _mm256_cvtps_epi32(_mm256_mul_ps(d, inv));
      alignas(32) int8_t q32[32];
      _mm256_store_si256((__m256i*)q32, _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(qa, qb), _mm256_packs_epi32(qc, qd)), order));
      put_x_codes(row, g, G, q32);
      dx[m * G + g] = amax / 127.f;
      xsum[m * G + g] = amax / 127.f * (float)hsum256i(_mm256_add_epi32(_mm256_add_epi32(qa, qb), _mm256_add_epi32(qc, qd)));
    }
  }
}

// a row's scales for n (up to 8, even) groups as fp32 (s, z8); mk: the n lanes
template <int KIND>
__attribute__((target("avx2,fma,f16c"))) inline void int4_scales_avx2(const uint8_t* sr, int n, __m256i mk, __m256& s,
                                                                      __m256& z8) {
  if constexpr (KIND == Q4_0) {
    __m128i h;
    if (n == 8) {
      h = _mm_loadu_si128((const __m128i*)sr);
    } else {  // the row's last groups: no reading past them
      alignas(16) uint16_t tail[8] = {0};
      std::memcpy(tail, sr, n * 2);
      h = _mm_load_si128((const __m128i*)tail);
    }
    s = _mm256_cvtph_ps(h);
    z8 = _mm256_mul_ps(s, _mm256_set1_ps(-8.f));
  } else if constexpr (KIND == Q4_1) {
    const __m256i v = _mm256_maskload_epi32((const int*)sr, mk);
    // [d0..3, m0..3 | d4..7, m4..7] as 16-bit halves, then the 64-bit quarters in order: d0..7, m0..7
    const __m256i p = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(v, 16)), 0xD8);
    s = _mm256_cvtph_ps(_mm256_castsi256_si128(p));
    z8 = _mm256_cvtph_ps(_mm256_extracti128_si256(p, 1));
  } else {
    const __m256i v = _mm256_maskload_epi32((const int*)sr, mk);
    s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    z8 = _mm256_fmadd_ps(s, _mm256_set1_ps(-8.f), _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u))));
  }
}

template <int R, int MB, int KIND>
struct Int4Avx2Tile {
  __attribute__((target("avx2,fma,f16c")))
  static void run(const uint8_t* w, int64_t ws, const uint8_t* sz, int64_t ss, const int8_t* xq,
                  const float* dx, const float* xsum, int64_t K, int64_t N, float* y) {
    const int64_t G = K / 32, XS = x_stride(K), GF = full_groups(G);
    __m256 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), all = _mm256_set1_epi32(-1);
    for (int64_t g0 = 0; g0 < GF; g0 += 8) {  // half a block at a time
      const int64_t b0 = g0 / 16 * 16, h = (g0 - b0) / 8;
      const int8_t* xb = xq + b0 / 16 * XBLOCK + h * 32;
      __m256i D[R][MB];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) D[r][m] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        __m256i wl[R], wh[R];
        for (int r = 0; r < R; ++r) {
          const uint8_t* p = w + r * ws + b0 * 16 + j * 64 + h * 32;
          if (h == 0) _mm_prefetch((const char*)p + PF4, _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256((const __m256i*)p);
          wl[r] = _mm256_and_si256(v, lo4);
          wh[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* xm = xb + m * XS + j * 128;
          const __m256i xl = _mm256_loadu_si256((const __m256i*)xm), xh = _mm256_loadu_si256((const __m256i*)(xm + 64));
          for (int r = 0; r < R; ++r)
            D[r][m] = _mm256_add_epi32(D[r][m], _mm256_madd_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(wl[r], xl), _mm256_maddubs_epi16(wh[r], xh)), ones));
        }
      }
      for (int r = 0; r < R; ++r) {
        const uint8_t* sr = sz + r * ss + g0 * scale_bytes(KIND);
        _mm_prefetch((const char*)sr + PF4 / 4, _MM_HINT_T0);
        __m256 s, z8;
        int4_scales_avx2<KIND>(sr, 8, all, s, z8);
        for (int m = 0; m < MB; ++m) {
          const __m256 c = _mm256_mul_ps(s, _mm256_loadu_ps(dx + m * G + g0));
          acc[r][m] = _mm256_fmadd_ps(z8, _mm256_loadu_ps(xsum + m * G + g0), acc[r][m]);
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(D[r][m]), c, acc[r][m]);
        }
      }
    }
    for (int64_t g0 = GF; g0 < G; g0 += 8) {  // the tail: a pair of groups a vector, 8 groups' scales at a time
      const int n = (int)std::min<int64_t>(8, G - g0);  // even: K is a multiple of 64
      const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256 C[R][MB];
      for (int r = 0; r < R; ++r) {
        __m256 s, z8;
        int4_scales_avx2<KIND>(sz + r * ss + g0 * scale_bytes(KIND), n, mk, s, z8);
        for (int m = 0; m < MB; ++m) {
          C[r][m] = _mm256_mul_ps(s, _mm256_maskload_ps(dx + m * G + g0, mk));
          acc[r][m] = _mm256_fmadd_ps(z8, _mm256_maskload_ps(xsum + m * G + g0, mk), acc[r][m]);
        }
      }
      for (int p = 0; p < n / 2; ++p) {
        const __m256i idx = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
        const int64_t t = g0 - GF + 2 * p;  // the pair's first group in the tail
        __m256i wl[R], wh[R];
        for (int r = 0; r < R; ++r) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(w + r * ws + (GF + t) * 16));
          wl[r] = _mm256_and_si256(v, lo4);
          wh[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        }
        for (int m = 0; m < MB; ++m) {
          const int8_t* xm = xq + m * XS + GF / 16 * XBLOCK + t / 4 * 128 + t % 4 * 16;
          const __m256i xa = _mm256_loadu_si256((const __m256i*)xm), xb = _mm256_loadu_si256((const __m256i*)(xm + 64));
          for (int r = 0; r < R; ++r) {
            const __m256i d = _mm256_madd_epi16(
                _mm256_add_epi16(_mm256_maddubs_epi16(wl[r], xa), _mm256_maddubs_epi16(wh[r], xb)), ones);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_permutevar8x32_ps(C[r][m], idx), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][m]), _mm256_extractf128_ps(acc[r][m], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        y[m * N + r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
      }
  }
};

template <template <int, int, int> class Tile, int R, int MB, int KIND>
void int4_rows(const uint8_t* w, int64_t ws, const uint8_t* sz, int64_t ss, const int8_t* xq, const float* dx,
               const float* xs, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) Tile<R, MB, KIND>::run(w + n * ws, ws, sz + n * ss, ss, xq, dx, xs, K, N, y + n);
  for (; n < n1; ++n) Tile<1, MB, KIND>::run(w + n * ws, ws, sz + n * ss, ss, xq, dx, xs, K, N, y + n);
}

// M rows of x [M, K] (fp32, bf16 or fp16, contiguous) against N rows of int4 groups: codes at W (rows
// ws bytes apart), their scales at SZ (rows ss bytes apart), read as KIND says; Y [M, N] fp32 (+ bias,
// fp32 or null). Written in place, no tensor made: a decode layer's step calls it per projection
template <int KIND, typename T>
void int4_into(const T* x, int64_t M, const uint8_t* W, int64_t ws, const uint8_t* SZ, int64_t ss, int64_t N,
               int64_t K, float* Y, const float* bias) {
  const int64_t G = K / 32;
  thread_local Scratch<int8_t> xq;
  thread_local Scratch<float> dx, xs;
  // the buffers by pointer: in the tasks below a thread_local's name is that thread's own
  const int64_t XR = x_stride(K);  // bytes a row of x's codes takes (whole blocks)
  int8_t* XQ = xq.get(M * XR);
  float *DX = dx.get(M * G), *XS = xs.get(M * G);
  if (g_isa == 2) quantize_groups_x(x, M, K, XQ, DX, XS);
  else quantize_groups_x_avx2(x, M, K, XQ, DX, XS);
  over_rows(N, K, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {  // x in chunks of up to 4 rows
      const int8_t* xm = XQ + m0 * XR;
      const float *dm = DX + m0 * G, *sm = XS + m0 * G;
      float* ym = Y + m0 * N;
      const int64_t mb = std::min<int64_t>(4, M - m0);
      // AVX-512: a prompt chunk's 32 rows of x are compute-bound, where 3 x 4 (24 int32 and fp32 sums
      // in the 32 registers) was the fastest; a decode step's few read W from memory (docs/kernels.md)
      if (g_isa == 2) switch (mb) {
        case 1: int4_rows<Int4Tile, 1, 1, KIND>(W, ws, SZ, ss, xm, dm, sm, K, N, n0, n1, ym); break;
        case 2: int4_rows<Int4Tile, 4, 2, KIND>(W, ws, SZ, ss, xm, dm, sm, K, N, n0, n1, ym); break;
        case 3: int4_rows<Int4Tile, 2, 3, KIND>(W, ws, SZ, ss, xm, dm, sm, K, N, n0, n1, ym); break;
        default:
          if (M > 8) int4_rows<Int4Tile, 3, 4, KIND>(W, ws, SZ, ss, xm, dm, sm, K, N, n0, n1, ym);
          else int4_rows<Int4Tile, 2, 4, KIND>(W, ws, SZ, ss, xm, dm, sm, K, N, n0, n1, ym);
      } else switch (mb) {  // AVX2's 16 registers: fewer sums a tile
        case 1: int4_rows<Int4Avx2Tile, 1, 1, KIND>(W, ws, SZ, ss, xm, dm, sm, K, N, n0, n1, ym); break;
        case 2: int4_rows<Int4Avx2Tile, 2, 2, KIND>(W, ws, SZ, ss, xm, dm, sm, K, N, n0, n1, ym); break;
        case 3: int4_rows<Int4Avx2Tile, 1, 3, KIND>(W, ws, SZ, ss, xm, dm, sm, K, N, n0, n1, ym); break;
        default: int4_rows<Int4Avx2Tile, 1, 4, KIND>(W, ws, SZ, ss, xm, dm, sm, K, N, n0, n1, ym);
      }
    }
    add_bias(Y, M, N, n0, n1, bias);
  });
  xq.done(), dx.done(), xs.done();
}

// x [..., K] (fp32, bf16 or fp16) against N rows of int4 groups (int4_into); y in x's dtype
template <int KIND>
at::Tensor int4_matmul(const at::Tensor& x, const uint8_t* W, int64_t ws, const uint8_t* SZ, int64_t ss,
                       int64_t N, int64_t K, const c10::optional<at::Tensor>& bias) {
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "linear_int4: x fp32, bf16 or fp16");
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  Out out(x, M, N, at::kFloat, bias);
  float* Y = out.sums.data_ptr<float>();
  if (st == at::kBFloat16) int4_into<KIND>(x2.data_ptr<at::BFloat16>(), M, W, ws, SZ, ss, N, K, Y, out.b());
  else if (st == at::kHalf) int4_into<KIND>(x2.data_ptr<at::Half>(), M, W, ws, SZ, ss, N, K, Y, out.b());
  else int4_into<KIND>(x2.data_ptr<float>(), M, W, ws, SZ, ss, N, K, Y, out.b());
  return out.finish<float>(M, N);
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, G = K / 32;
  check(x, codes, x.size(-1), bias);
  TORCH_CHECK(codes.scalar_type() == at::kByte && x.size(-1) == K && K % 64 == 0,
              "linear_int4: uint8 codes [N, K / 2] for x [..., K], K a multiple of 64");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(0) == N && sz.size(1) == G && sz.size(2) == 2,
              "linear_int4: bf16 scales and zeros [N, K / 32, 2]");
  auto cc = codes.contiguous();
  auto szc = sz.contiguous();
  return int4_matmul<Q4_BF16>(x, cc.data_ptr<uint8_t>(), K / 2, reinterpret_cast<const uint8_t*>(szc.data_ptr<at::BFloat16>()),
                              4 * G, N, K, bias);
}

// GGUF Q4_0 / Q4_1 rows held as uint8 [N, row]: each row its groups' 16 code bytes, then their scales as
// the blocks store them (`gguf_blocks`' int4 layout): kind 1 Q4_1's fp16 (d, m) pairs (row 20 K / 32
// bytes), kind 2 Q4_0's fp16 d (row 18 K / 32); y in fp32, as ggml's ops give it
at::Tensor gguf_linear_q4(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, int64_t kind,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(g_isa > 0, "layerline_cpu: no kernel for this CPU (AVX2 + FMA or AVX-512 BF16 needed)");
  TORCH_CHECK(kind == Q4_1 || kind == Q4_0, "gguf_linear_q4: kind 1 (Q4_1) or 2 (Q4_0)");
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) == K && K % 64 == 0,
              "gguf_linear_q4: x must be a CPU tensor [..., K], K a multiple of 64");
  const int64_t G = K / 32, row = (16 + scale_bytes(kind)) * G;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * row,
              "gguf_linear_q4: w must be contiguous uint8 [N, (16 + scale bytes) * K / 32]");
  TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->numel() == N, "gguf_linear_q4: one bias per row");
  const uint8_t* W = w.data_ptr<uint8_t>();
  const at::Tensor xf = x.to(at::kFloat);
  return kind == Q4_1 ? int4_matmul<Q4_1>(xf, W, row, W + 16 * G, row, N, K, bias)
                      : int4_matmul<Q4_0>(xf, W, row, W + 16 * G, row, N, K, bias);
}

}  // namespace
