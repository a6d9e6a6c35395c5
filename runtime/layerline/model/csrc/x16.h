// GGUF rows as the file stores them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K blocks) against x
// held at 16 bits: each 32 values of x (a K-quant block's 256) as int16 codes of one fp32 scale
// (XHeld). A block's codes are widened to int16 in registers and their products with x's codes
// summed exactly in int32 (a K-quant's codes times their sub-block's integer scale first, over the
// whole block), then scaled in fp32 by the block's scale times x's (less the block's mins times x's
// fp32 sums): the fp32 reference's product within 1/65534 of each group's largest x. ggml's vec_dot rounds x to 8 bits,
// which moves near-tied tokens (Gemma 3 270M Q4_K_M's top-1 agreement with fp32: 0.954 with that
// rounding, 1.0 with this; docs/models.md). Each (row, x row) sum runs over k in one order for any
// tile, so a row's bits do not depend on M or on the split over threads.
#pragma once

#include "common.h"

namespace {

constexpr int64_t PF8 = 8192;  // bytes ahead a row's stream is asked for (a cold 170 MB head: 1.27x faster than none)

#define X16_DECODE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

X16_DECODE float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// a block of 32 weights, weight i = s * code[i] - mn, codes as int8
struct Sub {
  __m256i code;
  float s, mn;
};

X16_DECODE __m256i load32(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }

// low nibbles of 16 bytes as codes 0-15, then their high nibbles as codes 16-31 (Q5_0 / Q5_1 order)
X16_DECODE __m256i nibbles16(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128((const __m128i*)p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

// the low (hi = false) or high nibbles of 32 bytes (Q4_K / Q5_K / Q6_K order)
X16_DECODE __m256i nibbles32(const uint8_t* p, bool hi) {
  const __m256i v = load32(p);
  return _mm256_and_si256(hi ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}

// byte i = 0x10 where bit i of qh is set (Q5_0 / Q5_1's fifth bits)
X16_DECODE __m256i fifth_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const __m256i byte_of = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), byte_of), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

// One struct a block type: QK weights and BYTES bytes a block; MIN: its weights have a min. The types
// of 32: sub(block) its weights with their fp32 scale (and min); the K-quants (QK 256, below): their
// codes and their scales as integers, TWO: a sub-block's halves of 16 have scales of their own
struct Q8_0B {
  static constexpr int64_t QK = 32, BYTES = 34; static constexpr bool MIN = false;
  X16_DECODE Sub sub(const uint8_t* b) {
    const float d = fp16_at(b);
    return {load32(b + 2), d, 0.f};
  }
};
struct Q4_0B {  // fp16 d, 16 bytes of nibbles; codes less 8
  static constexpr int64_t QK = 32, BYTES = 18; static constexpr bool MIN = false;
  X16_DECODE Sub sub(const uint8_t* b) {
    const float d = fp16_at(b);
    return {_mm256_sub_epi8(nibbles16(b + 2), _mm256_set1_epi8(8)), d, 0.f};
  }
};
struct Q4_1B {  // fp16 d and m, nibbles; weight = d * code + m
  static constexpr int64_t QK = 32, BYTES = 20; static constexpr bool MIN = true;
  X16_DECODE Sub sub(const uint8_t* b) {
    const float d = fp16_at(b);
    return {nibbles16(b + 4), d, -fp16_at(b + 2)};
  }
};
struct Q5_0B {  // fp16 d, 32 fifth bits, 16 bytes of nibbles; codes less 16
  static constexpr int64_t QK = 32, BYTES = 22; static constexpr bool MIN = false;
  X16_DECODE Sub sub(const uint8_t* b) {
    const float d = fp16_at(b);
    const __m256i c = _mm256_or_si256(nibbles16(b + 6), fifth_bits(b + 2));
    return {_mm256_sub_epi8(c, _mm256_set1_epi8(16)), d, 0.f};
  }
};
struct Q5_1B {  // fp16 d and m, fifth bits, nibbles; weight = d * code + m
  static constexpr int64_t QK = 32, BYTES = 24; static constexpr bool MIN = true;
  X16_DECODE Sub sub(const uint8_t* b) {
    const float d = fp16_at(b);
    return {_mm256_or_si256(nibbles16(b + 8), fifth_bits(b + 4)), d, -fp16_at(b + 2)};
  }
};
// The K-quants for the K tiles below, their scales as integers: weight i of sub-block s is
// d * sc(head, s, i < 16 ? 0 : 1) * code(s)[i] - dmin * mins(head)[s], codes as int8; head() reads a
// block's scales once, outside the sub-blocks' loop
struct KHead {
  uint32_t sc[2], mn[2];  // Q4_K / Q5_K: the eight 6-bit scales and mins, a byte each
};
struct Q4_KB {  // fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
  static constexpr int64_t QK = 256, BYTES = 144; static constexpr bool MIN = true, TWO = false;
  X16_DECODE float d(const uint8_t* b) { return fp16_at(b); }
  X16_DECODE float dmin(const uint8_t* b) { return fp16_at(b + 2); }
  // the 6-bit scales and mins as ggml's get_scale_min_k4 reads them, four sub-blocks' a 32-bit word at
  // a time, kept in registers (decoding them one by one, through memory, took a sixth of the time)
  X16_DECODE KHead head(const uint8_t* b) {
    uint32_t q[3];
    std::memcpy(q, b + 4, 12);
    return {{q[0] & 0x3f3f3f3fu, (q[2] & 0x0f0f0f0fu) | (((q[0] >> 6) & 0x03030303u) << 4)},
            {q[1] & 0x3f3f3f3fu, ((q[2] >> 4) & 0x0f0f0f0fu) | (((q[1] >> 6) & 0x03030303u) << 4)}};
  }
  X16_DECODE int sc(const KHead& h, const uint8_t*, int s, int) { return (h.sc[s >> 2] >> (8 * (s & 3))) & 0xFF; }
  X16_DECODE __m256 mins(const KHead& h) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)h.mn[0], (int)h.mn[1], 0, 0)));
  }
  X16_DECODE __m256i code(const uint8_t* b, int s) { return nibbles32(b + 16 + 32 * (s / 2), s & 1); }
};
struct Q5_KB {  // Q4_K's head, then 32 bytes of fifth bits (bit s of byte l: weight l of sub-block s), then nibbles
  static constexpr int64_t QK = 256, BYTES = 176; static constexpr bool MIN = true, TWO = false;
  X16_DECODE float d(const uint8_t* b) { return fp16_at(b); }
  X16_DECODE float dmin(const uint8_t* b) { return fp16_at(b + 2); }
  X16_DECODE KHead head(const uint8_t* b) { return Q4_KB::head(b); }
  X16_DECODE int sc(const KHead& h, const uint8_t* b, int s, int half) { return Q4_KB::sc(h, b, s, half); }
  X16_DECODE __m256 mins(const KHead& h) { return Q4_KB::mins(h); }
  X16_DECODE __m256i code(const uint8_t* b, int s) {
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load32(b + 16), s), _mm256_set1_epi8(1)), 4);
    return _mm256_or_si256(nibbles32(b + 48 + 32 * (s / 2), s & 1), hi);
  }
};
struct Q6_KB {  // 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 weights), fp16 d; codes less 32
  static constexpr int64_t QK = 256, BYTES = 210; static constexpr bool MIN = false, TWO = true;
  X16_DECODE float d(const uint8_t* b) { return fp16_at(b + 208); }
  X16_DECODE float dmin(const uint8_t*) { return 0.f; }
  X16_DECODE KHead head(const uint8_t*) { return {}; }
  // sub-block s: int8 scales 2s and 2s + 1, of its 16 weights each
  X16_DECODE int sc(const KHead&, const uint8_t* b, int s, int half) { return ((const int8_t*)(b + 192))[2 * s + half]; }
  X16_DECODE __m256 mins(const KHead&) { return _mm256_setzero_ps(); }
  X16_DECODE __m256i code(const uint8_t* b, int s) {
    const int h = s / 4, t = s % 4;  // a half of 128 weights holds 4 sub-blocks: ql's low nibbles, then the next 32 bytes', then high
    const __m256i lo = nibbles32(b + 64 * h + 32 * (t & 1), t >= 2);
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load32(b + 128 + 32 * h), 2 * t),
                                                          _mm256_set1_epi8(3)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
  }
};
// x held for the tiles: each 32 values as int16 codes of one scale (their largest magnitude over
// 32767: a relative step 1/65534 of it, 256 times finer than ggml's q8 x) and their fp32 sum
// (for the blocks' mins)
struct XHeld {
  std::vector<int16_t> qv;
  std::vector<float> dv, sv;
  const int16_t* q;
  const float *d, *sum;
  // `group` values share a scale: 32, or a K-quant block's 256 (its sub-blocks' integer scales then
  // apply to exact int32 sums, and one fp32 FMA a block remains); the sums are a 32 values' either way
  XHeld(const float* X, int64_t M, int64_t K, int64_t group = 32) : qv(M * K), dv(M * K / group), sv(M * K / 32) {
    q = qv.data(), d = dv.data(), sum = sv.data();
    int16_t* Q = qv.data();
    float *D = dv.data(), *S = sv.data();
    for (int64_t g = 0; g < M * K / group; ++g) {
      const float* xg = X + group * g;
      float amax = 0.f, total = 0.f;
      for (int64_t i = 0; i < group; i += 32) {
        float t = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xg[i + j])), t += xg[i + j];
        S[(group * g + i) / 32] = t;
        total += t;
      }
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      for (int64_t i = 0; i < group; ++i) Q[group * g + i] = (int16_t)std::nearbyint(xg[i] * inv);
      D[g] = std::isnan(total) ? total : amax / 32767.f;  // a NaN in x stays one in y (an inf does: 0 * inf)
    }
  }
};

// y = sum over each 32 weights of (s * codes . xq) * dx, less mn * sum(x): the codes' products with
// x's int16 codes are exact in int32 (|code| <= 128, two products a lane), then one fp32 FMA per 16
// of them, where fp32 weights took a conversion and an FMA per 16 weights besides (docs/kernels.md)
template <class B>
struct X16Tiles {
  template <int R, int MB>
  struct Tile512 {
    __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
    static void run(const uint8_t* w, int64_t rb, const int16_t* xq, const float* xd, const float* xs, int64_t K,
                    int64_t N, float* y) {
      const int64_t G = K / 32;
      __m512 acc[R][MB];
      float mins[R][MB];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps(), mins[r][m] = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* blk = w + r * rb + g * B::BYTES;
          if (PF8) for (int64_t o = 0; o < B::BYTES; o += 64) _mm_prefetch((const char*)blk + PF8 + o, _MM_HINT_T0);
          const Sub u = B::sub(blk);
          const __m512i c = _mm512_cvtepi8_epi16(u.code);
          for (int m = 0; m < MB; ++m) {
            const __m512i p = _mm512_madd_epi16(c, _mm512_loadu_si512(xq + m * K + 32 * g));
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(u.s * xd[m * G + g]), acc[r][m]);
            if (B::MIN) mins[r][m] += u.mn * xs[m * G + g];
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]) - mins[r][m];
    }
  };

  template <int R, int MB>
  struct TileAvx2 {
    __attribute__((target("avx2,fma,f16c")))
    static void run(const uint8_t* w, int64_t rb, const int16_t* xq, const float* xd, const float* xs, int64_t K,
                    int64_t N, float* y) {
      const int64_t G = K / 32;
      __m256 acc[R][MB][2];  // a block's two halves of 16 weights
      float mins[R][MB];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m][0] = acc[r][m][1] = _mm256_setzero_ps(), mins[r][m] = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* blk = w + r * rb + g * B::BYTES;
          if (PF8) for (int64_t o = 0; o < B::BYTES; o += 64) _mm_prefetch((const char*)blk + PF8 + o, _MM_HINT_T0);
          const Sub u = B::sub(blk);
          const __m256i c[2] = {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(u.code)),
                                _mm256_cvtepi8_epi16(_mm256_extracti128_si256(u.code, 1))};
          for (int m = 0; m < MB; ++m) {
            const __m256 sc = _mm256_set1_ps(u.s * xd[m * G + g]);
            const int16_t* xm = xq + m * K + 32 * g;
            for (int h = 0; h < 2; ++h) {
              const __m256i p = _mm256_madd_epi16(c[h], _mm256_loadu_si256((const __m256i*)(xm + 16 * h)));
              acc[r][m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[r][m][h]);
            }
            if (B::MIN) mins[r][m] += u.mn * xs[m * G + g];
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) {
          const __m256 a = _mm256_add_ps(acc[r][m][0], acc[r][m][1]);
          __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
          s = _mm_add_ps(s, _mm_movehl_ps(s, s));
          y[m * N + r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s))) - mins[r][m];
        }
    }
  };

  // K-quant blocks (256 weights) against x at one scale a block: each sub-block's codes times its
  // integer scale (|code * scale| <= 32 * 128, an int16), their products with x's codes summed exactly
  // in int32 over the block (|sum| < 2^31 for Q6_K's widest scales too), then one fp32 FMA a block by
  // d times x's scale, less dmin times each sub-block's min times x's fp32 sum there. A sub-block's
  // fp32 FMA, its scale's conversions and the chain through one accumulator had bound the tile
  template <int R, int MB>
  struct KTile512 {
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
    static void run(const uint8_t* w, int64_t rb, const int16_t* xq, const float* xd, const float* xs, int64_t K,
                    int64_t N, float* y) {
      const int64_t G = K / 32, NB = K / 256;
      __m512 acc[R][MB];
      __m256 mins[R][MB];  // each lane a sub-block's: dmin * its min * x's sum there
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps(), mins[r][m] = _mm256_setzero_ps();
      for (int64_t b = 0; b < NB; ++b) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* blk = w + r * rb + b * B::BYTES;
          if (PF8) for (int64_t o = 0; o < B::BYTES; o += 64) _mm_prefetch((const char*)blk + PF8 + o, _MM_HINT_T0);
          const KHead h = B::head(blk);
          __m512i ia[MB];
          for (int m = 0; m < MB; ++m) ia[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
          for (int s = 0; s < 8; ++s) {
            const __m512i sc = B::TWO ? _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((int16_t)B::sc(h, blk, s, 0)),
                                                                 _mm512_set1_epi16((int16_t)B::sc(h, blk, s, 1)))
                                       : _mm512_set1_epi16((int16_t)B::sc(h, blk, s, 0));
            const __m512i c = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(B::code(blk, s)), sc);
            for (int m = 0; m < MB; ++m)
              ia[m] = _mm512_dpwssd_epi32(ia[m], c, _mm512_loadu_si512(xq + m * K + 256 * b + 32 * s));
          }
          const float d = B::d(blk);
          const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(B::dmin(blk)), B::mins(h));
          for (int m = 0; m < MB; ++m) {
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m]), _mm512_set1_ps(d * xd[m * NB + b]), acc[r][m]);
            if (B::MIN) mins[r][m] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xs + m * G + 8 * b), mins[r][m]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) {
          __m128 s = _mm_add_ps(_mm256_castps256_ps128(mins[r][m]), _mm256_extractf128_ps(mins[r][m], 1));
          s = _mm_add_ps(s, _mm_movehl_ps(s, s));
          y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]) - _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        }
    }
  };

  template <int R, int MB>
  struct KTileAvx2 {
    __attribute__((target("avx2,fma,f16c")))
    static void run(const uint8_t* w, int64_t rb, const int16_t* xq, const float* xd, const float* xs, int64_t K,
                    int64_t N, float* y) {
      const int64_t G = K / 32, NB = K / 256;
      __m256 acc[R][MB], mins[R][MB];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps(), mins[r][m] = _mm256_setzero_ps();
      for (int64_t b = 0; b < NB; ++b) {
        for (int r = 0; r < R; ++r) {
          const uint8_t* blk = w + r * rb + b * B::BYTES;
          if (PF8) for (int64_t o = 0; o < B::BYTES; o += 64) _mm_prefetch((const char*)blk + PF8 + o, _MM_HINT_T0);
          const KHead h = B::head(blk);
          __m256i ia[MB];
          for (int m = 0; m < MB; ++m) ia[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int s = 0; s < 8; ++s) {
            const __m256i code = B::code(blk, s);
            const __m256i c0 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(code)),
                                                  _mm256_set1_epi16((int16_t)B::sc(h, blk, s, 0)));
            const __m256i c1 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(code, 1)),
                                                  _mm256_set1_epi16((int16_t)B::sc(h, blk, s, B::TWO)));
            for (int m = 0; m < MB; ++m) {
              const int16_t* xm = xq + m * K + 256 * b + 32 * s;
              ia[m] = _mm256_add_epi32(ia[m], _mm256_add_epi32(
                  _mm256_madd_epi16(c0, _mm256_loadu_si256((const __m256i*)xm)),
                  _mm256_madd_epi16(c1, _mm256_loadu_si256((const __m256i*)(xm + 16)))));
            }
          }
          const float d = B::d(blk);
          const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(B::dmin(blk)), B::mins(h));
          for (int m = 0; m < MB; ++m) {
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m]), _mm256_set1_ps(d * xd[m * NB + b]), acc[r][m]);
            if (B::MIN) mins[r][m] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xs + m * G + 8 * b), mins[r][m]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MB; ++m) {
          const __m256 a = _mm256_sub_ps(acc[r][m], mins[r][m]);
          __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
          s = _mm_add_ps(s, _mm_movehl_ps(s, s));
          y[m * N + r] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        }
    }
  };

  // the values of x a scale: a K-quant block's 256, else 32
  static constexpr int64_t group() { return B::QK == 256 ? 256 : 32; }

  template <template <int, int> class Tile, int R, int MB>
  static void rows(const uint8_t* w, int64_t rb, const int16_t* xq, const float* xd, const float* xs, int64_t K,
                   int64_t N, int64_t n0, int64_t n1, float* y) {
    int64_t n = n0;
    for (; n + R <= n1; n += R) Tile<R, MB>::run(w + n * rb, rb, xq, xd, xs, K, N, y + n);
    for (; n < n1; ++n) Tile<1, MB>::run(w + n * rb, rb, xq, xd, xs, K, N, y + n);
  }

  // rows [n0, n1) of W against x [M, K], x in chunks of up to 4 rows: the task's rows of W stay in cache
  static void run(const uint8_t* W, int64_t rb, const XHeld& x, int64_t K, int64_t M, int64_t N, int64_t n0,
                  int64_t n1, float* Y) {
    const int64_t G = K / 32;
    constexpr bool KQ = B::QK == 256;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int16_t* xq = x.q + m0 * K;
      const float* xd = x.d + m0 * (K / group());
      const float* xs = x.sum + m0 * G;
      float* ym = Y + m0 * N;
      const int64_t mb = std::min<int64_t>(4, M - m0);
      // one row of x: one row of W at a time, a single sequential stream (4 rows' interleaved streams
      // read a cold 170 MB head at half ggml's rate on Zen 4)
      if constexpr (KQ) {
        if (g_isa == 2) switch (mb) {
          case 1: rows<KTile512, 1, 1>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
          case 2: rows<KTile512, 4, 2>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
          case 3: rows<KTile512, 2, 3>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
          default: rows<KTile512, 2, 4>(W, rb, xq, xd, xs, K, N, n0, n1, ym);
        } else switch (mb) {
          case 1: rows<KTileAvx2, 1, 1>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
          case 2: rows<KTileAvx2, 2, 2>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
          case 3: rows<KTileAvx2, 1, 3>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
          default: rows<KTileAvx2, 1, 4>(W, rb, xq, xd, xs, K, N, n0, n1, ym);
        }
      } else if (g_isa == 2) switch (mb) {
        case 1: rows<Tile512, 1, 1>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
        case 2: rows<Tile512, 4, 2>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
        case 3: rows<Tile512, 2, 3>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
        default: rows<Tile512, 2, 4>(W, rb, xq, xd, xs, K, N, n0, n1, ym);
      } else switch (mb) {  // AVX2's 16 registers: fewer sums a tile
        case 1: rows<TileAvx2, 1, 1>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
        case 2: rows<TileAvx2, 2, 2>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
        case 3: rows<TileAvx2, 1, 3>(W, rb, xq, xd, xs, K, N, n0, n1, ym); break;
        default: rows<TileAvx2, 1, 4>(W, rb, xq, xd, xs, K, N, n0, n1, ym);
      }
    }
  }
};

// M rows of x [M, K] (fp32, contiguous) against N rows of blocks of ggml type `type` (its GGUF type id:
// 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K) at W, row_bytes(type, K) bytes a
// row; Y [M, N] fp32 (+ bias, fp32 or null), in place
struct X16Type {
  using Run = void (*)(const uint8_t*, int64_t, const XHeld&, int64_t, int64_t, int64_t, int64_t, int64_t, float*);
  int64_t qk = 0, bytes = 0, group = 32;
  Run run = nullptr;
  explicit X16Type(int64_t type) {
    auto pick = [&](auto b) {
      using B = decltype(b);
      qk = B::QK, bytes = B::BYTES, group = X16Tiles<B>::group(), run = &X16Tiles<B>::run;
    };
    switch (type) {
      case 2: pick(Q4_0B{}); break;
      case 3: pick(Q4_1B{}); break;
      case 8: pick(Q8_0B{}); break;
      case 6: pick(Q5_0B{}); break;
      case 7: pick(Q5_1B{}); break;
      case 12: pick(Q4_KB{}); break;
      case 13: pick(Q5_KB{}); break;
      case 14: pick(Q6_KB{}); break;
      default: TORCH_CHECK(false, "gguf_linear_x16: no kernel for GGUF type ", type, " (2, 3, 6, 7, 8, 12, 13, 14)");
    }
  }
  int64_t row_bytes(int64_t K) const { return K / qk * bytes; }
};

void x16_into(const float* x, int64_t M, const uint8_t* W, int64_t N, int64_t K, const X16Type& t, float* Y,
              const float* bias) {
  const int64_t rb = t.row_bytes(K);
  const XHeld X(x, M, K, t.group);
  over_rows(N, K, [&](int64_t n0, int64_t n1) {
    t.run(W, rb, X, K, M, N, n0, n1, Y);
    add_bias(Y, M, N, n0, n1, bias);
  });
}

// x [..., K] (any float dtype, taken as fp32) against N rows of blocks of ggml type `type` (x16_into),
// uint8 [N, row bytes]; y in fp32, as ggml's ops give it
at::Tensor gguf_linear_x16(const at::Tensor& x, const at::Tensor& w, int64_t N, int64_t K, int64_t type,
                            const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(g_isa > 0, "layerline_cpu: no kernel for this CPU (AVX2 + FMA or AVX-512 BF16 needed)");
  const X16Type t(type);
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) == K && K % t.qk == 0,
              "gguf_linear_x16: x must be a CPU tensor [..., K], K a multiple of ", t.qk);
  const int64_t rb = t.row_bytes(K);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * rb,
              "gguf_linear_x16: w must be contiguous uint8 [N, ", rb, "]");
  TORCH_CHECK(!bias.has_value() || !bias->defined() || bias->numel() == N, "gguf_linear_x16: one bias per row");
  const uint8_t* W = w.data_ptr<uint8_t>();
  return over_fp32_rows(x, N, K, bias, [&](const float* xr, int64_t M, float* y, const float* b) {
    x16_into(xr, M, W, N, K, t, y, b);
  });
}

}  // namespace
