// loom-bench-train: training throughput and MFU on this machine, for global MHA, local
// (sliding-window) MHA, global IHA and the paper's hybrid schedule, at the tiny-cpu width and a
// wider one (--widths tiny,wide), for each thread count of --threads 1,2 (--repeats R rounds over
// the schedules, the thread counts back to back, medians reported), with a per-op profile of where
// the step goes (--profile ROWS), and two kernels against their LibTorch reference in the same
// rounds: --linear split,torch (cpu_kernels/linear_cpu.h) or --adamw fused,torch
// (cpu_kernels/adamw_cpu.h). MFU is measured against a matmul ceiling this program measures
// itself at the same thread count in the same run, so the numbers mean something on any CPU.
// Prints Markdown tables (docs/benchmarks.md records them).
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/cli_args.h"
#include "base/status_macros.h"
#include "loom/spec.h"
#include "worker/trainer/bench_main.h"
#include "worker/trainer/op_profile.h"
#include "worker/trainer/trainer.h"

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

struct Measured {
  double step_s = 0, flops_per_token = 0;
  double sys_per_user = 0;  // system / user CPU time over the timed steps (allocation churn)
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
  LOOM_ASSIGN_OR_RETURN(TrainSummary summary, trainer->Run());
  Measured m;
  double user = 0, sys = 0;
  for (size_t i = static_cast<size_t>(warmup); i < summary.steps.size(); ++i) {
    m.step_s += summary.steps[i].seconds;
    user += summary.steps[i].cpu_user_s;
    sys += summary.steps[i].cpu_sys_s;
  }
  m.sys_per_user = sys / std::max(1e-9, user);
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

// The profile's largest rows as a share of the profiled steps' time (warm-up included) and in
// milliseconds per step, which compare across thread counts.
void PrintProfile(const Measured& m, double profiled_s, int64_t steps, int64_t rows) {
  double recorded = 0;
  for (const OpProfile::Row& r : m.profile) recorded += r.self_s;
  const double per_step = 1e3 / static_cast<double>(std::max<int64_t>(1, steps));
  std::cout << "| op (self time) | share | ms/step | calls |\n| --- | ---: | ---: | ---: |\n";
  for (int64_t i = 0; i < rows && i < static_cast<int64_t>(m.profile.size()); ++i) {
    const OpProfile::Row& r = m.profile[i];
    std::cout << absl::StrFormat("| %s | %.1f%% | %.2f | %d |\n", ShortOpName(r.name),
                                 100 * r.self_s / profiled_s, r.self_s * per_step, r.calls);
  }
  const double outside = std::max(0.0, profiled_s - recorded);
  std::cout << absl::StrFormat(
      "| (outside any op: data, Python-free glue, waits) | %.1f%% | %.2f | |\n\n",
      100 * outside / profiled_s, outside * per_step);
}

// What one invocation measures.
struct BenchPlan {
  int64_t steps = 0, warmup = 0, batch = 0, p = 0, layers = 0, profile_rows = 0;
  int64_t repeats = 1;  // rounds over the schedules and thread counts; medians reported
  std::vector<int64_t> thread_counts;  // 0 = LibTorch's default
  std::vector<Width> widths;
  // Kernel switches compared in the same rounds (one run per arm, back to back): the
  // environment variable and value an arm sets, and its label; one unlabelled arm = as set.
  struct Arm {
    std::string variable, value, label;
  };
  std::vector<Arm> arms{Arm{}};
  bool bf16 = false;
};

absl::StatusOr<BenchPlan> PlanFromArgs(const CliArgs& args) {
  BenchPlan plan;
  LOOM_ASSIGN_OR_RETURN(plan.steps, args.GetInt("steps", 20, 1, 100000));
  LOOM_ASSIGN_OR_RETURN(plan.warmup, args.GetInt("warmup", 3, 0, 1000));
  LOOM_ASSIGN_OR_RETURN(int64_t seq_len, args.GetInt("seq-len", 256, 16, 8192));
  LOOM_ASSIGN_OR_RETURN(plan.batch, args.GetInt("batch", 8, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(plan.p, args.GetInt("p", 2, 1, 16));
  LOOM_ASSIGN_OR_RETURN(plan.layers, args.GetInt("layers", 5, 1, 64));
  LOOM_ASSIGN_OR_RETURN(plan.profile_rows, args.GetInt("profile", 0, 0, 1000));
  LOOM_ASSIGN_OR_RETURN(plan.repeats, args.GetInt("repeats", 1, 1, 100));
  plan.bf16 = args.Has("bf16");
  for (absl::string_view t : absl::StrSplit(args.Has("threads") ? args.Get("threads") : "0", ',')) {
    int64_t n = 0;
    if (!absl::SimpleAtoi(t, &n) || n < 0 || n > 1024) {
      return absl::InvalidArgumentError(
          absl::StrCat("--threads: '", t, "' is not a thread count (0 = LibTorch's default)"));
    }
    plan.thread_counts.push_back(n);
  }
  if (args.Has("linear") && args.Has("adamw")) {
    return absl::InvalidArgumentError("--linear and --adamw: compare one kernel at a time");
  }
  for (const auto& [flag, variable, ours] :
       {std::tuple<const char*, const char*, const char*>{"linear", "LOOM_CPU_LINEAR", "split"},
        {"adamw", "LOOM_CPU_ADAMW", "fused"}}) {
    if (!args.Has(flag)) continue;
    plan.arms.clear();
    for (absl::string_view a : absl::StrSplit(args.Get(flag), ',', absl::SkipEmpty())) {
      if (a != ours && a != "torch") {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag, ": '", a, "' is not ", ours, " or torch"));
      }
      plan.arms.push_back({variable, std::string(a), absl::StrCat(flag, " ", a)});
    }
    if (plan.arms.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": give ", ours, ", torch or both"));
    }
  }
  for (absl::string_view name :
       absl::StrSplit(args.Has("widths") ? args.Get("widths") : "tiny", ',')) {
    if (name == "tiny") {
      plan.widths.push_back({"tiny-cpu width (d_model 128, 4 heads, FFN 512)", 128, 4, seq_len});
    } else if (name == "wide") {
      plan.widths.push_back({"wide (d_model 256, 8 heads, FFN 1024)", 256, 8, 512});
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--widths: '", name, "' is not a width (tiny, wide)"));
    }
  }
  return plan;
}

class TrainBench {
 public:
  TrainBench(BenchPlan plan, PluginLoader& loader) : plan_(std::move(plan)), loader_(loader) {}
  absl::Status RunWidth(const Width& w);

 private:
  absl::StatusOr<Measured> Measure(const Width& w, const Variant& v, bool profile,
                                   const std::string& precision = "fp32") {
    return RunSchedule(w, v, plan_.layers, plan_.batch, plan_.warmup, plan_.steps, loader_, profile,
                       precision);
  }
  // runs[thread count][schedule]: plan_.repeats rounds over every schedule, the thread counts
  // back to back per schedule, so that a slow minute of a shared VM hits both sides of a ratio
  // alike and one round of every schedule, not every repeat of one (the medians drop it).
  // With several arms (--linear, --adamw), one Runs per arm, each run of a round back to back.
  using Runs = std::vector<std::vector<std::vector<Measured>>>;
  absl::StatusOr<std::vector<Runs>> MeasureAll(const Width& w,
                                               const std::vector<Variant>& variants);
  // One table per thread count from the runs' medians; the schedules' tokens/s.
  std::vector<double> ThroughputTable(const Width& w, const std::vector<Variant>& variants,
                                      const std::vector<std::vector<Measured>>& runs,
                                      double ceiling);
  absl::Status Bf16Table(const Width& w, const std::vector<Variant>& variants,
                         const std::vector<double>& fp32_rates);
  void ScalingLine(const std::vector<Variant>& variants, const Runs& runs) const;
  void ArmLine(const std::vector<Variant>& variants, const std::vector<Runs>& runs) const;
  void SetArm(size_t a) const {
    const BenchPlan::Arm& arm = plan_.arms[a];
    if (!arm.variable.empty()) setenv(arm.variable.c_str(), arm.value.c_str(), 1);
  }
  void SetThreads(int64_t threads) const {
    torch::set_num_threads(threads > 0 ? static_cast<int>(threads) : default_threads_);
  }
  absl::Status Profiles(const Width& w, const std::vector<Variant>& variants);

  BenchPlan plan_;
  PluginLoader& loader_;
  const int default_threads_ = torch::get_num_threads();
};

// The run with the median step time (the upper median of an even count).
const Measured& MedianRun(const std::vector<Measured>& runs) {
  std::vector<const Measured*> sorted;
  for (const Measured& m : runs) sorted.push_back(&m);
  std::sort(sorted.begin(), sorted.end(),
            [](const Measured* a, const Measured* b) { return a->step_s < b->step_s; });
  return *sorted[sorted.size() / 2];
}

absl::Status TrainBench::RunWidth(const Width& w) {
  const std::vector<Variant> variants = Schedules(plan_.p, w.seq_len);
  LOOM_ASSIGN_OR_RETURN(std::vector<Runs> all, MeasureAll(w, variants));
  const Runs& runs = all.front();          // the tables are the first arm's
  SetArm(0);                               // and so are the bf16 table and the profiles below
  std::vector<std::vector<double>> rates;  // [thread count][schedule]
  for (size_t t = 0; t < plan_.thread_counts.size(); ++t) {
    SetThreads(plan_.thread_counts[t]);
    rates.push_back(ThroughputTable(w, variants, runs[t], MatmulCeilingFlops(1024)));
  }
  // Mixed precision against the fp32 rows above (the last thread count).
  if (plan_.bf16) LOOM_RETURN_IF_ERROR(Bf16Table(w, variants, rates.back()));
  if (rates.size() > 1) ScalingLine(variants, runs);
  if (all.size() > 1) ArmLine(variants, all);
  if (plan_.profile_rows > 0) LOOM_RETURN_IF_ERROR(Profiles(w, variants));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<TrainBench::Runs>> TrainBench::MeasureAll(
    const Width& w, const std::vector<Variant>& variants) {
  std::vector<Runs> runs(
      plan_.arms.size(),
      Runs(plan_.thread_counts.size(), std::vector<std::vector<Measured>>(variants.size())));
  for (int64_t r = 0; r < plan_.repeats; ++r) {
    for (size_t v = 0; v < variants.size(); ++v) {
      for (size_t t = 0; t < plan_.thread_counts.size(); ++t) {
        SetThreads(plan_.thread_counts[t]);
        for (size_t a = 0; a < plan_.arms.size(); ++a) {
          SetArm(a);
          LOOM_ASSIGN_OR_RETURN(Measured m, Measure(w, variants[v], false));
          runs[a][t][v].push_back(std::move(m));
        }
      }
    }
  }
  return runs;
}

std::vector<double> TrainBench::ThroughputTable(const Width& w,
                                                const std::vector<Variant>& variants,
                                                const std::vector<std::vector<Measured>>& runs,
                                                double ceiling) {
  std::cout << absl::StrFormat(
      "\n### %s, %d layers, batch %d x %d tokens, %d LibTorch threads; fp32 matmul ceiling "
      "%.1f GFLOP/s (1024^3, best of 5); %d timed steps after %d warm-up%s\n\n",
      w.name, plan_.layers, plan_.batch, w.seq_len, torch::get_num_threads(), ceiling / 1e9,
      plan_.steps, plan_.warmup,
      plan_.repeats > 1 ? absl::StrFormat("; median of %d runs", plan_.repeats) : "");
  std::cout << "| schedule | FLOPs/token (fwd) | step ms | tokens/s | vs mha | GFLOP/s | MFU vs "
               "matmul ceiling | sys/user CPU |\n"
            << "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  std::vector<double> rates;
  for (size_t i = 0; i < variants.size(); ++i) {
    const Variant& v = variants[i];
    const Measured& m = MedianRun(runs[i]);
    const double rate = static_cast<double>(plan_.batch * w.seq_len) / m.step_s;
    rates.push_back(rate);
    const double achieved = 3.0 * m.flops_per_token * rate;
    std::cout << absl::StrFormat("| %s | %.3g | %.1f | %.0f | %.2f | %.2f | %.1f%% | %.1f%% |\n",
                                 v.name, m.flops_per_token, 1e3 * m.step_s, rate,
                                 rate / rates.front(), achieved / 1e9, 100 * achieved / ceiling,
                                 100 * m.sys_per_user);
  }
  return rates;
}

absl::Status TrainBench::Bf16Table(const Width& w, const std::vector<Variant>& variants,
                                   const std::vector<double>& fp32_rates) {
  std::cout << absl::StrFormat("\nbf16 autocast vs fp32 (%d threads, the same steps):\n\n",
                               torch::get_num_threads())
            << "| schedule | fp32 tokens/s | bf16 tokens/s | bf16 vs fp32 |\n"
            << "| --- | ---: | ---: | ---: |\n";
  for (size_t i = 0; i < variants.size(); ++i) {
    LOOM_ASSIGN_OR_RETURN(Measured m, Measure(w, variants[i], false, "bf16"));
    const double rate = static_cast<double>(plan_.batch * w.seq_len) / m.step_s;
    std::cout << absl::StrFormat("| %s | %.0f | %.0f | %.2fx |\n", variants[i].name, fp32_rates[i],
                                 rate, rate / fp32_rates[i]);
  }
  return absl::OkStatus();
}

// Per schedule, ratio(schedule, repeat) over the repeats: the median, and the range when there
// are several (the ratios are of run pairs measured back to back in one round).
template <typename Ratio>
void PrintPairedRatios(const std::vector<Variant>& variants, int64_t repeats, const Ratio& ratio) {
  for (size_t i = 0; i < variants.size(); ++i) {
    std::vector<double> ratios;
    for (int64_t r = 0; r < repeats; ++r) ratios.push_back(ratio(i, r));
    std::sort(ratios.begin(), ratios.end());
    std::cout << absl::StrFormat("%s%s %.2fx", i ? ", " : "", variants[i].name,
                                 ratios[ratios.size() / 2]);
    if (ratios.size() > 1) {
      std::cout << absl::StrFormat(" (%.2f-%.2f)", ratios.front(), ratios.back());
    }
  }
  std::cout << "\n";
}

// Tokens/s at the last thread count over the first.
void TrainBench::ScalingLine(const std::vector<Variant>& variants, const Runs& runs) const {
  std::cout << absl::StrFormat(
      "\nTokens/s at %d threads / at %d threads%s: ", plan_.thread_counts.back(),
      plan_.thread_counts.front(), plan_.repeats > 1 ? " (median of the paired runs, range)" : "");
  PrintPairedRatios(variants, plan_.repeats, [&](size_t i, int64_t r) {
    return runs.front()[i][r].step_s / runs.back()[i][r].step_s;
  });
}

// Per thread count, step time with the last arm over the first.
void TrainBench::ArmLine(const std::vector<Variant>& variants,
                         const std::vector<Runs>& runs) const {
  for (size_t t = 0; t < plan_.thread_counts.size(); ++t) {
    std::cout << absl::StrFormat(
        "\nStep time with %s / with %s at %d threads%s: ", plan_.arms.back().label,
        plan_.arms.front().label, plan_.thread_counts[t],
        plan_.repeats > 1 ? " (median of the paired runs, range)" : "");
    PrintPairedRatios(variants, plan_.repeats, [&](size_t i, int64_t r) {
      return runs.back()[t][i][r].step_s / runs.front()[t][i][r].step_s;
    });
  }
}

absl::Status TrainBench::Profiles(const Width& w, const std::vector<Variant>& variants) {
  std::cout << absl::StrFormat("\nWhere the step goes (%d threads, %d steps profiled):\n",
                               torch::get_num_threads(), plan_.warmup + plan_.steps);
  for (const Variant& v : variants) {
    const auto start = Clock::now();
    LOOM_ASSIGN_OR_RETURN(Measured m, Measure(w, v, true));
    std::cout << "\n" << v.name << ":\n\n";
    PrintProfile(m, std::chrono::duration<double>(Clock::now() - start).count(),
                 plan_.warmup + plan_.steps, plan_.profile_rows);
  }
  return absl::OkStatus();
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(
      CliArgs args,
      CliArgs::Parse(argc, argv, 1,
                     {"steps", "warmup", "seq-len", "batch", "threads", "p", "plugin-dir", "layers",
                      "widths", "profile", "repeats", "linear", "adamw"},
                     {"bf16"}));
  LOOM_ASSIGN_OR_RETURN(BenchPlan plan, PlanFromArgs(args));
  PluginLoader loader;
  loader.LoadDirectories(args.Has("plugin-dir") ? std::vector<std::string>{args.Get("plugin-dir")}
                                                : PluginLoader::DefaultSearchPath());
  std::cout << absl::StrFormat("machine: %s; %s\n", CpuName(), BlasDescription());
  const std::vector<Width> widths = plan.widths;
  TrainBench bench(std::move(plan), loader);
  for (const Width& w : widths) LOOM_RETURN_IF_ERROR(bench.RunWidth(w));
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
