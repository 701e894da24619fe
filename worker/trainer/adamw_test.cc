// Loom's AdamW against torch::optim::AdamW (float64, tolerance 1e-12 over 6 steps; the fused CPU
// pass takes these tensors), decay only on matrices, state round trips, and 50 float32 training
// steps of a small MLP on two threads with the fused pass against the tensor-op path.
#include "worker/trainer/adamw.h"

#include <gtest/gtest.h>

#include "cpu_kernels/thread_count_for_test.h"

namespace loom::trainer {
namespace {

TEST(AdamW, MatchesTorchAdamW) {
  torch::manual_seed(0);
  torch::Tensor w = torch::randn({4, 3}, torch::kFloat64).requires_grad_();
  torch::Tensor b = torch::randn({3}, torch::kFloat64).requires_grad_();
  torch::Tensor w_ref = w.detach().clone().requires_grad_();
  torch::Tensor b_ref = b.detach().clone().requires_grad_();
  AdamW ours({{"w", w}, {"b", b}}, {0.9, 0.95, 1e-8, 0.1});
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      std::vector<torch::Tensor>{w_ref},
      std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(0.01).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1)));
  groups.emplace_back(
      std::vector<torch::Tensor>{b_ref},
      std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(0.01).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.0)));
  torch::optim::AdamW ref(groups, torch::optim::AdamWOptions(0.01));
  torch::Tensor x = torch::randn({5, 4}, torch::kFloat64);
  for (int step = 0; step < 6; ++step) {
    const double lr = 0.01 * (step + 1);
    for (auto& g : ref.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    w.mutable_grad() = torch::Tensor();
    b.mutable_grad() = torch::Tensor();
    ref.zero_grad();
    (torch::tanh(x.matmul(w) + b)).pow(2).sum().backward();
    (torch::tanh(x.matmul(w_ref) + b_ref)).pow(2).sum().backward();
    ours.Step(lr);
    ref.step();
    EXPECT_LT((w - w_ref).abs().max().item<double>(), 1e-12) << step;
    EXPECT_LT((b - b_ref).abs().max().item<double>(), 1e-12) << step;
  }
  EXPECT_EQ(ours.step(), 6);
  // Decay on the matrix w, not on the vector b: with zero gradients and fresh moments one step
  // only scales w by (1 - lr·wd).
  AdamW fresh({{"w", w}, {"b", b}}, {0.9, 0.95, 1e-8, 0.1});
  w.mutable_grad() = torch::zeros_like(w);
  b.mutable_grad() = torch::zeros_like(b);
  const torch::Tensor w_before = w.detach().clone(), b_before = b.detach().clone();
  fresh.Step(0.5);
  EXPECT_TRUE(torch::allclose(w, w_before * (1 - 0.5 * 0.1), 1e-12, 0));
  EXPECT_TRUE(torch::equal(b, b_before));
}

// One copy of a small MLP trained to memorise one fixed batch with the chosen update path; returns
// its losses (the test calls it once per path).
std::vector<float> TrainMlp(bool fused, torch::nn::Sequential& net) {
  torch::manual_seed(7);
  net = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::GELU(),
                              torch::nn::Linear(256, 64));
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& item : net->named_parameters()) params.emplace_back(item.key(), item.value());
  AdamWConfig config;
  config.fused_cpu = fused;
  AdamW opt(params, config);
  std::vector<float> losses;
  const torch::Tensor x = torch::randn({512, 64}), y = torch::randn({512, 64});  // to memorise
  for (int step = 0; step < 50; ++step) {
    for (auto& [name, p] : params) p.mutable_grad() = torch::Tensor();
    torch::Tensor loss = torch::mse_loss(net->forward(x), y);
    loss.backward();
    opt.Step(3e-3);
    losses.push_back(loss.item<float>());
  }
  return losses;
}

TEST(AdamW, FusedCpuPassTrainsLikeTheTensorOps) {
  torch::nn::Sequential fused_net, ops_net;
  std::vector<float> fused, ops;
  {
    cpu_kernels::ThreadCount two(2);
    fused = TrainMlp(true, fused_net);
    ops = TrainMlp(false, ops_net);
  }
  ASSERT_EQ(fused.size(), ops.size());
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_NEAR(fused[i], ops[i], 1e-4 * ops[i]) << i;
  EXPECT_LT(fused.back(), 0.95f * fused.front());  // it trained
  const auto a = fused_net->parameters(), b = ops_net->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = b[i].abs().max().item<double>();
    EXPECT_LT((a[i] - b[i]).abs().max().item<double>(), 1e-4 * scale) << "parameter " << i;
  }
}

TEST(AdamW, StateRoundTrips) {
  torch::Tensor w = torch::randn({2, 2}).requires_grad_();
  AdamW a({{"w", w}}, {});
  w.sum().backward();
  a.Step(0.1);
  std::map<std::string, torch::Tensor> state;
  for (auto& [k, v] : a.StateTensors()) state[k] = v.clone();
  AdamW b({{"w", w}}, {});
  ASSERT_TRUE(b.LoadState(state, a.step()).ok());
  EXPECT_EQ(b.step(), 1);
  EXPECT_TRUE(torch::equal(b.StateTensors()[0].second, a.StateTensors()[0].second));
  state.erase("w.exp_avg_sq");
  auto s = b.LoadState(state, 1);
  EXPECT_NE(s.message().find("missing w.exp_avg_sq"), std::string::npos) << s;
}

}  // namespace
}  // namespace loom::trainer
