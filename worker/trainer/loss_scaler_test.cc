// The loss scaler on real tensors: why it exists (an fp16 gradient of 1e-8 underflows to zero
// and survives when scaled), exact unscaling, back-off and growth, and its checkpoint state.
#include "worker/trainer/loss_scaler.h"

#include <gtest/gtest.h>

#include <cmath>

namespace loom::trainer {
namespace {

// d/dx sum(x · 1e-8) through an fp16 activation: the gradient reaching the fp16 tensor is 1e-8,
// below fp16's smallest subnormal (6e-8).
torch::Tensor GradientThroughHalf(const LossScaler* scaler) {
  torch::Tensor x = torch::ones({4}, torch::kFloat32).requires_grad_(true);
  torch::Tensor loss = (x.to(torch::kHalf).to(torch::kFloat32) * 1e-8).sum();
  (scaler ? scaler->Scale(loss) : loss).backward();
  if (scaler) scaler->Unscale({x});
  return x.grad();
}

TEST(LossScaler, KeepsFp16GradientsThatWouldUnderflow) {
  EXPECT_TRUE(torch::equal(GradientThroughHalf(nullptr), torch::zeros({4})));
  LossScaler scaler(LossScaler::Options{});
  torch::Tensor g = GradientThroughHalf(&scaler);
  // 1e-8 · 2^16 is an fp16 normal number: about 3 significant digits survive.
  EXPECT_TRUE(torch::allclose(g, torch::full({4}, 1e-8), 1e-3, 0)) << g;
}

TEST(LossScaler, UnscalesExactlyAndSkipsUndefinedGradients) {
  LossScaler scaler(LossScaler::Options{});
  torch::Tensor a = torch::randn({3, 5}, torch::kFloat32).requires_grad_(true);
  torch::Tensor unused = torch::ones({2}).requires_grad_(true);
  torch::Tensor reference = torch::randn({3, 5});
  (a * reference).sum().backward();
  const torch::Tensor plain = a.grad().clone();
  a.mutable_grad() = torch::Tensor();
  scaler.Scale((a * reference).sum()).backward();
  scaler.Unscale({a, unused});
  EXPECT_TRUE(torch::equal(a.grad(), plain));  // powers of two: bitwise
  EXPECT_FALSE(unused.grad().defined());
}

TEST(LossScaler, BacksOffOnOverflowAndGrowsAfterCleanSteps) {
  LossScaler::Options o;
  o.initial = 1024;
  o.growth_interval = 3;
  LossScaler scaler(o);
  EXPECT_TRUE(scaler.Update(false));
  EXPECT_EQ(scaler.scale(), 512);
  EXPECT_FALSE(scaler.Update(true));
  EXPECT_FALSE(scaler.Update(true));
  EXPECT_EQ(scaler.good_steps(), 2);
  EXPECT_TRUE(scaler.Update(false));  // an overflow restarts the count
  EXPECT_EQ(scaler.scale(), 256);
  EXPECT_EQ(scaler.good_steps(), 0);
  for (int i = 0; i < 3; ++i) scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 512);
  EXPECT_EQ(scaler.good_steps(), 0);

  o.initial = 2;
  LossScaler low(o);
  low.Update(false);
  low.Update(false);
  EXPECT_EQ(low.scale(), 1) << "never below 1: it would shrink the gradients";
  o.initial = 0x1p127;
  o.growth_interval = 1;
  LossScaler high(o);
  EXPECT_FALSE(high.Update(true));
  EXPECT_EQ(high.scale(), 0x1p127) << "never beyond the largest power of two a float holds";
}

TEST(LossScaler, StateRoundTripsExactlyAndRejectsGarbage) {
  LossScaler::Options o;
  o.initial = 3072;  // not a power of two: its halves must still come back bit for bit
  LossScaler scaler(o);
  for (int i = 0; i < 5; ++i) scaler.Update(false);
  scaler.Update(true);
  LossScaler restored(LossScaler::Options{});
  ASSERT_TRUE(restored.Restore(scaler.State()).ok()) << scaler.State();
  EXPECT_EQ(restored.scale(), 96);
  EXPECT_EQ(restored.scale(), scaler.scale());
  EXPECT_EQ(restored.good_steps(), 1);
  for (const char* bad :
       {"", "abc 1", "0x1p4", "0x1p4 -1", "inf 0", "0x1p-2 0", "0x1p4 1 2", "0x1p4x 1"}) {
    EXPECT_FALSE(restored.Restore(bad).ok()) << bad;
  }
  EXPECT_EQ(restored.scale(), 96) << "a rejected state changes nothing";
}

}  // namespace
}  // namespace loom::trainer
