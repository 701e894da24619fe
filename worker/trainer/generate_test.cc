// Generation and reasoning evaluation: the model's KV-cached decoding equals recomputing the full
// prefix for every attention plugin (float64, 1e-10), greedy generation equals a naive argmax
// loop over full forwards, sampled sequences do not depend on their batch, shared prefill (a
// forked cache) equals one prefill per row (1e-12) and samples the same tokens, stops and
// limits, and Pass@1 / Maj@k scoring with ties and unanswerable samples.
#include "worker/trainer/generate.h"

#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "worker/trainer/plugin_factory.h"
#include "worker/trainer/reasoning_eval.h"

namespace loom::trainer {
namespace {

class GenerateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LoadReport r = loader_.LoadDirectories({std::getenv("LOOM_PLUGIN_PATH")});
    ASSERT_TRUE(r.failures.empty());
  }
  std::shared_ptr<Transformer> Model(const std::string& json) {
    v1::ModelConfig c;
    auto s = google::protobuf::util::JsonStringToMessage(json, &c);
    EXPECT_TRUE(s.ok()) << s.ToString();
    auto model = Transformer::Create(c, loader_);
    EXPECT_TRUE(model.ok()) << model.status();
    (*model)->to(torch::kFloat64);
    return *model;
  }
  PluginLoader loader_;
};

// Every plugin once, RoPE on; the IHA layers use the fused kernel for full forwards, so the
// cached path (reference maths on pseudo-tokens) is checked against an independent kernel.
const char kEveryPlugin[] = R"({
  "d_model": 32, "n_layers": 8, "n_heads": 4, "vocab_size": 260, "max_seq_len": 48,
  "rope_theta": 10000, "tie_embeddings": true,
  "schedule": [
    {"repeat": 1, "attention": {"plugin": "mha"}},
    {"repeat": 1, "attention": {"plugin": "local", "window": 3}},
    {"repeat": 1, "attention": {"plugin": "talking_heads"}},
    {"repeat": 1, "attention": {"plugin": "diff"}},
    {"repeat": 1, "attention": {"plugin": "simplicial", "options": {"window1": 6, "window2": 4, "rope": "rotate"}}},
    {"repeat": 1, "attention": {"plugin": "iha", "options": {"p": "2", "kernel": "fused", "init": "random"}}},
    {"repeat": 1, "attention": {"plugin": "iha", "window": 2, "options": {"p": "2", "kernel": "fused", "mask": "block", "kv_cache": "heads", "init": "random"}}},
    {"repeat": 1, "attention": {"plugin": "iha", "options": {"p": "3", "init": "random"}}}]
})";

TEST_F(GenerateTest, CachedDecodingEqualsFullPrefixForEveryPlugin) {
  torch::manual_seed(3);
  auto model = Model(kEveryPlugin);
  torch::NoGradGuard no_grad;
  const int64_t n = 20;
  torch::Tensor tokens = torch::randint(0, 260, {2, n}, torch::kInt64);
  torch::Tensor full = model->forward(ModelInputs{tokens, {}, {}, {}, {}});
  DecodeState state = model->NewDecodeState();
  std::vector<torch::Tensor> parts;
  int64_t at = 0;
  for (int64_t chunk : {6, 1, 1, 5, 1, 1, 1, 4}) {
    parts.push_back(
        model->ForwardCached(ModelInputs{tokens.narrow(1, at, chunk), {}, {}, {}, {}}, state));
    at += chunk;
  }
  ASSERT_EQ(at, n);
  EXPECT_EQ(state.tokens(), n);
  EXPECT_GT(state.bytes(), 0);
  EXPECT_LT((torch::cat(parts, 1) - full).abs().max().item<double>(), 1e-10);
}

TEST_F(GenerateTest, GreedyGenerationEqualsNaiveArgmaxLoop) {
  torch::manual_seed(4);
  auto model = Model(kEveryPlugin);
  const std::vector<std::vector<uint32_t>> prompts = {{5, 9, 200, 17}, {3, 3, 3, 3, 3, 3, 3}, {42}};
  SamplingOptions o;
  o.greedy = true;
  o.max_new_tokens = 9;
  o.batch = 3;  // all prompts in one left-padded batch
  std::vector<GenerationRequest> requests;
  for (const auto& p : prompts) requests.push_back({p, 1});
  auto out = Generate(*model, requests, o, [](const std::vector<uint32_t>&) { return ""; });
  ASSERT_TRUE(out.ok()) << out.status();
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::vector<int64_t> seq(prompts[i].begin(), prompts[i].end());
    std::vector<uint32_t> expected;
    for (int s = 0; s < 9; ++s) {
      torch::Tensor t = torch::tensor(seq, torch::kInt64).unsqueeze(0);
      torch::Tensor logits = model->forward(ModelInputs{t, {}, {}, {}, {}});
      const int64_t next = logits[0][-1].argmax().item<int64_t>();
      expected.push_back(static_cast<uint32_t>(next));
      seq.push_back(next);
    }
    EXPECT_EQ((*out)[i].tokens, expected) << "prompt " << i;
    EXPECT_EQ((*out)[i].finish, "length");
  }
}

TEST_F(GenerateTest, SamplesDoNotDependOnTheirBatch) {
  torch::manual_seed(5);
  auto model = Model(kEveryPlugin);
  std::vector<GenerationRequest> requests = {
      {{1, 2, 3}, 11}, {{7, 7, 7, 7, 7, 7}, 12}, {{100, 101}, 13}, {{1, 2, 3}, 14}};
  SamplingOptions o;
  o.temperature = 1.0;
  o.top_p = 0.9;
  o.max_new_tokens = 8;
  auto decode = [](const std::vector<uint32_t>&) { return std::string(); };
  o.batch = 4;
  auto together = Generate(*model, requests, o, decode);
  o.batch = 1;
  auto alone = Generate(*model, requests, o, decode);
  ASSERT_TRUE(together.ok() && alone.ok());
  for (size_t i = 0; i < requests.size(); ++i)
    EXPECT_EQ((*together)[i].tokens, (*alone)[i].tokens) << i;
  // Same prompt, different seeds: different samples (8 tokens from 260 at T = 1).
  EXPECT_NE((*together)[0].tokens, (*together)[3].tokens);
}

// Left-padded prompt inputs as Generate builds them (pads in segment 0 at position 0).
ModelInputs PaddedPrompts(const std::vector<std::vector<int64_t>>& prompts, int64_t longest) {
  const int64_t b = static_cast<int64_t>(prompts.size());
  torch::Tensor tokens = torch::zeros({b, longest}, torch::kInt64);
  torch::Tensor positions = torch::zeros({b, longest}, torch::kInt64);
  torch::Tensor segments = torch::zeros({b, longest}, torch::kInt64);
  for (int64_t r = 0; r < b; ++r) {
    const auto& p = prompts[static_cast<size_t>(r)];
    const int64_t n = static_cast<int64_t>(p.size()), pad = longest - n;
    tokens[r].narrow(0, pad, n).copy_(torch::tensor(p, torch::kInt64));
    positions[r].narrow(0, pad, n).copy_(torch::arange(n, torch::kInt64));
    segments[r].narrow(0, pad, n).fill_(1);
  }
  return ModelInputs{tokens, positions, {}, {}, segments};
}

// The mechanism of shared prefill: one prefill row per distinct prompt, forked by KeepRows with
// repeated rows, gives every decode step the logits of prefilling each row itself (float64,
// every plugin: the windowed layers see prompts longer than their windows, both IHA layouts).
TEST_F(GenerateTest, ForkedPrefillCacheEqualsOnePrefillPerRow) {
  torch::manual_seed(7);
  auto model = Model(kEveryPlugin);
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> a = {5, 9, 200, 17, 3, 3, 8, 44, 2}, b = {42, 7, 1, 90};
  const int64_t longest = static_cast<int64_t>(a.size());
  const std::vector<int64_t> fork = {0, 0, 0, 1, 1, 0};
  std::vector<std::vector<int64_t>> every_row;
  for (int64_t f : fork) every_row.push_back(f == 0 ? a : b);
  DecodeState unshared = model->NewDecodeState(), shared = model->NewDecodeState();
  torch::Tensor lu = model->ForwardCached(PaddedPrompts(every_row, longest), unshared);
  torch::Tensor ls = model->ForwardCached(PaddedPrompts({a, b}, longest), shared);
  const torch::Tensor rows = torch::tensor(fork, torch::kInt64);
  shared.KeepRows(rows);
  EXPECT_EQ(shared.tokens(), unshared.tokens());
  EXPECT_EQ(shared.bytes(), unshared.bytes());
  double worst = (lu.select(1, longest - 1) - ls.select(1, longest - 1).index_select(0, rows))
                     .abs()
                     .max()
                     .item<double>();
  const int64_t n = static_cast<int64_t>(fork.size());
  for (int64_t step = 0; step < 8; ++step) {  // each row is fed its own tokens
    torch::Tensor tokens = (torch::arange(n, torch::kInt64) * 31 + step * 7).remainder(260);
    torch::Tensor positions = torch::tensor(fork, torch::kInt64) * (4 - longest) + longest + step;
    ModelInputs in{
        tokens.view({n, 1}), positions.view({n, 1}), {}, {}, torch::ones({n, 1}, torch::kInt64)};
    worst = std::max(worst, (model->ForwardCached(in, unshared) - model->ForwardCached(in, shared))
                                .abs()
                                .max()
                                .item<double>());
  }
  EXPECT_LT(worst, 1e-12);
}

// Generate with and without shared prefill: the same tokens for the same seeds, k times fewer
// prefill tokens, whether a batch holds whole problems or cuts through one.
TEST_F(GenerateTest, SharedPrefillGeneratesTheSameSamples) {
  torch::manual_seed(8);
  auto model = Model(kEveryPlugin);
  const std::vector<std::vector<uint32_t>> prompts = {
      {5, 9, 200, 17, 3, 3, 8}, {42, 7}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}};
  std::vector<GenerationRequest> requests;
  for (size_t i = 0; i < prompts.size(); ++i)
    for (uint64_t k = 0; k < 4; ++k) requests.push_back({prompts[i], 100 * i + k});
  SamplingOptions o;
  o.temperature = 1.0;
  o.top_p = 0.95;
  o.max_new_tokens = 10;
  auto decode = [](const std::vector<uint32_t>&) { return std::string(); };
  for (int64_t batch : {12, 5, 4}) {
    o.batch = batch;
    GenerationStats off_stats, on_stats;
    o.share_prefill = false;
    auto off = Generate(*model, requests, o, decode, &off_stats);
    o.share_prefill = true;
    auto on = Generate(*model, requests, o, decode, &on_stats);
    ASSERT_TRUE(off.ok() && on.ok());
    for (size_t i = 0; i < requests.size(); ++i) {
      EXPECT_EQ((*on)[i].tokens, (*off)[i].tokens) << "batch " << batch << ", request " << i;
      EXPECT_EQ((*on)[i].finish, (*off)[i].finish);
    }
    EXPECT_EQ(on_stats.generated_tokens, off_stats.generated_tokens);
    if (batch == 4) {  // one problem per batch: exactly k = 4 times fewer
      EXPECT_EQ(off_stats.prefill_tokens, 4 * (7 + 2 + 11));
      EXPECT_EQ(on_stats.prefill_tokens, 7 + 2 + 11);
    } else {
      EXPECT_LT(on_stats.prefill_tokens, off_stats.prefill_tokens);
    }
  }
  // The samples of one prompt still differ from each other (their own random streams).
  auto out = Generate(*model, requests, o, decode);
  ASSERT_TRUE(out.ok());
  EXPECT_NE((*out)[0].tokens, (*out)[1].tokens);
}

TEST(SampleToken, TemperatureAndTopP) {
  std::mt19937_64 rng(1);
  SamplingOptions o;
  o.temperature = 1.0;
  torch::Tensor logits = torch::tensor({0.0, std::log(3.0), -1e9});
  int ones = 0;
  const int draws = 8000;
  for (int i = 0; i < draws; ++i) ones += SampleToken(logits, o, rng) == 1;
  EXPECT_NEAR(ones / static_cast<double>(draws), 0.75, 0.02);  // 4.5 standard deviations
  o.top_p = 0.7;  // the most likely token alone reaches 0.75
  for (int i = 0; i < 200; ++i) EXPECT_EQ(SampleToken(logits, o, rng), 1u);
  o.top_p = 1.0;
  o.temperature = 1e-3;  // nearly greedy
  for (int i = 0; i < 200; ++i) EXPECT_EQ(SampleToken(logits, o, rng), 1u);
  o.greedy = true;
  EXPECT_EQ(SampleToken(torch::tensor({3.0, 1.0, 5.0}), o, rng), 2u);
}

std::string Bytes(const std::vector<uint32_t>& tokens) {
  std::string s;
  for (uint32_t t : tokens)
    if (t < 256) s += static_cast<char>(t);
  return s;
}

TEST_F(GenerateTest, StopsAndLimits) {
  torch::manual_seed(6);
  auto model = Model(kEveryPlugin);
  SamplingOptions o;
  o.greedy = true;
  o.max_new_tokens = 12;
  auto free_run = Generate(*model, {{{65, 66, 67}, 1}}, o, Bytes);
  ASSERT_TRUE(free_run.ok());
  const std::vector<uint32_t>& tokens = (*free_run)[0].tokens;
  ASSERT_EQ(tokens.size(), 12u);
  // Stop token: the third generated token ends the sequence before it.
  o.stop_tokens = {tokens[2]};
  auto stopped = Generate(*model, {{{65, 66, 67}, 1}}, o, Bytes);
  ASSERT_TRUE(stopped.ok());
  const size_t first = std::find(tokens.begin(), tokens.end(), tokens[2]) - tokens.begin();
  EXPECT_EQ((*stopped)[0].finish, "stop_token");
  EXPECT_EQ((*stopped)[0].tokens, std::vector<uint32_t>(tokens.begin(), tokens.begin() + first));
  // Stop string: the text is cut where it first appears.
  const std::string text = Bytes(tokens);
  if (text.size() >= 3) {
    o.stop_tokens.clear();
    o.stop = {text.substr(2, 1)};
    auto cut = Generate(*model, {{{65, 66, 67}, 1}}, o, Bytes);
    ASSERT_TRUE(cut.ok());
    EXPECT_EQ((*cut)[0].finish, "stop_string");
    EXPECT_EQ((*cut)[0].text, text.substr(0, text.find(text.substr(2, 1))));
  }
  // max_seq_len (48) caps generation: a 45-token prompt gets 3 new tokens.
  o.stop.clear();
  auto capped = Generate(*model, {{std::vector<uint32_t>(45, 7), 1}}, o, Bytes);
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ((*capped)[0].tokens.size(), 3u);
  EXPECT_EQ((*capped)[0].finish, "length");
  // Bad prompts are errors, not crashes.
  EXPECT_EQ(Generate(*model, {{{}, 1}}, o, Bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Generate(*model, {{{999}, 1}}, o, Bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Generate(*model, {{std::vector<uint32_t>(48, 1), 1}}, o, Bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
}

EvalProblem Problem(const std::string& reference) {
  EvalProblem p;
  p.id = reference;
  p.reference = reference;
  return p;
}

TEST(ReasoningScore, PassAtOneAndMajorityVote) {
  const std::vector<EvalProblem> problems = {Problem("42"), Problem("7"), Problem("1,000"),
                                             Problem("9")};
  const std::vector<std::vector<std::string>> completions = {
      // 2 of 4 right; majority 42 (2 votes vs 1).
      {"#### 42", "#### 41", "so #### 42.0", "no answer here"},
      // tie 3 vs 7 (one vote each, unanswerable ignored): the first to reach the count, 3, wins.
      {"#### 3", "#### 7", "", "####"},
      // thousands separators and $...$ normalise.
      {"#### 1000", "#### $1,000$", "#### 999", "#### 1000."},
      // nobody answers: Maj wrong, Pass 0.
      {"", "", "", ""}};
  ReasoningEvalSummary s = ScoreCompletions(problems, completions, "gsm8k");
  EXPECT_EQ(s.problems, 4);
  EXPECT_EQ(s.samples, 4);
  EXPECT_DOUBLE_EQ(s.pass_at_1, (2.0 / 4 + 1.0 / 4 + 3.0 / 4 + 0) / 4);
  EXPECT_DOUBLE_EQ(s.maj_at_k, 2.0 / 4);  // problems 1 and 3
  EXPECT_DOUBLE_EQ(s.answered, 9.0 / 16);
  EXPECT_EQ(*s.outcomes[1].majority, "3");
  EXPECT_FALSE(s.outcomes[3].majority.has_value());
  // MATH style.
  ReasoningEvalSummary m = ScoreCompletions({Problem("\\frac{1}{2}")},
                                            {{"so \\boxed{\\frac{1}{2}}", "\\boxed{0.5}"}}, "math");
  EXPECT_DOUBLE_EQ(m.pass_at_1, 0.5);  // textual answers compare as text
}

TEST_F(GenerateTest, EvalProblemFilesAndHeldOutSplit) {
  auto objective = CreateSftObjective(loader_, "openthoughts", {}, 256);
  ASSERT_TRUE(objective.ok()) << objective.status();
  const auto dir =
      std::filesystem::temp_directory_path() / ("loom-eval-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  v1::ReasoningEvalConfig c;
  c.set_source("gsm8k");
  c.set_answer_style("gsm8k");
  c.set_path(write("gsm8k.jsonl",
                   "{\"question\": \"2+2?\", \"answer\": \"2+2=4\\n#### 4\"}\n\n"
                   "{\"question\": \"3*3?\", \"answer\": \"#### 9\"}\n"));
  auto gsm = LoadEvalProblems(c, **objective);
  ASSERT_TRUE(gsm.ok()) << gsm.status();
  ASSERT_EQ(gsm->size(), 2u);
  EXPECT_EQ((*gsm)[0].reference, "4");
  EXPECT_EQ((*gsm)[1].prompt.turns[0].text, "3*3?");
  c.set_path(write("bad.jsonl",
                   "{\"question\": \"q\", \"answer\": \"#### 1\"}\n"
                   "{\"question\": \"q\", \"answer\": \"no marker\"}\n"));
  auto bad = LoadEvalProblems(c, **objective);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(":2:"), std::string::npos) << bad.status();
  c.set_source("math500");
  c.set_answer_style("math");
  c.set_path(write("math.jsonl",
                   "{\"problem\": \"p\", \"answer\": \"\\\\frac{1}{2}\", "
                   "\"unique_id\": \"test/algebra/1.json\"}\n{\"problem\": 3}\n"));
  auto math = LoadEvalProblems(c, **objective);
  ASSERT_FALSE(math.ok());
  EXPECT_NE(math.status().message().find(":2: \"problem\""), std::string::npos) << math.status();
  c.set_problems(1);  // only the first line is read
  math = LoadEvalProblems(c, **objective);
  ASSERT_TRUE(math.ok()) << math.status();
  EXPECT_EQ((*math)[0].id, "test/algebra/1.json");
  EXPECT_EQ((*math)[0].reference, "\\frac{1}{2}");
  // Built-in problems come from the held-out split: none of them is ever generated for training.
  v1::ReasoningEvalConfig b;
  b.set_source("builtin");
  b.set_task("mixed");
  b.set_problems(40);
  auto held = LoadEvalProblems(b, **objective);
  ASSERT_TRUE(held.ok());
  std::set<std::string> train;
  for (const auto& ex : data::GenerateReasoning("mixed", 4000, 1))
    train.insert(ex.conversation.turns[0].text);
  for (const auto& p : *held) {
    EXPECT_TRUE(data::IsHeldOutProblem(p.prompt.turns[0].text));
    EXPECT_EQ(train.count(p.prompt.turns[0].text), 0u) << p.prompt.turns[0].text;
    EXPECT_EQ(p.prompt.turns.back().role, data::Role::kUser);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace loom::trainer
