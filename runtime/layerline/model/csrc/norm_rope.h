// rms_norm and rope: each torch module's ops in one call, rounded as torch rounds them.
#pragma once

#include "common.h"

namespace {

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

// one row of hd values: o = x * c + rotate_half(x) * s, rounded as torch's ops round them
template <typename T>
inline void rope_row(const T* xr, const T* cr, const T* sr, T* orow, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t k = 0; k < hd; ++k) {
    const float rot = k < half ? -(float)xr[k + half] : (float)xr[k - half];
    const float a = (float)(T)((float)xr[k] * (float)cr[k]);
    const float r = (float)(T)((float)(T)rot * (float)sr[k]);
    orow[k] = (T)(a + r);
  }
}

// Rotary embedding of x [B, H, T, hd] (any strides, rows contiguous) with cos/sin [P, 1, T, hd]
// (P = 1: every row alike; P = B: row b its own): x * cos + rotate_half(x) * sin, each product
// and the sum rounded to x's dtype as torch's three ops round them, in one call instead of six.
template <typename T>
void rope_rows(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, at::Tensor& o) {
  const int64_t B = x.size(0), H = x.size(1), Tn = x.size(2), hd = x.size(3);
  const T* xp = x.data_ptr<T>();
  const T* cp = c.data_ptr<T>();
  const T* sp = s.data_ptr<T>();
  T* op = o.data_ptr<T>();
  const bool per_row = c.size(0) > 1;
  at::parallel_for(0, B * H * Tn, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (H * Tn), h = (i / Tn) % H, t = i % Tn;
      rope_row(xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2),
               cp + (per_row ? b * c.stride(0) : 0) + t * c.stride(2),
               sp + (per_row ? b * s.stride(0) : 0) + t * s.stride(2), op + ((b * H + h) * Tn + t) * hd, hd);
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

}  // namespace
