// Incremental decoding (AttentionLayer::ForwardCached) for every attention plugin: feeding a
// sequence in chunks through the KV cache gives exactly what forward() gives for the whole
// sequence, also with left-padded batches (pads in segment 0) against each row alone; sliding
// windows keep the cache bounded; IHA's two cache layouts agree and differ in memory as
// documented. float64; tolerance 1e-12 absolute.
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

struct KvCacheCase {
  std::string name;
  Factory make;
};

std::vector<KvCacheCase> KvCacheCases() {
  std::vector<KvCacheCase> cases;
  cases.push_back({"mha", [] {
                     return std::make_shared<MultiHeadAttention>(TestSpec(16, 4, 4, true, 0, 100),
                                                                 "mha", false);
                   }});
  cases.push_back({"local W=3", [] {
                     return std::make_shared<MultiHeadAttention>(TestSpec(16, 4, 4, true, 3, 100),
                                                                 "local", true);
                   }});
  cases.push_back(
      {"talking_heads",
       [] { return std::make_shared<TalkingHeadsAttention>(TestSpec(16, 4, 4, true, 0, 100)); }});
  cases.push_back({"talking_heads W=4", [] {
                     return std::make_shared<TalkingHeadsAttention>(
                         TestSpec(16, 4, 4, true, 4, 100, KeptOptions({{"init", "random"}})));
                   }});
  cases.push_back(
      {"diff", [] { return std::make_shared<DiffAttention>(TestSpec(16, 4, 4, true, 0, 100)); }});
  cases.push_back({"simplicial", [] {
                     return std::make_shared<SimplicialAttention>(TestSpec(16, 4, 4, true, 0, 100));
                   }});
  cases.push_back({"simplicial W=3", [] {
                     return std::make_shared<SimplicialAttention>(TestSpec(
                         16, 4, 4, true, 0, 100,
                         KeptOptions({{"window1", "3"}, {"window2", "2"}, {"rope", "rotate"}})));
                   }});
  for (const char* cache : {"pseudo", "heads"}) {
    for (const char* mask : {"interleaved", "block"}) {
      for (int64_t window : {0, 2}) {
        for (const char* phase : {"interleaved", "token"}) {
          auto* o = KeptOptions({{"p", "2"},
                                 {"init", "random"},
                                 {"kv_cache", cache},
                                 {"mask", mask},
                                 {"rope_phase", phase}});
          cases.push_back({std::string("iha ") + cache + " " + mask +
                               " W=" + std::to_string(window) + " rope " + phase,
                           [o, window] {
                             return std::make_shared<iha::IhaAttention>(
                                 TestSpec(16, 4, 4, true, window, 100, o));
                           }});
        }
      }
    }
    auto* o =
        KeptOptions({{"p", "3"}, {"init", "random"}, {"kv_cache", cache}, {"score", "linear"}});
    cases.push_back(
        {std::string("iha linear P=3 ") + cache,
         [o] { return std::make_shared<iha::IhaAttention>(TestSpec(16, 4, 4, true, 0, 0, o)); }});
  }
  return cases;
}

torch::Tensor Arange(int64_t from, int64_t to) { return torch::arange(from, to, torch::kInt64); }

TEST(KvCache, ChunkedDecodingEqualsFullForward) {
  for (const KvCacheCase& c : KvCacheCases()) {
    torch::manual_seed(5);
    auto layer = c.make();
    layer->to(torch::kFloat64);
    torch::NoGradGuard no_grad;
    const int64_t n = 12;
    torch::Tensor x = torch::randn({2, n, 16}, torch::kFloat64);
    AttentionInputs full;
    full.positions = Arange(0, n);
    torch::Tensor expected = layer->forward(x, full);
    auto cache = layer->NewCache();
    std::vector<torch::Tensor> parts;
    int64_t at = 0;
    for (int64_t chunk : {4, 1, 1, 3, 1, 2}) {
      AttentionInputs in;
      in.positions = Arange(at, at + chunk);
      parts.push_back(layer->ForwardCached(x.narrow(1, at, chunk), in, *cache));
      at += chunk;
      EXPECT_EQ(cache->tokens(), at) << c.name;
    }
    ASSERT_EQ(at, n);
    const double diff = (torch::cat(parts, 1) - expected).abs().max().item<double>();
    EXPECT_LT(diff, 1e-12) << c.name;
  }
}

TEST(KvCache, LeftPaddedBatchEqualsEachRowAlone) {
  for (const KvCacheCase& c : KvCacheCases()) {
    torch::manual_seed(6);
    auto layer = c.make();
    layer->to(torch::kFloat64);
    torch::NoGradGuard no_grad;
    // Row 0: 3 pads then 6 real tokens; row 1: 9 real tokens; then 3 decoding steps each.
    const int64_t longest = 9, pads = 3, steps = 3;
    torch::Tensor x = torch::randn({2, longest + steps, 16}, torch::kFloat64);
    torch::Tensor positions =
        torch::stack({torch::cat({torch::zeros({pads}, torch::kInt64), Arange(0, longest - pads)}),
                      Arange(0, longest)});
    torch::Tensor segments = torch::ones({2, longest}, torch::kInt64);
    segments[0].narrow(0, 0, pads).zero_();
    auto cache = layer->NewCache();
    AttentionInputs prefill{positions, segments};
    std::vector<torch::Tensor> out = {
        layer->ForwardCached(x.narrow(1, 0, longest), prefill, *cache)};
    for (int64_t s = 0; s < steps; ++s) {
      AttentionInputs step;
      step.positions = torch::tensor({longest - pads + s, longest + s}, torch::kInt64).view({2, 1});
      step.segments = torch::ones({2, 1}, torch::kInt64);
      out.push_back(layer->ForwardCached(x.narrow(1, longest + s, 1), step, *cache));
    }
    torch::Tensor batched = torch::cat(out, 1);
    for (int64_t row = 0; row < 2; ++row) {
      const int64_t skip = row == 0 ? pads : 0, len = longest + steps - skip;
      AttentionInputs alone;
      alone.positions = Arange(0, len);
      torch::Tensor expected = layer->forward(x[row].narrow(0, skip, len).unsqueeze(0), alone);
      const double diff =
          (batched[row].narrow(0, skip, len) - expected[0]).abs().max().item<double>();
      EXPECT_LT(diff, 1e-12) << c.name << " row " << row;
    }
  }
}

TEST(KvCache, SlidingWindowsKeepTheCacheBounded) {
  for (const KvCacheCase& c : KvCacheCases()) {
    if (c.name.find("W=") == std::string::npos || c.name.find("W=0") != std::string::npos) continue;
    auto layer = c.make();
    layer->to(torch::kFloat64);
    torch::NoGradGuard no_grad;
    auto cache = layer->NewCache();
    int64_t after_8 = 0;
    for (int64_t t = 0; t < 40; ++t) {
      AttentionInputs in;
      in.positions = Arange(t, t + 1);
      layer->ForwardCached(torch::randn({1, 1, 16}, torch::kFloat64), in, *cache);
      if (t == 7) after_8 = cache->bytes();
    }
    EXPECT_GT(after_8, 0) << c.name;
    EXPECT_EQ(cache->bytes(), after_8) << c.name << ": a windowed cache must stop growing";
  }
}

TEST(KvCache, IhaPseudoCacheHoldsPTimesTheHeadsCache) {
  torch::NoGradGuard no_grad;
  int64_t bytes[2];
  int i = 0;
  for (const char* layout : {"pseudo", "heads"}) {
    auto* o = KeptOptions({{"p", "4"}, {"kv_cache", layout}});
    iha::IhaAttention layer(TestSpec(16, 4, 4, true, 0, 0, o));
    layer.to(torch::kFloat64);
    auto cache = layer.NewCache();
    AttentionInputs in;
    in.positions = Arange(0, 10);
    layer.ForwardCached(torch::randn({1, 10, 16}, torch::kFloat64), in, *cache);
    bytes[i++] = cache->bytes();
  }
  // heads: K and V of 10 tokens x 4 heads x 4 wide in float64 (no positions without RoPE).
  EXPECT_EQ(bytes[1], 2 * 10 * 4 * 4 * 8);
  EXPECT_EQ(bytes[0], 4 * bytes[1]);
}

TEST(KvCache, MisuseIsAClearError) {
  MultiHeadAttention encoder(TestSpec(16, 4, 4, false, 0, 0), "mha", false);
  auto cache = encoder.NewCache();
  AttentionInputs in;
  in.positions = Arange(0, 3);
  try {
    encoder.ForwardCached(torch::randn({1, 3, 16}), in, *cache);
    FAIL() << "an encoder layer decoded incrementally";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("causal"), std::string::npos) << e.what();
  }
  MultiHeadAttention decoder(TestSpec(16, 4, 4, true, 0, 0), "mha", false);
  auto* o = KeptOptions({{"p", "2"}});
  iha::IhaAttention iha_layer(TestSpec(16, 4, 4, true, 0, 0, o));
  auto iha_cache = iha_layer.NewCache();
  try {
    decoder.ForwardCached(torch::randn({1, 3, 16}), in, *iha_cache);
    FAIL() << "another layer's cache was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("NewCache"), std::string::npos) << e.what();
  }
  auto dcache = decoder.NewCache();
  decoder.ForwardCached(torch::randn({2, 3, 16}), in, *dcache);
  try {
    decoder.ForwardCached(torch::randn({3, 1, 16}), AttentionInputs{Arange(3, 4), {}}, *dcache);
    FAIL() << "a different batch size was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("batch"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom::attention
