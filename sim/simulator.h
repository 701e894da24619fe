// loom-sim's cluster model: the coordinator's job lifecycle (queued, scheduled and running,
// stopping for a preemption, requeued after one or after a node failure, succeeded) on
// simulated nodes, with the real scheduler (coordinator/scheduler.h: Schedule, fair share's
// UsageLedger, preemption) deciding every pass and a ManualClock as the only time source.
// Agents, RocksDB and the network are not in the loop: it measures the policy and the pass.
#ifndef LOOM_SIM_SIMULATOR_H_
#define LOOM_SIM_SIMULATOR_H_

#include <cstdint>
#include <map>
#include <vector>

#include "coordinator/scheduler.h"
#include "sim/trace.h"

namespace loom::sim {

struct SimOptions {
  coordinator::SchedulerOptions scheduler;
  double half_life_s = 86400;
  int64_t tick_ms = 10000;                // one scheduling pass per tick, as the coordinator
  double end_hours = 24;                  // simulated time
  int64_t checkpoint_every_ms = 1800000;  // jobs checkpoint every 30 min
  int64_t stop_ms = 30000;                // SIGTERM to exit 76: the step in flight + a checkpoint
  int64_t start_overhead_ms = 60000;      // rendezvous and restoring a checkpoint
  // false: the baseline without fair share (no weights, no usage history, no turns by slots
  // held): within a band, queue order alone.
  bool fair_share = true;
};

struct Percentiles {
  double p50 = 0, p99 = 0, max = 0;
  int64_t count = 0;
};

struct SimReport {
  double utilisation = 0;              // GPU-time held by jobs / GPU-time of live nodes
  double utilisation_waiting = 0;      // the same, over the passes that left jobs waiting
  std::map<int, Percentiles> wait_s;   // per priority: submission to first start (started jobs)
  std::map<int, int64_t> not_started;  // per priority: submitted, never started
  double jain = 0;  // over users, usage / weighted max-min fair share of their demand
  double worst_share = 0, best_share = 0;  // min and max of usage / fair share
  int64_t succeeded = 0, preemptions = 0, failures = 0, requeued_by_failures = 0;
  double preemption_gpu_hours_lost = 0, failure_gpu_hours_lost = 0, gpu_hours_used = 0;
  Percentiles pass_ms;    // Schedule() alone
  Percentiles inputs_ms;  // assembling its inputs (free workers, running jobs, fair share)
  int64_t max_queue = 0, max_running = 0;
};

SimReport Simulate(const Trace& trace, const TraceOptions& trace_options,
                   const SimOptions& options);

}  // namespace loom::sim

#endif  // LOOM_SIM_SIMULATOR_H_
