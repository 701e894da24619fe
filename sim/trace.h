// A synthetic cluster trace for loom-sim: nodes with GPUs in two pools, users with fair-share
// weights and uneven demand, jobs with heavy-tailed sizes and durations and three priorities,
// and node failures. Deterministic for a seed.
#ifndef LOOM_SIM_TRACE_H_
#define LOOM_SIM_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

namespace loom::sim {

struct TraceOptions {
  int nodes = 10000;
  int gpus_per_node = 8;
  double special_pool_fraction = 0.3;  // nodes labelled gpu=a100 (the rest gpu=h100)
  int users = 200;
  int jobs = 100000;
  double hours = 24;              // submissions spread over this much simulated time
  double load = 1.3;              // GPU-time submitted / GPU-time the cluster has over `hours`
  double node_mtbf_hours = 2400;  // per node: 10 000 nodes lose about 100 a day
  double repair_minutes = 60;
  uint64_t seed = 1;
};

struct TraceJob {
  int64_t submit_ms = 0;
  int user = 0;
  int gpus = 1;
  int64_t duration_ms = 0;  // of work, uninterrupted
  int priority = 0;         // 0 (most), 1, or 10 (urgent)
  int pool = -1;            // -1: any node; 1: gpu=a100 only
};

struct NodeFailure {
  int64_t at_ms = 0;
  int node = 0;
  int64_t down_ms = 0;
};

struct Trace {
  std::vector<double> weights;        // per user
  std::vector<TraceJob> jobs;         // by submit time
  std::vector<NodeFailure> failures;  // by time
};

Trace MakeTrace(const TraceOptions& options);

}  // namespace loom::sim

#endif  // LOOM_SIM_TRACE_H_
