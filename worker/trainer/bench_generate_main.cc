// loom-bench-generate: KV-cached decoding throughput and cache memory for global MHA and global
// IHA with both cache layouts (kv_cache pseudo | heads), so the IHA cache choice (docs/sft.md) is
// a measurement. One model shape, greedy decoding of `new` tokens after a `prompt`-token prompt
// for `batch` sequences; tokens/s is relative to MHA measured in the same run. Prints Markdown.
//
// --maj K: a Maj@K-shaped reasoning eval instead (`problems` distinct prompts of `prompt` tokens,
// K samples each at temperature 0.6, decoded 16 at a time as the trainer's eval does), with
// shared prefill off and on in the same run: prefill tokens computed, wall time, their ratios,
// and whether both drew the same tokens.
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

// The Maj@K table: one row per attention variant.
struct MajShape {
  int64_t samples = 0, problems = 0, prompt = 0, fresh = 0;
};

absl::Status MajRow(Transformer& model, const std::string& name, const MajShape& shape) {
  std::vector<GenerationRequest> requests;
  for (int64_t i = 0; i < shape.problems; ++i) {
    std::vector<uint32_t> prompt(static_cast<size_t>(shape.prompt));
    for (int64_t t = 0; t < shape.prompt; ++t)
      prompt[t] = static_cast<uint32_t>((i * 37 + t) % 256);
    for (int64_t k = 0; k < shape.samples; ++k)
      requests.push_back({prompt, static_cast<uint64_t>(i * 1000 + k)});
  }
  SamplingOptions o;
  o.temperature = 0.6;
  o.max_new_tokens = shape.fresh;
  o.batch = 16;
  const auto decode = [](const std::vector<uint32_t>&) { return std::string(); };
  GenerationStats off, on;
  o.share_prefill = false;
  LOOM_ASSIGN_OR_RETURN(std::vector<Generation> a, Generate(model, requests, o, decode, &off));
  o.share_prefill = true;
  LOOM_ASSIGN_OR_RETURN(std::vector<Generation> b, Generate(model, requests, o, decode, &on));
  bool same = true;
  for (size_t i = 0; i < a.size(); ++i) same &= a[i].tokens == b[i].tokens;
  std::cout << absl::StrFormat(
      "| %s | %d | %d | %.1fx | %.2f s | %.2f s | %.2fx | %s |\n", name, off.prefill_tokens,
      on.prefill_tokens, static_cast<double>(off.prefill_tokens) / on.prefill_tokens, off.seconds,
      on.seconds, off.seconds / on.seconds, same ? "yes" : "NO");
  return absl::OkStatus();
}

void PrintHeader(int64_t d_model, int64_t heads, int64_t layers, int64_t batch,
                 const MajShape& maj) {
  if (maj.samples > 0) {
    std::cout << absl::StrFormat(
        "d_model %d, %d heads, %d layers, vocab 260; Maj@%d: %d problems x %d samples x (%d "
        "prompt + %d new tokens), temperature 0.6, batch 16; %d LibTorch threads\n\n",
        d_model, heads, layers, maj.samples, maj.problems, maj.samples, maj.prompt, maj.fresh,
        torch::get_num_threads());
    std::cout << "| attention | prefill tokens, unshared | shared | fewer | time, unshared | "
                 "shared | faster | same tokens |\n|---|---|---|---|---|---|---|---|\n";
  } else {
    std::cout << absl::StrFormat(
        "d_model %d, %d heads, %d layers, vocab 260; %d sequences x (%d prompt + %d new tokens), "
        "greedy; %d LibTorch threads\n\n",
        d_model, heads, layers, batch, maj.prompt, maj.fresh, torch::get_num_threads());
    std::cout << "| attention | KV cache at the end | vs MHA | tokens/s | vs MHA |\n"
                 "|---|---|---|---|---|\n";
  }
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(
      CliArgs args, CliArgs::Parse(argc, argv, 1,
                                   {"prompt", "new", "batch", "threads", "p", "layers", "d-model",
                                    "heads", "plugin-dir", "maj", "problems"}));
  LOOM_ASSIGN_OR_RETURN(int64_t prompt, args.GetInt("prompt", 64, 1, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t fresh, args.GetInt("new", 256, 1, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t batch, args.GetInt("batch", 8, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", 0, 0, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t p, args.GetInt("p", 2, 1, 16));
  LOOM_ASSIGN_OR_RETURN(int64_t layers, args.GetInt("layers", 4, 1, 64));
  LOOM_ASSIGN_OR_RETURN(int64_t d_model, args.GetInt("d-model", 256, 8, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t heads, args.GetInt("heads", 8, 1, 256));
  MajShape maj{0, 0, prompt, fresh};
  LOOM_ASSIGN_OR_RETURN(maj.samples, args.GetInt("maj", 0, 0, 1024));
  LOOM_ASSIGN_OR_RETURN(maj.problems, args.GetInt("problems", 4, 1, 4096));
  if (threads > 0) torch::set_num_threads(static_cast<int>(threads));
  PluginLoader loader;
  loader.LoadDirectories(args.Has("plugin-dir") ? std::vector<std::string>{args.Get("plugin-dir")}
                                                : PluginLoader::DefaultSearchPath());
  PrintHeader(d_model, heads, layers, batch, maj);
  const auto variants = DecodingVariants(p);
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
    if (maj.samples > 0) {
      LOOM_RETURN_IF_ERROR(MajRow(*model, name, maj));
      continue;
    }
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
