// Helpers shared by the attention plugin tests: spec construction and the finite-difference
// gradient check.
#ifndef LOOM_PLUGINS_ATTENTION_COMMON_ATTENTION_TEST_UTIL_H_
#define LOOM_PLUGINS_ATTENTION_COMMON_ATTENTION_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "loom/attention_plugin.h"

namespace loom::attention {

// Plugin options as the C spec wants them, for test cases built once and kept for the whole
// test run (the strings and the list are deliberately never freed).
inline std::vector<LoomOption>* KeptOptions(std::vector<std::pair<std::string, std::string>> kv) {
  auto* store = new std::vector<std::pair<std::string, std::string>>(std::move(kv));
  auto* list = new std::vector<LoomOption>();
  for (auto& [k, v] : *store) list->push_back({k.c_str(), v.c_str()});
  return list;
}

inline LoomAttentionSpecV1 TestSpec(int64_t d_model, int64_t heads, int64_t head_dim, bool causal,
                                    int64_t window, double theta,
                                    std::vector<LoomOption>* options = nullptr, int64_t layer = 0) {
  LoomAttentionSpecV1 s{};
  s.d_model = d_model;
  s.n_heads = heads;
  s.head_dim = head_dim;
  s.causal = causal;
  s.window = window;
  s.rope_theta = theta;
  s.layer_index = layer;
  s.n_layers = layer + 1;
  if (options) {
    s.options = options->data();
    s.num_options = options->size();
  }
  return s;
}

// Compares `grad` (the autograd gradient of `loss` with respect to `t`) with central
// differences (step 1e-6) on every `stride`-th entry of `t`; float64 only. Returns how many
// entries it checked.
inline int64_t ExpectGradientMatchesFiniteDifferences(const torch::Tensor& t,
                                                      const torch::Tensor& grad,
                                                      const std::function<torch::Tensor()>& loss,
                                                      int64_t stride, double tolerance,
                                                      const std::string& name) {
  torch::NoGradGuard no_grad;
  torch::Tensor flat = t.view(-1), g = grad.view(-1);
  int64_t checked = 0;
  for (int64_t i = 0; i < flat.numel(); i += stride) {
    const double h = 1e-6, orig = flat[i].item<double>();
    flat[i] = orig + h;
    const double up = loss().item<double>();
    flat[i] = orig - h;
    const double down = loss().item<double>();
    flat[i] = orig;
    EXPECT_NEAR(g[i].item<double>(), (up - down) / (2 * h), tolerance) << name << "[" << i << "]";
    ++checked;
  }
  return checked;
}

// The same for every `stride(name)`-th entry of each parameter of `module`.
inline int64_t ExpectGradientsMatchFiniteDifferences(
    torch::nn::Module& module, const std::function<torch::Tensor()>& loss,
    const std::function<int64_t(const std::string&)>& stride, double tolerance) {
  module.zero_grad();
  loss().backward();
  int64_t checked = 0;
  for (auto& p : module.named_parameters()) {
    checked += ExpectGradientMatchesFiniteDifferences(p.value(), p.value().grad(), loss,
                                                      stride(p.key()), tolerance, p.key());
  }
  return checked;
}

}  // namespace loom::attention

#endif  // LOOM_PLUGINS_ATTENTION_COMMON_ATTENTION_TEST_UTIL_H_
