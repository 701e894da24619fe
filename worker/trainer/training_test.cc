// A short real training run: the micro preset on the generated corpus must lower the held-out
// loss by a stated margin, deterministically.
#include <gtest/gtest.h>

#include <cstdlib>

#include "corpus.h"
#include "standalone_train.h"

namespace loom::trainer {
namespace {

TEST(Training, LossFallsByMargin) {
  torch::set_num_threads(1);
  PluginLoader loader;
  ASSERT_TRUE(loader.LoadDirectories({std::getenv("LOOM_PLUGIN_PATH")}).failures.empty());
  auto config = ModelPreset("micro");
  ASSERT_TRUE(config.ok());
  config->set_init_seed(1);
  auto model = Transformer::Create(*config, loader);
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o;
  o.steps = 150;
  o.batch = 8;
  o.seq_len = 64;
  o.log_every = 0;
  auto train = ByteTokens(GenerateCorpus(1, 1 << 18));
  auto eval = ByteTokens(GenerateCorpus(2, 1 << 14));
  auto result = TrainLanguageModel(**model, train, eval, o, nullptr);
  ASSERT_TRUE(result.ok()) << result.status();
  // Untrained, a byte model sits near ln(256) = 5.55 nats. 150 steps must take the held-out
  // loss below 2.6 nats, at least 2.5 nats lower than where it started.
  EXPECT_GT(result->eval_loss_before, 5.0);
  EXPECT_LT(result->eval_loss_after, 2.6);
  EXPECT_LT(result->eval_loss_after, result->eval_loss_before - 2.5);
}

TEST(Training, LearningRateSchedule) {
  TrainOptions o;
  o.steps = 100;
  o.warmup_steps = 10;
  o.lr = 1e-3;
  o.min_lr = 1e-4;
  EXPECT_DOUBLE_EQ(LearningRateAt(o, 0), 1e-4);
  EXPECT_DOUBLE_EQ(LearningRateAt(o, 9), 1e-3);
  EXPECT_NEAR(LearningRateAt(o, 10), 1e-3, 1e-12);
  EXPECT_NEAR(LearningRateAt(o, 55), 0.5 * (1e-3 + 1e-4), 1e-12);
  EXPECT_NEAR(LearningRateAt(o, 100), 1e-4, 1e-12);
}

TEST(Corpus, DeterministicBySeed) {
  EXPECT_EQ(GenerateCorpus(5, 4096), GenerateCorpus(5, 4096));
  EXPECT_NE(GenerateCorpus(5, 4096), GenerateCorpus(6, 4096));
}

}  // namespace
}  // namespace loom::trainer
