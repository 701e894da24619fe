#include <gtest/gtest.h>

#include <set>

#include "sim/simulator.h"
#include "sim/trace.h"

namespace loom::sim {
namespace {

TraceOptions Small() {
  TraceOptions o;
  o.nodes = 100;
  o.users = 10;
  o.jobs = 1000;
  o.hours = 4;
  return o;
}

// The trace offers the load asked for, is the same for a seed, and has what the goals need:
// gangs up to 512 GPUs capped by the cluster, three priorities, failures.
TEST(SimTest, TraceIsCalibratedAndDeterministic) {
  const TraceOptions o = Small();
  const Trace a = MakeTrace(o), b = MakeTrace(o);
  ASSERT_EQ(a.jobs.size(), 1000u);
  double gpu_ms = 0;
  std::set<int> priorities;
  for (size_t i = 0; i < a.jobs.size(); ++i) {
    EXPECT_EQ(a.jobs[i].submit_ms, b.jobs[i].submit_ms);
    EXPECT_EQ(a.jobs[i].duration_ms, b.jobs[i].duration_ms);
    EXPECT_LE(a.jobs[i].gpus, o.nodes * o.gpus_per_node / 4);
    gpu_ms += static_cast<double>(a.jobs[i].gpus) * a.jobs[i].duration_ms;
    priorities.insert(a.jobs[i].priority);
  }
  const double capacity = o.nodes * o.gpus_per_node * o.hours * 3600e3;
  EXPECT_NEAR(gpu_ms / capacity, o.load, 0.02) << "durations under a minute are raised to one";
  EXPECT_EQ(priorities, (std::set<int>{0, 1, 10}));
  TraceOptions other = o;
  other.seed = 2;
  EXPECT_NE(MakeTrace(other).jobs[0].submit_ms, a.jobs[0].submit_ms);
}

// The simulation's books balance: utilisation in (0, 1], every started job's wait counted,
// urgent jobs wait less than the rest, and switching preemption off removes it.
TEST(SimTest, ReportIsConsistent) {
  const TraceOptions o = Small();
  const Trace trace = MakeTrace(o);
  SimOptions s;
  s.end_hours = o.hours;
  const SimReport r = Simulate(trace, o, s);
  EXPECT_GT(r.utilisation, 0.5);
  EXPECT_LE(r.utilisation, 1.0);
  int64_t seen = 0;
  for (const auto& [p, w] : r.wait_s) seen += w.count;
  for (const auto& [p, n] : r.not_started) seen += n;
  EXPECT_EQ(seen, 1000);
  EXPECT_LT(r.wait_s.at(10).p99, r.wait_s.at(0).p99);
  EXPECT_GT(r.preemptions, 0);
  EXPECT_GT(r.jain, 0.5);
  s.scheduler.preempt_after_ms = -1;
  EXPECT_EQ(Simulate(trace, o, s).preemptions, 0);
}

}  // namespace
}  // namespace loom::sim
