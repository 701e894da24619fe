// loom-bench-serve: the serving engine's throughput under concurrent clients. For global MHA and
// global IHA with both cache layouts: `requests` greedy requests (prompt of `prompt` tokens,
// `new` generated tokens each) served sequentially (one request at a time, the baseline measured
// in the same run) and by `c` concurrent clients with continuous batching (c = 1, 8, 32): each
// client submits its next request as soon as the previous one finishes. Prints Markdown.
//
// --n K: a Maj@K-shaped evaluation instead: `requests` prompts, each one request with n = K
// sampled choices (temperature 0.6, seeds seed + k) from `clients` concurrent clients, with
// shared prefill off and on in the same run: prefill tokens computed, wall time, time to first
// token, and whether both sampled the same tokens.
//
// --choices K: an lm-eval-shaped multiple-choice workload instead: `requests` questions, each a
// context of `prompt` tokens followed by K answers of 2..K+1 tokens, every answer its own
// request as lm-evaluation-harness sends loglikelihood requests (echo with logprobs, one
// greedy token), from c = 1, 8 and 32 concurrent clients, with the prefix cache off and on in
// the same run: prompt tokens scored per second, mean time to first token, and the largest
// difference between the two runs' prompt log-probabilities.
//
// --cache-cost: the prefix cache's cost where it cannot help: the generation workload above with
// prompts that share nothing (random tokens per request), from c = 1, 8 and 32 clients, with the
// cache off and on (1024 MiB) in the same run: generated tokens per second and their ratio
// (medians of --repeat runs, default 3).
#include <google/protobuf/util/json_util.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/cli_args.h"
#include "base/status_macros.h"
#include "loom/spec.h"
#include "serve/engine.h"
#include "worker/trainer/bench_main.h"

namespace loom::serve {
namespace {

struct BenchShape {
  int64_t prompt, fresh, requests;
};

// Request i: its prompt one repeated token, or (unrelated) random tokens no other prompt starts
// with.
std::shared_ptr<Sequence> Request(const BenchShape& shape, int64_t i, bool unrelated) {
  SequenceParams p;
  p.prompt.assign(static_cast<size_t>(shape.prompt), static_cast<uint32_t>(40 + i % 50));
  for (size_t t = 0; unrelated && t < p.prompt.size(); ++t)
    p.prompt[t] = 4 + static_cast<uint32_t>(trainer::SplitMix64((i << 20) + t) % 252);
  p.max_tokens = shape.fresh;
  return std::make_shared<Sequence>(p);
}

// Generated tokens per second with `clients` clients over one engine of `max_batch` rows.
// `cache_bytes` > 0: with a prefix cache that big, and prompts that share nothing.
double TokensPerSecond(const std::shared_ptr<trainer::Transformer>& model, const BenchShape& shape,
                       int clients, int max_batch, int64_t cache_bytes = -1) {
  EngineOptions options{max_batch, 4096};
  options.prefix_cache_bytes = std::max<int64_t>(cache_bytes, 0);
  const bool unrelated = cache_bytes >= 0;
  Engine engine(
      model, [](const std::vector<uint32_t>&) { return std::string(); }, options, nullptr);
  std::atomic<int64_t> next{0}, generated{0};
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      for (int64_t i = next++; i < shape.requests; i = next++) {
        auto s = Request(shape, i, unrelated);
        if (!engine.Submit({s}).ok()) return;
        bool done = false;
        std::vector<TokenOutput> out;
        while (!done) out = s->Wait(SIZE_MAX, std::chrono::milliseconds(100), &done);
        generated += static_cast<int64_t>(out.size());
      }
    });
  }
  for (auto& t : threads) t.join();
  return static_cast<double>(generated) /
         std::chrono::duration<double>(Clock::now() - start).count();
}

struct MajResult {
  int64_t prefill_tokens = 0;
  double seconds = 0, first_token_seconds = 0;  // the latter: mean over requests
  std::vector<std::vector<uint32_t>> tokens;    // per choice, in request order
};

// `shape.requests` requests of n choices each from `clients` clients.
MajResult MajEval(const std::shared_ptr<trainer::Transformer>& model, const BenchShape& shape,
                  int64_t n, int clients, bool share) {
  Engine engine(
      model, [](const std::vector<uint32_t>&) { return std::string(); },
      EngineOptions{32, 4096, share}, nullptr);
  MajResult result;
  result.tokens.resize(static_cast<size_t>(shape.requests * n));
  std::atomic<int64_t> next{0};
  std::vector<double> first_token(static_cast<size_t>(shape.requests));
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      for (int64_t i = next++; i < shape.requests; i = next++) {
        std::vector<std::shared_ptr<Sequence>> choices;
        for (int64_t k = 0; k < n; ++k) {
          SequenceParams p = Request(shape, i, false)->params();
          p.greedy = false;
          p.temperature = 0.6;
          p.seed = static_cast<uint64_t>(1000 * i + k);
          choices.push_back(std::make_shared<Sequence>(p));
        }
        const auto submitted = Clock::now();
        if (!engine.Submit(choices).ok()) return;
        bool done = false;
        choices[0]->Wait(0, std::chrono::seconds(600), &done);
        first_token[i] = std::chrono::duration<double>(Clock::now() - submitted).count();
        for (int64_t k = 0; k < n; ++k) {
          std::vector<TokenOutput> out;
          for (done = false; !done;)
            out = choices[k]->Wait(SIZE_MAX, std::chrono::milliseconds(100), &done);
          for (const TokenOutput& t : out) result.tokens[i * n + k].push_back(t.token);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (double s : first_token) result.first_token_seconds += s / shape.requests;
  result.prefill_tokens = engine.prefill_tokens();
  return result;
}

std::string MajRow(const std::shared_ptr<trainer::Transformer>& model, const std::string& name,
                   const BenchShape& shape, int64_t n, int clients) {
  const MajResult off = MajEval(model, shape, n, clients, false);
  const MajResult on = MajEval(model, shape, n, clients, true);
  return absl::StrFormat(
      "| %s | %d | %d | %.1fx | %.2f s | %.2f s | %.2fx | %.3f s | %.3f s | %s |", name,
      off.prefill_tokens, on.prefill_tokens,
      static_cast<double>(off.prefill_tokens) / on.prefill_tokens, off.seconds, on.seconds,
      off.seconds / on.seconds, off.first_token_seconds, on.first_token_seconds,
      off.tokens == on.tokens ? "yes" : "NO");
}

// Request i of the multiple-choice workload: question i / choices, answer i % choices.
SequenceParams ChoiceRequest(const BenchShape& shape, int64_t choices, int64_t i) {
  const int64_t q = i / choices, k = i % choices;
  SequenceParams p;
  for (int64_t j = 0; j < shape.prompt; ++j)
    p.prompt.push_back(static_cast<uint32_t>(3 + (q * 7919 + j * 31 + j * j) % 250));
  for (int64_t j = 0; j < 2 + k; ++j)
    p.prompt.push_back(static_cast<uint32_t>(3 + (q * 5 + k * 13 + j) % 250));
  p.max_tokens = 1;
  p.greedy = true;
  p.logprobs = 1;
  p.prompt_logprobs = true;
  return p;
}

struct ChoiceResult {
  double seconds = 0, first_token_seconds = 0;  // the latter: mean over requests
  int64_t prompt_tokens = 0, prefill_tokens = 0;
  std::vector<std::vector<double>> scores;  // per request: its prompt's logprobs
};

ChoiceResult ChoiceEval(const std::shared_ptr<trainer::Transformer>& model, const BenchShape& shape,
                        int64_t choices, int clients, bool cache) {
  EngineOptions options{32, 4096, true, cache ? int64_t{1024} << 20 : 0};
  Engine engine(
      model, [](const std::vector<uint32_t>&) { return std::string(); }, options, nullptr);
  const int64_t total = shape.requests * choices;
  ChoiceResult result;
  result.scores.resize(static_cast<size_t>(total));
  std::vector<double> first_token(static_cast<size_t>(total));
  std::atomic<int64_t> next{0}, prompt_tokens{0};
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      for (int64_t i = next++; i < total; i = next++) {
        auto s = std::make_shared<Sequence>(ChoiceRequest(shape, choices, i));
        const auto submitted = Clock::now();
        if (!engine.Submit({s}).ok()) return;
        bool done = false;
        s->Wait(0, std::chrono::seconds(600), &done);
        first_token[i] = std::chrono::duration<double>(Clock::now() - submitted).count();
        while (!done) s->Wait(SIZE_MAX, std::chrono::milliseconds(100), &done);
        for (const TokenOutput& t : s->prompt_scores()) result.scores[i].push_back(t.logprob);
        prompt_tokens += static_cast<int64_t>(s->params().prompt.size());
      }
    });
  }
  for (auto& t : threads) t.join();
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (double s : first_token) result.first_token_seconds += s / static_cast<double>(total);
  result.prompt_tokens = prompt_tokens;
  result.prefill_tokens = engine.prefill_tokens();
  return result;
}

std::string ChoiceRow(const std::shared_ptr<trainer::Transformer>& model, const std::string& name,
                      const BenchShape& shape, int64_t choices, int clients) {
  const ChoiceResult off = ChoiceEval(model, shape, choices, clients, false);
  const ChoiceResult on = ChoiceEval(model, shape, choices, clients, true);
  double worst = 0;
  for (size_t i = 0; i < off.scores.size(); ++i) {
    if (off.scores[i].size() != on.scores[i].size()) return "| " + name + " | scores differ |";
    for (size_t t = 1; t < off.scores[i].size(); ++t)
      worst = std::max(worst, std::abs(off.scores[i][t] - on.scores[i][t]));
  }
  const double off_rate = off.prompt_tokens / off.seconds, on_rate = on.prompt_tokens / on.seconds;
  return absl::StrFormat("| %s | %d | %d | %d | %.0f | %.0f | %.2fx | %.3f s | %.3f s | %.1e |",
                         name, clients, off.prefill_tokens, on.prefill_tokens, off_rate, on_rate,
                         on_rate / off_rate, off.first_token_seconds, on.first_token_seconds,
                         worst);
}

// Generated tokens/s on unrelated prompts without and with the prefix cache, c = 1, 8, 32: the
// medians of `repeat` runs of each, off and on alternating (so drift in the machine's speed
// falls on both), and the median of the runs' paired ratios.
std::string CacheCostRow(const std::shared_ptr<trainer::Transformer>& model,
                         const std::string& name, const BenchShape& shape, int repeat) {
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::string row = absl::StrFormat("| %s |", name);
  for (int k : {1, 8, 32}) {
    std::vector<double> off, on, ratio;
    for (int r = 0; r < repeat; ++r) {
      off.push_back(TokensPerSecond(model, shape, k, 32, 0));
      on.push_back(TokensPerSecond(model, shape, k, 32, int64_t{1024} << 20));
      ratio.push_back(on.back() / off.back());
    }
    absl::StrAppendFormat(&row, " %.0f | %.0f (%.2fx) |", median(off), median(on), median(ratio));
  }
  return row;
}

void PrintHeader(int64_t d_model, int64_t heads, int64_t layers, const BenchShape& shape, int64_t n,
                 int64_t clients, int64_t choices, bool cache_cost, int64_t repeat) {
  std::cout << absl::StrFormat("d_model %d, %d heads, %d layers, vocab 260; ", d_model, heads,
                               layers);
  if (cache_cost) {
    std::cout << absl::StrFormat(
        "%d requests x (%d prompt + %d new tokens), greedy, prompts sharing nothing, max batch "
        "32, prefix cache off vs 1024 MiB in blocks of 16; %d LibTorch threads; medians of %d "
        "runs each (off and on alternating), ratio the median of the paired ratios\n\n",
        shape.requests, shape.prompt, shape.fresh, torch::get_num_threads(), repeat);
    std::cout << "| attention | c=1, no cache | cache | c=8, no cache | cache | c=32, no cache | "
                 "cache |\n|---|---|---|---|---|---|---|\n";
    return;
  }
  if (choices > 0) {
    std::cout << absl::StrFormat(
        "multiple choice: %d questions x %d answers (2..%d tokens) after a %d-token context, each "
        "answer a request (echo, logprobs 1, max_tokens 1, greedy), max batch 32, prefix cache "
        "1024 MiB in blocks of 16; %d LibTorch threads\n\n",
        shape.requests, choices, choices + 1, shape.prompt, torch::get_num_threads());
    std::cout << "| attention | clients | prefill tokens, no cache | cache | prompt tokens/s, "
                 "no cache | cache | faster | first token, no cache | cache | max logprob "
                 "difference |\n|---|---|---|---|---|---|---|---|---|---|\n";
    return;
  }
  if (n > 0) {
    std::cout << absl::StrFormat(
        "Maj@%d: %d requests with n = %d x (%d prompt + %d new tokens), temperature 0.6, %d "
        "clients, max batch 32; %d LibTorch threads\n\n",
        n, shape.requests, n, shape.prompt, shape.fresh, clients, torch::get_num_threads());
    std::cout << "| attention | prefill tokens, unshared | shared | fewer | time, unshared | "
                 "shared | faster | first token, unshared | shared | same tokens |\n"
                 "|---|---|---|---|---|---|---|---|---|---|\n";
    return;
  }
  std::cout << absl::StrFormat(
      "%d requests x (%d prompt + %d new tokens), greedy; %d LibTorch threads\n\n", shape.requests,
      shape.prompt, shape.fresh, torch::get_num_threads());
  std::cout << "| attention | sequential tokens/s | c=1 | c=8 | c=32 |\n|---|---|---|---|---|\n";
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 1,
                                                     {"prompt", "new", "requests", "threads", "p",
                                                      "layers", "d-model", "heads", "plugin-dir",
                                                      "n", "clients", "choices", "repeat"},
                                                     {"cache-cost"}));
  BenchShape shape;
  LOOM_ASSIGN_OR_RETURN(shape.prompt, args.GetInt("prompt", 64, 1, 8192));
  LOOM_ASSIGN_OR_RETURN(shape.fresh, args.GetInt("new", 64, 1, 8192));
  LOOM_ASSIGN_OR_RETURN(shape.requests, args.GetInt("requests", 64, 1, 100000));
  LOOM_ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", 0, 0, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t p, args.GetInt("p", 2, 1, 16));
  LOOM_ASSIGN_OR_RETURN(int64_t layers, args.GetInt("layers", 4, 1, 64));
  LOOM_ASSIGN_OR_RETURN(int64_t d_model, args.GetInt("d-model", 256, 8, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t heads, args.GetInt("heads", 8, 1, 256));
  LOOM_ASSIGN_OR_RETURN(int64_t n, args.GetInt("n", 0, 0, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t clients, args.GetInt("clients", 8, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t choices, args.GetInt("choices", 0, 0, 64));
  LOOM_ASSIGN_OR_RETURN(int64_t repeat, args.GetInt("repeat", 3, 1, 100));  // --cache-cost
  if (threads > 0) torch::set_num_threads(static_cast<int>(threads));
  trainer::PluginLoader loader;
  LOOM_RETURN_IF_ERROR(trainer::LoadPluginDirectories(args.Get("plugin-dir"), loader, false));
  const bool cache_cost = args.Has("cache-cost");
  PrintHeader(d_model, heads, layers, shape, n, clients, choices, cache_cost, repeat);
  for (const auto& [name, attention] : trainer::DecodingVariants(p)) {
    v1::ModelConfig c;
    const std::string json = absl::StrFormat(
        R"({"d_model": %d, "n_layers": %d, "n_heads": %d, "vocab_size": 260, "max_seq_len": %d,
            "rope_theta": 10000, "tie_embeddings": true,
            "schedule": [{"repeat": 1, "attention": %s}]})",
        d_model, layers, heads, shape.prompt + std::max(shape.fresh, choices + 1) + 1, attention);
    LOOM_RETURN_IF_ERROR(ParseJsonMessage(json, name, &c));
    LOOM_ASSIGN_OR_RETURN(auto model, trainer::Transformer::Create(c, loader));
    if (cache_cost) {
      std::cout << CacheCostRow(model, name, shape, static_cast<int>(repeat)) << std::endl;
      continue;
    }
    if (choices > 0) {
      for (int k : {1, 8, 32}) std::cout << ChoiceRow(model, name, shape, choices, k) << std::endl;
      continue;
    }
    if (n > 0) {
      std::cout << MajRow(model, name, shape, n, static_cast<int>(clients)) << std::endl;
      continue;
    }
    const double sequential = TokensPerSecond(model, shape, 1, 1);
    std::string row = absl::StrFormat("| %s | %.0f |", name, sequential);
    for (int k : {1, 8, 32}) {
      const double rate = TokensPerSecond(model, shape, k, 32);
      absl::StrAppendFormat(&row, " %.0f (%.2fx) |", rate, rate / sequential);
    }
    std::cout << row << std::endl;
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::serve

int main(int argc, char** argv) {
  return loom::trainer::BenchmarkMain("loom-bench-serve", argv,
                                      [&] { return loom::serve::Run(argc, argv); });
}
