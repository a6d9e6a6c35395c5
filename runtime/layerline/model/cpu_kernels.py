"""CPU kernels for decode steps: a linear layer over a few rows (one token per sequence) that streams
its weight once, at close to the memory's speed, and the attention of one new token per row.

A decode step on a CPU is bound by reading every weight once per token, and torch's own kernels
(oneDNN's bf16 GEMM, `_weight_int8pack_mm`) read a one-row product's weight at about half the
rate a plain dot-product loop reaches (2 cores, AVX-512, a 32000x1024 bf16 matrix: 2.6 ms against
1.4 ms). Three ops, built from the C++ below at first use:

  layerline_cpu::linear_bf16(x, w, bias?)        x bf16 [..., K] @ w bf16 [N, K].T
  layerline_cpu::linear_int8(x, q, scale, bias?) x [..., K] @ (q int8 [N, K] * scale f32 [N]).T
  layerline_cpu::linear_int4(x, codes, sz, bias?) x [..., K] @ int4 W in groups of 32 (codes uint8
                                                  [N, K / 2], sz bf16 [N, K / 32, 2]; any rows)

Each output is one row's dot product over k in one fixed order (fp32 lanes, then their sum), the
same for any number of rows in the call: a row's bits do not depend on what it is batched with.
bf16 and int8 run for up to `MAX_ROWS` rows (decode steps and the server's micro-batches; prefills
stay with torch's GEMMs, which are faster for many rows) and K a multiple of 32; rows are split
across torch's threads. The ISA is chosen at run time: AVX-512 with BF16 and VNNI (vdpbf16ps,
vpdpwssd, vpdpbusd), else AVX2 + FMA (bf16 widened to fp32 for FMA, vpmaddwd, vpmaddubsw); both
run all three. On a 2-core AVX2-only AMD EPYC (Zen 3, 2026-12-03; `bench/bench_kernel_variants.py`
with torch=torch, the demo model's 65 matrices, in turns) the AVX2 kernels took 0.85x of torch's
time at bf16 for one row (oneDNN's GEMV), 0.31x for 4 rows and 0.24x for 8; int8 0.64x, 0.50x,
0.39x of `_weight_int8pack_mm`'s; int4 0.55x, 0.38x, 0.39x of `_weight_int4pack_mm_for_cpu`'s.
(An AVX2 bf16 kernel tried on an AVX-512 machine under AVX2 limits had lost to torch's there.)

int4 quantizes x per group of 32 to int8 (as llama.cpp's q8_0) and sums each group's code * x
exactly in int32 before scaling it (2 cores, the demo model's 64 int4 matrices streamed from
memory, one row: 1.2-1.8x the rate of torch's `_weight_int4pack_mm_for_cpu` on AVX-512; 128
rows: 1.3x). It runs any number of rows: a prefill's too.

A third op does a decode step's attention: `decode_attention` writes each row's new k/v into its
cache and attends over that row's keys in place (GQA heads share each key's load; softmax in
fp32), bf16 or fp32, with explicit AVX-512 or AVX2 vectors.
torch's SDPA (its flash kernel) took 90-100 us for one bf16 query over 130 keys (16 heads, 4 KV
heads, head_dim 64); this op 11-14 us, most of it the call. On AVX-512 it scores 16 keys at a time
(one accumulator a key, their lanes summed together) and keeps two query rows' sums over the values
in registers: 1.5-2.2x the one-key-at-a-time version from 129 keys on (2048 keys, 4 KV heads, one
thread: 108-124 against 178-274 us, 2026-12-03, in turns). On AVX2 it scores 8 keys at a time from
a block widened to fp32 once for all the query heads: 33-34 us against 83-101 for the
compiler-vectorized loops before it at 130-190 keys, 96-176 against 380 at 1024 (Zen 3, one bf16
row of the demo's heads, 2 threads, 2026-12-03).

Built with the host's C++ compiler (`CXX`, else g++) against torch's headers into a cache
(`LAYERLINE_KERNEL_CACHE`, else ~/.cache/layerline/kernels), once per source and torch version: about
10 s. A host without a compiler, a CPU with neither ISA, or `LAYERLINE_CPU_KERNELS=off` decodes with
torch's kernels; `status()` says which and why. `LAYERLINE_CPU_KERNELS=avx2` caps the ISA (tests run
both where the CPU has both).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 8     # rows per call the kernels take; more (a prefill) go to torch's GEMMs
K_MULTIPLE = 32  # the kernels' step along K
ISAS = {"avx2": 1, "avx512-bf16": 2}  # the C++ side's numbers
BUILD_TIMEOUT_S = 300

SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

int64_t g_isa = 0;            // 0: none, 1: AVX2 + FMA, 2: AVX-512 with BF16
constexpr int64_t PF = 4096;  // bytes ahead of each row that a core asks for early
constexpr int64_t PF_AVX2 = 8192;  // AVX2's (Zen 3: 1.09-1.12x faster than 4096 at one row)
constexpr int64_t PF4 = 8192;  // the same for int4's codes (their scales: a quarter of it); 4096: 0.87-0.94x

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
// AVX-512 (32 registers): 4, 4, 4, 2 (16 sums at most); bf16 takes R4 = 2: its 4 x 4 tile read 0.9x
// as fast (demo shapes, in turns), int8's not. AVX2 (16 registers): 4, 2, 2, 1, so the sums and
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

// bf16: vdpbf16ps, pairs of bf16 products added into fp32 lanes. With several rows of x, each row
// of W's next lines are asked for PF bytes ahead (as int8's): the longer loop body otherwise
// keeps too few loads in flight (8 rows of x: 0.65-0.75x the time, demo shapes, in turns)
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
// (at 8 the tile is busy enough: 1.1x slower with them)
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

__attribute__((target("avx2,fma"))) inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

__attribute__((target("avx2,fma"))) inline int32_t hsum256i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

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
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::BFloat16* p) {
  return bf16x8(reinterpret_cast<const uint16_t*>(p));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

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

// y [..., N] in x's dtype, sums [M, N] (the kernels' scratch), bias as float (or undefined)
struct Out {
  at::Tensor y, sums, bias;
  Out(const at::Tensor& x, int64_t M, int64_t N, at::ScalarType sum_type, const c10::optional<at::Tensor>& b) {
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    y = at::empty(sizes, x.options());
    sums = at::empty({M, N}, x.options().dtype(sum_type));
    if (b.has_value() && b->defined()) bias = b->to(at::kFloat).contiguous();
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
    if (g_isa == 2) tiles<Bf16Tile, 4, 4, 2, 2>(W, X, K, M, N, n0, n1, Y);
    else tiles<Bf16Avx2Tile, 4, 2, 2, 1>(W, X, K, M, N, n0, n1, Y);
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
    if (g_isa == 2) tiles<Int8Tile, 4, 4, 4, 2>(W, X, K, M, N, n0, n1, Y);
    else tiles<Int8Avx2Tile, 4, 2, 2, 1>(W, X, K, M, N, n0, n1, Y);
    out.store_rows<int32_t>(M, N, n0, n1, xs.data(), S);
  });
  return out.y;
}

// Decode attention: one new token per row. Row i writes its k/v at pos[i] of its caches and its
// query heads attend over keys lo[i]..pos[i] there, in place. A task is one (row, kv head): its g
// query heads share each key's load. Each sum runs in one fixed order, so a row's bits do not
// depend on the other rows or the thread count.

// the AVX-512 task: keys scored 16 at a time, softmax, two query heads' sums over the values
#define LL_512 __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) inline
LL_512 __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
LL_512 __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
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

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<at::Tensor>& kc,
                const std::vector<at::Tensor>& vc, int64_t n, c10::IntArrayRef pos, c10::IntArrayRef lo, double scale,
                at::Tensor& out) {
  const int64_t nh = q.size(1), hd = q.size(2), nkv = k.size(1), g = nh / nkv;
  at::parallel_for(0, n * nkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / nkv, h = t % nkv;
      const T* qi = q.data_ptr<T>() + i * q.stride(0) + h * g * q.stride(1);
      const T* ki = k.data_ptr<T>() + i * k.stride(0) + h * k.stride(1);
      const T* vi = v.data_ptr<T>() + i * v.stride(0) + h * v.stride(1);
      T* kci = kc[i].data_ptr<T>() + h * kc[i].stride(0);
      T* vci = vc[i].data_ptr<T>() + h * vc[i].stride(0);
      T* o = out.data_ptr<T>() + i * nh * hd + h * g * hd;
      if (g_isa == 2)
        attend_task_512(qi, q.stride(1), ki, vi, kci, vci, kc[i].stride(1), lo[i], pos[i], g, hd, (float)scale, o, buf);
      else
        attend_task_avx2(qi, q.stride(1), ki, vi, kci, vci, kc[i].stride(1), lo[i], pos[i], g, hd, (float)scale, o, buf);
    }
  });
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

// int4 weights in groups of 32 (layerline's layout, `quant.Int4Linear` with rows=True): codes
// uint8 [N, K / 2], 16 bytes a group (byte j: code j in its low nibble, code j + 16 in its high one,
// as GGUF's Q4_0 / Q4_1 blocks), and sz [N, K / 32] pairs of bf16 (s, z): w = (code - 8) * s + z.
// x is quantized per group of 32 to int8 (one scale a group, as llama.cpp's q8_0), so a group's
// sum of code * x is exact in int32 (vpdpbusd); it is scaled by s * dx in fp32, and the zeros add
// (z - 8 s) * (the group's sum of x). The x codes are laid out per pair of groups as two groups'
// nibbles unpack into one vector: [g0 0..15, g1 0..15, g0 16..31, g1 16..31].
LL_512 __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#define LL_VNNI __attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl,avx512vnni,avx512dq")))

template <typename T>
LL_VNNI void quantize_groups_x(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xsum) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const T* p = x + m * K + g * 32;
      const __m512 a = load16(p), b = load16(p + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      int8_t* out = xq + m * K + (g / 2) * 64 + (g % 2) * 16;
      _mm_storeu_si128((__m128i*)out, _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128((__m128i*)(out + 32), _mm512_cvtsepi32_epi8(qb));
      dx[m * G + g] = amax / 127.f;
      xsum[m * G + g] = amax / 127.f * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

// R rows of W against MB rows of x, 16 groups at a time: their (s, z) in one load, then each pair
// of groups' 32 code bytes as one vector. The scale rows are a stream of their own, asked for early
// as the codes are (without it the kernel read 0.65x of torch's int4 kernel's rate from memory).
template <int R, int MB>
struct Int4Tile {
  LL_VNNI static void run(const uint8_t* w, const uint32_t* sz, const int8_t* xq, const float* dx,
                          const float* xsum, int64_t K, int64_t N, float* y) {
    const int64_t G = K / 32, KB = K / 2;
    __m512 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const __m512i zmask = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);  // lane -> group of 2
    for (int64_t g0 = 0; g0 < G; g0 += 16) {
      const int ng = (int)std::min<int64_t>(16, G - g0);
      const __mmask16 mk = (__mmask16)(ng == 16 ? 0xFFFFu : (1u << ng) - 1);
      __m512 C[R][MB];  // s * dx of each of the 16 groups
      for (int r = 0; r < R; ++r) {
        _mm_prefetch((const char*)(sz + r * G + g0) + PF4 / 4, _MM_HINT_T0);
        const __m512i v = _mm512_maskz_loadu_epi32(mk, sz + r * G + g0);
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 z8 = _mm512_fmadd_ps(s, _mm512_set1_ps(-8.f), _mm512_castsi512_ps(_mm512_and_si512(v, zmask)));
        for (int m = 0; m < MB; ++m) {
          C[r][m] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mk, dx + m * G + g0));
          acc[r][m] = _mm512_fmadd_ps(z8, _mm512_maskz_loadu_ps(mk, xsum + m * G + g0), acc[r][m]);
        }
      }
      for (int p = 0; p < ng / 2; ++p) {
        const __m512i idx = _mm512_add_epi32(pair, _mm512_set1_epi32(2 * p));
        const int64_t off = (g0 + 2 * p) * 16;
        __m512i wv[R];
        for (int r = 0; r < R; ++r) {
          if ((off & 63) == 0) _mm_prefetch((const char*)(w + r * KB + off) + PF4, _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256((const __m256i*)(w + r * KB + off));
          wv[r] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, lo4)),
                                     _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), 1);
        }
        for (int m = 0; m < MB; ++m) {
          const __m512i xv = _mm512_loadu_si512(xq + m * K + off * 2);
          for (int r = 0; r < R; ++r) {
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv);
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(idx, C[r][m]), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
};

// AVX2: the same x codes, layout and sums. A group's 16 code bytes times its x codes by vpmaddubsw
// (unsigned codes 0..15 times signed x: each int16 pair sum at most 2 * 15 * 127, never saturating),
// then vpmaddwd into int32 lanes, four a group; each pair of groups' eight lanes scaled in fp32.
template <typename T>
__attribute__((target("avx2,fma,f16c")))
void quantize_groups_x_avx2(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xsum) {
  const int64_t G = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' lane-wise order undone
  for (int64_t m = 0; m < M; ++m)
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
      const __m256i q = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(qa, qb), _mm256_packs_epi32(qc, qd)), order);
      int8_t* out = xq + m * K + (g / 2) * 64 + (g % 2) * 16;
      _mm_storeu_si128((__m128i*)out, _mm256_castsi256_si128(q));
      _mm_storeu_si128((__m128i*)(out + 32), _mm256_extracti128_si256(q, 1));
      dx[m * G + g] = amax / 127.f;
      xsum[m * G + g] = amax / 127.f * (float)hsum256i(_mm256_add_epi32(_mm256_add_epi32(qa, qb), _mm256_add_epi32(qc, qd)));
    }
}

template <int R, int MB>
struct Int4Avx2Tile {
  __attribute__((target("avx2,fma")))
  static void run(const uint8_t* w, const uint32_t* sz, const int8_t* xq, const float* dx,
                  const float* xsum, int64_t K, int64_t N, float* y) {
    const int64_t G = K / 32, KB = K / 2;
    __m256 acc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i zmask = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
      const int ng = (int)std::min<int64_t>(8, G - g0);  // even: K is a multiple of 64
      const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(ng), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256 C[R][MB];  // s * dx of each of the 8 groups
      for (int r = 0; r < R; ++r) {
        _mm_prefetch((const char*)(sz + r * G + g0) + PF4 / 4, _MM_HINT_T0);
        const __m256i v = _mm256_maskload_epi32((const int*)(sz + r * G + g0), mk);
        const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 z8 = _mm256_fmadd_ps(s, _mm256_set1_ps(-8.f), _mm256_castsi256_ps(_mm256_and_si256(v, zmask)));
        for (int m = 0; m < MB; ++m) {
          C[r][m] = _mm256_mul_ps(s, _mm256_maskload_ps(dx + m * G + g0, mk));
          acc[r][m] = _mm256_fmadd_ps(z8, _mm256_maskload_ps(xsum + m * G + g0, mk), acc[r][m]);
        }
      }
      for (int p = 0; p < ng / 2; ++p) {
        const __m256i idx = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
        const int64_t off = (g0 + 2 * p) * 16;
        __m256i wl[R], wh[R];
        for (int r = 0; r < R; ++r) {
          if ((off & 63) == 0) _mm_prefetch((const char*)(w + r * KB + off) + PF4, _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256((const __m256i*)(w + r * KB + off));
          wl[r] = _mm256_and_si256(v, lo4);
          wh[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        }
        for (int m = 0; m < MB; ++m) {
          const __m256i xa = _mm256_loadu_si256((const __m256i*)(xq + m * K + off * 2));
          const __m256i xb = _mm256_loadu_si256((const __m256i*)(xq + m * K + off * 2 + 32));
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

template <template <int, int> class Tile, int R, int MB>
void int4_rows(const uint8_t* w, const uint32_t* sz, const int8_t* xq, const float* dx, const float* xs,
               int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t G = K / 32;
  int64_t n = n0;
  for (; n + R <= n1; n += R) Tile<R, MB>::run(w + n * (K / 2), sz + n * G, xq, dx, xs, K, N, y + n);
  for (; n < n1; ++n) Tile<1, MB>::run(w + n * (K / 2), sz + n * G, xq, dx, xs, K, N, y + n);
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sz,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, G = K / 32;
  check(x, codes, x.size(-1), bias);
  TORCH_CHECK(codes.scalar_type() == at::kByte && x.size(-1) == K && K % 64 == 0,
              "linear_int4: uint8 codes [N, K / 2] for x [..., K], K a multiple of 64");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(0) == N && sz.size(1) == G && sz.size(2) == 2,
              "linear_int4: bf16 scales and zeros [N, K / 32, 2]");
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "linear_int4: x fp32, bf16 or fp16");
  auto cc = codes.contiguous();
  auto szc = sz.contiguous();
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * G), xs(M * G);
  auto quantize = [&](auto* p) {
    if (g_isa == 2) quantize_groups_x(p, M, K, xq.data(), dx.data(), xs.data());
    else quantize_groups_x_avx2(p, M, K, xq.data(), dx.data(), xs.data());
  };
  if (st == at::kBFloat16) quantize(x2.data_ptr<at::BFloat16>());
  else if (st == at::kHalf) quantize(x2.data_ptr<at::Half>());
  else quantize(x2.data_ptr<float>());
  Out out(x, M, N, at::kFloat, bias);
  const uint8_t* W = cc.data_ptr<uint8_t>();
  const uint32_t* SZ = reinterpret_cast<const uint32_t*>(szc.data_ptr<at::BFloat16>());
  float* Y = out.sums.data_ptr<float>();
  over_rows(N, K, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {  // x in chunks of up to 4 rows
      const int8_t* xm = xq.data() + m0 * K;
      const float *dm = dx.data() + m0 * G, *sm = xs.data() + m0 * G;
      float* ym = Y + m0 * N;
      const int64_t mb = std::min<int64_t>(4, M - m0);
      if (g_isa == 2) switch (mb) {
        case 1: int4_rows<Int4Tile, 4, 1>(W, SZ, xm, dm, sm, K, N, n0, n1, ym); break;
        case 2: int4_rows<Int4Tile, 4, 2>(W, SZ, xm, dm, sm, K, N, n0, n1, ym); break;
        case 3: int4_rows<Int4Tile, 2, 3>(W, SZ, xm, dm, sm, K, N, n0, n1, ym); break;
        default: int4_rows<Int4Tile, 2, 4>(W, SZ, xm, dm, sm, K, N, n0, n1, ym);
      } else switch (mb) {  // AVX2's 16 registers: fewer sums a tile
        case 1: int4_rows<Int4Avx2Tile, 2, 1>(W, SZ, xm, dm, sm, K, N, n0, n1, ym); break;
        case 2: int4_rows<Int4Avx2Tile, 2, 2>(W, SZ, xm, dm, sm, K, N, n0, n1, ym); break;
        case 3: int4_rows<Int4Avx2Tile, 1, 3>(W, SZ, xm, dm, sm, K, N, n0, n1, ym); break;
        default: int4_rows<Int4Avx2Tile, 1, 4>(W, SZ, xm, dm, sm, K, N, n0, n1, ym);
      }
    }
    out.store_rows<float>(M, N, n0, n1, nullptr, nullptr);
  });
  return out.y;
}

// RMSNorm of each row of x [..., D] (bf16 or fp32, rows contiguous) with weight w [D]: in fp32,
// x * rsqrt(mean(x^2) + eps), rounded to x's dtype, times w (in x's dtype), as the torch module
// computes it, in one call instead of eight ops. A row's bits depend on that row alone.
template <typename T>
void rms_rows(const T* x, const T* w, T* o, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * d;
      T* orow = o + r * d;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t j = 0;
      for (; j + 8 <= d; j += 8)
        for (int u = 0; u < 8; ++u) { float f = (float)xr[j + u]; acc[u] += f * f; }
      float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
      for (; j < d; ++j) { float f = (float)xr[j]; ss += f * f; }
      const float inv = 1.0f / std::sqrt(ss / (float)d + eps);
      for (int64_t k = 0; k < d; ++k) orow[k] = (T)((float)w[k] * (float)(T)((float)xr[k] * inv));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x and weight of one dtype, fp32 or bf16");
  const int64_t d = x.size(-1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == d, "rms_norm: weight [D] for x [..., D]");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto out = at::empty_like(xc);
  const int64_t rows = d ? xc.numel() / d : 0;
  if (x.scalar_type() == at::kBFloat16)
    rms_rows<at::BFloat16>(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
                           rows, d, (float)eps);
  else
    rms_rows<float>(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows, d, (float)eps);
  return out;
}

// Rotary embedding of x [B, H, T, hd] (any strides, rows contiguous) with cos/sin [P, 1, T, hd]
// (P = 1: every row alike; P = B: row b its own): x * cos + rotate_half(x) * sin, each product
// and the sum rounded to x's dtype as torch's three ops round them, in one call instead of six.
template <typename T>
void rope_rows(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, at::Tensor& o) {
  const int64_t B = x.size(0), H = x.size(1), Tn = x.size(2), hd = x.size(3), half = hd / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = c.data_ptr<T>();
  const T* sp = s.data_ptr<T>();
  T* op = o.data_ptr<T>();
  const bool per_row = c.size(0) > 1;
  at::parallel_for(0, B * H * Tn, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / (H * Tn), h = (i / Tn) % H, t = i % Tn;
        const T* xr = xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
        const int64_t ci = (per_row ? b * c.stride(0) : 0) + t * c.stride(2);
        const T* cr = cp + ci;
        const T* sr = sp + (per_row ? b * s.stride(0) : 0) + t * s.stride(2);
        T* orow = op + ((b * H + h) * Tn + t) * hd;
        for (int64_t k = 0; k < hd; ++k) {
          const float rot = k < half ? -(float)xr[k + half] : (float)xr[k - half];
          const float a = (float)(T)((float)xr[k] * (float)cr[k]);
          const float r = (float)(T)((float)(T)rot * (float)sr[k]);
          orow[k] = (T)(a + r);
        }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.stride(3) == 1, "rope: x [B, H, T, hd], rows contiguous");
  TORCH_CHECK(cos.dim() == 4 && cos.sizes() == sin.sizes() && cos.size(1) == 1 && cos.size(2) == x.size(2) &&
              cos.size(3) == x.size(3) && (cos.size(0) == 1 || cos.size(0) == x.size(0)),
              "rope: cos/sin [1 or B, 1, T, hd]");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), "rope: one dtype, fp32 or bf16");
  auto c = cos.stride(3) == 1 ? cos : cos.contiguous();
  auto s = sin.stride(3) == 1 ? sin : sin.contiguous();
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.scalar_type() == at::kBFloat16) rope_rows<at::BFloat16>(x, c, s, out);
  else rope_rows<float>(x, c, s, out);
  return out;
}

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
}
TORCH_LIBRARY_IMPL(layerline_cpu, CPU, m) {
  m.impl("linear_bf16", linear_bf16);
  m.impl("linear_int8", linear_int8);
  m.impl("linear_int4", linear_int4);
  m.impl("decode_attention", decode_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("rope", rope);
}
TORCH_LIBRARY_IMPL(layerline_cpu, Meta, m) {
  m.impl("linear_bf16", linear_bf16_meta);
  m.impl("linear_int8", linear_int8_meta);
  m.impl("linear_int4", linear_int4_meta);
  m.impl("rms_norm", rms_norm_meta);
  m.impl("rope", rope_meta);
}
"""


class _State:
    tried = False
    isa: str | None = None    # the ISA in use, None when the kernels are off
    why_off: str | None = None


_S = _State()


def status() -> str:
    """The kernels' state in a word or a line: "avx512-bf16", "avx2", or "off: why"."""
    if not _S.tried:
        return "off: not loaded (only CPU stages at bf16, int8 or int4 load them)"
    return _S.isa or f"off: {_S.why_off}"


def enabled() -> bool:
    return _S.isa is not None


def cache_dir() -> Path:
    d = os.environ.get("LAYERLINE_KERNEL_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "layerline" / "kernels"


def compiler() -> tuple[str, list[str]]:
    """The C++ compiler and the flags that build SOURCE into a library torch can load."""
    cxx = os.environ.get("CXX") or "g++"
    if not shutil.which(cxx):
        raise RuntimeError(f"no C++ compiler ({cxx}) on PATH; install g++ or set CXX")
    torch_dir = Path(torch.__file__).parent
    return cxx, ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-w",
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                 f"-I{torch_dir / 'include'}", f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu"]


def _build() -> Path:
    """The compiled library, built into the cache unless already there (one builder at a time)."""
    cxx, flags = compiler()
    key = hashlib.sha256("\0".join([SOURCE, torch.__version__, cxx, *flags]).encode()).hexdigest()[:16]
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    lib = d / f"layerline_cpu-{key}.so"
    if lib.exists():
        return lib
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same one: wait for it
        if lib.exists():
            return lib
        print(f"layerline: building CPU kernels into {d} (once, about 10 s)", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            src, out = Path(tmp) / "layerline_cpu.cpp", Path(tmp) / "layerline_cpu.so"
            src.write_text(SOURCE)
            r = subprocess.run([cxx, str(src), "-o", str(out), *flags], capture_output=True, text=True,
                               timeout=BUILD_TIMEOUT_S)
            if r.returncode != 0:
                # the first error line (the last is often a caret line under the source)
                lines = r.stderr.strip().splitlines()
                first = next((ln for ln in lines if "error" in ln), lines[-1] if lines else f"rc {r.returncode}")
                raise RuntimeError(f"{cxx} failed: {first.strip()}")
            os.replace(out, lib)
    return lib


def load() -> bool:
    """Build (once per cache) and load the kernels; whether they are in use. Never raises: a host
    that cannot have them decodes with torch's kernels, and `status()` says why."""
    if _S.tried:
        return enabled()
    _S.tried = True
    want = os.environ.get("LAYERLINE_CPU_KERNELS", "auto").strip().lower()
    if want == "off":
        _S.why_off = "LAYERLINE_CPU_KERNELS=off"
        return False
    if want not in ("auto", *ISAS):
        _S.why_off = f"LAYERLINE_CPU_KERNELS={want}: not auto, off, {', '.join(ISAS)}"
        print(f"layerline: {_S.why_off}; decoding with torch's kernels", file=sys.stderr, flush=True)
        return False
    try:
        torch.ops.load_library(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _S.why_off = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"layerline: CPU kernels unavailable ({_S.why_off}); decoding with torch's kernels",
              file=sys.stderr, flush=True)
        return False
    return use_isa("avx512-bf16" if want == "auto" else want)


def use_isa(cap: str) -> bool:
    """Use the best ISA this CPU has up to `cap` ("off", "avx2" or "avx512-bf16"); whether any. Tests
    use it to run the AVX2 kernels on an AVX-512 CPU, or torch's kernels ("off") beside them."""
    got = int(torch.ops.layerline_cpu.use_isa(ISAS.get(cap, 0)))
    _S.isa = {v: k for k, v in ISAS.items()}.get(got)
    if _S.isa is None:
        _S.why_off = "turned off" if cap == "off" else "this CPU has neither AVX2 + FMA nor AVX-512 BF16 + VNNI"
    return enabled()


def _takes(x: torch.Tensor, k: int) -> bool:
    return _S.isa is not None and x.device.type == "cpu" and k % K_MULTIPLE == 0 and x.numel() <= MAX_ROWS * k


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `linear_bf16` for a few bf16 rows where the kernels are loaded."""
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and _takes(x, w.shape[1]):
        return torch.ops.layerline_cpu.linear_bf16(x, w, bias)
    return F.linear(x, w, bias)


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`linear_int8` of a few rows, or None where the kernels do not apply (the caller's path)."""
    if (x.dtype in (torch.bfloat16, torch.float32, torch.float16) and scale.dtype == torch.float32
            and _takes(x, q.shape[1])):
        return torch.ops.layerline_cpu.linear_int8(x, q, scale, bias)
    return None


def int4_ready() -> bool:
    """Whether int4 matrices are held in layerline's layout and run by `linear_int4` (kernels loaded
    with AVX-512 VNNI). Loads the kernels (once) if nothing has yet."""
    return load() and enabled()


def linear_int4(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`linear_int4` of any number of rows (it beats torch's int4 kernel at 128 rows too), or None
    where it does not apply (the caller dequantizes)."""
    if _S.isa is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32, torch.float16):
        return torch.ops.layerline_cpu.linear_int4(x, codes, sz, bias)
    return None


def _applies(x: torch.Tensor) -> bool:
    """Whether the attention, RoPE and RMSNorm ops take x: kernels loaded, a CPU bf16/fp32 tensor."""
    return _S.isa is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: list[torch.Tensor],
                     vc: list[torch.Tensor], pos: list[int], lo: list[int], scale: float) -> torch.Tensor | None:
    """One new token per row (q [B, nh, 1, hd], k/v [B, nkv, 1, hd]): for each of the first n =
    len(kc) rows, its k/v written at pos[i] of its caches kc[i], vc[i] ([1, nkv, max_len, hd] or
    [nkv, max_len, hd]) and its attention over keys lo[i]..pos[i] there; [B, 1, nh * hd], zeros
    past n. None where the kernel does not apply (the caller's path)."""
    if not _applies(q) or not (k.dtype == v.dtype == kc[0].dtype == q.dtype) or q.shape[-1] % 16:
        return None
    return torch.ops.layerline_cpu.decode_attention(q, k, v, kc, vc, pos, lo, scale)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm (`llama.RMSNorm`'s numbers) in one call, or None where it does not apply (the
    caller's path): kernels off, not a CPU tensor, or not bf16/fp32 of the weight's dtype."""
    if not _applies(x) or w.dtype != x.dtype:
        return None
    return torch.ops.layerline_cpu.rms_norm(x, w, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x * cos + rotate_half(x) * sin (`llama.Attention`'s numbers, bit for bit) in one call, or
    None where it does not apply (the caller's path)."""
    if not _applies(x) or cos.dtype != x.dtype or x.stride(-1) != 1:
        return None
    return torch.ops.layerline_cpu.rope(x, cos, sin)
