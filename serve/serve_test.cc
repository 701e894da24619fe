// loom-serve below HTTP. The engine against references that share none of its batching: cache rows
// joining and leaving a batch equal each row decoded alone (every attention plugin, float64,
// 1e-10); 32 concurrent greedy requests equal the same requests served one at a time; prompt
// log-probabilities equal a full uncached forward; shared prefill of equal prompts (a request's
// n choices) equals one prefill per sequence (1e-12), also through the HTTP API; the prefix cache
// changes no output (every plugin, 1e-12), evicts under a small budget and spares entries in
// use; stops, limits, cancellation, a full queue.
// The server's routes are exactly those api/serve-openapi.yaml documents.
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "serve/engine.h"
#include "serve/server.h"
#include "worker/trainer/checkpoint_model.h"

namespace loom::serve {
namespace {

using trainer::DecodeState;
using trainer::ModelInputs;
using trainer::Transformer;

// Every plugin once, windows included, both IHA cache layouts.
const char kEveryPlugin[] = R"({
  "d_model": 32, "n_layers": 8, "n_heads": 4, "vocab_size": 260, "max_seq_len": 64,
  "rope_theta": 10000, "tie_embeddings": true,
  "schedule": [
    {"repeat": 1, "attention": {"plugin": "mha"}},
    {"repeat": 1, "attention": {"plugin": "local", "window": 3}},
    {"repeat": 1, "attention": {"plugin": "talking_heads"}},
    {"repeat": 1, "attention": {"plugin": "diff"}},
    {"repeat": 1, "attention": {"plugin": "simplicial", "options": {"window1": 6, "window2": 4, "rope": "rotate"}}},
    {"repeat": 1, "attention": {"plugin": "iha", "options": {"p": "2", "init": "random"}}},
    {"repeat": 1, "attention": {"plugin": "iha", "window": 2, "options": {"p": "2", "mask": "block", "kv_cache": "heads", "init": "random"}}},
    {"repeat": 1, "attention": {"plugin": "iha", "window": 4, "options": {"p": "3", "init": "random"}}}]
})";

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    trainer::LoadReport r = loader_.LoadDirectories({std::getenv("LOOM_PLUGIN_PATH")});
    ASSERT_TRUE(r.failures.empty());
    v1::ModelConfig c;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(kEveryPlugin, &c).ok());
    torch::manual_seed(11);
    auto model = Transformer::Create(c, loader_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *model;
    model_->to(torch::kFloat64);
  }

  // Logits [1, V] of feeding `tokens` one at a time after `prompt`, one row alone, no segments.
  std::vector<torch::Tensor> Alone(const std::vector<int64_t>& prompt,
                                   const std::vector<int64_t>& tokens) {
    torch::NoGradGuard no_grad;
    DecodeState state = model_->NewDecodeState();
    const int64_t n = static_cast<int64_t>(prompt.size());
    std::vector<torch::Tensor> out = {
        model_
            ->ForwardCached(ModelInputs{torch::tensor(prompt).view({1, n}), {}, {}, {}, {}}, state)
            .select(1, n - 1)};
    for (int64_t t : tokens) {
      out.push_back(
          model_->ForwardCached(ModelInputs{torch::tensor({t}).view({1, 1}), {}, {}, {}, {}}, state)
              .select(1, 0));
    }
    return out;
  }

  trainer::PluginLoader loader_;
  std::shared_ptr<Transformer> model_;
};

// Prefill of one prompt with segments (what the engine does), last logits [1, V].
torch::Tensor Prefill(Transformer& m, DecodeState& s, const std::vector<int64_t>& prompt) {
  const int64_t n = static_cast<int64_t>(prompt.size());
  ModelInputs in{torch::tensor(prompt).view({1, n}),
                 torch::arange(n).view({1, n}),
                 {},
                 {},
                 torch::ones({1, n}, torch::kInt64)};
  return m.ForwardCached(in, s).select(1, n - 1);
}

// One decode step of every row: token and position per row.
torch::Tensor Step(Transformer& m, DecodeState& s, const std::vector<int64_t>& tokens,
                   const std::vector<int64_t>& positions) {
  const int64_t b = static_cast<int64_t>(tokens.size());
  ModelInputs in{torch::tensor(tokens).view({b, 1}),
                 torch::tensor(positions).view({b, 1}),
                 {},
                 {},
                 torch::ones({b, 1}, torch::kInt64)};
  return m.ForwardCached(in, s).select(1, 0);
}

TEST_F(EngineTest, RowsJoiningAndLeavingEqualEachRowAlone) {
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> a = {5, 9, 200, 17, 3, 3, 8}, b = {42, 7, 1},
                             c = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  const std::vector<int64_t> feed = {30, 31, 32, 33, 34, 35, 36, 37};
  const auto ra = Alone(a, feed), rb = Alone(b, feed), rc = Alone(c, feed);
  auto close = [](const torch::Tensor& x, const torch::Tensor& y) {
    return (x - y).abs().max().item<double>() < 1e-10;
  };
  DecodeState s = model_->NewDecodeState();
  ASSERT_TRUE(close(Prefill(*model_, s, a), ra[0][0]));
  torch::Tensor l = Step(*model_, s, {feed[0]}, {7});
  ASSERT_TRUE(close(l[0], ra[1][0]));
  // b joins a batch that holds 8 tokens per row: its 3 are left-padded.
  DecodeState sb = model_->NewDecodeState();
  ASSERT_TRUE(close(Prefill(*model_, sb, b), rb[0][0]));
  s.AppendRows(sb);
  l = Step(*model_, s, {feed[1], feed[0]}, {8, 3});
  EXPECT_TRUE(close(l[0], ra[2][0])) << "row a after b joined";
  EXPECT_TRUE(close(l[1], rb[1][0])) << "row b after joining";
  // c (13 tokens) is longer than the batch (10): the batch's rows are padded instead.
  DecodeState sc = model_->NewDecodeState();
  Prefill(*model_, sc, c);
  s.AppendRows(sc);
  l = Step(*model_, s, {feed[2], feed[1], feed[0]}, {9, 4, 13});
  EXPECT_TRUE(close(l[0], ra[3][0]));
  EXPECT_TRUE(close(l[1], rb[2][0]));
  EXPECT_TRUE(close(l[2], rc[1][0]));
  // c leaves, then a: b's leading padding is dropped with them.
  const int64_t before = s.tokens();
  s.KeepRows(torch::tensor({0, 1}));
  l = Step(*model_, s, {feed[3], feed[2]}, {10, 5});
  EXPECT_TRUE(close(l[0], ra[4][0]));
  EXPECT_TRUE(close(l[1], rb[3][0]));
  s.KeepRows(torch::tensor({1}));
  EXPECT_LT(s.tokens(), before) << "padding no row needs is dropped";
  EXPECT_EQ(s.tokens(), 6);  // b's 3 prompt tokens and the 3 fed since
  l = Step(*model_, s, {feed[3]}, {6});
  EXPECT_TRUE(close(l[0], rb[4][0]));
  // Every row left: the state is empty and takes a new row as a fresh one.
  s.KeepRows(torch::empty({0}, torch::kInt64));
  EXPECT_EQ(s.tokens(), 0);
  EXPECT_EQ(s.bytes(), 0);
}

std::shared_ptr<Sequence> Greedy(std::vector<uint32_t> prompt, int64_t max_tokens) {
  SequenceParams p;
  p.prompt = std::move(prompt);
  p.max_tokens = max_tokens;
  return std::make_shared<Sequence>(p);
}

std::vector<uint32_t> Tokens(const Sequence& s) {
  bool done = false;
  std::vector<uint32_t> out;
  for (const TokenOutput& t : s.Wait(0, std::chrono::milliseconds(0), &done))
    out.push_back(t.token);
  return out;
}

void WaitDone(const Sequence& s) {
  for (bool done = false; !done;) s.Wait(SIZE_MAX, std::chrono::milliseconds(100), &done);
}

std::string Bytes(const std::vector<uint32_t>& ids) { return std::string(ids.begin(), ids.end()); }

TEST_F(EngineTest, ConcurrentGreedyRequestsEqualSequentialOnes) {
  std::vector<std::vector<uint32_t>> prompts;
  std::mt19937 rng(5);
  for (int i = 0; i < 32; ++i) {
    std::vector<uint32_t> p(1 + rng() % 20);
    for (auto& t : p) t = rng() % 256;
    prompts.push_back(p);
  }
  std::vector<std::vector<uint32_t>> alone;
  {
    Engine sequential(model_, Bytes, EngineOptions{1, 64}, nullptr);
    for (const auto& p : prompts) {
      auto s = Greedy(p, 12 + static_cast<int64_t>(p.size()) % 7);
      ASSERT_TRUE(sequential.Submit({s}).ok());
      WaitDone(*s);
      alone.push_back(Tokens(*s));
    }
  }
  metrics::Registry registry("serve");
  Engine batched(model_, Bytes, EngineOptions{32, 64}, &registry);
  std::vector<std::shared_ptr<Sequence>> all;
  std::vector<std::thread> clients;
  std::mutex mu;
  for (size_t i = 0; i < prompts.size(); ++i) {
    clients.emplace_back([&, i] {  // staggered, so rows join a batch that is already decoding
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * (i % 8)));
      auto s = Greedy(prompts[i], 12 + static_cast<int64_t>(prompts[i].size()) % 7);
      EXPECT_TRUE(batched.Submit({s}).ok());
      WaitDone(*s);
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_EQ(Tokens(*s), alone[i]) << "request " << i;
      EXPECT_EQ(s->finish_reason(), "length");
      all.push_back(s);
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(all.size(), 32u);
  const std::string text = registry.Render();
  EXPECT_NE(text.find("loom_serve_generated_tokens_total"), std::string::npos);
  EXPECT_NE(text.find("loom_serve_batch_size"), std::string::npos);
}

TEST_F(EngineTest, PromptLogprobsEqualAFullForward) {
  Engine engine(model_, Bytes, EngineOptions{}, nullptr);
  const std::vector<uint32_t> prompt = {10, 20, 30, 40, 50, 60, 70, 80, 90};
  SequenceParams p;
  p.prompt = prompt;
  p.max_tokens = 1;
  p.logprobs = 1;
  p.prompt_logprobs = true;
  auto s = std::make_shared<Sequence>(p);
  auto other = Greedy({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, 5);  // padding
  ASSERT_TRUE(engine.Submit({other, s}).ok());
  WaitDone(*s);
  auto full = trainer::ScoreTokens(*model_, prompt);
  ASSERT_TRUE(full.ok());
  const auto scores = s->prompt_scores();
  ASSERT_EQ(scores.size(), prompt.size());
  EXPECT_TRUE(std::isnan(scores[0].logprob));
  for (size_t i = 1; i < prompt.size(); ++i) {
    EXPECT_NEAR(scores[i].logprob, (*full)[i], 1e-10) << i;
    ASSERT_EQ(scores[i].top.size(), 1u);
    EXPECT_GE(scores[i].top[0].logprob, scores[i].logprob);
  }
  bool done = false;
  const auto generated = s->Wait(0, std::chrono::milliseconds(0), &done);
  ASSERT_EQ(generated.size(), 1u);
  // Greedy: the generated token is the top alternative, with the identical logprob.
  EXPECT_EQ(generated[0].top[0].token, generated[0].token);
  EXPECT_EQ(generated[0].top[0].logprob, generated[0].logprob);
  auto with_next = prompt;
  with_next.push_back(generated[0].token);
  auto full_next = trainer::ScoreTokens(*model_, with_next);
  EXPECT_NEAR(generated[0].logprob, full_next->back(), 1e-10);
}

// The value of an unlabelled counter in a registry's rendering (0 when it has no series).
double CounterValue(const metrics::Registry& registry, const std::string& name) {
  std::istringstream lines(registry.Render());
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name, 0) == 0 && (line[name.size()] == ' ' || line[name.size()] == '{'))
      return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return 0;
}

// Shared prefill: sequences admitted together with equal prompts are prefilled once and fork
// the cache; every output (sampled tokens, their logprobs, prompt scores) equals prefilling each
// sequence itself (float64, every plugin, windows shorter than the prompts).
TEST_F(EngineTest, SharedPrefillEqualsOnePrefillPerSequence) {
  auto make = [] {
    std::vector<std::shared_ptr<Sequence>> out;
    const std::vector<uint32_t> a = {5, 9, 200, 17, 3, 3, 8, 44, 2}, b = {42, 7, 1, 90};
    for (uint64_t k = 0; k < 5; ++k) {
      SequenceParams p;
      p.prompt = k < 3 ? a : b;
      p.greedy = false;
      p.temperature = 1.0;
      p.top_p = 0.95;
      p.max_tokens = k == 1 ? 0 : 10;  // a choice that only scores its prompt leaves at once
      p.seed = 40 + k;
      p.logprobs = 2;
      p.prompt_logprobs = k == 1 || k == 4;
      out.push_back(std::make_shared<Sequence>(p));
    }
    return out;
  };
  metrics::Registry on_metrics("serve"), off_metrics("serve");
  Engine on(model_, Bytes, EngineOptions{32, 64, true}, &on_metrics);
  Engine off(model_, Bytes, EngineOptions{32, 64, false}, &off_metrics);
  const auto shared = make(), separate = make();
  ASSERT_TRUE(on.Submit(shared).ok());
  ASSERT_TRUE(off.Submit(separate).ok());
  for (size_t i = 0; i < shared.size(); ++i) {
    WaitDone(*shared[i]);
    WaitDone(*separate[i]);
    EXPECT_EQ(Tokens(*shared[i]), Tokens(*separate[i])) << i;
    EXPECT_EQ(shared[i]->finish_reason(), separate[i]->finish_reason()) << i;
    bool done = false;
    const auto x = shared[i]->Wait(0, std::chrono::milliseconds(0), &done);
    const auto y = separate[i]->Wait(0, std::chrono::milliseconds(0), &done);
    for (size_t t = 0; t < std::min(x.size(), y.size()); ++t)
      EXPECT_NEAR(x[t].logprob, y[t].logprob, 1e-12) << i << " token " << t;
    const auto px = shared[i]->prompt_scores(), py = separate[i]->prompt_scores();
    ASSERT_EQ(px.size(), py.size());
    for (size_t t = 1; t < px.size(); ++t) EXPECT_NEAR(px[t].logprob, py[t].logprob, 1e-12);
  }
  EXPECT_EQ(Tokens(*shared[0]).size(), 10u);
  EXPECT_NE(Tokens(*shared[0]), Tokens(*shared[2])) << "each choice samples its own stream";
  // Two distinct prompts, padded to 9 tokens: 2 rows instead of 5.
  EXPECT_EQ(CounterValue(on_metrics, "loom_serve_prefill_tokens_total"), 2 * 9);
  EXPECT_EQ(CounterValue(off_metrics, "loom_serve_prefill_tokens_total"), 5 * 9);
  EXPECT_EQ(CounterValue(on_metrics, "loom_serve_prompt_tokens_total"), 3 * 9 + 2 * 4);
}

// Through the HTTP API: a completion with n = 4 and a seed equals four requests with n = 1 and
// the seeds seed + k, served without shared prefill.
TEST_F(EngineTest, CompletionWithNEqualsSeparateRequests) {
  auto server = [&](bool share) {
    trainer::CheckpointModel m;
    m.model = model_;
    m.tokenizer = data::MakeByteTokenizer();
    ServeOptions o;
    o.engine.share_prefill = share;
    return std::make_unique<Server>(std::move(m), o);
  };
  auto shared = server(true), separate = server(false);
  net::HttpServer shared_http{net::HttpServerOptions{}}, separate_http{net::HttpServerOptions{}};
  shared->AddRoutes(shared_http);
  separate->AddRoutes(separate_http);
  auto complete = [](net::HttpServer& http, int n, int seed) {
    const std::string body = absl::StrCat(
        R"({"prompt": [72, 101, 108, 108, 111, 44, 32, 119], "max_tokens": 8, "temperature": 1,)",
        R"( "logprobs": 1, "n": )", n, R"(, "seed": )", seed, "}");
    net::HttpResponse res = http.Answer("POST", "/v1/completions", {}, body);
    EXPECT_EQ(res.status, 200) << res.body;
    return nlohmann::json::parse(res.body)["choices"];
  };
  const nlohmann::json together = complete(shared_http, 4, 7);
  ASSERT_EQ(together.size(), 4u);
  for (int k = 0; k < 4; ++k) {
    const nlohmann::json alone = complete(separate_http, 1, 7 + k)[0];
    EXPECT_EQ(together[k]["text"], alone["text"]) << k;
    EXPECT_EQ(together[k]["logprobs"]["tokens"], alone["logprobs"]["tokens"]) << k;
    const auto& x = together[k]["logprobs"]["token_logprobs"];
    const auto& y = alone["logprobs"]["token_logprobs"];
    ASSERT_EQ(x.size(), y.size());
    for (size_t t = 0; t < x.size(); ++t)
      EXPECT_NEAR(x[t].get<double>(), y[t].get<double>(), 1e-12) << k;
  }
  EXPECT_NE(together[0]["text"], together[1]["text"]);
  EXPECT_EQ(CounterValue(shared->registry(), "loom_serve_prefill_tokens_total"), 8);
  EXPECT_EQ(CounterValue(separate->registry(), "loom_serve_prefill_tokens_total"), 4 * 8);
}

// Prefix caching. `Batches` submits each batch of sequences at once (one admission) and waits
// for it; `Same` checks two runs produced the same tokens, finish reasons, token logprobs and
// prompt scores (with their top alternatives), float64 within 1e-12.
std::vector<std::shared_ptr<Sequence>> Batches(Engine& engine,
                                               const std::vector<std::vector<SequenceParams>>& in,
                                               const std::function<void()>& after_each = {}) {
  std::vector<std::shared_ptr<Sequence>> all;
  for (const auto& batch : in) {
    std::vector<std::shared_ptr<Sequence>> seqs;
    for (const SequenceParams& p : batch) seqs.push_back(std::make_shared<Sequence>(p));
    EXPECT_TRUE(engine.Submit(seqs).ok());
    for (const auto& s : seqs) WaitDone(*s);
    all.insert(all.end(), seqs.begin(), seqs.end());
    if (after_each) after_each();
  }
  return all;
}

void ExpectSame(const std::vector<std::shared_ptr<Sequence>>& x,
                const std::vector<std::shared_ptr<Sequence>>& y) {
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(Tokens(*x[i]), Tokens(*y[i])) << i;
    EXPECT_EQ(x[i]->finish_reason(), y[i]->finish_reason()) << i;
    bool done = false;
    const auto a = x[i]->Wait(0, std::chrono::milliseconds(0), &done);
    const auto b = y[i]->Wait(0, std::chrono::milliseconds(0), &done);
    for (size_t t = 0; t < std::min(a.size(), b.size()); ++t)
      EXPECT_NEAR(a[t].logprob, b[t].logprob, 1e-12) << i << " token " << t;
    const auto pa = x[i]->prompt_scores(), pb = y[i]->prompt_scores();
    ASSERT_EQ(pa.size(), pb.size()) << i;
    for (size_t t = 1; t < pa.size(); ++t) {
      EXPECT_EQ(pa[t].token, pb[t].token) << i;
      EXPECT_NEAR(pa[t].logprob, pb[t].logprob, 1e-12) << i << " prompt token " << t;
      ASSERT_EQ(pa[t].top.size(), pb[t].top.size()) << i;
      for (size_t k = 0; k < pa[t].top.size(); ++k) {
        EXPECT_EQ(pa[t].top[k].token, pb[t].top[k].token) << i;
        EXPECT_NEAR(pa[t].top[k].logprob, pb[t].top[k].logprob, 1e-12) << i;
      }
    }
  }
}

// A long shared context with different endings, as lm-eval's multiple-choice requests send.
std::vector<uint32_t> Context(uint32_t seed, size_t length) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < length; ++i)
    out.push_back(static_cast<uint32_t>((seed * 131 + 17 * i * i + 3 * i) % 256));
  return out;
}

SequenceParams Ask(std::vector<uint32_t> prompt, const std::vector<uint32_t>& ending, int kind) {
  SequenceParams p;
  prompt.insert(prompt.end(), ending.begin(), ending.end());
  p.prompt = std::move(prompt);
  p.max_tokens = kind == 0 ? 1 : 6;
  p.greedy = kind != 2;
  p.temperature = 0.8;
  p.seed = 7 + static_cast<uint64_t>(ending.size());
  p.logprobs = kind == 1 ? -1 : 2;
  p.prompt_logprobs = kind == 0;  // lm-eval's loglikelihood: echo, logprobs, one token
  return p;
}

std::vector<std::vector<SequenceParams>> SharedContextWorkload() {
  const auto c = Context(1, 29), d = Context(2, 26);
  return {
      {Ask(c, {10, 11}, 0)},      // miss: snapshots
      {Ask(c, {12, 13, 14}, 0)},  // hit
      {Ask(c, {15}, 2), Ask(c, {16, 17, 18, 19, 20, 21}, 0), Ask(c, {10, 11}, 1)},
      {Ask(d, {1, 2, 3}, 0), Ask(d, {4}, 0), Ask(d, {5, 6, 7, 8, 9}, 2)},  // branch together
      {Ask(c, {10, 11}, 0), Ask(d, {4}, 1)},                               // whole prompts again
      {Ask({5, 9}, {}, 0), Ask(Context(3, 9), {}, 2)},                     // shorter than blocks
  };
}

// Outputs with the prefix cache equal those without, for every plugin (windows shorter than the
// cached prefixes, both IHA cache layouts), and the cache is used.
TEST_F(EngineTest, PrefixCacheEqualsNoCache) {
  metrics::Registry on_metrics("serve");
  Engine on(model_, Bytes, EngineOptions{32, 64, true, 64 << 20, 4}, &on_metrics);
  Engine off(model_, Bytes, EngineOptions{32, 64, true}, nullptr);
  ASSERT_NE(on.prefix_cache(), nullptr);
  EXPECT_EQ(off.prefix_cache(), nullptr);
  ExpectSame(Batches(on, SharedContextWorkload()), Batches(off, SharedContextWorkload()));
  EXPECT_GT(on.prefix_hit_tokens(), 150);
  EXPECT_LT(on.prefill_tokens(), off.prefill_tokens() / 2);
  EXPECT_EQ(on.prefix_hit_tokens() + on.prefix_miss_tokens(),
            CounterValue(on_metrics, "loom_serve_prompt_tokens_total"));
  EXPECT_EQ(CounterValue(on_metrics, "loom_serve_prefix_cache_hit_tokens_total"),
            on.prefix_hit_tokens());
  EXPECT_GT(on.prefix_cache()->entries(), 0);
  EXPECT_GT(CounterValue(on_metrics, "loom_serve_prefix_cache_bytes"), 0);
}

// Under a budget of about two entries, older prefixes are evicted, the cache stays under its
// budget, and outputs still equal the uncached ones.
TEST_F(EngineTest, PrefixCacheEvictsUnderASmallBudget) {
  std::vector<std::vector<SequenceParams>> work;
  for (uint32_t c = 0; c < 6; ++c) {
    for (uint32_t k = 0; k < 2; ++k) work.push_back({Ask(Context(10 + c, 25), {k + 1}, 0)});
  }
  int64_t one = 0;
  {
    Engine probe(model_, Bytes, EngineOptions{32, 64, true, 64 << 20, 4}, nullptr);
    Batches(probe, {work[0]});
    one = probe.prefix_cache()->bytes();
    ASSERT_GT(one, 0);
  }
  metrics::Registry metrics("serve");
  Engine on(model_, Bytes, EngineOptions{32, 64, true, one * 5 / 2, 4}, &metrics);
  Engine off(model_, Bytes, EngineOptions{32, 64, true}, nullptr);
  const PrefixCache& cache = *on.prefix_cache();
  ExpectSame(Batches(on, work, [&] { EXPECT_LE(cache.bytes(), cache.budget()); }),
             Batches(off, work));
  EXPECT_GT(cache.evictions(), 0);
  EXPECT_LE(cache.entries(), 2);
  EXPECT_GT(on.prefix_hit_tokens(), 0);
  EXPECT_EQ(CounterValue(metrics, "loom_serve_prefix_cache_evictions_total"), cache.evictions());
}

// The cache alone: ids are verified on a hit, the deepest prefix wins, least recently used
// entries go first, an entry in use is never evicted, and nothing exceeds the budget.
TEST(PrefixCacheTest, LruEvictionSparesEntriesInUse) {
  PrefixCache cache(250, 2);
  auto entry = [](std::vector<uint32_t> tokens) {
    auto e = std::make_shared<PrefixEntry>();
    e->tokens = std::move(tokens);
    e->bytes = 100;
    return e;
  };
  const std::vector<uint32_t> a = {1, 2, 3, 4, 9}, b = {5, 6, 7}, c = {8, 8, 8};
  const auto ka = cache.Keys(a, 2), kb = cache.Keys(b, 1), kc = cache.Keys(c, 1);
  ASSERT_TRUE(cache.Insert(ka[0], entry({1, 2})));
  ASSERT_TRUE(cache.Insert(ka[1], entry({1, 2, 3, 4})));
  EXPECT_EQ(cache.Lookup(a, ka, -1)->tokens.size(), 4u) << "the deepest prefix";
  EXPECT_EQ(cache.Lookup({1, 2, 3, 5}, ka, -1)->tokens.size(), 2u) << "ids are verified";
  EXPECT_EQ(cache.Lookup(a, ka, 0), nullptr) << "no scores held";
  auto held = cache.Lookup({1, 2, 0}, cache.Keys({1, 2, 0}, 1), -1);  // in use from here
  ASSERT_NE(held, nullptr);
  EXPECT_EQ(cache.Lookup(a, ka, -1)->tokens.size(), 4u);  // {1, 2} is now least recent
  ASSERT_TRUE(cache.Insert(kb[0], entry({5, 6})));
  EXPECT_EQ(cache.evictions(), 1);
  EXPECT_NE(cache.Lookup({1, 2}, cache.Keys({1, 2}, 1), -1), nullptr) << "in use: kept";
  EXPECT_EQ(cache.Lookup(a, ka, -1)->tokens.size(), 2u) << "{1, 2, 3, 4} was evicted";
  EXPECT_LE(cache.bytes(), cache.budget());
  auto held_b = cache.Lookup(b, kb, -1);
  EXPECT_FALSE(cache.Insert(kc[0], entry({8, 8}))) << "every entry is in use";
  EXPECT_EQ(cache.entries(), 2);
  held.reset();
  EXPECT_TRUE(cache.Insert(kc[0], entry({8, 8})));
  EXPECT_EQ(cache.Lookup({1, 2}, cache.Keys({1, 2}, 1), -1), nullptr) << "released: evicted";
  EXPECT_NE(cache.Lookup(b, kb, -1), nullptr);
  held_b.reset();
  EXPECT_EQ(cache.entries(), 2);
  EXPECT_LE(cache.bytes(), cache.budget());
  auto big = entry({8, 8});
  big->bytes = 251;
  EXPECT_FALSE(cache.Insert(kc[0], big)) << "larger than the budget";
}

TEST_F(EngineTest, StopsLimitsCancellationAndAFullQueue) {
  Engine engine(model_, Bytes, EngineOptions{2, 3}, nullptr);
  // max_tokens 0 scores the prompt only; the context bounds everything else.
  auto none = Greedy({1, 2, 3}, 0);
  auto near_end = Greedy(std::vector<uint32_t>(62, 7), 50);
  ASSERT_TRUE(engine.Submit({none, near_end}).ok());
  WaitDone(*none);
  WaitDone(*near_end);
  EXPECT_EQ(Tokens(*none).size(), 0u);
  EXPECT_EQ(Tokens(*near_end).size(), 3u) << "62 tokens + 2 fed fill the 64-token context";
  EXPECT_EQ(near_end->finish_reason(), "length");
  // A stop token ends the row without being output; a stop string cuts the text.
  auto probe = Greedy({9, 9, 9}, 6);
  ASSERT_TRUE(engine.Submit({probe}).ok());
  WaitDone(*probe);
  const std::vector<uint32_t> free_run = Tokens(*probe);
  ASSERT_EQ(free_run.size(), 6u);
  SequenceParams p;
  p.prompt = {9, 9, 9};
  p.max_tokens = 6;
  p.stop_tokens = {free_run[2]};
  auto stopped = std::make_shared<Sequence>(p);
  p.stop_tokens.clear();
  p.stop = {Bytes({free_run[1], free_run[2]})};
  auto cut = std::make_shared<Sequence>(p);
  ASSERT_TRUE(engine.Submit({stopped, cut}).ok());
  WaitDone(*stopped);
  WaitDone(*cut);
  const size_t first = std::find(free_run.begin(), free_run.end(), free_run[2]) - free_run.begin();
  EXPECT_EQ(Tokens(*stopped), std::vector<uint32_t>(free_run.begin(), free_run.begin() + first));
  EXPECT_EQ(stopped->finish_reason(), "stop");
  EXPECT_EQ(cut->finish_reason(), "stop");
  EXPECT_EQ(cut->text().find(p.stop[0]), std::string::npos);
  // Cancelled rows leave; the queue holds 3, so 4 more are refused as a whole.
  auto long_one = Greedy({4}, 60);
  ASSERT_TRUE(engine.Submit({long_one}).ok());
  long_one->Cancel();
  WaitDone(*long_one);
  EXPECT_EQ(long_one->finish_reason(), "cancelled");
  EXPECT_LT(Tokens(*long_one).size(), 60u);
  std::vector<std::shared_ptr<Sequence>> four = {Greedy({1}, 50), Greedy({1}, 50), Greedy({1}, 50),
                                                 Greedy({1}, 50)};
  EXPECT_TRUE(absl::IsResourceExhausted(engine.Submit(four)));
}

TEST_F(EngineTest, ASequenceCancelledWhileQueuedLeavesAtOnce) {
  Engine engine(model_, Bytes, EngineOptions{1, 16}, nullptr);
  // One row, eight long sequences ahead: FIFO admission alone would answer the victim only
  // after about 8 x 60 decode steps.
  std::vector<std::shared_ptr<Sequence>> ahead;
  for (int i = 0; i < 8; ++i) ahead.push_back(Greedy({static_cast<uint32_t>(i + 1)}, 60));
  ASSERT_TRUE(engine.Submit(ahead).ok());
  auto victim = Greedy({3}, 60);
  ASSERT_TRUE(engine.Submit({victim}).ok());
  victim->Cancel();
  WaitDone(*victim);
  EXPECT_EQ(victim->finish_reason(), "cancelled");
  EXPECT_TRUE(Tokens(*victim).empty());
  EXPECT_FALSE(ahead.back()->done()) << "the victim left before the queue reached it";
  EXPECT_LE(engine.queued(), 7);
  for (const auto& s : ahead) WaitDone(*s);
}

TEST_F(EngineTest, OpenApiDocumentsExactlyTheServedRoutes) {
  const char* path = std::getenv("LOOM_SERVE_OPENAPI");
  ASSERT_NE(path, nullptr);
  YAML::Node doc = YAML::LoadFile(path);
  trainer::CheckpointModel m;
  m.model = model_;
  m.tokenizer = data::MakeByteTokenizer();
  Server server(std::move(m), ServeOptions{});
  net::HttpServer http{net::HttpServerOptions{}};
  server.AddRoutes(http);
  std::map<std::string, bool> served, documented;  // "GET /v1/models" -> needs the token
  for (const auto& r : http.Routes()) served[r.method + " " + r.path] = r.auth != "none";
  for (const auto& p : doc["paths"]) {
    for (const auto& op : p.second) {
      std::string method;
      for (char ch : op.first.as<std::string>()) method += static_cast<char>(std::toupper(ch));
      const bool open = op.second["security"] && op.second["security"].size() == 0;
      documented[method + " " + p.first.as<std::string>()] = !open;
    }
  }
  EXPECT_EQ(served, documented);
  EXPECT_EQ(served.size(), 7u);
}

}  // namespace
}  // namespace loom::serve
