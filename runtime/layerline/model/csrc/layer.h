// DecodeLayer: one decoder layer's one-token step in one call from Python. The eager modules'
// ops run in their order, on the same kernels, so the bits are theirs; what goes is the Python
// between them (module calls, views, the kernels' Python wrappers), about a third of a small
// model's eager step. Built once per layer by llama.DecoderLayer.decode_step.
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
// gguf_blocks.BlockLinear's) or, for a matrix held as floats, at::linear. y in x's dtype. Python
// names the kind (a gguf_blocks layout, or "dense"); the numbers stay here.
struct LayerLinear {
  enum Kind : int64_t { Q4 = 0, X16 = 1, X8 = 2, FILE = 3, DENSE = 4 };
  int64_t kind = DENSE;

  static Kind kind_of(const std::string& name) {
    if (name == "int4") return Q4;
    if (name == "x16") return X16;
    if (name == "x8") return X8;
    if (name == "file") return FILE;
    TORCH_CHECK(name == "dense", "DecodeLayer: linear kind '", name, "' is not int4, x16, x8, file or dense");
    return DENSE;
  }
  at::Tensor w;
  std::vector<int64_t> a;
  c10::optional<at::Tensor> bias;

  static size_t args_of(int64_t kind) {
    switch (kind) {
      case Q4: case X16: return 3;
      case X8: return 8;
      case FILE: return 6;
      case DENSE: return 0;
      default: TORCH_CHECK(false, "DecodeLayer: linear kind ", kind, " is not 0-4");  // kind_of's
    }
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    switch (kind) {
      case Q4: y = gguf_linear_q4(x, w, a[0], a[1], a[2], bias); break;
      case X16: y = gguf_linear_x16(x, w, a[0], a[1], a[2], bias); break;
      case X8: y = gguf_linear_x8(x, w, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], bias); break;
      case FILE: y = gguf_linear(x, w, a[0], a[1], a[2], a[3], a[4], a[5], bias); break;
      default: y = at::linear(x, w, bias);
    }
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }
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
    *slot = w;
  }

  void linear(const std::string& name, const std::string& kind_name, const at::Tensor& w, std::vector<int64_t> args,
              c10::optional<at::Tensor> bias) {
    std::vector<LayerLinear>* slot = name == "qkv" ? &qkv : name == "o" ? &o : name == "gate_up" ? &gate_up
                                   : name == "down" ? &down : nullptr;
    TORCH_CHECK(slot != nullptr, "DecodeLayer.linear: no linear called ", name);
    const int64_t kind = LayerLinear::kind_of(kind_name);
    TORCH_CHECK(args.size() == LayerLinear::args_of(kind), "DecodeLayer.linear: ", name, " kind ", kind_name, " takes ",
                LayerLinear::args_of(kind), " ints, got ", args.size());
    slot->push_back(LayerLinear{kind, w, std::move(args), std::move(bias)});
  }

  bool ready() const {
    const bool split_ok = (qkv.size() == 1 || qkv.size() == 3) && (gate_up.size() == 1 || gate_up.size() == 2);
    return split_ok && o.size() == 1 && down.size() == 1 && n_in.defined() && n_attn.defined() &&
           n_q.defined() == n_k.defined() && (!sandwich || (n_pre_ff.defined() && n_post_ff.defined()));
  }

  // the parts' outputs: one fused product split by rows' sizes, or each part's own
  static std::vector<at::Tensor> parts(const std::vector<LayerLinear>& ls, const at::Tensor& x,
                                       std::vector<int64_t> sizes) {
    if (ls.size() == 1) return ls[0](x).split_with_sizes(sizes, -1);
    std::vector<at::Tensor> out;
    for (const auto& l : ls) out.push_back(l(x));
    return out;
  }

  // x [B, 1, hidden] at the positions cos/sin [P, 1, 1, hd] hold; kc/vc: one cache per row
  // ([(1,) nkv, max_len, hd]), or one [rows >= B, nkv, max_len, hd] whose first B rows are the rows;
  // pos/lo per row: where its k/v is written and its first key (llama.Attention._attend_one / _rows)
  at::Tensor step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> kc,
                  std::vector<at::Tensor> vc, std::vector<int64_t> pos, std::vector<int64_t> lo) {
    TORCH_CHECK(ready(), "DecodeLayer.step: the layer is not fully described");
    TORCH_CHECK(x.dim() == 3 && x.size(1) == 1, "DecodeLayer.step: x [B, 1, hidden]");
    const int64_t B = x.size(0);
    if (kc.size() == 1 && vc.size() == 1 && kc[0].dim() == 4) {  // one sequence of B rows: its cache's first B
      kc = kc[0].narrow(0, 0, B).unbind(0);
      vc = vc[0].narrow(0, 0, B).unbind(0);
    }
    auto qkv_ = parts(qkv, rms_norm(x, n_in, eps), {nh * hd, nkv * hd, nkv * hd});
    at::Tensor q = qkv_[0].reshape({B, 1, nh, hd}).transpose(1, 2);
    at::Tensor k = qkv_[1].reshape({B, 1, nkv, hd}).transpose(1, 2);
    at::Tensor v = qkv_[2].reshape({B, 1, nkv, hd}).transpose(1, 2);
    if (n_q.defined()) {
      q = rms_norm(q, n_q, eps);
      k = rms_norm(k, n_k, eps);
    }
    q = rope(q, cos, sin);
    k = rope(k, cos, sin);
    at::Tensor a = o[0](decode_attention(q, k, v, kc, vc, pos, lo, scale));
    at::Tensor h = sandwich ? x + rms_norm(a, n_attn, eps) : x + a;
    auto gu = parts(gate_up, rms_norm(h, sandwich ? n_pre_ff : n_attn, eps), {ffn, ffn});
    at::Tensor f = down[0]((gelu ? at::gelu(gu[0], "tanh") : at::silu(gu[0])) * gu[1]);
    return sandwich ? h + rms_norm(f, n_post_ff, eps) : h + f;
  }
};

// A stage's layers' steps in one call: each DecodeLayer::step in order, with no return to Python
// between them (a layer's call from Python, its lists built and converted, cost about 10 us).
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
    const size_t n = kc.size() / L;
    for (size_t i = 0; i < L; ++i) {
      TORCH_CHECK((size_t)rope_of[i] < cos.size() && (size_t)(window_of[i] + 1) * P <= lo.size(),
                  "DecodeStack.step: layer ", i, "'s RoPE table or window is not given");
      const auto at = [&](const std::vector<at::Tensor>& c) {
        return std::vector<at::Tensor>(c.begin() + i * n, c.begin() + (i + 1) * n);
      };
      x = layers[i]->step(x, cos[rope_of[i]], sin[rope_of[i]], at(kc), at(vc), pos,
                          std::vector<int64_t>(lo.begin() + window_of[i] * P, lo.begin() + (window_of[i] + 1) * P));
    }
    return x;
  }
};

}  // namespace
