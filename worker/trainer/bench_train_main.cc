// loom-bench-train: training throughput and MFU on this machine, for global MHA, local
// (sliding-window) MHA, global IHA and the paper's hybrid schedule, at the tiny-cpu width and a
// wider one (--widths tiny,wide), for each thread count of --threads 1,2, with a per-op profile
// of where the step goes (--profile ROWS). MFU is measured against a matmul ceiling this
// program measures itself at the same thread count in the same run, so the numbers mean
// something on any CPU. Prints Markdown tables (docs/benchmarks.md records them).
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench_main.h"
#include "loom/cli_args.h"
#include "loom/spec.h"
#include "loom/status_macros.h"
#include "op_profile.h"
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

// The BLAS LibTorch's matmuls run on, as the benchmark's header states it.
std::string BlasDescription() {
  if (openblas_get_corename == nullptr) return "BLAS: not OpenBLAS";
  const std::string threading = OpenBlasThreading();
  return absl::StrCat("OpenBLAS ", openblas_get_corename(), " kernels, ", threading, " build",
                      threading == "OpenMP"     ? " (LibTorch's thread pool)"
                      : threading == "pthreads" ? " (its own thread pool)"
                                                : "");
}

std::string CpuName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

// A model width the benchmark runs: the tiny-cpu preset's, and a wider one where the matmuls,
// not the per-op overhead, dominate.
struct Width {
  std::string name;
  int64_t d_model, heads, seq_len;
};

struct Variant {
  std::string name, schedule_json;
};

std::vector<Variant> Schedules(int64_t p, int64_t seq_len) {
  const std::string iha_opts = absl::StrCat(R"({"p": )", p, "}");
  const int64_t window = std::max<int64_t>(1, seq_len / (2 * p * p));
  return {
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
}

// CPU seconds this process has used, in user and in system (kernel) mode.
std::pair<double, double> CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * t.tv_usec; };
  return {s(u.ru_utime), s(u.ru_stime)};
}

struct Measured {
  double step_s = 0, flops_per_token = 0;
  double sys_per_user = 0;  // system / user CPU time over the whole run (allocation churn)
  std::vector<OpProfile::Row> profile;  // with --profile only
};

absl::StatusOr<Measured> RunSchedule(const Width& w, const Variant& v, int64_t layers,
                                     int64_t batch, int64_t warmup, int64_t steps,
                                     PluginLoader& loader, bool profile,
                                     const std::string& precision = "fp32") {
  const std::string json = absl::StrCat(
      R"({"preset": "tiny-cpu", "precision": ")", precision, R"(", "steps": )", warmup + steps,
      R"(, "micro_batch": )", batch, R"(, "seq_len": )", w.seq_len,
      R"(, "eval": {"batches": 1}, "model": {"n_layers": )", layers, R"(, "d_model": )", w.d_model,
      R"(, "n_heads": )", w.heads, R"(, "ffn_hidden": )", 4 * w.d_model, R"(, "max_seq_len": )",
      w.seq_len, ", ", v.schedule_json, "}}");
  v1::JobSpec spec;
  LOOM_RETURN_IF_ERROR(ParseJsonMessage(json, v.name, &spec));
  LOOM_ASSIGN_OR_RETURN(v1::JobSpec resolved, ResolveJobSpec(spec));
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(resolved, loader, {}));
  std::unique_ptr<OpProfile> recorder;
  if (profile) recorder = std::make_unique<OpProfile>();
  const auto [user0, sys0] = CpuSeconds();
  LOOM_ASSIGN_OR_RETURN(TrainSummary summary, trainer->Run());
  const auto [user1, sys1] = CpuSeconds();
  Measured m;
  m.sys_per_user = (sys1 - sys0) / std::max(1e-9, user1 - user0);
  for (size_t i = static_cast<size_t>(warmup); i < summary.steps.size(); ++i)
    m.step_s += summary.steps[i].seconds;
  m.step_s /= static_cast<double>(steps);
  m.flops_per_token = trainer->model().ForwardFlopsPerToken(w.seq_len);
  if (recorder) m.profile = recorder->Rows();
  return m;
}

// Autograd nodes of custom Functions are named torch::autograd::CppNode<ns::Function>: shown
// as "Function (backward)".
std::string ShortOpName(const std::string& name) {
  const size_t node = name.find("CppNode<");
  if (node == std::string::npos) return name;
  std::string inner = name.substr(node + 8);
  if (!inner.empty() && inner.back() == '>') inner.pop_back();
  const size_t colon = inner.rfind("::");
  return (colon == std::string::npos ? inner : inner.substr(colon + 2)) + " (backward)";
}

// The profile's largest rows as a share of the profiled steps' time (warm-up included).
void PrintProfile(const Measured& m, double profiled_s, int64_t rows) {
  double recorded = 0;
  for (const OpProfile::Row& r : m.profile) recorded += r.self_s;
  std::cout << "| op (self time) | share | calls |\n| --- | ---: | ---: |\n";
  for (int64_t i = 0; i < rows && i < static_cast<int64_t>(m.profile.size()); ++i) {
    const OpProfile::Row& r = m.profile[i];
    std::cout << absl::StrFormat("| %s | %.1f%% | %d |\n", ShortOpName(r.name),
                                 100 * r.self_s / profiled_s, r.calls);
  }
  std::cout << absl::StrFormat("| (outside any op: data, Python-free glue, waits) | %.1f%% | |\n\n",
                               100 * std::max(0.0, profiled_s - recorded) / profiled_s);
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args,
                        CliArgs::Parse(argc, argv, 1,
                                       {"steps", "warmup", "seq-len", "batch", "threads", "p",
                                        "plugin-dir", "layers", "widths", "profile"},
                                       {"bf16"}));
  LOOM_ASSIGN_OR_RETURN(int64_t steps, args.GetInt("steps", 20, 1, 100000));
  LOOM_ASSIGN_OR_RETURN(int64_t warmup, args.GetInt("warmup", 3, 0, 1000));
  LOOM_ASSIGN_OR_RETURN(int64_t seq_len, args.GetInt("seq-len", 256, 16, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t batch, args.GetInt("batch", 8, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t p, args.GetInt("p", 2, 1, 16));
  LOOM_ASSIGN_OR_RETURN(int64_t layers, args.GetInt("layers", 5, 1, 64));
  LOOM_ASSIGN_OR_RETURN(int64_t profile_rows, args.GetInt("profile", 0, 0, 1000));
  std::vector<int64_t> thread_counts;
  for (absl::string_view t : absl::StrSplit(args.Has("threads") ? args.Get("threads") : "0", ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(t, &n) || n < 0 || n > 1024) {
      return absl::InvalidArgumentError(
          absl::StrCat("--threads: '", t, "' is not a thread count (0 = LibTorch's default)"));
    }
    thread_counts.push_back(n);
  }
  std::vector<Width> widths;
  for (absl::string_view name :
       absl::StrSplit(args.Has("widths") ? args.Get("widths") : "tiny", ',')) {
    if (name == "tiny") {
      widths.push_back({"tiny-cpu width (d_model 128, 4 heads, FFN 512)", 128, 4, seq_len});
    } else if (name == "wide") {
      widths.push_back({"wide (d_model 256, 8 heads, FFN 1024)", 256, 8, 512});
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--widths: '", name, "' is not a width (tiny, wide)"));
    }
  }
  PluginLoader loader;
  std::vector<std::string> dirs = args.Has("plugin-dir")
                                      ? std::vector<std::string>{args.Get("plugin-dir")}
                                      : PluginLoader::DefaultSearchPath();
  loader.LoadDirectories(dirs);
  const int default_threads = torch::get_num_threads();
  std::cout << absl::StrFormat("machine: %s; %s\n", CpuName(), BlasDescription());
  for (const Width& w : widths) {
    const std::vector<Variant> variants = Schedules(p, w.seq_len);
    std::vector<std::vector<double>> tps(thread_counts.size());  // [thread count][schedule]
    for (size_t ti = 0; ti < thread_counts.size(); ++ti) {
      torch::set_num_threads(thread_counts[ti] > 0 ? static_cast<int>(thread_counts[ti])
                                                   : default_threads);
      const double ceiling = MatmulCeilingFlops(1024);
      std::cout << absl::StrFormat(
          "\n### %s, %d layers, batch %d x %d tokens, %d LibTorch threads; fp32 matmul ceiling "
          "%.1f GFLOP/s (1024^3, best of 5); %d timed steps after %d warm-up\n\n",
          w.name, layers, batch, w.seq_len, torch::get_num_threads(), ceiling / 1e9, steps, warmup);
      std::cout
          << "| schedule | FLOPs/token (fwd) | step ms | tokens/s | vs mha | GFLOP/s | MFU vs "
             "matmul ceiling | sys/user CPU |\n"
          << "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
      for (const Variant& v : variants) {
        LOOM_ASSIGN_OR_RETURN(Measured m,
                              RunSchedule(w, v, layers, batch, warmup, steps, loader, false));
        const double rate = static_cast<double>(batch * w.seq_len) / m.step_s;
        tps[ti].push_back(rate);
        const double achieved = 3.0 * m.flops_per_token * rate;
        std::cout << absl::StrFormat(
            "| %s | %.3g | %.1f | %.0f | %.2f | %.2f | %.1f%% | %.1f%% |\n", v.name,
            m.flops_per_token, 1e3 * m.step_s, rate, rate / tps[ti][0], achieved / 1e9,
            100 * achieved / ceiling, 100 * m.sys_per_user);
      }
    }
    if (args.Has("bf16")) {  // mixed precision against the fp32 rows above (last thread count)
      std::cout << absl::StrFormat("\nbf16 autocast vs fp32 (%d threads, the same steps):\n\n",
                                   torch::get_num_threads())
                << "| schedule | fp32 tokens/s | bf16 tokens/s | bf16 vs fp32 |\n"
                << "| --- | ---: | ---: | ---: |\n";
      for (size_t i = 0; i < variants.size(); ++i) {
        LOOM_ASSIGN_OR_RETURN(Measured m, RunSchedule(w, variants[i], layers, batch, warmup, steps,
                                                      loader, false, "bf16"));
        const double rate = static_cast<double>(batch * w.seq_len) / m.step_s;
        std::cout << absl::StrFormat("| %s | %.0f | %.0f | %.2fx |\n", variants[i].name,
                                     tps.back()[i], rate, rate / tps.back()[i]);
      }
    }
    if (thread_counts.size() > 1) {
      std::cout << absl::StrFormat("\nTokens/s at %d threads / at %d threads: ",
                                   thread_counts.back(), thread_counts.front());
      for (size_t i = 0; i < variants.size(); ++i) {
        std::cout << absl::StrFormat("%s%s %.2fx", i ? ", " : "", variants[i].name,
                                     tps.back()[i] / tps.front()[i]);
      }
      std::cout << "\n";
    }
    if (profile_rows > 0) {
      std::cout << absl::StrFormat("\nWhere the step goes (%d threads, %d steps profiled):\n",
                                   torch::get_num_threads(), warmup + steps);
      for (const Variant& v : variants) {
        const auto start = Clock::now();
        LOOM_ASSIGN_OR_RETURN(Measured m,
                              RunSchedule(w, v, layers, batch, warmup, steps, loader, true));
        std::cout << "\n" << v.name << ":\n\n";
        PrintProfile(m, std::chrono::duration<double>(Clock::now() - start).count(), profile_rows);
      }
    }
  }
  std::cout << "\nFLOPs/token are the plugins' exact counts (masks counted); a training step is "
               "taken as 3x the forward. Attention runs each plugin's kernel: auto (the fused "
               "flash kernel on the CPU for mha, local and iha).\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::trainer

int main(int argc, char** argv) {
  return loom::trainer::BenchmarkMain("loom-bench-train", argv,
                                      [&] { return loom::trainer::Run(argc, argv); });
}
