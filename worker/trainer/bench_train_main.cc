// loom-bench-train: training throughput and MFU of the tiny presets on this machine, for global
// MHA, local (sliding-window) MHA, global IHA and the paper's hybrid schedule. MFU is measured
// against a matmul ceiling this program measures itself in the same run, so the numbers mean
// something on any CPU. Prints a Markdown table (docs/benchmarks.md records it).
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_main.h"
#include "loom/cli_args.h"
#include "loom/spec.h"
#include "loom/status_macros.h"
#include "trainer.h"

namespace loom::trainer {
namespace {

using Clock = std::chrono::steady_clock;

// Best-of-5 fp32 GEMM rate at a size that fits the cache hierarchy poorly enough to be honest.
double MatmulCeilingFlops(int64_t n) {
  torch::Tensor a = torch::randn({n, n}), b = torch::randn({n, n});
  torch::mm(a, b);  // warm-up
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    torch::Tensor c = torch::mm(a, b);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, 2.0 * n * n * n / s);
  }
  return best;
}

std::string CpuName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 1,
                                                     {"steps", "warmup", "seq-len", "batch",
                                                      "threads", "p", "plugin-dir", "layers"}));
  LOOM_ASSIGN_OR_RETURN(int64_t steps, args.GetInt("steps", 20, 1, 100000));
  LOOM_ASSIGN_OR_RETURN(int64_t warmup, args.GetInt("warmup", 3, 0, 1000));
  LOOM_ASSIGN_OR_RETURN(int64_t seq_len, args.GetInt("seq-len", 256, 16, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t batch, args.GetInt("batch", 8, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", 0, 0, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t p, args.GetInt("p", 2, 1, 16));
  LOOM_ASSIGN_OR_RETURN(int64_t layers, args.GetInt("layers", 5, 1, 64));
  if (threads > 0) torch::set_num_threads(static_cast<int>(threads));
  PluginLoader loader;
  std::vector<std::string> dirs = args.Has("plugin-dir")
                                      ? std::vector<std::string>{args.Get("plugin-dir")}
                                      : PluginLoader::DefaultSearchPath();
  loader.LoadDirectories(dirs);

  const double ceiling = MatmulCeilingFlops(1024);
  std::cout << absl::StrFormat(
      "machine: %s, %d LibTorch threads; fp32 matmul ceiling %.1f GFLOP/s (1024^3, best of 5)\n",
      CpuName(), torch::get_num_threads(), ceiling / 1e9);
  std::cout << absl::StrFormat(
      "model: tiny-cpu width (d_model 128, 4 heads), %d layers, batch %d x %d tokens, "
      "%d timed steps after %d warm-up\n\n",
      layers, batch, seq_len, steps, warmup);
  struct Variant {
    std::string name, schedule_json;
  };
  const std::string iha_opts = absl::StrCat(R"({"p": )", p, "}");
  const int64_t window = std::max<int64_t>(1, seq_len / (2 * p * p));
  const std::vector<Variant> variants = {
      {"mha (global)", R"("schedule": [{"repeat": 1, "attention": {"plugin": "mha"}}])"},
      {absl::StrCat("local mha (W=", window, ")"),
       absl::StrCat(R"("schedule": [{"repeat": 1, "attention": {"plugin": "local", "window": )",
                    window, "}}]")},
      {absl::StrCat("iha global (P=", p, ")"),
       absl::StrCat(R"("schedule": [{"repeat": 1, "attention": {"plugin": "iha", "options": )",
                    iha_opts, "}}]")},
      {absl::StrCat("hybrid 4 local iha : 1 mha (P=", p, ", W=", window, ")"),
       absl::StrCat(R"("hybrid": {"iha_options": )", iha_opts, "}")},
  };
  std::cout << "| schedule | FLOPs/token (fwd) | step ms | tokens/s | vs mha | GFLOP/s | MFU vs "
               "matmul ceiling |\n"
            << "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  double mha_tps = 0;
  for (const Variant& v : variants) {
    const std::string json = absl::StrCat(
        R"({"preset": "tiny-cpu", "steps": )", warmup + steps, R"(, "micro_batch": )", batch,
        R"(, "seq_len": )", seq_len, R"(, "eval": {"batches": 1}, "model": {"n_layers": )", layers,
        R"(, "max_seq_len": )", seq_len, ", ", v.schedule_json, "}}");
    v1::JobSpec spec;
    LOOM_RETURN_IF_ERROR(ParseJsonMessage(json, v.name, &spec));
    LOOM_ASSIGN_OR_RETURN(v1::JobSpec resolved, ResolveJobSpec(spec));
    LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(resolved, loader, {}));
    LOOM_ASSIGN_OR_RETURN(TrainSummary summary, trainer->Run());
    double seconds = 0;
    for (size_t i = static_cast<size_t>(warmup); i < summary.steps.size(); ++i)
      seconds += summary.steps[i].seconds;
    const double step_s = seconds / static_cast<double>(steps);
    const double tps = static_cast<double>(batch * seq_len) / step_s;
    const double flops_per_token = trainer->model().ForwardFlopsPerToken(seq_len);
    const double achieved = 3.0 * flops_per_token * tps;
    if (mha_tps == 0) mha_tps = tps;
    std::cout << absl::StrFormat("| %s | %.3g | %.1f | %.0f | %.2f | %.2f | %.1f%% |\n", v.name,
                                 flops_per_token, 1e3 * step_s, tps, tps / mha_tps, achieved / 1e9,
                                 100 * achieved / ceiling);
  }
  std::cout << "\nFLOPs/token are the plugins' exact counts (masks counted); a training step is "
               "taken as 3x the "
               "forward. IHA layers run kernel: auto (the fused CPU kernel from N·P >= 512).\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::trainer

int main(int argc, char** argv) {
  return loom::trainer::BenchmarkMain("loom-bench-train", argv,
                                      [&] { return loom::trainer::Run(argc, argv); });
}
