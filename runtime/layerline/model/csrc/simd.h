// Vector loads and horizontal sums that more than one op uses.
#pragma once

#include "common.h"

namespace {

__attribute__((target("avx2,fma"))) inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

__attribute__((target("avx2,fma"))) inline int32_t hsum256i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// 8 values of x as fp32
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::BFloat16* p) {
  return bf16x8(reinterpret_cast<const uint16_t*>(p));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

// 16 values of x as fp32
#define LL_512 __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) inline
LL_512 __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
LL_512 __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
LL_512 __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

}  // namespace
