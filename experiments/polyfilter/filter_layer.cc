#include "experiments/polyfilter/filter_layer.h"

#include <cmath>

#include "plugins/attention/iha/iha_core.h"

namespace loom::polyfilter {

FilterLayer::FilterLayer(const LayerShape& s, Init init, double noise, at::Generator gen)
    : shape_(s) {
  TORCH_CHECK(s.mixing || s.pseudo == 1, "polyfilter: MHA (no mixing) has P = 1");
  const int64_t h = s.heads, p = s.pseudo, out = s.powers * s.features;
  auto opts = torch::TensorOptions().dtype(s.dtype);
  auto normal = [&](std::initializer_list<int64_t> shape, double sd) {
    return torch::randn(shape, gen, opts) * sd;
  };
  torch::NoGradGuard no_grad;
  // Scores start at about 1/√(N·P) each, so a pseudo-head's sum over its N·P keys is O(1).
  const double qk_sd = 1.0 / std::sqrt(s.scale * std::sqrt(static_cast<double>(s.key_width)) *
                                       std::sqrt(static_cast<double>(s.nodes * p)));
  wq = register_parameter("wq", normal({h, s.nodes, s.key_width}, qk_sd));
  wk = register_parameter("wk", normal({h, s.nodes, s.key_width}, qk_sd));
  wv = register_parameter("wv", normal({h, s.features, s.value_width},
                                       1.0 / std::sqrt(static_cast<double>(s.features))));
  wo = register_parameter("wo", normal({h * s.value_width, out},
                                       1.0 / std::sqrt(static_cast<double>(h * s.value_width))));
  torch::Tensor eye_alpha = torch::eye(h, opts).unsqueeze(-1).repeat({1, 1, p});
  torch::Tensor eye_r = torch::zeros({h, h, p}, opts);
  eye_r.select(2, 0).copy_(torch::eye(h, opts));
  eye_r = eye_r.reshape({h, h * p});
  if (!s.mixing) {  // MHA: head h reads head h, collapse is the identity; nothing to train
    alpha_q = register_buffer("alpha_q", eye_alpha);
    alpha_k = register_buffer("alpha_k", eye_alpha.clone());
    alpha_v = register_buffer("alpha_v", eye_alpha.clone());
    collapse = register_buffer("collapse", eye_r);
    return;
  }
  auto alpha = [&]() {
    if (init == Init::kRandom) return normal({h, h, p}, 1.0 / std::sqrt(static_cast<double>(h)));
    return eye_alpha + normal({h, h, p}, noise);
  };
  alpha_q = register_parameter("alpha_q", alpha());
  alpha_k = register_parameter("alpha_k", alpha());
  alpha_v = register_parameter("alpha_v", alpha());
  collapse = register_parameter(
      "collapse", init == Init::kRandom
                      ? normal({h, h * p}, 1.0 / std::sqrt(static_cast<double>(h * p)))
                      : eye_r + normal({h, h * p}, noise));
}

torch::Tensor FilterLayer::Scores() const {
  const int64_t h = shape_.heads, n = shape_.nodes, p = shape_.pseudo;
  if (!shape_.mixing) return torch::matmul(wq, wk.transpose(1, 2)) * shape_.scale;  // MHA
  // Pseudo query/key (h, j) of token n = Σ_m alpha[m, h, j] · head m's; row s = n·P + j.
  auto interleave = [&](const torch::Tensor& w, const torch::Tensor& alpha) {
    return torch::einsum("mnd,mhj->hnjd", {w, alpha}).reshape({h, n * p, w.size(2)});
  };
  return torch::matmul(interleave(wq, alpha_q), interleave(wk, alpha_k).transpose(1, 2)) *
         shape_.scale;
}

torch::Tensor FilterLayer::LinearMap() const {
  const int64_t h = shape_.heads, n = shape_.nodes, p = shape_.pseudo, dx = shape_.features;
  const int64_t dv = shape_.value_width, out = shape_.powers * dx;
  if (!shape_.mixing) {
    // MHA: T[g, m] = 1(g = m)·S_m, so F = Σ_m S_m ⊗ (wv[m]·wo[m]) without the H² pairs below.
    torch::Tensor m = torch::einsum("mae,mec->mac", {wv, wo.view({h, dv, out})});
    torch::Tensor f =
        torch::matmul(Scores().permute({1, 2, 0}).reshape({n * n, h}), m.reshape({h, dx * out}));
    return f.view({n, n, dx, out}).permute({0, 3, 1, 2});
  }
  // Un-interleaved scores S[h, n, j, n', j'] with the value mixing folded in:
  // U[h, n, j, n', m] = Σ_j' S[h, n, j, n', j'] · alpha_v[m, h, j'].
  torch::Tensor u = torch::matmul(Scores().view({h, n * p * n, p}), alpha_v.permute({1, 2, 0}));
  // Collapse: T[g, n, n', m] = Σ_{h, j} R[g, h·P + j] · U[h, n, j, n', m], the operator from
  // value head m to output head g.
  u = u.view({h, n, p, n, h}).permute({0, 2, 1, 3, 4}).reshape({h * p, n * n * h});
  torch::Tensor t = torch::matmul(collapse, u).view({h, n, n, h});
  // Value and output projections: M[g, m, a, c] = Σ_e wv[m, a, e] · wo[g·dv + e, c].
  torch::Tensor m = torch::einsum("mae,gec->gmac", {wv, wo.view({h, dv, out})});
  torch::Tensor f =
      torch::matmul(t.permute({1, 2, 0, 3}).reshape({n * n, h * h}), m.reshape({h * h, dx * out}));
  return f.view({n, n, dx, out}).permute({0, 3, 1, 2});  // [n, c, n', a]
}

torch::Tensor FilterLayer::forward(const torch::Tensor& x) const {
  const int64_t b = x.size(0), n = shape_.nodes, dx = shape_.features;
  const int64_t out = shape_.powers * dx;
  torch::Tensor f = LinearMap().reshape({n * out, n * dx});
  return torch::matmul(x.reshape({b, n * dx}), f.t()).view({b, n, out});
}

torch::Tensor FilterLayer::PluginForward(const torch::Tensor& x, bool fused) const {
  const int64_t b = x.size(0), n = shape_.nodes, dx = shape_.features, h = shape_.heads;
  const int64_t dk = shape_.key_width, dv = shape_.value_width;
  auto opts = x.options();
  torch::Tensor xhat = torch::cat({x, torch::eye(n, opts).expand({b, n, n})}, 2);  // [B, N, dx+N]
  torch::Tensor wq_full = torch::cat({torch::zeros({h, dx, dk}, opts), wq}, 1);
  torch::Tensor wk_full = torch::cat({torch::zeros({h, dx, dk}, opts), wk}, 1);
  torch::Tensor wv_full = torch::cat({wv, torch::zeros({h, n, dv}, opts)}, 1);
  auto project = [&](const torch::Tensor& w) {  // [B, N, H, width]
    return torch::einsum("bnf,mfd->bnmd", {xhat, w}).contiguous();
  };
  attention::iha::Options o;
  o.p = shape_.pseudo;
  o.mask = attention::iha::Mask::kNone;
  o.score = attention::iha::Score::kLinear;
  o.scale = shape_.scale;
  torch::Tensor q = project(wq_full), k = project(wk_full), v = project(wv_full);
  torch::Tensor heads =
      fused ? attention::iha::FusedForward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, {}, o)
            : attention::iha::Forward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, {}, o);
  return torch::matmul(heads.reshape({b, n, h * dv}), wo);
}

int64_t FilterLayer::ParameterCount() const {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.numel();
  return count;
}

void LoadTheorem3(FilterLayer& layer, const torch::Tensor& a) {
  const LayerShape& s = layer.shape();
  const int64_t h = s.heads, p = s.pseudo, dx = s.features, dv = s.value_width;
  TORCH_CHECK(s.mixing && h == p && h * h >= s.powers && s.key_width == s.nodes && dv >= p * dx,
              "polyfilter: Theorem 3 needs IHA with H = P, H² >= k, dk = N, dv >= P·dx");
  torch::NoGradGuard no_grad;
  auto opts = torch::TensorOptions().dtype(s.dtype);
  for (const auto& t : layer.parameters()) t.zero_();
  torch::Tensor am = a.to(s.dtype), eye_x = torch::eye(dx, opts);
  for (int64_t m = 0; m < h; ++m) {
    layer.wq[m].copy_(torch::matrix_power(am, m * h) / s.scale);  // query: row n of A^{mH}
    layer.wk[m].copy_(torch::matrix_power(am, m).t());            // key: column n of A^m
    layer.wv[m].narrow(1, m * dx, dx).copy_(eye_x);               // value: X into block m
  }
  for (int64_t g = 0; g < h; ++g) {
    layer.alpha_q.index_put_({g, g, 0}, 1.0);    // head g's query into its pseudo 0
    layer.collapse.index_put_({g, g * p}, 1.0);  // R keeps pseudo 0
    for (int64_t j = 0; j < p; ++j) {            // head j's key and value into pseudo j
      layer.alpha_k.index_put_({j, g, j}, 1.0);
      layer.alpha_v.index_put_({j, g, j}, 1.0);
      // Head g's block j now holds A^{gH + j}·X: output block g·H + j.
      if (g * h + j < s.powers) {
        layer.wo.narrow(0, g * dv + j * dx, dx).narrow(1, (g * h + j) * dx, dx).copy_(eye_x);
      }
    }
  }
}

}  // namespace loom::polyfilter
