// Packed sequences (AttentionInputs.segments): for every attention plugin, and both IHA kernels,
// a row holding examples A and B (segment ids 1 and 2, positions restarting at 0) gives each
// example exactly the output it gets alone, and no gradient flows from one example's output to
// the other's input. float64; tolerance 1e-12 absolute (outputs) and exact zero (cross
// gradients).
#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "plugins/attention/common/attention_test_util.h"
#include "plugins/attention/diff/diff_attention.h"
#include "plugins/attention/iha/iha_attention.h"
#include "plugins/attention/mha/mha_attention.h"
#include "plugins/attention/simplicial/simplicial_attention.h"
#include "plugins/attention/talking_heads/talking_heads_attention.h"

namespace loom::attention {
namespace {

using Factory = std::function<std::shared_ptr<AttentionLayer>()>;

struct PackingCase {
  std::string name;
  Factory make;
};

std::vector<PackingCase> PackingCases() {
  std::vector<PackingCase> cases;
  cases.push_back({"mha", [] {
                     return std::make_shared<MultiHeadAttention>(TestSpec(16, 4, 4, true, 0, 100),
                                                                 "mha", false);
                   }});
  cases.push_back({"mha encoder", [] {
                     return std::make_shared<MultiHeadAttention>(TestSpec(16, 4, 4, false, 0, 100),
                                                                 "mha", false);
                   }});
  cases.push_back({"local W=3", [] {
                     return std::make_shared<MultiHeadAttention>(TestSpec(16, 4, 4, true, 3, 100),
                                                                 "local", true);
                   }});
  cases.push_back(
      {"talking_heads",
       [] { return std::make_shared<TalkingHeadsAttention>(TestSpec(16, 4, 4, true, 0, 100)); }});
  cases.push_back(
      {"diff", [] { return std::make_shared<DiffAttention>(TestSpec(16, 4, 4, true, 0, 100)); }});
  cases.push_back(
      {"simplicial", [] {
         return std::make_shared<SimplicialAttention>(
             TestSpec(16, 4, 4, true, 0, 100, KeptOptions({{"window1", "3"}, {"rope", "rotate"}})));
       }});
  cases.push_back(
      {"simplicial encoder",
       [] { return std::make_shared<SimplicialAttention>(TestSpec(16, 4, 4, false, 0, 100)); }});
  for (const char* kernel : {"reference", "fused"}) {
    for (const char* mask : {"interleaved", "block"}) {
      for (int64_t window : {0, 2}) {
        auto* o = KeptOptions({{"p", "2"}, {"init", "random"}, {"kernel", kernel}, {"mask", mask}});
        cases.push_back({std::string("iha ") + kernel + " " + mask + " W=" + std::to_string(window),
                         [o, window] {
                           return std::make_shared<iha::IhaAttention>(
                               TestSpec(16, 4, 4, true, window, 100, o));
                         }});
      }
    }
    auto* o = KeptOptions({{"p", "3"}, {"init", "random"}, {"kernel", kernel}, {"mask", "none"}});
    cases.push_back({std::string("iha encoder ") + kernel, [o] {
                       return std::make_shared<iha::IhaAttention>(
                           TestSpec(16, 4, 4, false, 0, 100, o));
                     }});
  }
  return cases;
}

TEST(PackingIsolation, EveryPluginSeesOnlyItsOwnExample) {
  for (const PackingCase& c : PackingCases()) {
    torch::manual_seed(11);
    std::shared_ptr<AttentionLayer> layer = c.make();
    layer->to(torch::kFloat64);
    const int64_t na = 5, nb = 4;
    torch::Tensor a = torch::randn({1, na, 16}, torch::kFloat64),
                  b = torch::randn({1, nb, 16}, torch::kFloat64);
    torch::Tensor packed = torch::cat({a, b}, 1).requires_grad_();
    AttentionInputs in;
    in.positions = torch::cat({torch::arange(na), torch::arange(nb)}).unsqueeze(0);
    in.segments =
        torch::cat({torch::full({na}, 1, torch::kInt64), torch::full({nb}, 2, torch::kInt64)})
            .unsqueeze(0);
    torch::Tensor y = layer->forward(packed, in);
    torch::Tensor ya = layer->forward(a, {torch::arange(na), {}});
    torch::Tensor yb = layer->forward(b, {torch::arange(nb), {}});
    EXPECT_LT((y.narrow(1, 0, na) - ya).abs().max().item<double>(), 1e-12) << c.name;
    EXPECT_LT((y.narrow(1, na, nb) - yb).abs().max().item<double>(), 1e-12) << c.name;
    // A's outputs do not depend on B's inputs (and, for encoders, the other way round).
    torch::Tensor g = torch::autograd::grad({y.narrow(1, 0, na).sum()}, {packed})[0];
    EXPECT_EQ(g.narrow(1, na, nb).abs().max().item<double>(), 0.0) << c.name;
    g = torch::autograd::grad({layer->forward(packed, in).narrow(1, na, nb).sum()}, {packed})[0];
    EXPECT_EQ(g.narrow(1, 0, na).abs().max().item<double>(), 0.0) << c.name;
  }
}

TEST(PackingIsolation, BatchRowsPackDifferently) {
  // Two rows with different packings in one call: each row follows its own segments.
  for (const char* kernel : {"reference", "fused"}) {
    std::vector<std::pair<std::string, std::string>> kv = {
        {"p", "2"}, {"init", "random"}, {"kernel", kernel}};
    std::vector<LoomOption> o;
    for (auto& [k, v] : kv) o.push_back({k.c_str(), v.c_str()});
    torch::manual_seed(3);
    iha::IhaAttention layer(TestSpec(16, 4, 4, true, 0, 100, &o));
    layer.to(torch::kFloat64);
    torch::Tensor x = torch::randn({2, 6, 16}, torch::kFloat64);
    AttentionInputs in;
    in.segments = torch::tensor({1, 1, 1, 1, 2, 2, 1, 1, 2, 2, 2, 2}, torch::kInt64).view({2, 6});
    in.positions = torch::tensor({0, 1, 2, 3, 0, 1, 0, 1, 0, 1, 2, 3}, torch::kInt64).view({2, 6});
    torch::Tensor y = layer.forward(x, in);
    auto alone = [&](int64_t row, int64_t from, int64_t len) {
      return layer.forward(x.narrow(0, row, 1).narrow(1, from, len), {torch::arange(len), {}});
    };
    EXPECT_LT((y.narrow(0, 0, 1).narrow(1, 0, 4) - alone(0, 0, 4)).abs().max().item<double>(),
              1e-12)
        << kernel;
    EXPECT_LT((y.narrow(0, 0, 1).narrow(1, 4, 2) - alone(0, 4, 2)).abs().max().item<double>(),
              1e-12)
        << kernel;
    EXPECT_LT((y.narrow(0, 1, 1).narrow(1, 0, 2) - alone(1, 0, 2)).abs().max().item<double>(),
              1e-12)
        << kernel;
    EXPECT_LT((y.narrow(0, 1, 1).narrow(1, 2, 4) - alone(1, 2, 4)).abs().max().item<double>(),
              1e-12)
        << kernel;
  }
}

}  // namespace
}  // namespace loom::attention
