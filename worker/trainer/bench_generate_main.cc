// loom-bench-generate: KV-cached decoding throughput and cache memory for global MHA and global
// IHA with both cache layouts (kv_cache pseudo | heads), so the IHA cache choice (docs/sft.md) is
// a measurement. One model shape, greedy decoding of `new` tokens after a `prompt`-token prompt
// for `batch` sequences; tokens/s is relative to MHA measured in the same run. Prints Markdown.
#include <google/protobuf/util/json_util.h>
#include <torch/torch.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/cli_args.h"
#include "base/status_macros.h"
#include "loom/spec.h"
#include "worker/trainer/bench_main.h"
#include "worker/trainer/generate.h"

namespace loom::trainer {
namespace {

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 1,
                                                     {"prompt", "new", "batch", "threads", "p",
                                                      "layers", "d-model", "heads", "plugin-dir"}));
  LOOM_ASSIGN_OR_RETURN(int64_t prompt, args.GetInt("prompt", 64, 1, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t fresh, args.GetInt("new", 256, 1, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t batch, args.GetInt("batch", 8, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", 0, 0, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t p, args.GetInt("p", 2, 1, 16));
  LOOM_ASSIGN_OR_RETURN(int64_t layers, args.GetInt("layers", 4, 1, 64));
  LOOM_ASSIGN_OR_RETURN(int64_t d_model, args.GetInt("d-model", 256, 8, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t heads, args.GetInt("heads", 8, 1, 256));
  if (threads > 0) torch::set_num_threads(static_cast<int>(threads));
  PluginLoader loader;
  loader.LoadDirectories(args.Has("plugin-dir") ? std::vector<std::string>{args.Get("plugin-dir")}
                                                : PluginLoader::DefaultSearchPath());
  std::cout << absl::StrFormat(
      "d_model %d, %d heads, %d layers, vocab 260; %d sequences x (%d prompt + %d new tokens), "
      "greedy; %d LibTorch threads\n\n",
      d_model, heads, layers, batch, prompt, fresh, torch::get_num_threads());
  std::cout << "| attention | KV cache at the end | vs MHA | tokens/s | vs MHA |\n"
               "|---|---|---|---|---|\n";
  const std::string pp = std::to_string(p);
  const std::vector<std::pair<std::string, std::string>> variants = {
      {"mha", R"({"plugin": "mha"})"},
      {"iha P=" + pp + ", kv_cache pseudo",
       R"({"plugin": "iha", "options": {"p": ")" + pp + R"(", "kv_cache": "pseudo"}})"},
      {"iha P=" + pp + ", kv_cache heads",
       R"({"plugin": "iha", "options": {"p": ")" + pp + R"(", "kv_cache": "heads"}})"}};
  double base_rate = 0, base_bytes = 0;
  for (const auto& [name, attention] : variants) {
    v1::ModelConfig c;
    const std::string json = absl::StrFormat(
        R"({"d_model": %d, "n_layers": %d, "n_heads": %d, "vocab_size": 260, "max_seq_len": %d,
            "rope_theta": 10000, "tie_embeddings": true,
            "schedule": [{"repeat": 1, "attention": %s}]})",
        d_model, layers, heads, prompt + fresh + 1, attention);
    LOOM_RETURN_IF_ERROR(ParseJsonMessage(json, name, &c));
    LOOM_ASSIGN_OR_RETURN(auto model, Transformer::Create(c, loader));
    std::vector<GenerationRequest> requests;
    for (int64_t b = 0; b < batch; ++b)
      requests.push_back({std::vector<uint32_t>(prompt, static_cast<uint32_t>(65 + b)), 1});
    SamplingOptions o;
    o.greedy = true;
    o.max_new_tokens = fresh;
    o.batch = batch;
    GenerationStats stats;
    LOOM_RETURN_IF_ERROR(
        Generate(
            *model, requests, o, [](const std::vector<uint32_t>&) { return ""; }, &stats)
            .status());
    const double rate = stats.generated_tokens / stats.seconds;
    if (base_rate == 0) {
      base_rate = rate;
      base_bytes = static_cast<double>(stats.peak_cache_bytes);
    }
    std::cout << absl::StrFormat("| %s | %.1f MiB | %.2fx | %.0f | %.2fx |\n", name,
                                 stats.peak_cache_bytes / 1048576.0,
                                 stats.peak_cache_bytes / base_bytes, rate, rate / base_rate);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::trainer

int main(int argc, char** argv) {
  return loom::trainer::BenchmarkMain("loom-bench-generate", argv,
                                      [&] { return loom::trainer::Run(argc, argv); });
}
