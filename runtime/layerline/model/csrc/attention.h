// Decode attention: one new token per row. Row i writes its k/v at pos[i] of its caches and its
// query heads attend over keys lo[i]..pos[i] there, in place. A task is one (row, kv head): its g
// query heads share each key's load. Each sum runs in one fixed order, so a row's bits do not
// depend on the other rows or the thread count.
#pragma once

#include "common.h"
#include "simd.h"

namespace {

// the AVX-512 task: keys scored 16 at a time, softmax, two query heads' sums over the values
LL_512 void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
LL_512 void store16(at::BFloat16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }

// e^x for the 16 lanes of x <= 0 (scores minus their max): 2^n * p(r), a degree-6 polynomial on
// |r| <= ln2 / 2, within 2 ulp
LL_512 __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// 16 vectors to one: lane i the sum of v[i]'s lanes (a transpose as it adds: 31 shuffles and 15
// adds, where 16 reductions of one vector each take about 128 ops, each a chain)
LL_512 __m512 hsum16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // halves: [v2i 8 lanes, v2i+1 8 lanes]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: 128-bit block b holds 4 lanes of v4i+b
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block b: 2 lanes each of v8i+b and v8i+4+b, interleaved
    z[i] = _mm512_add_ps(_mm512_unpacklo_ps(y[2 * i], y[2 * i + 1]), _mm512_unpackhi_ps(y[2 * i], y[2 * i + 1]));
  const __m512d z0 = _mm512_castps_pd(z[0]), z1 = _mm512_castps_pd(z[1]);
  // lane 4b + m: the sum of v[4m + b]; back to lane i: the sum of v[i]
  const __m512 w = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(z0, z1)), _mm512_castpd_ps(_mm512_unpackhi_pd(z0, z1)));
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), w);
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void attend_task_512(const T* q, int64_t qs, const T* knew, const T* vnew, T* kc, T* vc, int64_t ls,
                     int64_t lo, int64_t pos, int64_t g, int64_t hd, float scale, T* out,
                     std::vector<float>& buf) {
  for (int64_t d = 0; d < hd; ++d) { kc[pos * ls + d] = knew[d]; vc[pos * ls + d] = vnew[d]; }
  const int64_t L = pos - lo + 1, nv = hd / 16, Lp = (L + 15) / 16 * 16;
  buf.resize(g * hd * 2 + g * Lp);
  float *qf = buf.data(), *acc = qf + g * hd, *sc = acc + g * hd;
  for (int64_t r = 0; r < g; ++r)
    for (int64_t d = 0; d < nv; ++d) store16(qf + r * hd + 16 * d, load16(q + r * qs + 16 * d));
  // scores 16 keys at a time: one accumulator a key, summed across lanes together (hsum16)
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < L; j0 += 16) {
    const int64_t nb = std::min<int64_t>(16, L - j0);
    const T* k0 = kc + (lo + j0) * ls;
    for (int64_t r = 0; r < g; ++r) {
      const float* qr = qf + r * hd;
      __m512 a[16];
#pragma GCC unroll 16
      for (int jj = 0; jj < 16; ++jj) a[jj] = _mm512_setzero_ps();
      for (int64_t d = 0; d < nv; ++d) {
        const __m512 qd = _mm512_loadu_ps(qr + 16 * d);
#pragma GCC unroll 16
        for (int jj = 0; jj < 16; ++jj)
          if (jj < nb) a[jj] = _mm512_fmadd_ps(qd, load16(k0 + jj * ls + 16 * d), a[jj]);
      }
      _mm512_storeu_ps(sc + r * Lp + j0, _mm512_mul_ps(hsum16(a), vscale));
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    float* s = sc + r * Lp;
    for (int64_t j = L; j < Lp; ++j) s[j] = -INFINITY;  // unused lanes: e^-87 at most, nothing beside the max's 1
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < Lp; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    for (int64_t j = 0; j < Lp; j += 16) _mm512_storeu_ps(s + j, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx)));
  }
  if (nv <= 8) {
    // two query rows at a time, their sums over the values in registers (16 at most)
    for (int64_t r0 = 0; r0 < g; r0 += 2) {
      const bool two = r0 + 1 < g;
      const float *s0 = sc + r0 * Lp, *s1 = sc + (two ? r0 + 1 : r0) * Lp;
      __m512 a0[8], a1[8];
#pragma GCC unroll 8
      for (int d = 0; d < 8; ++d) a0[d] = a1[d] = _mm512_setzero_ps();
      for (int64_t j = 0; j < L; ++j) {
        const T* vj = vc + (lo + j) * ls;
        const __m512 p0 = _mm512_set1_ps(s0[j]), p1 = _mm512_set1_ps(s1[j]);
#pragma GCC unroll 8
        for (int d = 0; d < 8; ++d)
          if (d < nv) {
            const __m512 x = load16(vj + 16 * d);
            a0[d] = _mm512_fmadd_ps(p0, x, a0[d]);
            a1[d] = _mm512_fmadd_ps(p1, x, a1[d]);
          }
      }
      for (int64_t d = 0; d < nv; ++d) {
        _mm512_storeu_ps(acc + r0 * hd + 16 * d, a0[d]);
        if (two) _mm512_storeu_ps(acc + (r0 + 1) * hd + 16 * d, a1[d]);
      }
    }
  } else {
    std::fill(acc, acc + g * hd, 0.f);
    for (int64_t j = 0; j < L; ++j) {
      const T* vj = vc + (lo + j) * ls;
      for (int64_t d = 0; d < nv; ++d) {
        const __m512 x = load16(vj + 16 * d);
        for (int64_t r = 0; r < g; ++r) {
          float* a = acc + r * hd + 16 * d;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(sc[r * Lp + j]), x, _mm512_loadu_ps(a)));
        }
      }
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    __m512 t = _mm512_setzero_ps();
    for (int64_t j = 0; j < Lp; j += 16) t = _mm512_add_ps(t, _mm512_loadu_ps(sc + r * Lp + j));
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(t));
    for (int64_t d = 0; d < nv; ++d) store16(out + r * hd + 16 * d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * hd + 16 * d), inv));
  }
}

// the AVX2 task: the AVX-512 task's steps in 8 lanes. Each block of 8 keys is widened to fp32 once
// for all g query heads and scored 8 at a time, summed across lanes together (hsum8); one query
// head's sums over the values in registers up to hd 64
#define LL_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) inline
LL_AVX2 __m256 load8w(const float* p) { return _mm256_loadu_ps(p); }
LL_AVX2 __m256 load8w(const at::BFloat16* p) { return bf16x8(reinterpret_cast<const uint16_t*>(p)); }

// e^x for the 8 lanes of x <= 0, as exp_neg16
LL_AVX2 __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 vectors to one: lane i the sum of v[i]'s lanes
LL_AVX2 __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [v0..v3 low halves | high halves]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

LL_AVX2 float hsum8f(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <typename T>
__attribute__((target("avx2,fma,f16c")))
void attend_task_avx2(const T* q, int64_t qs, const T* knew, const T* vnew, T* kc, T* vc, int64_t ls,
                      int64_t lo, int64_t pos, int64_t g, int64_t hd, float scale, T* out,
                      std::vector<float>& buf) {
  for (int64_t d = 0; d < hd; ++d) { kc[pos * ls + d] = knew[d]; vc[pos * ls + d] = vnew[d]; }
  const int64_t L = pos - lo + 1, nv = hd / 8, Lp = (L + 7) / 8 * 8;
  buf.resize(g * hd * 2 + g * Lp + 8 * hd);
  float *qf = buf.data(), *acc = qf + g * hd, *sc = acc + g * hd, *kf = sc + g * Lp;
  for (int64_t r = 0; r < g; ++r)
    for (int64_t d = 0; d < nv; ++d) _mm256_storeu_ps(qf + r * hd + 8 * d, load8w(q + r * qs + 8 * d));
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < L; j0 += 8) {
    const int64_t nb = std::min<int64_t>(8, L - j0);
    const T* k0 = kc + (lo + j0) * ls;
    for (int64_t jj = 0; jj < 8; ++jj)  // the block's keys in fp32 (past L: zeros)
      for (int64_t d = 0; d < nv; ++d)
        _mm256_storeu_ps(kf + jj * hd + 8 * d, jj < nb ? load8w(k0 + jj * ls + 8 * d) : _mm256_setzero_ps());
    for (int64_t r = 0; r < g; ++r) {
      const float* qr = qf + r * hd;
      __m256 a[8];
#pragma GCC unroll 8
      for (int jj = 0; jj < 8; ++jj) a[jj] = _mm256_setzero_ps();
      for (int64_t d = 0; d < nv; ++d) {
        const __m256 qd = _mm256_loadu_ps(qr + 8 * d);
#pragma GCC unroll 8
        for (int jj = 0; jj < 8; ++jj) a[jj] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kf + jj * hd + 8 * d), a[jj]);
      }
      _mm256_storeu_ps(sc + r * Lp + j0, _mm256_mul_ps(hsum8(a), vscale));
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    float* s = sc + r * Lp;
    for (int64_t j = L; j < Lp; ++j) s[j] = -INFINITY;  // unused lanes: e^-87 at most, nothing beside the max's 1
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < Lp; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))));
    for (int64_t j = 0; j < Lp; j += 8) _mm256_storeu_ps(s + j, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx)));
  }
  if (nv <= 8) {
    for (int64_t r = 0; r < g; ++r) {
      const float* s = sc + r * Lp;
      __m256 a[8];
#pragma GCC unroll 8
      for (int d = 0; d < 8; ++d) a[d] = _mm256_setzero_ps();
      for (int64_t j = 0; j < L; ++j) {
        const T* vj = vc + (lo + j) * ls;
        const __m256 p = _mm256_set1_ps(s[j]);
#pragma GCC unroll 8
        for (int d = 0; d < 8; ++d)
          if (d < nv) a[d] = _mm256_fmadd_ps(p, load8w(vj + 8 * d), a[d]);
      }
      for (int64_t d = 0; d < nv; ++d) _mm256_storeu_ps(acc + r * hd + 8 * d, a[d]);
    }
  } else {
    std::fill(acc, acc + g * hd, 0.f);
    for (int64_t j = 0; j < L; ++j) {
      const T* vj = vc + (lo + j) * ls;
      for (int64_t d = 0; d < nv; ++d) {
        const __m256 x = load8w(vj + 8 * d);
        for (int64_t r = 0; r < g; ++r) {
          float* a = acc + r * hd + 8 * d;
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(sc[r * Lp + j]), x, _mm256_loadu_ps(a)));
        }
      }
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    __m256 t = _mm256_setzero_ps();
    for (int64_t j = 0; j < Lp; j += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(sc + r * Lp + j));
    const float inv = 1.f / hsum8f(t);
    for (int64_t d = 0; d < hd; ++d) out[r * hd + d] = static_cast<T>(acc[r * hd + d] * inv);
  }
}

// one row's attention as its tasks see it: its query heads (qh apart), new k and v (kh, vh: a kv
// head's offset), its caches (kch, vch: a kv head's offset; ls: a position's, in both), where it
// writes (pos) and its first key (lo), and its output [nh * hd]
template <typename T>
struct AttendRow {
  const T *q, *k, *v;
  int64_t qh, kh, vh;
  T *kc, *vc;
  int64_t kch, vch, ls, lo, pos;
  T* out;
};

// every row's (row, kv head) tasks over torch's threads
template <typename T>
void attend_rows(const AttendRow<T>* rows, int64_t n, int64_t nkv, int64_t g, int64_t hd, double scale) {
  at::parallel_for(0, n * nkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t t = t0; t < t1; ++t) {
      const AttendRow<T>& r = rows[t / nkv];
      const int64_t h = t % nkv;
      const T* qi = r.q + h * g * r.qh;
      const T* ki = r.k + h * r.kh;
      const T* vi = r.v + h * r.vh;
      T* kci = r.kc + h * r.kch;
      T* vci = r.vc + h * r.vch;
      T* o = r.out + h * g * hd;
      if (g_isa == 2) attend_task_512(qi, r.qh, ki, vi, kci, vci, r.ls, r.lo, r.pos, g, hd, (float)scale, o, buf);
      else attend_task_avx2(qi, r.qh, ki, vi, kci, vci, r.ls, r.lo, r.pos, g, hd, (float)scale, o, buf);
    }
  });
}

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<at::Tensor>& kc,
                const std::vector<at::Tensor>& vc, int64_t n, c10::IntArrayRef pos, c10::IntArrayRef lo, double scale,
                at::Tensor& out) {
  const int64_t nh = q.size(1), hd = q.size(2), nkv = k.size(1), g = nh / nkv;
  std::vector<AttendRow<T>> rows;
  for (int64_t i = 0; i < n; ++i)
    rows.push_back({q.data_ptr<T>() + i * q.stride(0), k.data_ptr<T>() + i * k.stride(0), v.data_ptr<T>() + i * v.stride(0),
                    q.stride(1), k.stride(1), v.stride(1), kc[i].data_ptr<T>(), vc[i].data_ptr<T>(), kc[i].stride(0),
                    vc[i].stride(0), kc[i].stride(1), lo[i], pos[i], out.data_ptr<T>() + i * nh * hd});
  attend_rows(rows.data(), n, nkv, g, hd, scale);
}

// q [B, nh, (1,) hd], k/v [B, nkv, (1,) hd]; kc/vc: for the first n <= B rows, each its
// [(1,) nkv, max_len, hd] caches (views of any batch), written at pos[i]; -> [B, 1, nh * hd] in q's
// dtype, zeros for rows past n (a compiled step's padding)
at::Tensor decode_attention(const at::Tensor& q4, const at::Tensor& k4, const at::Tensor& v4, at::TensorList kc,
                            at::TensorList vc, c10::IntArrayRef pos, c10::IntArrayRef lo, double scale) {
  auto one = [](const at::Tensor& t) { return t.dim() == 4 && t.size(2) == 1 ? t.select(2, 0) : t; };
  const at::Tensor q = one(q4), k = one(k4), v = one(v4);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "decode_attention: q [B, nh, 1, hd], k/v [B, nkv, 1, hd]");
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k.size(1), n = (int64_t)kc.size();
  TORCH_CHECK(k.size(0) == B && k.size(2) == hd && nkv > 0 && nh % nkv == 0 && hd % 16 == 0,
              "decode_attention: rows, heads (a multiple of the kv heads) and head_dim (a multiple of 16) must agree");
  TORCH_CHECK(n <= B && (int64_t)vc.size() == n && (int64_t)pos.size() == n && (int64_t)lo.size() == n,
              "decode_attention: one cache, position and first key per row, at most one per row of q");
  auto st = q.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16, "decode_attention: fp32 or bf16");
  auto last1 = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  auto qc = last1(q), kk = last1(k), vv = last1(v);
  TORCH_CHECK(kk.scalar_type() == st && vv.scalar_type() == st, "decode_attention: q, k, v of one dtype");
  auto cache = [](const at::Tensor& t) { return t.dim() == 4 && t.size(0) == 1 ? t.select(0, 0) : t; };
  std::vector<at::Tensor> kcs, vcs;
  for (int64_t i = 0; i < n; ++i) {
    kcs.push_back(cache(kc[i]));
    vcs.push_back(cache(vc[i]));
    for (const auto& c : {kcs[i], vcs[i]})
      TORCH_CHECK(c.dim() == 3 && c.size(0) == nkv && c.size(2) == hd && c.stride(2) == 1 &&
                  c.scalar_type() == st && c.device().is_cpu(),
                  "decode_attention: caches [nkv, max_len, hd] of q's dtype, rows contiguous");
    TORCH_CHECK(0 <= lo[i] && lo[i] <= pos[i] && pos[i] < kcs[i].size(1) && vcs[i].size(1) == kcs[i].size(1),
                "decode_attention: 0 <= lo <= pos < max_len");
  }
  auto out = n < B ? at::zeros({B, 1, nh * hd}, q.options()) : at::empty({B, 1, nh * hd}, q.options());
  if (st == at::kBFloat16) attend_all<at::BFloat16>(qc, kk, vv, kcs, vcs, n, pos, lo, scale, out);
  else attend_all<float>(qc, kk, vv, kcs, vcs, n, pos, lo, scale, out);
  return out;
}

}  // namespace
