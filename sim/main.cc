// loom-sim: the real scheduler over a synthetic day of a large shared cluster (docs/scheduler.md).
//
//   loom-sim                        10 000 nodes x 8 GPUs, 100 000 jobs, 200 users, 24 hours
//   loom-sim --nodes 200 --jobs 2000 --check   a small run that must meet the goals
#include <iostream>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "base/cli_args.h"
#include "base/status_macros.h"
#include "sim/simulator.h"

namespace {

constexpr char kUsage[] = R"(usage: loom-sim [flags]
  --nodes N            nodes (default 10000)          --gpus-per-node N   (default 8)
  --users N            users (default 200)            --jobs N            (default 100000)
  --hours H            submissions spread over H hours of simulated time (default 24)
  --load X             GPU-time submitted / GPU-time the cluster has (default 1.3)
  --node-mtbf-hours H  per node (default 2400)        --seed N            (default 1)
  --tick-s S           one scheduling pass per S simulated seconds (default 10)
  --aging-seconds S    --reserve-after-s S   --preempt-after-s S   --min-run-s S
  --fair-share-half-life-s S                 the coordinator's flags, same defaults
  --compare-fifo       also run the same trace without fair share (within a band, queue order
                       alone) and print the ratios fair share / that baseline
  --check              exit 1 unless the goals hold: a pass's p99 under --max-pass-ms (50),
                       utilisation while jobs wait >= --min-utilisation (0.9), Jain's index
                       >= --min-fairness (0.95)
)";

using loom::CliArgs;

absl::Status ReadOptions(const CliArgs& a, loom::sim::TraceOptions& t, loom::sim::SimOptions& s) {
  LOOM_ASSIGN_OR_RETURN(int64_t nodes, a.GetInt("nodes", 10000, 1, 1000000));
  LOOM_ASSIGN_OR_RETURN(int64_t gpus, a.GetInt("gpus-per-node", 8, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t users, a.GetInt("users", 200, 1, 1000000));
  LOOM_ASSIGN_OR_RETURN(int64_t jobs, a.GetInt("jobs", 100000, 1, 100000000));
  LOOM_ASSIGN_OR_RETURN(int64_t seed, a.GetInt("seed", 1, 0, int64_t{1} << 62));
  LOOM_ASSIGN_OR_RETURN(t.hours, a.GetDouble("hours", 24, 0.01, 10000));
  LOOM_ASSIGN_OR_RETURN(t.load, a.GetDouble("load", 1.3, 0.01, 100));
  LOOM_ASSIGN_OR_RETURN(t.node_mtbf_hours, a.GetDouble("node-mtbf-hours", 2400, 1, 1e9));
  LOOM_ASSIGN_OR_RETURN(int64_t tick, a.GetInt("tick-s", 10, 1, 3600));
  LOOM_ASSIGN_OR_RETURN(s.scheduler.aging_seconds, a.GetDouble("aging-seconds", 86400, 0.001, 1e9));
  LOOM_ASSIGN_OR_RETURN(int64_t reserve, a.GetInt("reserve-after-s", 300, 0, 1000000000));
  LOOM_ASSIGN_OR_RETURN(int64_t preempt, a.GetInt("preempt-after-s", 600, -1, 1000000000));
  LOOM_ASSIGN_OR_RETURN(int64_t min_run, a.GetInt("min-run-s", 600, 0, 1000000000));
  LOOM_ASSIGN_OR_RETURN(s.half_life_s, a.GetDouble("fair-share-half-life-s", 86400, 1, 1e9));
  t.nodes = static_cast<int>(nodes);
  t.gpus_per_node = static_cast<int>(gpus);
  t.users = static_cast<int>(users);
  t.jobs = static_cast<int>(jobs);
  t.seed = static_cast<uint64_t>(seed);
  s.tick_ms = tick * 1000;
  s.end_hours = t.hours;
  s.scheduler.reserve_after_ms = reserve * 1000;
  s.scheduler.preempt_after_ms = preempt < 0 ? -1 : preempt * 1000;
  s.scheduler.min_run_ms = min_run * 1000;
  return absl::OkStatus();
}

void Print(const loom::sim::TraceOptions& t, const loom::sim::SimReport& r) {
  std::cout << absl::StrFormat(
      "loom-sim: %d nodes x %d GPUs, %d users, %d jobs over %.1f h (load %.2f)\n", t.nodes,
      t.gpus_per_node, t.users, t.jobs, t.hours, t.load);
  std::cout << absl::StrFormat("utilisation: %.3f while jobs wait, %.3f overall (%.0f GPU-hours)\n",
                               r.utilisation_waiting, r.utilisation, r.gpu_hours_used);
  for (const auto& [priority, w] : r.wait_s) {
    std::cout << absl::StrFormat(
        "queue wait, priority %2d: p50 %8.0f s  p99 %8.0f s  (%lld started, %lld never)\n",
        priority, w.p50, w.p99, static_cast<long long>(w.count),
        static_cast<long long>(r.not_started.count(priority) ? r.not_started.at(priority) : 0));
  }
  std::cout << absl::StrFormat(
      "fairness: Jain's index %.4f of usage / weighted fair share (min %.3f, max %.3f)\n", r.jain,
      r.worst_share, r.best_share);
  std::cout << absl::StrFormat(
      "preemptions: %lld (%.1f GPU-hours lost to stopping and restarting); node failures: %lld "
      "(%lld jobs requeued, %.1f GPU-hours lost)\n",
      static_cast<long long>(r.preemptions), r.preemption_gpu_hours_lost,
      static_cast<long long>(r.failures), static_cast<long long>(r.requeued_by_failures),
      r.failure_gpu_hours_lost);
  std::cout << absl::StrFormat(
      "scheduling pass (Schedule()): p50 %.2f ms  p99 %.2f ms  max %.2f ms over %lld passes; "
      "queue up to %lld jobs, %lld running\n",
      r.pass_ms.p50, r.pass_ms.p99, r.pass_ms.max, static_cast<long long>(r.pass_ms.count),
      static_cast<long long>(r.max_queue), static_cast<long long>(r.max_running));
  std::cout << absl::StrFormat("assembling a pass's inputs: p50 %.2f ms  p99 %.2f ms\n",
                               r.inputs_ms.p50, r.inputs_ms.p99);
}

absl::Status Check(const CliArgs& a, const loom::sim::SimReport& r) {
  LOOM_ASSIGN_OR_RETURN(double max_pass, a.GetDouble("max-pass-ms", 50, 0, 1e9));
  LOOM_ASSIGN_OR_RETURN(double min_util, a.GetDouble("min-utilisation", 0.9, 0, 1));
  LOOM_ASSIGN_OR_RETURN(double min_fair, a.GetDouble("min-fairness", 0.95, 0, 1));
  std::string failed;
  if (r.pass_ms.p99 > max_pass)
    failed += absl::StrFormat(" pass p99 %.2f ms > %.2f;", r.pass_ms.p99, max_pass);
  if (r.utilisation_waiting < min_util)
    failed += absl::StrFormat(" utilisation %.3f < %.3f;", r.utilisation_waiting, min_util);
  if (r.jain < min_fair) failed += absl::StrFormat(" fairness %.4f < %.4f;", r.jain, min_fair);
  if (!failed.empty()) return absl::FailedPreconditionError("goals not met:" + failed);
  std::cout << "goals met\n";
  return absl::OkStatus();
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(
      CliArgs args,
      CliArgs::Parse(
          argc, argv, 1,
          {"nodes", "gpus-per-node", "users", "jobs", "hours", "load", "node-mtbf-hours", "seed",
           "tick-s", "aging-seconds", "reserve-after-s", "preempt-after-s", "min-run-s",
           "fair-share-half-life-s", "max-pass-ms", "min-utilisation", "min-fairness"},
          {"help", "check", "compare-fifo"}));
  if (args.Has("help")) {
    std::cout << kUsage;
    return absl::OkStatus();
  }
  loom::sim::TraceOptions trace_options;
  loom::sim::SimOptions options;
  LOOM_RETURN_IF_ERROR(ReadOptions(args, trace_options, options));
  const loom::sim::Trace trace = loom::sim::MakeTrace(trace_options);
  const loom::sim::SimReport report = loom::sim::Simulate(trace, trace_options, options);
  Print(trace_options, report);
  if (args.Has("compare-fifo")) {
    loom::sim::SimOptions fifo = options;
    fifo.fair_share = false;
    const loom::sim::SimReport base = loom::sim::Simulate(trace, trace_options, fifo);
    std::cout << "\nbaseline, the same trace without fair share (queue order within a band):\n";
    Print(trace_options, base);
    std::cout << absl::StrFormat(
        "\nfair share / baseline: Jain's index %.3f, worst user's share %.3f, utilisation while "
        "jobs wait %.3f, priority-0 p99 wait %.3f, pass p99 %.3f\n",
        report.jain / base.jain, report.worst_share / base.worst_share,
        report.utilisation_waiting / base.utilisation_waiting,
        report.wait_s.count(0) && base.wait_s.count(0) && base.wait_s.at(0).p99 > 0
            ? report.wait_s.at(0).p99 / base.wait_s.at(0).p99
            : 0.0,
        base.pass_ms.p99 > 0 ? report.pass_ms.p99 / base.pass_ms.p99 : 0.0);
  }
  return args.Has("check") ? Check(args, report) : absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  const absl::Status s = Run(argc, argv);
  if (!s.ok()) {
    std::cerr << "loom-sim: " << s.message() << "\n";
    return absl::IsInvalidArgument(s) ? 2 : 1;
  }
  return 0;
}
