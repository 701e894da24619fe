#include "worker/trainer/model.h"

#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu_kernels/thread_count_for_test.h"

namespace loom::trainer {
namespace {

class ModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LoadReport r = loader_.LoadDirectories({std::getenv("LOOM_PLUGIN_PATH")});
    ASSERT_TRUE(r.failures.empty());
  }
  static v1::ModelConfig Parse(const std::string& json) {
    v1::ModelConfig c;
    auto s = google::protobuf::util::JsonStringToMessage(json, &c);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return c;
  }
  PluginLoader loader_;
};

const char kHybrid[] = R"({
  "d_model": 32, "n_layers": 5, "n_heads": 4, "vocab_size": 50, "max_seq_len": 32,
  "rope_theta": 10000, "tie_embeddings": true,
  "schedule": [{"repeat": 2, "attention": {"plugin": "local", "window": 4}},
               {"repeat": 1, "attention": {"plugin": "mha"}}]
})";

TEST_F(ModelTest, ScheduleIsCycledToDepth) {
  auto c = ResolveModelConfig(Parse(kHybrid));
  ASSERT_TRUE(c.ok()) << c.status();
  auto layers = ExpandSchedule(*c);
  ASSERT_EQ(layers.size(), 5u);
  const char* expected[] = {"local", "local", "mha", "local", "local"};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(layers[i].plugin(), expected[i]) << i;
  EXPECT_EQ(c->head_dim(), 8);
  EXPECT_EQ(c->ffn_hidden(), 128);
  EXPECT_EQ(c->ffn_activation(), "gelu");
}

TEST_F(ModelTest, ConfigErrorsNameTheField) {
  struct Bad {
    const char* json;
    const char* field;
  };
  const Bad cases[] = {
      {R"({"d_model": 30, "n_layers": 1, "n_heads": 4, "vocab_size": 5, "max_seq_len": 8})",
       "model.n_heads"},
      {R"({"d_model": 32, "n_layers": 0, "n_heads": 4, "vocab_size": 5, "max_seq_len": 8})",
       "model.n_layers"},
      {R"({"d_model": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 5, "max_seq_len": 8, "ffn_activation": "relu"})",
       "model.ffn_activation"},
      {R"({"d_model": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 5, "max_seq_len": 8, "mode": "encoder"})",
       "model.num_classes"},
      {R"({"d_model": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 5, "max_seq_len": 8, "schedule": [{"repeat": 0, "attention": {"plugin": "mha"}}]})",
       "model.schedule[0].repeat"},
      {R"({"d_model": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 5, "max_seq_len": 8, "schedule": [{"repeat": 1, "attention": {"plugin": "local", "window": 9}}]})",
       "model.schedule[0].attention.window"},
      {R"({"d_model": 32, "n_layers": 1, "n_heads": 4, "head_dim": 5, "vocab_size": 5, "max_seq_len": 8, "rope_theta": 10})",
       "model.head_dim"},
  };
  for (const Bad& b : cases) {
    auto r = ResolveModelConfig(Parse(b.json));
    ASSERT_FALSE(r.ok()) << b.json;
    EXPECT_NE(r.status().message().find(b.field), std::string::npos) << r.status();
  }
  // Unknown JSON fields are rejected by the JSON mapping itself, naming the field.
  v1::ModelConfig c;
  auto s = google::protobuf::util::JsonStringToMessage(R"({"d_modle": 3})", &c);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.ToString().find("d_modle"), std::string::npos) << s.ToString();
}

TEST_F(ModelTest, DecoderIsCausalEndToEnd) {
  auto model = Transformer::Create(Parse(kHybrid), loader_);
  ASSERT_TRUE(model.ok()) << model.status();
  (*model)->to(torch::kFloat64);
  torch::Tensor tokens = torch::randint(0, 50, {2, 16}, torch::kInt64);
  torch::Tensor logits = (*model)->forward(ModelInputs{tokens, {}, {}, {}, {}});
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 16, 50}));
  torch::Tensor changed = tokens.clone();
  changed.index_put_({torch::indexing::Slice(), 10},
                     (tokens.index({torch::indexing::Slice(), 10}) + 1) % 50);
  torch::Tensor diff =
      ((*model)->forward(ModelInputs{changed, {}, {}, {}, {}}) - logits).abs().amax({0, 2});
  for (int i = 0; i < 10; ++i) EXPECT_EQ(diff[i].item<double>(), 0.0) << i;
  EXPECT_GT(diff[10].item<double>(), 0.0);
}

// Every projection (mha's and iha's), both FFN matrices and the tied LM head take the row-split
// linear (cpu_kernels/linear_cpu.h) on two threads, and none does with LOOM_CPU_LINEAR=torch.
int CountNodes(const torch::Tensor& root, const std::string& part) {
  std::set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo{root.grad_fn().get()};
  int count = 0;
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (node->name().find(part) != std::string::npos) ++count;
    for (const auto& edge : node->next_edges()) todo.push_back(edge.function.get());
  }
  return count;
}

TEST_F(ModelTest, LinearLayersTakeTheRowSplitKernelOnTwoThreads) {
  auto model = Transformer::Create(Parse(R"({"d_model": 64, "n_layers": 2, "n_heads": 4,
      "vocab_size": 256, "max_seq_len": 64, "rope_theta": 10000, "tie_embeddings": true,
      "schedule": [{"repeat": 1, "attention": {"plugin": "iha"}},
                   {"repeat": 1, "attention": {"plugin": "mha"}}]})"),
                                   loader_);
  ASSERT_TRUE(model.ok()) << model.status();
  torch::Tensor logits, reference;
  {
    cpu_kernels::ThreadCount two(2);
    torch::Tensor tokens = torch::randint(0, 256, {8, 64}, torch::kInt64);
    logits = (*model)->forward(ModelInputs{tokens, {}, {}, {}, {}});
    setenv("LOOM_CPU_LINEAR", "torch", 1);
    reference = (*model)->forward(ModelInputs{tokens, {}, {}, {}, {}});
    unsetenv("LOOM_CPU_LINEAR");
  }
  // 2 layers × (4 projections + up + down) + the LM head.
  EXPECT_EQ(CountNodes(logits, "RowSplitLinearFunction"), 13);
  EXPECT_EQ(CountNodes(reference, "RowSplit"), 0);
  EXPECT_TRUE(torch::allclose(logits, reference, 1e-5, 1e-5));
}

// Packed examples (ModelInputs.segments, positions restarting per example): each example's
// logits, and so its loss, are the ones it gets alone, through every layer of a hybrid IHA
// stack (float64, 1e-10).
TEST_F(ModelTest, PackedExamplesMatchTheirSoloRuns) {
  auto model = Transformer::Create(Parse(R"({
    "d_model": 32, "n_layers": 3, "n_heads": 4, "vocab_size": 50, "max_seq_len": 32,
    "rope_theta": 10000, "tie_embeddings": true,
    "schedule": [{"repeat": 1, "attention": {"plugin": "iha", "window": 3, "options": {"p": "2", "kernel": "fused"}}},
                 {"repeat": 1, "attention": {"plugin": "iha", "options": {"p": "2", "kernel": "reference"}}},
                 {"repeat": 1, "attention": {"plugin": "mha"}}]})"),
                                   loader_);
  ASSERT_TRUE(model.ok()) << model.status();
  (*model)->to(torch::kFloat64);
  torch::Tensor a = torch::randint(0, 50, {1, 7}, torch::kInt64),
                b = torch::randint(0, 50, {1, 6}, torch::kInt64);
  ModelInputs packed;
  packed.tokens = torch::cat({a, b}, 1);
  packed.positions = torch::cat({torch::arange(7), torch::arange(6)}).unsqueeze(0);
  packed.segments =
      torch::cat({torch::ones({7}, torch::kInt64), 2 * torch::ones({6}, torch::kInt64)})
          .unsqueeze(0);
  torch::Tensor y = (*model)->forward(packed);
  torch::Tensor ya = (*model)->forward(ModelInputs{a, {}, {}, {}, {}});
  torch::Tensor yb = (*model)->forward(ModelInputs{b, {}, {}, {}, {}});
  EXPECT_LT((y.narrow(1, 0, 7) - ya).abs().max().item<double>(), 1e-10);
  EXPECT_LT((y.narrow(1, 7, 6) - yb).abs().max().item<double>(), 1e-10);
}

// Sweep pairing (docs/sweeps.md): with one init seed, every parameter an MHA and an IHA model
// both have with the same shape starts identical (each module draws from a generator seeded by
// its name), whatever extra parameters IHA adds; another seed changes them.
TEST_F(ModelTest, SharedParametersStartEqualAcrossAttentionKinds) {
  auto build = [&](const std::string& plugin, int seed) {
    auto m = Transformer::Create(
        Parse(absl::StrCat(R"({"d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 50,
          "max_seq_len": 32, "init_seed": )",
                           seed, R"(, "schedule": [{"repeat": 1, "attention": {"plugin": ")",
                           plugin, R"(", "options": {}}}]})")),
        loader_);
    EXPECT_TRUE(m.ok()) << m.status();
    return *m;
  };
  auto mha = build("mha", 3), iha = build("iha", 3), other = build("mha", 4);
  auto iha_params = iha->named_parameters();
  auto other_params = other->named_parameters();
  int shared = 0, differs_by_seed = 0;
  for (const auto& p : mha->named_parameters()) {
    const torch::Tensor* t = iha_params.find(p.key());
    ASSERT_NE(t, nullptr) << p.key() << " missing from the IHA model";
    ASSERT_EQ(t->sizes(), p.value().sizes()) << p.key();
    EXPECT_TRUE(torch::equal(*t, p.value())) << p.key() << " starts differently";
    ++shared;
    differs_by_seed += torch::equal(*other_params.find(p.key()), p.value()) ? 0 : 1;
  }
  EXPECT_GT(iha_params.size(), mha->named_parameters().size());  // IHA's mixing parameters
  EXPECT_GE(shared, 10);
  // Norm weights start at one whatever the seed; everything drawn at random moves with it.
  EXPECT_GE(differs_by_seed, shared / 2);
}

TEST_F(ModelTest, ParameterNamesCountsAndFlops) {
  auto model = Transformer::Create(Parse(kHybrid), loader_);
  ASSERT_TRUE(model.ok());
  auto params = (*model)->named_parameters();
  EXPECT_TRUE(params.contains("layers.0.attention.q_proj.weight"));
  EXPECT_TRUE(params.contains("layers.2.attention.o_proj.weight"));
  EXPECT_TRUE(params.contains("layers.4.ffn.up.weight"));
  EXPECT_FALSE(params.contains("lm_head.weight"));  // tied
  const int64_t D = 32, V = 50, F = 128;
  const int64_t per_layer = 4 * D * D + 2 * D * F + 2 * D;
  EXPECT_EQ((*model)->NumParameters(), V * D + 5 * per_layer + D);
  auto attn = (*model)->AttentionFlopsPerToken(32);
  ASSERT_EQ(attn.size(), 5u);
  EXPECT_LT(attn[0], attn[2]);  // local layers attend to fewer keys than the global one
  double sum = 0;
  for (double a : attn) sum += a + 2.0 * 2 * D * F;
  EXPECT_DOUBLE_EQ((*model)->ForwardFlopsPerToken(32), sum + 2.0 * D * V);
}

TEST_F(ModelTest, SwigluAndUntiedHead) {
  auto c = Parse(R"({"d_model": 16, "n_layers": 1, "n_heads": 2, "vocab_size": 11, "max_seq_len": 8,
                     "ffn_activation": "swiglu", "ffn_hidden": 24})");
  auto model = Transformer::Create(c, loader_);
  ASSERT_TRUE(model.ok()) << model.status();
  auto params = (*model)->named_parameters();
  EXPECT_TRUE(params.contains("lm_head.weight"));
  EXPECT_TRUE(params.contains("layers.0.ffn.gate.weight"));
  torch::Tensor logits =
      (*model)->forward(ModelInputs{torch::randint(0, 11, {1, 8}, torch::kInt64), {}, {}, {}, {}});
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{1, 8, 11}));
}

TEST_F(ModelTest, EncoderWithGridPositions) {
  auto c = Parse(R"({"d_model": 16, "n_layers": 2, "n_heads": 2, "vocab_size": 2, "max_seq_len": 64,
                     "mode": "encoder", "num_classes": 1, "grid_max_rows": 8, "grid_max_cols": 8})");
  auto model = Transformer::Create(c, loader_);
  ASSERT_TRUE(model.ok()) << model.status();
  (*model)->to(torch::kFloat64);
  // A 4x4 grid flattened row-major.
  torch::Tensor idx = torch::arange(16);
  ModelInputs in;
  in.tokens = torch::randint(0, 2, {1, 16}, torch::kInt64);
  in.grid_rows = torch::div(idx, 4, "floor").unsqueeze(0);
  in.grid_cols = (idx % 4).unsqueeze(0);
  torch::Tensor out = (*model)->forward(in);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{1, 16, 1}));
  // Bidirectional: the last token changes the first output.
  ModelInputs changed = in;
  changed.tokens = in.tokens.clone();
  changed.tokens.index_put_({0, 15}, 1 - in.tokens.index({0, 15}));
  EXPECT_GT(((*model)->forward(changed) - out).abs().index({0, 0}).item<double>(), 0.0);
  // The grid coordinates matter: transposing the layout changes the outputs.
  ModelInputs transposed = in;
  transposed.grid_rows = in.grid_cols;
  transposed.grid_cols = in.grid_rows;
  EXPECT_GT(((*model)->forward(transposed) - out).abs().max().item<double>(), 0.0);
  // Missing coordinates are an error, not a crash.
  ModelInputs missing;
  missing.tokens = in.tokens;
  EXPECT_THROW((*model)->forward(missing), c10::Error);
}

TEST_F(ModelTest, UnknownPluginInScheduleFailsCleanly) {
  auto c = Parse(R"({"d_model": 16, "n_layers": 2, "n_heads": 2, "vocab_size": 5, "max_seq_len": 8,
                     "schedule": [{"repeat": 1, "attention": {"plugin": "mha"}},
                                  {"repeat": 1, "attention": {"plugin": "warp_drive"}}]})");
  auto model = Transformer::Create(c, loader_);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("warp_drive"), std::string::npos) << model.status();
}

}  // namespace
}  // namespace loom::trainer

namespace loom::trainer {
namespace {

// The paper's hybrid stack: 4 local IHA layers (W = N/(2P²)) then 1 global layer.
TEST_F(ModelTest, HybridScheduleExpandsAndIsFlopMatchedUnderThePapersAccounting) {
  auto c = ResolveModelConfig(Parse(R"({
    "d_model": 32, "n_layers": 5, "n_heads": 4, "vocab_size": 50, "max_seq_len": 64,
    "rope_theta": 10000, "hybrid": {"iha_options": {"p": 2}}})"));
  ASSERT_TRUE(c.ok()) << c.status();
  auto layers = ExpandSchedule(*c);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(layers[i].plugin(), "iha");
    EXPECT_EQ(layers[i].window(), 8);  // 64 / (2 · 2²)
    EXPECT_EQ(layers[i].options().fields().at("p").number_value(), 2);
  }
  EXPECT_EQ(layers[4].plugin(), "mha");
  EXPECT_EQ(layers[4].window(), 0);

  // Both accountings from the plugins' own numbers. Attention part of a layer at context n:
  // core(n) = F(n) - F(0), F = ForwardFlopsPerToken, an average over the n positions.
  auto model = Transformer::Create(*c, loader_);
  ASSERT_TRUE(model.ok()) << model.status();
  auto core_at = [&](int64_t context) {
    auto full = (*model)->AttentionFlopsPerToken(context),
         none = (*model)->AttentionFlopsPerToken(0);
    std::vector<double> out(full.size());
    for (size_t i = 0; i < full.size(); ++i) out[i] = full[i] - none[i];
    return out;
  };
  const double n = 64, p = 2, w = layers[0].window();
  const std::vector<double> core = core_at(64), core_before = core_at(63);
  const double per_key = 4.0 * 4 * 8;  // H · 4d FLOPs per attended (query, key) pair

  // Appendix C's accounting is dense: N keys per token for a global MHA layer, P pseudo-queries
  // x W·P pseudo-keys = P²·W for a local IHA layer. That is what the plugins charge the last
  // token of a full context (position N - 1 sees every key; its pseudo-queries see a full
  // window), i.e. n·core(n) - (n-1)·core(n-1). With W = N/(2P²) the 5-layer average is then 3/5
  // of the global layer. Tolerance 1e-9 relative: the per-token figures are averages (one
  // division each), multiplied back here.
  auto last_token = [&](int i) { return n * core[i] - (n - 1) * core_before[i]; };
  EXPECT_NEAR(last_token(4), per_key * n, 1e-9 * per_key * n);
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(last_token(i), per_key * p * p * w, 1e-9 * per_key * n) << i;
  }
  const double paper_ratio = (4 * last_token(0) + last_token(4)) / 5 / last_token(4);
  EXPECT_NEAR(paper_ratio, 0.6, 1e-9);

  // Loom's exact accounting (the average over positions): with causal masks a global layer
  // attends (N+1)/2 keys on average, so the hybrid stack is about FLOP-matched (ratio near 1)
  // rather than 3/5 cheaper. docs/iha.md records both.
  EXPECT_DOUBLE_EQ(core[4], per_key * 32.5);                   // mha: (64 + 1) / 2 keys
  const double local_keys = (16.0 * 17 / 2 + 112 * 16) / 128;  // interleaved, window 16 of 128
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(core[i], per_key * p * local_keys);
  const double exact_ratio = (core[0] * 4 + core[4]) / 5 / core[4];
  EXPECT_GT(exact_ratio, 0.9);
  EXPECT_LT(exact_ratio, 1.0);
  // Global kind iha: the global layer costs P² times a causal MHA layer (interleaved mask).
  auto g = ResolveModelConfig(Parse(R"({
    "d_model": 32, "n_layers": 5, "n_heads": 4, "vocab_size": 50, "max_seq_len": 64,
    "hybrid": {"global_kind": "iha", "iha_options": {"p": 2}, "window": 4}})"));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(ExpandSchedule(*g)[4].plugin(), "iha");
  EXPECT_EQ(ExpandSchedule(*g)[0].window(), 4);
  // hybrid and schedule together are an error naming the field.
  auto both = ResolveModelConfig(Parse(R"({
    "d_model": 32, "n_layers": 5, "n_heads": 4, "vocab_size": 50, "max_seq_len": 64,
    "hybrid": {}, "schedule": [{"repeat": 1, "attention": {"plugin": "mha"}}]})"));
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("model.hybrid"), std::string::npos);
}

// Nodes of the autograd graph behind `t` whose name contains `name`.
int GraphNodesNamed(const torch::Tensor& t, const std::string& name) {
  std::vector<torch::autograd::Node*> todo = {t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  int count = 0;
  while (!todo.empty()) {
    torch::autograd::Node* n = todo.back();
    todo.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    count += n->name().find(name) != std::string::npos;
    for (const auto& edge : n->next_edges()) todo.push_back(edge.function.get());
  }
  return count;
}

// Activation checkpointing trades memory for time only: for every plugin (IHA through both its
// fused kernel's custom backward and its reference path, windows, packing), the loss and every
// parameter's gradient with full and selective recomputation equal the plain path (float64).
TEST_F(ModelTest, ActivationCheckpointingGivesTheSameGradientsForEveryPlugin) {
  const std::string layers = R"(
    "schedule": [
      {"repeat": 1, "attention": {"plugin": "mha"}},
      {"repeat": 1, "attention": {"plugin": "local", "window": 3}},
      {"repeat": 1, "attention": {"plugin": "talking_heads"}},
      {"repeat": 1, "attention": {"plugin": "diff"}},
      {"repeat": 1, "attention": {"plugin": "simplicial", "options": {"window1": 4}}},
      {"repeat": 1, "attention": {"plugin": "iha", "options": {"p": "2", "kernel": "fused", "init": "random"}}},
      {"repeat": 1, "attention": {"plugin": "iha", "window": 2, "options": {"p": "3", "kernel": "reference", "mask": "block", "init": "random"}}}])";
  torch::Tensor tokens = torch::randint(0, 50, {2, 12}, torch::kInt64);
  torch::Tensor segments =
      torch::cat({torch::ones({2, 5}, torch::kInt64), 2 * torch::ones({2, 7}, torch::kInt64)}, 1);
  std::map<std::string, std::map<std::string, torch::Tensor>> grads;
  std::map<std::string, double> losses;
  for (const std::string mode : {"none", "full", "selective"}) {
    auto model = Transformer::Create(
        Parse(absl::StrCat(R"({"d_model": 32, "n_layers": 7, "n_heads": 4, "vocab_size": 50,
                              "max_seq_len": 16, "rope_theta": 10000, "tie_embeddings": true,
                              "init_seed": 5, "activation_checkpointing": ")",
                           mode, R"(", )", layers, "}")),
        loader_);
    ASSERT_TRUE(model.ok()) << model.status();
    (*model)->to(torch::kFloat64);
    torch::Tensor logits = (*model)->forward(ModelInputs{tokens, {}, {}, {}, segments});
    torch::Tensor loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, 50}), torch::roll(tokens, -1, 1).reshape({-1}));
    // The recomputing nodes are in the graph exactly when asked for (one per layer).
    EXPECT_EQ(GraphNodesNamed(loss, "RecomputeFunction"), mode == "none" ? 0 : 7) << mode;
    loss.backward();
    losses[mode] = loss.item<double>();
    for (const auto& p : (*model)->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << mode << " " << p.key();
      grads[mode][p.key()] = p.value().grad().clone();
    }
  }
  for (const std::string mode : {"full", "selective"}) {
    EXPECT_EQ(losses[mode], losses["none"]) << mode;
    ASSERT_EQ(grads[mode].size(), grads["none"].size());
    for (const auto& [name, g] : grads["none"]) {
      EXPECT_LT((grads[mode][name] - g).abs().max().item<double>(), 1e-10) << mode << " " << name;
    }
  }
  EXPECT_GT(grads["none"].size(), 40u);
}

TEST_F(ModelTest, ActivationCheckpointingModeIsValidated) {
  auto model = Transformer::Create(
      Parse(R"({"d_model": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 10, "max_seq_len": 8,
                "activation_checkpointing": "some"})"),
      loader_);
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("activation_checkpointing"), std::string::npos);
}

}  // namespace
}  // namespace loom::trainer
