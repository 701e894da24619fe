// loom-bench-serve: the serving engine's throughput under concurrent clients. For global MHA and
// global IHA with both cache layouts: `requests` greedy requests (prompt of `prompt` tokens,
// `new` generated tokens each) served sequentially (one request at a time, the baseline measured
// in the same run) and by `c` concurrent clients with continuous batching (c = 1, 8, 32): each
// client submits its next request as soon as the previous one finishes. Prints Markdown.
#include <google/protobuf/util/json_util.h>
#include <torch/torch.h>

#include <atomic>
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

std::shared_ptr<Sequence> Request(const BenchShape& shape, int64_t i) {
  SequenceParams p;
  p.prompt.assign(static_cast<size_t>(shape.prompt), static_cast<uint32_t>(40 + i % 50));
  p.max_tokens = shape.fresh;
  return std::make_shared<Sequence>(p);
}

// Generated tokens per second with `clients` clients over one engine of `max_batch` rows.
double TokensPerSecond(const std::shared_ptr<trainer::Transformer>& model, const BenchShape& shape,
                       int clients, int max_batch) {
  Engine engine(
      model, [](const std::vector<uint32_t>&) { return std::string(); },
      EngineOptions{max_batch, 4096}, nullptr);
  std::atomic<int64_t> next{0}, generated{0};
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&] {
      for (int64_t i = next++; i < shape.requests; i = next++) {
        auto s = Request(shape, i);
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

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 1,
                                                     {"prompt", "new", "requests", "threads", "p",
                                                      "layers", "d-model", "heads", "plugin-dir"}));
  BenchShape shape;
  LOOM_ASSIGN_OR_RETURN(shape.prompt, args.GetInt("prompt", 64, 1, 8192));
  LOOM_ASSIGN_OR_RETURN(shape.fresh, args.GetInt("new", 64, 1, 8192));
  LOOM_ASSIGN_OR_RETURN(shape.requests, args.GetInt("requests", 64, 1, 100000));
  LOOM_ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", 0, 0, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t p, args.GetInt("p", 2, 1, 16));
  LOOM_ASSIGN_OR_RETURN(int64_t layers, args.GetInt("layers", 4, 1, 64));
  LOOM_ASSIGN_OR_RETURN(int64_t d_model, args.GetInt("d-model", 256, 8, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t heads, args.GetInt("heads", 8, 1, 256));
  if (threads > 0) torch::set_num_threads(static_cast<int>(threads));
  trainer::PluginLoader loader;
  LOOM_RETURN_IF_ERROR(trainer::LoadPluginDirectories(args.Get("plugin-dir"), loader, false));
  std::cout << absl::StrFormat(
      "d_model %d, %d heads, %d layers, vocab 260; %d requests x (%d prompt + %d new tokens), "
      "greedy; %d LibTorch threads\n\n",
      d_model, heads, layers, shape.requests, shape.prompt, shape.fresh, torch::get_num_threads());
  std::cout << "| attention | sequential tokens/s | c=1 | c=8 | c=32 |\n|---|---|---|---|---|\n";
  const std::string pp = std::to_string(p);
  const std::vector<std::pair<std::string, std::string>> variants = {
      {"mha", R"({"plugin": "mha"})"},
      {"iha P=" + pp + ", kv_cache pseudo",
       R"({"plugin": "iha", "options": {"p": ")" + pp + R"(", "kv_cache": "pseudo"}})"},
      {"iha P=" + pp + ", kv_cache heads",
       R"({"plugin": "iha", "options": {"p": ")" + pp + R"(", "kv_cache": "heads"}})"}};
  for (const auto& [name, attention] : variants) {
    v1::ModelConfig c;
    const std::string json = absl::StrFormat(
        R"({"d_model": %d, "n_layers": %d, "n_heads": %d, "vocab_size": 260, "max_seq_len": %d,
            "rope_theta": 10000, "tie_embeddings": true,
            "schedule": [{"repeat": 1, "attention": %s}]})",
        d_model, layers, heads, shape.prompt + shape.fresh + 1, attention);
    LOOM_RETURN_IF_ERROR(ParseJsonMessage(json, name, &c));
    LOOM_ASSIGN_OR_RETURN(auto model, trainer::Transformer::Create(c, loader));
    const double sequential = TokensPerSecond(model, shape, 1, 1);
    std::string row = absl::StrFormat("| %s | %.0f |", name, sequential);
    for (int clients : {1, 8, 32}) {
      const double rate = TokensPerSecond(model, shape, clients, 32);
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
