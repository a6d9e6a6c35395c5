// DecodeLayer: one decoder layer's one-token step in one call from Python, at fp32. The eager
// modules' ops run in their order, on the same kernels, so the bits are theirs; what goes is the
// Python between them (module calls, views, the kernels' Python wrappers) and, since each
// projection writes into buffers the step holds, ATen's views and allocations around the kernels
// (about 25 a layer). Built once per layer by llama.DecoderLayer.decode_step.
#pragma once

#include <torch/custom_class.h>
#include <string>

#include "common.h"
#include "attention.h"
#include "x16.h"
#include "gguf_blocks.h"
#include "int4.h"
#include "norm_rope.h"

namespace {

// A linear layer as its module calls it: a GGUF block kernel by layout (the args are
// gguf_blocks.BlockLinear's) or, for a matrix held as floats, at::linear. Python names the kind (a
// gguf_blocks layout, or "dense"); the numbers stay here. Shapes are checked once, when the layer is
// described; each step then writes y [M, N] for x [M, K] in place.
struct LayerLinear {
  enum Kind : int64_t { Q4 = 0, X16 = 1, X8 = 2, FILE = 3, DENSE = 4 };
  int64_t kind = DENSE;
  at::Tensor w;
  std::vector<int64_t> a;
  c10::optional<at::Tensor> bias;
  at::Tensor biasf;  // bias as fp32, or undefined
  int64_t N = 0, K = 0;

  static Kind kind_of(const std::string& name) {
    if (name == "int4") return Q4;
    if (name == "x16") return X16;
    if (name == "x8") return X8;
    if (name == "file") return FILE;
    TORCH_CHECK(name == "dense", "DecodeLayer: linear kind '", name, "' is not int4, x16, x8, file or dense");
    return DENSE;
  }

  static size_t args_of(int64_t kind) {
    switch (kind) {
      case Q4: case X16: return 3;
      case X8: return 8;
      case FILE: return 6;
      case DENSE: return 0;
      default: TORCH_CHECK(false, "DecodeLayer: linear kind ", kind, " is not 0-4");  // kind_of's
    }
  }

  LayerLinear(int64_t kind, at::Tensor w_, std::vector<int64_t> args, c10::optional<at::Tensor> b)
      : kind(kind), w(std::move(w_)), a(std::move(args)), bias(std::move(b)) {
    if (kind == DENSE) {
      TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "DecodeLayer.linear: a dense matrix is fp32 [N, K]");
      N = w.size(0), K = w.size(1);
    } else {
      N = a[0], K = a[1];
      int64_t bytes = 0;
      if (kind == Q4) {
        TORCH_CHECK((a[2] == Q4_1 || a[2] == Q4_0) && K % 64 == 0, "DecodeLayer.linear: int4 kind 1 (Q4_1) or 2 (Q4_0), K a multiple of 64");
        bytes = (16 + scale_bytes(a[2])) * (K / 32);
      } else if (kind == X16) {
        const X16Type t(a[2]);
        TORCH_CHECK(K % t.qk == 0, "DecodeLayer.linear: x16 K a multiple of ", t.qk);
        bytes = t.row_bytes(K);
      } else {
        TORCH_CHECK(kind != X8 || N % 8 == 0, "DecodeLayer.linear: x8 rows a multiple of 8");
        bytes = a[2];
      }
      TORCH_CHECK(N > 0 && K > 0 && w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * bytes,
                  "DecodeLayer.linear: contiguous uint8 blocks [N, ", bytes, "] for N = ", N, ", K = ", K);
    }
    if (bias.has_value() && bias->defined()) {
      TORCH_CHECK(bias->numel() == N, "DecodeLayer.linear: one bias per row");
      biasf = bias->to(at::kFloat).contiguous();
    }
  }

  // y [M, N] = x [M, K] @ W.T (+ bias), both fp32 and contiguous
  void operator()(const float* x, int64_t M, float* y) const {
    const float* b = biasf.defined() ? biasf.data_ptr<float>() : nullptr;
    const uint8_t* W = kind == DENSE ? nullptr : w.data_ptr<uint8_t>();
    switch (kind) {
      case Q4: {
        const int64_t G = K / 32, row = (16 + scale_bytes(a[2])) * G;
        if (a[2] == Q4_1) int4_into<Q4_1>(x, M, W, row, W + 16 * G, row, N, K, y, b);
        else int4_into<Q4_0>(x, M, W, row, W + 16 * G, row, N, K, y, b);
        break;
      }
      case X16: x16_into(x, M, W, N, K, X16Type(a[2]), y, b); break;
      case X8: x8_into(x, M, W, N, K, a[2], a[3], a[4], a[5], a[6], a[7], y, b); break;
      case FILE: gguf_into(x, M, W, N, K, a[2], a[3], a[4], a[5], y, b); break;
      default: {  // as the module: at::linear on x [M, 1, K]
        auto opt = at::TensorOptions().dtype(at::kFloat);
        const at::Tensor out = at::linear(at::from_blob(const_cast<float*>(x), {M, 1, K}, opt), w, bias);
        std::memcpy(y, out.contiguous().data_ptr<float>(), sizeof(float) * M * N);
      }
    }
  }
};

// rows of a [B, D] buffer: row b at p + b * rs
struct Rows {
  float* p;
  int64_t rs;
  float* row(int64_t b) const { return p + b * rs; }
};

// The caches one layer's step writes and reads, per row: as DecodeLayer.step takes them (one
// [(1,) nkv, max_len, hd] cache per row, or one [rows >= B, nkv, max_len, hd] whose first B rows are
// the rows), checked as decode_attention checks them. q/k/v/out are the step's to fill.
std::vector<AttendRow<float>> cache_rows(const std::vector<at::Tensor>& kc, const std::vector<at::Tensor>& vc,
                                         int64_t B, int64_t nkv, int64_t hd, c10::IntArrayRef pos, c10::IntArrayRef lo) {
  TORCH_CHECK(kc.size() == vc.size() && (int64_t)pos.size() == B && (int64_t)lo.size() == B &&
              ((int64_t)kc.size() == B || (kc.size() == 1 && kc[0].dim() == 4)),
              "DecodeLayer.step: one cache per row (or one of B rows or more), a position and first key per row");
  std::vector<AttendRow<float>> rows(B);
  for (int64_t b = 0; b < B; ++b) {
    const bool one = kc.size() == 1 && kc[0].dim() == 4;  // row b of one cache
    const at::Tensor& k = one ? kc[0] : kc[b];
    const at::Tensor& v = one ? vc[0] : vc[b];
    const int64_t off = k.dim() == 4 ? 1 : 0;
    for (const auto& c : {k, v})
      TORCH_CHECK(c.dim() == 3 + off && (one ? c.size(0) >= B : (off == 0 || c.size(0) == 1)) && c.size(off) == nkv &&
                  c.size(off + 2) == hd && c.stride(off + 2) == 1 && c.scalar_type() == at::kFloat && c.device().is_cpu(),
                  "DecodeLayer.step: caches [nkv, max_len, hd] of fp32, rows contiguous");
    const int64_t len = k.size(off + 1);
    TORCH_CHECK(v.size(off + 1) == len && v.stride(off + 1) == k.stride(off + 1) && 0 <= lo[b] && lo[b] <= pos[b] &&
                pos[b] < len, "DecodeLayer.step: 0 <= lo <= pos < max_len, keys and values alike");
    const int64_t row = one ? b : 0;
    AttendRow<float>& r = rows[b];
    r.kc = k.data_ptr<float>() + (off ? row * k.stride(0) : 0);
    r.vc = v.data_ptr<float>() + (off ? row * v.stride(0) : 0);
    r.kch = k.stride(off), r.vch = v.stride(off), r.ls = k.stride(off + 1), r.lo = lo[b], r.pos = pos[b];
  }
  return rows;
}

// cos/sin [P, 1, 1, hd] fp32 (P = 1 or B), rows contiguous
void check_rope(const at::Tensor& cos, const at::Tensor& sin, int64_t B, int64_t hd) {
  TORCH_CHECK(cos.dim() == 4 && cos.sizes() == sin.sizes() && cos.size(1) == 1 && cos.size(2) == 1 && cos.size(3) == hd &&
              (cos.size(0) == 1 || cos.size(0) == B) && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.stride(3) == 1 && sin.stride(3) == 1, "DecodeLayer.step: cos/sin [1 or B, 1, 1, head_dim] of fp32");
}

// A prompt chunk of one sequence through a layer: its T tokens are the step's rows, written into the
// sequence's cache at pos0.. and attended by ATen's scaled_dot_product_attention as the module
// calls it (the keys lo..pos0 + T - 1 in view, the module's mask), so its bits are the module's.
struct ChunkView {
  at::Tensor kc, vc;  // the layer's cache of the sequence, [1, nkv, max_len, hd]
  int64_t pos0, lo;
  at::Tensor mask;    // bool [T, pos0 + T - lo]
};

struct DecodeLayer : torch::CustomClassHolder {
  int64_t nh, nkv, hd, ffn;
  double scale, eps;
  bool gelu, sandwich;
  // norms' weights as the kernel multiplies by them (Gemma's 1 + w); undefined where absent
  at::Tensor n_in, n_attn, n_pre_ff, n_post_ff, n_q, n_k;
  std::vector<LayerLinear> qkv, gate_up;  // one fused matrix (split after) or the parts apart
  std::vector<LayerLinear> o, down;       // exactly one each

  DecodeLayer(int64_t nh, int64_t nkv, int64_t hd, int64_t ffn, double scale, double eps, bool gelu, bool sandwich)
      : nh(nh), nkv(nkv), hd(hd), ffn(ffn), scale(scale), eps(eps), gelu(gelu), sandwich(sandwich) {
    TORCH_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0 && hd % 16 == 0 && ffn > 0,
                "DecodeLayer: heads a multiple of the kv heads, head_dim a multiple of 16, a feed-forward size");
  }

  void norm(const std::string& name, const at::Tensor& w) {
    at::Tensor* slot = name == "input" ? &n_in : name == "post_attention" ? &n_attn
                     : name == "pre_feedforward" ? &n_pre_ff : name == "post_feedforward" ? &n_post_ff
                     : name == "q" ? &n_q : name == "k" ? &n_k : nullptr;
    TORCH_CHECK(slot != nullptr, "DecodeLayer.norm: no norm called ", name);
    TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat, "DecodeLayer.norm: an fp32 weight [D]");
    *slot = w.contiguous();
  }

  void linear(const std::string& name, const std::string& kind_name, const at::Tensor& w, std::vector<int64_t> args,
              c10::optional<at::Tensor> bias) {
    std::vector<LayerLinear>* slot = name == "qkv" ? &qkv : name == "o" ? &o : name == "gate_up" ? &gate_up
                                   : name == "down" ? &down : nullptr;
    TORCH_CHECK(slot != nullptr, "DecodeLayer.linear: no linear called ", name);
    const int64_t kind = LayerLinear::kind_of(kind_name);
    TORCH_CHECK(args.size() == LayerLinear::args_of(kind), "DecodeLayer.linear: ", name, " kind ", kind_name, " takes ",
                LayerLinear::args_of(kind), " ints, got ", args.size());
    slot->emplace_back(kind, w, std::move(args), std::move(bias));
  }

  bool ready() const {
    const bool split_ok = (qkv.size() == 1 || qkv.size() == 3) && (gate_up.size() == 1 || gate_up.size() == 2);
    return split_ok && o.size() == 1 && down.size() == 1 && n_in.defined() && n_attn.defined() &&
           n_q.defined() == n_k.defined() && (!sandwich || (n_pre_ff.defined() && n_post_ff.defined()));
  }

  // the matrices' and norms' shapes against a hidden size H (once a step)
  void check_shapes(int64_t H) const {
    TORCH_CHECK(ready(), "DecodeLayer.step: the layer is not fully described");
    const int64_t dq = nh * hd, dk = nkv * hd;
    auto fits = [&](const std::vector<LayerLinear>& ls, std::vector<int64_t> ns, int64_t k) {
      if (ls.size() == 1) return ls[0].K == k && ls[0].N == std::accumulate(ns.begin(), ns.end(), (int64_t)0);
      for (size_t i = 0; i < ls.size(); ++i)
        if (ls[i].K != k || ls[i].N != ns[i]) return false;
      return true;
    };
    TORCH_CHECK(fits(qkv, {dq, dk, dk}, H) && fits(gate_up, {ffn, ffn}, H) && fits(o, {H}, dq) && fits(down, {H}, ffn),
                "DecodeLayer.step: the projections' shapes do not fit hidden size ", H);
    for (const auto* n : {&n_in, &n_attn, &n_pre_ff, &n_post_ff})
      TORCH_CHECK(!n->defined() || n->numel() == H, "DecodeLayer.step: a norm's weight is not [hidden]");
    TORCH_CHECK(!n_q.defined() || (n_q.numel() == hd && n_k.numel() == hd), "DecodeLayer.step: q/k norms' weights [head_dim]");
  }

  // floats of scratch a step of B rows takes
  int64_t scratch(int64_t B, int64_t H) const {
    const int64_t dq = nh * hd, dk = nkv * hd;
    return B * (3 * H + 2 * (dq + 2 * dk) + 2 * dq + dk + 3 * ffn);  // step_rows' buffers, in its order
  }

  // the one parts' outputs: a fused product's row views, or each part's own [B, n] block of `buf`
  static std::vector<Rows> parts(const std::vector<LayerLinear>& ls, const float* x, int64_t B, float* buf,
                                 const std::vector<int64_t>& sizes) {
    std::vector<Rows> out;
    if (ls.size() == 1) {
      const int64_t D = ls[0].N;
      ls[0](x, B, buf);
      for (int64_t off = 0, i = 0; i < (int64_t)sizes.size(); off += sizes[i++]) out.push_back({buf + off, D});
      return out;
    }
    for (size_t i = 0; i < ls.size(); ++i) {
      ls[i](x, B, buf);
      out.push_back({buf, sizes[i]});
      buf += B * sizes[i];
    }
    return out;
  }

  // a chunk's T tokens (the rows of q, k, v) roped, their keys and values written at pos0.. of the
  // sequence's cache, and attended as llama.Attention._attend_one attends them: q [1, nh, T, hd]
  // contiguous (qr's floats) over the cache's keys lo..pos0 + T - 1 under the chunk's mask; att [T, nh * hd]
  void chunk_attention(Rows q, Rows k, Rows v, int64_t T, const float* cp, int64_t cs, const float* sp, int64_t ss,
                       const ChunkView& ch, float* qr, float* att) const {
    const int64_t ls = ch.kc.stride(2);
    float *kc = ch.kc.data_ptr<float>(), *vc = ch.vc.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      const float *c = cp + t * cs, *s = sp + t * ss;
      for (int64_t h = 0; h < nh; ++h) rope_row(q.row(t) + h * hd, c, s, qr + (h * T + t) * hd, hd);
      for (int64_t h = 0; h < nkv; ++h) {
        rope_row(k.row(t) + h * hd, c, s, kc + h * ch.kc.stride(1) + (ch.pos0 + t) * ls, hd);
        std::memcpy(vc + h * ch.vc.stride(1) + (ch.pos0 + t) * ch.vc.stride(2), v.row(t) + h * hd, sizeof(float) * hd);
      }
    }
    const int64_t keys = ch.pos0 + T - ch.lo;
    const at::Tensor qt = at::from_blob(qr, {1, nh, T, hd}, at::TensorOptions().dtype(at::kFloat));
    const at::Tensor out = at::scaled_dot_product_attention(qt, ch.kc.narrow(2, ch.lo, keys), ch.vc.narrow(2, ch.lo, keys),
                                                            ch.mask, 0.0, false, scale, nkv != nh);
    at::Tensor o = at::from_blob(att, {1, T, nh, hd}, at::TensorOptions().dtype(at::kFloat));
    o.copy_(out.transpose(1, 2));
  }

  // y [B, H] from x [B, H] (fp32, contiguous, y apart from x); rows: each row's caches (cache_rows),
  // or a chunk of one sequence (B its tokens, rows unused; cos/sin [1, 1, B, hd]); ws: scratch(B, H) floats
  void step_rows(const float* x, float* y, int64_t B, int64_t H, const at::Tensor& cos, const at::Tensor& sin,
                 std::vector<AttendRow<float>>& rows, float* ws, const ChunkView* chunk = nullptr) const {
    const int64_t dq = nh * hd, dk = nkv * hd;
    const float fe = (float)eps;
    float *xn = ws, *hb = xn + B * H, *f = hb + B * H, *qkvb = f + B * H, *qk = qkvb + B * (dq + 2 * dk);
    float *qr = qk + B * (dq + 2 * dk), *kr = qr + B * dq, *att = kr + B * dk, *gub = att + B * dq, *act = gub + B * 2 * ffn;
    rms_rows<float>(x, n_in.data_ptr<float>(), xn, B, H, fe);
    std::vector<Rows> p = parts(qkv, xn, B, qkvb, {dq, dk, dk});
    Rows q = p[0], k = p[1], v = p[2];
    if (n_q.defined()) {  // per head, over head_dim
      for (int64_t b = 0; b < B; ++b) {
        rms_rows<float>(q.row(b), n_q.data_ptr<float>(), qk + b * dq, nh, hd, fe);
        rms_rows<float>(k.row(b), n_k.data_ptr<float>(), qk + B * dq + b * dk, nkv, hd, fe);
      }
      q = {qk, dq}, k = {qk + B * dq, dk};
    }
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    if (chunk) {
      chunk_attention(q, k, v, B, cp, cos.stride(2), sp, sin.stride(2), *chunk, qr, att);
    } else {
      const bool per_row = cos.size(0) > 1;
      for (int64_t b = 0; b < B; ++b) {
        const float* c = cp + (per_row ? b * cos.stride(0) : 0);
        const float* s = sp + (per_row ? b * sin.stride(0) : 0);
        for (int64_t h = 0; h < nh; ++h) rope_row(q.row(b) + h * hd, c, s, qr + b * dq + h * hd, hd);
        for (int64_t h = 0; h < nkv; ++h) rope_row(k.row(b) + h * hd, c, s, kr + b * dk + h * hd, hd);
        AttendRow<float>& r = rows[b];
        r.q = qr + b * dq, r.k = kr + b * dk, r.v = v.row(b), r.qh = r.kh = r.vh = hd, r.out = att + b * dq;
      }
      attend_rows(rows.data(), B, nkv, nh / nkv, hd, scale);
    }
    o[0](att, B, f);
    if (sandwich) rms_rows<float>(f, n_attn.data_ptr<float>(), f, B, H, fe);  // in place: a row is read before written
    for (int64_t i = 0; i < B * H; ++i) hb[i] = x[i] + f[i];
    rms_rows<float>(hb, (sandwich ? n_pre_ff : n_attn).data_ptr<float>(), xn, B, H, fe);
    p = parts(gate_up, xn, B, gub, {ffn, ffn});
    // the activation by ATen's own op (its vectorized exp and tanh: the modules' bits), on g's rows
    // as the module's split leaves them; the product by hand (one rounding either way)
    auto opt = at::TensorOptions().dtype(at::kFloat);
    at::Tensor g = at::from_blob(p[0].p, {B, 1, ffn}, {p[0].rs, p[0].rs, 1}, opt);
    at::Tensor out = at::from_blob(act, {B, 1, ffn}, opt);
    if (gelu) at::gelu_out(out, g, "tanh");
    else at::silu_out(out, g);
    for (int64_t b = 0; b < B; ++b) {
      const float* u = p[1].row(b);
      float* a = act + b * ffn;
      for (int64_t j = 0; j < ffn; ++j) a[j] *= u[j];
    }
    down[0](act, B, f);
    if (sandwich) rms_rows<float>(f, n_post_ff.data_ptr<float>(), f, B, H, fe);
    for (int64_t i = 0; i < B * H; ++i) y[i] = hb[i] + f[i];
  }

  // x [B, 1, hidden] fp32 at the positions cos/sin [P, 1, 1, hd] hold (P = 1 or B); kc/vc: one cache
  // per row ([(1,) nkv, max_len, hd]), or one [rows >= B, nkv, max_len, hd] whose first B rows are the
  // rows; pos/lo per row: where its k/v is written and its first key (llama.Attention._attend_one / _rows)
  at::Tensor step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> kc,
                  std::vector<at::Tensor> vc, std::vector<int64_t> pos, std::vector<int64_t> lo) {
    TORCH_CHECK(g_isa > 0, "layerline_cpu: no kernel for this CPU (AVX2 + FMA or AVX-512 BF16 needed)");
    TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "DecodeLayer.step: x [B, 1, hidden] of fp32");
    const int64_t B = x.size(0), H = x.size(2);
    check_shapes(H);
    check_rope(cos, sin, B, hd);
    auto rows = cache_rows(kc, vc, B, nkv, hd, pos, lo);
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({B, 1, H}, xc.options());
    std::vector<float> ws(scratch(B, H));
    step_rows(xc.data_ptr<float>(), y.data_ptr<float>(), B, H, cos, sin, rows, ws.data());
    return y;
  }
};

// A stage's layers' steps in one call: each DecodeLayer's step in order, with no return to Python
// between them (a layer's call from Python, its lists built and converted, cost about 10 us), each
// layer's output in a buffer the next reads.
struct DecodeStack : torch::CustomClassHolder {
  std::vector<c10::intrusive_ptr<DecodeLayer>> layers;
  std::vector<int64_t> rope_of, window_of;  // each layer's RoPE table and attention window, by index

  void add(const c10::intrusive_ptr<DecodeLayer>& layer, int64_t rope, int64_t window) {
    TORCH_CHECK(layer->ready() && rope >= 0 && window >= 0,
                "DecodeStack.add: a fully described layer, the index of its RoPE table and of its window");
    layers.push_back(layer);
    rope_of.push_back(rope);
    window_of.push_back(window);
  }

  // x [B, 1, hidden]; cos/sin one per RoPE table; kc/vc each layer's caches (as DecodeLayer.step
  // takes them), layer after layer; pos as DecodeLayer.step's; lo pos.size() first keys a window,
  // window after window
  at::Tensor step(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, std::vector<at::Tensor> kc,
                  std::vector<at::Tensor> vc, std::vector<int64_t> pos, std::vector<int64_t> lo) {
    const size_t L = layers.size(), P = pos.size();
    TORCH_CHECK(L > 0 && !kc.empty() && kc.size() % L == 0 && vc.size() == kc.size() && P > 0 && lo.size() % P == 0 &&
                cos.size() == sin.size(), "DecodeStack.step: the same number of caches for each layer, keys and "
                "values alike, and pos.size() first keys for each window");
    TORCH_CHECK(g_isa > 0, "layerline_cpu: no kernel for this CPU (AVX2 + FMA or AVX-512 BF16 needed)");
    TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "DecodeStack.step: x [B, 1, hidden] of fp32");
    const int64_t B = x.size(0), H = x.size(2);
    const size_t n = kc.size() / L;
    int64_t need = 0;
    std::vector<std::vector<AttendRow<float>>> rows(L);
    for (size_t i = 0; i < L; ++i) {
      TORCH_CHECK((size_t)rope_of[i] < cos.size() && (size_t)(window_of[i] + 1) * P <= lo.size(),
                  "DecodeStack.step: layer ", i, "'s RoPE table or window is not given");
      const DecodeLayer& layer = *layers[i];
      layer.check_shapes(H);
      check_rope(cos[rope_of[i]], sin[rope_of[i]], B, layer.hd);
      const auto at = [&](const std::vector<at::Tensor>& c) {
        return std::vector<at::Tensor>(c.begin() + i * n, c.begin() + (i + 1) * n);
      };
      rows[i] = cache_rows(at(kc), at(vc), B, layer.nkv, layer.hd, pos,
                           c10::IntArrayRef(lo.data() + window_of[i] * P, P));
      need = std::max(need, layer.scratch(B, H));
    }
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({B, 1, H}, xc.options());
    thread_local Scratch<float> ws;  // the steps' scratch and the layers' outputs between them
    float* w = ws.get(need + 2 * B * H);
    float *buf[2] = {w + need, w + need + B * H};
    const float* src = xc.data_ptr<float>();
    for (size_t i = 0; i < L; ++i) {
      float* dst = i + 1 == L ? y.data_ptr<float>() : buf[i % 2];
      layers[i]->step_rows(src, dst, B, H, cos[rope_of[i]], sin[rope_of[i]], rows[i], w);
      src = dst;
    }
    ws.done();
    return y;
  }

  // A prompt chunk of one sequence, x [1, T, hidden] (T > 1) at positions pos0..pos0 + T - 1: cos/sin
  // one per RoPE table [1, 1, T, hd]; kc/vc each layer's cache of the sequence ([rows >= 1, nkv,
  // max_len, hd], its first row), layer after layer; lo and mask one per window (llama._views': the
  // first key in view, bool [T, pos0 + T - lo]). The modules' bits (ChunkView).
  at::Tensor chunk(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, std::vector<at::Tensor> kc,
                   std::vector<at::Tensor> vc, int64_t pos0, std::vector<int64_t> lo, std::vector<at::Tensor> mask) {
    const size_t L = layers.size();
    TORCH_CHECK(L > 0 && kc.size() == L && vc.size() == L && lo.size() == mask.size() && cos.size() == sin.size(),
                "DecodeStack.chunk: one cache of the sequence per layer, keys and values alike, a first key and a "
                "mask per window");
    TORCH_CHECK(g_isa > 0, "layerline_cpu: no kernel for this CPU (AVX2 + FMA or AVX-512 BF16 needed)");
    TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) > 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "DecodeStack.chunk: x [1, T > 1, hidden] of fp32");
    const int64_t T = x.size(1), H = x.size(2);
    int64_t need = 0;
    std::vector<ChunkView> views(L);
    for (size_t i = 0; i < L; ++i) {
      TORCH_CHECK((size_t)rope_of[i] < cos.size() && (size_t)window_of[i] < lo.size(),
                  "DecodeStack.chunk: layer ", i, "'s RoPE table or window is not given");
      const DecodeLayer& layer = *layers[i];
      layer.check_shapes(H);
      const at::Tensor &c = cos[rope_of[i]], &s = sin[rope_of[i]];
      TORCH_CHECK(c.dim() == 4 && c.sizes() == s.sizes() && c.size(0) == 1 && c.size(1) == 1 && c.size(2) == T &&
                  c.size(3) == layer.hd && c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat &&
                  c.stride(3) == 1 && s.stride(3) == 1, "DecodeStack.chunk: cos/sin [1, 1, T, head_dim] of fp32");
      ChunkView& v = views[i];
      v.kc = kc[i].narrow(0, 0, 1), v.vc = vc[i].narrow(0, 0, 1), v.pos0 = pos0, v.lo = lo[window_of[i]];
      v.mask = mask[window_of[i]];
      for (const auto& t : {v.kc, v.vc})
        TORCH_CHECK(t.dim() == 4 && t.size(1) == layer.nkv && t.size(3) == layer.hd && t.stride(3) == 1 &&
                    t.scalar_type() == at::kFloat && t.device().is_cpu() && t.sizes() == v.kc.sizes(),
                    "DecodeStack.chunk: caches [rows, nkv, max_len, hd] of fp32, rows contiguous");
      TORCH_CHECK(0 <= v.lo && v.lo <= pos0 && pos0 + T <= v.kc.size(2), "DecodeStack.chunk: 0 <= lo <= pos0 and pos0 + T "
                  "<= max_len");
      TORCH_CHECK(v.mask.dim() == 2 && v.mask.size(0) == T && v.mask.size(1) == pos0 + T - v.lo &&
                  v.mask.scalar_type() == at::kBool, "DecodeStack.chunk: a bool mask [T, pos0 + T - lo] per window");
      need = std::max(need, layer.scratch(T, H));
    }
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({1, T, H}, xc.options());
    thread_local Scratch<float> ws;
    float* w = ws.get(need + 2 * T * H);
    float *buf[2] = {w + need, w + need + T * H};
    const float* src = xc.data_ptr<float>();
    std::vector<AttendRow<float>> none;
    for (size_t i = 0; i < L; ++i) {
      float* dst = i + 1 == L ? y.data_ptr<float>() : buf[i % 2];
      layers[i]->step_rows(src, dst, T, H, cos[rope_of[i]], sin[rope_of[i]], none, w, &views[i]);
      src = dst;
    }
    ws.done();
    return y;
  }
};

}  // namespace
