#include "sim/trace.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace loom::sim {

namespace {

// Gang sizes 1..512 GPUs, each power of two half as likely as the one below it: most jobs are
// small, most GPU-time goes to the few large ones (as in published cluster traces).
int DrawGpus(std::mt19937_64& rng) {
  std::geometric_distribution<int> exponent(0.5);
  return 1 << std::min(exponent(rng), 9);
}

// Weights 1 (most users), 2 (one in five) and 4 (one in twenty); demand is uneven on purpose
// (a lognormal factor per user), so that fair share, not the submission rate, has to decide.
void DrawUsers(const TraceOptions& o, std::mt19937_64& rng, Trace& trace,
               std::vector<double>& demand) {
  std::uniform_real_distribution<double> u(0, 1);
  std::lognormal_distribution<double> skew(0, 1);
  for (int i = 0; i < o.users; ++i) {
    const double r = u(rng);
    trace.weights.push_back(r < 0.05 ? 4 : r < 0.25 ? 2 : 1);
    demand.push_back(trace.weights.back() * skew(rng));
  }
}

void DrawJobs(const TraceOptions& o, std::mt19937_64& rng, const std::vector<double>& demand,
              Trace& trace) {
  const int64_t span_ms = static_cast<int64_t>(o.hours * 3600e3);
  std::uniform_int_distribution<int64_t> when(0, span_ms - 1);
  std::discrete_distribution<int> who(demand.begin(), demand.end());
  std::lognormal_distribution<double> minutes(std::log(30.0), 1.2);  // median 30 min
  std::uniform_real_distribution<double> u(0, 1);
  double gpu_ms = 0;
  for (int i = 0; i < o.jobs; ++i) {
    TraceJob j;
    j.submit_ms = when(rng);
    j.user = who(rng);
    j.gpus = std::min(DrawGpus(rng), o.nodes * o.gpus_per_node / 4);
    j.duration_ms = static_cast<int64_t>(std::min(minutes(rng), 24 * 60.0) * 60e3);
    const double p = u(rng);
    j.priority = p < 0.03 ? 10 : p < 0.18 ? 1 : 0;
    j.pool = u(rng) < 0.2 ? 1 : -1;
    if (j.pool == 1) j.gpus = std::min(j.gpus, 64);
    gpu_ms += static_cast<double>(j.gpus) * static_cast<double>(j.duration_ms);
    trace.jobs.push_back(j);
  }
  // Scale the durations so that the offered load is what was asked.
  const double capacity = static_cast<double>(o.nodes) * o.gpus_per_node * span_ms;
  const double scale = o.load * capacity / gpu_ms;
  for (TraceJob& j : trace.jobs) {
    j.duration_ms = std::max<int64_t>(60000, static_cast<int64_t>(j.duration_ms * scale));
  }
  std::sort(trace.jobs.begin(), trace.jobs.end(),
            [](const TraceJob& a, const TraceJob& b) { return a.submit_ms < b.submit_ms; });
}

void DrawFailures(const TraceOptions& o, std::mt19937_64& rng, Trace& trace) {
  const double span_ms = o.hours * 3600e3;
  const double rate_per_ms = o.nodes / (o.node_mtbf_hours * 3600e3);
  std::exponential_distribution<double> gap(rate_per_ms);
  std::uniform_int_distribution<int> node(0, o.nodes - 1);
  std::exponential_distribution<double> repair(1.0 / (o.repair_minutes * 60e3));
  for (double t = gap(rng); t < span_ms; t += gap(rng)) {
    trace.failures.push_back({static_cast<int64_t>(t), node(rng),
                              std::max<int64_t>(60000, static_cast<int64_t>(repair(rng)))});
  }
}

}  // namespace

Trace MakeTrace(const TraceOptions& options) {
  std::mt19937_64 rng(options.seed);
  Trace trace;
  std::vector<double> demand;
  DrawUsers(options, rng, trace, demand);
  DrawJobs(options, rng, demand, trace);
  DrawFailures(options, rng, trace);
  return trace;
}

}  // namespace loom::sim
