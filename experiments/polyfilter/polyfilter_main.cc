// loom-exp-polyfilter: Theorem 3 of the IHA paper trained directly (issue 53, item 4). For every
// graph family, seed, k, model (MHA with H heads, IHA with H heads and P = H) and restart of the
// plan file, trains one linear-attention layer to output [X, AX, …, A^{k−1}X] from X̂ = [X, I]
// and writes one raw CSV row: train loss, held-out and population relative residuals, the
// Eckart–Young floors, steps and wall seconds. Restart selection and statistics are
// report_polyfilter.py's. Exit code 2 for a bad command line or plan file, 1 for a failed run.
//
//   loom-exp-polyfilter --plan experiments/polyfilter/theorem3.yaml --out RAW.csv
//       [--only SUBSTRING] [--steps N] [--restarts N] [--seeds 1,2] [--threads 1]
//
// --only keeps the cells whose key "family/k/model/heads" contains SUBSTRING; --steps,
// --restarts and --seeds override the plan for pilots (stderr says so) and are not for results.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/cli_args.h"
#include "base/cpu_process.h"
#include "base/status_macros.h"
#include "experiments/polyfilter/filter_plan.h"

namespace loom::polyfilter {
namespace {

constexpr char kHeader[] =
    "family,k,model,heads,pseudo,params,seed,restart,steps,train_loss,train_residual,"
    "heldout_residual,population_residual,ey_bound_heads,ey_bound_rank,rank_cap,wall_s\n";

// One generator per purpose, seeded from the plan seed (splitmix64 of the tuple): the graph of
// (family, seed), the evaluation set of the seed, and the init and data stream of (seed,
// restart), the same in every cell so MHA and IHA at one seed see the same A and data.
at::Generator Gen(int64_t seed, int64_t purpose, int64_t index) {
  uint64_t z = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ULL +
               purpose * 0xBF58476D1CE4E5B9ULL +
               static_cast<uint64_t>(index) * 0x94D049BB133111EBULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return at::detail::createCPUGenerator(z ^ (z >> 31));
}

struct Overrides {
  std::string only;
  bool pilot = false;
};

// The per-seed state shared by every cell of a (family, seed).
struct SeedState {
  const Family* family;
  int64_t seed;
  torch::Tensor a, x_eval;
};

// The layer must compute what the plugin's IHA core computes on X̂ (float64: 1e-9).
absl::Status CheckAgainstPlugin(const FilterLayer& layer, const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  torch::Tensor mine = layer.forward(x), plugin = layer.PluginForward(x, /*fused=*/false);
  const double tol = layer.shape().dtype == torch::kFloat64 ? 1e-9 : 1e-3;
  const double err = ((mine - plugin).abs().max() / plugin.abs().max()).item<double>();
  if (err > tol) {
    return absl::InternalError(
        absl::StrFormat("layer and plugin core differ by %.3g (relative) at H %d, P %d", err,
                        layer.shape().heads, layer.shape().pseudo));
  }
  return absl::OkStatus();
}

absl::Status RunCell(const Plan& plan, const SeedState& st, int64_t k, bool iha, int64_t heads,
                     std::ostream& out) {
  const LayerShape shape = CellShape(plan, k, iha, heads);
  const int64_t rank_cap =
      iha ? std::min(heads * heads, heads * shape.pseudo * shape.pseudo) : heads;
  const double ey_heads = EckartYoungResidual(st.a, k, heads);
  const double ey_rank = EckartYoungResidual(st.a, k, rank_cap);
  for (int64_t r = 0; r < plan.restarts; ++r) {
    FilterLayer layer(shape, plan.model.iha_init, plan.model.init_noise, Gen(st.seed, 3, r));
    if (r == 0) LOOM_RETURN_IF_ERROR(CheckAgainstPlugin(layer, st.x_eval.narrow(0, 0, 2)));
    const auto t0 = std::chrono::steady_clock::now();
    TrainResult res = Train(layer, st.a, plan.train, Gen(st.seed, 4, r));
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double heldout = HeldOutResidual(layer, st.a, st.x_eval);
    const double population = PopulationResidual(layer, st.a);
    out << absl::StrFormat(
        "%s,%d,%s,%d,%d,%d,%d,%d,%d,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%d,%.3f\n", st.family->name, k,
        iha ? "iha" : "mha", heads, shape.pseudo, layer.ParameterCount(), st.seed, r, res.steps,
        res.train_loss, res.train_residual, heldout, population, ey_heads, ey_rank, rank_cap, wall);
    out.flush();
    std::cerr << absl::StrFormat(
        "%s k %d %s H %d seed %d restart %d: %d steps, held-out %.3g "
        "(floor %.3g), %.1f s\n",
        st.family->name, k, iha ? "iha" : "mha", heads, st.seed, r, res.steps, heldout, ey_rank,
        wall);
  }
  return absl::OkStatus();
}

absl::Status RunPlan(const Plan& plan, const Overrides& ov, std::ostream& out) {
  out << kHeader;
  auto opts = torch::TensorOptions().dtype(plan.dtype);
  for (size_t fi = 0; fi < plan.families.size(); ++fi) {
    const Family& fam = plan.families[fi];
    for (int64_t seed : plan.seeds) {
      SeedState st{
          &fam, seed,
          GraphMatrix(fam.kind, plan.nodes, fam.edge_prob, Gen(seed, 1, static_cast<int64_t>(fi)),
                      plan.dtype),
          torch::randn({plan.eval_samples, plan.nodes, plan.features}, Gen(seed, 2, 0), opts)};
      for (const GridRow& row : plan.grid) {
        for (bool iha : {false, true}) {
          for (int64_t heads : iha ? row.iha : row.mha) {
            const std::string key =
                absl::StrFormat("%s/%d/%s/%d", fam.name, row.k, iha ? "iha" : "mha", heads);
            if (key.find(ov.only) == std::string::npos) continue;
            LOOM_RETURN_IF_ERROR(RunCell(plan, st, row.k, iha, heads, out));
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Plan> ApplyOverrides(const CliArgs& args, Plan plan, Overrides& ov) {
  LOOM_ASSIGN_OR_RETURN(plan.train.steps, args.GetInt("steps", plan.train.steps, 1, 10000000));
  plan.train.window = std::min(plan.train.window, plan.train.steps);
  LOOM_ASSIGN_OR_RETURN(plan.restarts, args.GetInt("restarts", plan.restarts, 1, 1000));
  if (args.Has("seeds")) {
    plan.seeds.clear();
    for (absl::string_view s : absl::StrSplit(args.Get("seeds"), ',')) {
      int64_t v = 0;
      if (!absl::SimpleAtoi(s, &v)) return UsageError("--seeds: a comma-separated list of ints");
      plan.seeds.push_back(v);
    }
  }
  ov.only = args.Get("only");
  ov.pilot = args.Has("steps") || args.Has("restarts") || args.Has("seeds");
  return plan;
}

// Returns the exit code: 2 for a bad command line or plan, 1 for a failed run.
int Main(int argc, char** argv) {
  absl::StatusOr<CliArgs> args = CliArgs::Parse(
      argc, argv, 1, {"plan", "out", "only", "steps", "restarts", "seeds", "threads"});
  absl::StatusOr<std::string> plan_path =
      args.ok() ? args->Require("plan") : absl::StatusOr<std::string>(args.status());
  absl::StatusOr<std::string> out_path =
      args.ok() ? args->Require("out") : absl::StatusOr<std::string>(args.status());
  absl::StatusOr<int64_t> threads = args.ok() ? args->GetInt("threads", 1, 1, 256) : args.status();
  absl::StatusOr<Plan> plan = plan_path.ok() ? LoadPlan(*plan_path) : plan_path.status();
  Overrides ov;
  if (plan.ok() && out_path.ok() && threads.ok()) plan = ApplyOverrides(*args, *plan, ov);
  for (const absl::Status& s : {out_path.status(), threads.status(), plan.status()}) {
    if (!s.ok()) {
      std::cerr << "loom-exp-polyfilter: " << s.message() << "\n";
      return 2;
    }
  }
  torch::set_num_threads(static_cast<int>(*threads));
  if (ov.pilot) std::cerr << "loom-exp-polyfilter: PILOT (plan overridden), not a result\n";
  std::ofstream out(*out_path);
  if (!out) {
    std::cerr << "loom-exp-polyfilter: --out: cannot write '" << *out_path << "'\n";
    return 2;
  }
  absl::Status s;
  try {
    s = RunPlan(*plan, ov, out);
  } catch (const std::exception& e) {
    s = absl::InternalError(e.what());
  }
  if (!s.ok()) {
    std::cerr << "loom-exp-polyfilter: " << s.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace loom::polyfilter

int main(int argc, char** argv) {
  loom::SetUpCpuProcess(argv);  // before any matmul
  return loom::polyfilter::Main(argc, argv);
}
