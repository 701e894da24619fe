#include "coordinator/scheduler.h"

#include <gtest/gtest.h>

#include <set>

namespace loom::coordinator {
namespace {

QueuedJob Job(const std::string& id, int world, int priority, int64_t since,
              std::map<std::string, std::string> pool = {}) {
  QueuedJob j;
  j.id = id;
  j.world_size = world;
  j.priority = priority;
  j.queued_since_ms = since;
  j.pool = std::move(pool);
  return j;
}

FreeWorker Worker(const std::string& id, int slots, int free,
                  std::map<std::string, std::string> labels = {}) {
  FreeWorker w;
  w.id = id;
  w.slots = slots;
  w.free_slots = free;
  w.labels = std::move(labels);
  return w;
}

TEST(SchedulerTest, GangIsAllOrNothingAndRanksAreContiguous) {
  SchedulerOptions o;
  auto r = Schedule({Job("a", 3, 0, 0)}, {Worker("w1", 2, 2), Worker("w2", 2, 1)}, o, 1000);
  ASSERT_EQ(r.placed.size(), 1u);
  const auto& p = r.placed[0].workers;
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].first, "w1");
  EXPECT_EQ(p[0].second, (std::vector<int>{0, 1}));
  EXPECT_EQ(p[1].first, "w2");
  EXPECT_EQ(p[1].second, (std::vector<int>{2}));

  // 4 ranks but only 3 free: nothing placed, and the reason says so.
  r = Schedule({Job("b", 4, 0, 0)}, {Worker("w1", 2, 2), Worker("w2", 2, 1)}, o, 1000);
  EXPECT_TRUE(r.placed.empty());
  EXPECT_NE(r.waiting.at("b").find("waiting for 4 slots (3 free of 4"), std::string::npos);
}

TEST(SchedulerTest, PoolsAreSelectedByLabels) {
  SchedulerOptions o;
  auto r = Schedule(
      {Job("gpu", 1, 0, 0, {{"pool", "gpu"}}), Job("cpu", 1, 0, 1, {{"pool", "cpu"}})},
      {Worker("c", 1, 1, {{"pool", "cpu"}}), Worker("g", 1, 1, {{"pool", "gpu"}, {"zone", "a"}})},
      o, 1000);
  ASSERT_EQ(r.placed.size(), 2u);
  for (const auto& p : r.placed) EXPECT_EQ(p.workers[0].first, p.job_id == "gpu" ? "g" : "c");
  r = Schedule({Job("x", 1, 0, 0, {{"pool", "tpu"}})}, {Worker("c", 1, 1, {{"pool", "cpu"}})}, o,
               1000);
  EXPECT_TRUE(r.placed.empty());
  EXPECT_NE(r.waiting.at("x").find("no live worker matches pool {pool=tpu}"), std::string::npos);
  // A gang never spans pools: 2 ranks, one matching worker with 1 slot.
  r = Schedule({Job("y", 2, 0, 0, {{"pool", "cpu"}})},
               {Worker("c", 1, 1, {{"pool", "cpu"}}), Worker("g", 4, 4, {{"pool", "gpu"}})}, o,
               1000);
  EXPECT_TRUE(r.placed.empty());
  EXPECT_NE(r.waiting.at("y").find("has 1 on live workers"), std::string::npos);
}

TEST(SchedulerTest, PriorityThenAgeDecideTheOrder) {
  SchedulerOptions o;
  o.aging_seconds = 10;
  // One slot: the higher priority wins...
  auto r = Schedule({Job("low", 1, 0, 0), Job("high", 1, 5, 0)}, {Worker("w", 1, 1)}, o, 1000);
  ASSERT_EQ(r.placed.size(), 1u);
  EXPECT_EQ(r.placed[0].job_id, "high");
  // ...unless the low one has waited 60 s more (6 points of aging beat 5 of priority).
  r = Schedule({Job("low", 1, 0, 0), Job("high", 1, 5, 60000)}, {Worker("w", 1, 1)}, o, 60000);
  ASSERT_EQ(r.placed.size(), 1u);
  EXPECT_EQ(r.placed[0].job_id, "low");
  // Equal priority: first come first served.
  r = Schedule({Job("b", 1, 0, 20), Job("a", 1, 0, 10)}, {Worker("w", 1, 1)}, o, 20);
  EXPECT_EQ(r.placed[0].job_id, "a");
}

TEST(SchedulerTest, SmallJobsBackfillUntilTheLargeJobReserves) {
  SchedulerOptions o;
  o.aging_seconds = 1e9;  // no aging: isolate the reservation rule
  o.reserve_after_ms = 5000;
  // Large job (4 ranks) waits; 2 slots free; a small job behind it backfills.
  auto r = Schedule({Job("large", 4, 0, 0), Job("small", 2, 0, 100)}, {Worker("w", 4, 2)}, o, 1000);
  ASSERT_EQ(r.placed.size(), 1u);
  EXPECT_EQ(r.placed[0].job_id, "small");
  // After 5 s the large job holds the free slots: the small job waits instead of starving it.
  r = Schedule({Job("large", 4, 0, 0), Job("small", 2, 0, 100)}, {Worker("w", 4, 2)}, o, 6000);
  EXPECT_TRUE(r.placed.empty());
  EXPECT_NE(r.waiting.at("large").find("reserving"), std::string::npos);
  // Once all 4 slots are free the large job runs.
  r = Schedule({Job("large", 4, 0, 0), Job("small", 2, 0, 100)}, {Worker("w", 4, 4)}, o, 7000);
  ASSERT_EQ(r.placed.size(), 1u);
  EXPECT_EQ(r.placed[0].job_id, "large");
}

TEST(SchedulerTest, AStreamOfSmallJobsCannotStarveALargeOne) {
  // Simulated cluster: 4 slots, 1-slot jobs arriving every second and running 3 s each, one
  // 4-slot job submitted at t = 0. The large job must start within reserve_after + a job length.
  SchedulerOptions o;
  o.aging_seconds = 1e9;
  o.reserve_after_ms = 10000;
  std::vector<QueuedJob> queue = {Job("large", 4, 0, 0)};
  std::vector<std::pair<int64_t, int>> running;  // end time, slots
  int next = 0;
  int64_t large_started = -1;
  for (int64_t t = 0; t <= 60000 && large_started < 0; t += 1000) {
    queue.push_back(Job("s" + std::to_string(next++), 1, 0, t));
    running.erase(
        std::remove_if(running.begin(), running.end(), [&](auto& r) { return r.first <= t; }),
        running.end());
    int used = 0;
    for (auto& r : running) used += r.second;
    auto r = Schedule(queue, {Worker("w", 4, 4 - used)}, o, t);
    for (const auto& p : r.placed) {
      if (p.job_id == "large") large_started = t;
      int slots = 0;
      for (auto& w : p.workers) slots += static_cast<int>(w.second.size());
      running.emplace_back(t + 3000, slots);
      queue.erase(
          std::remove_if(queue.begin(), queue.end(), [&](auto& q) { return q.id == p.job_id; }),
          queue.end());
    }
  }
  ASSERT_GE(large_started, 0) << "the 4-slot job never ran";
  EXPECT_LE(large_started, 10000 + 3000);
}

// Quotas: a job that would take its owner, or its project, beyond the limit waits with the
// reason and reserves nothing (a job behind it that fits runs); what a pass places counts.
TEST(SchedulerTest, QuotasHoldJobsBackWithTheirReason) {
  SchedulerOptions o;
  o.reserve_after_ms = 0;  // a blocked job would reserve at once: a quota must not
  Quotas q;
  q.user_limit["alice"] = 4;
  q.user_used["alice"] = 2;
  q.project_limit["iha"] = 3;
  auto job = [](const std::string& id, int world, const std::string& user,
                const std::string& project, int64_t since) {
    QueuedJob j = Job(id, world, 0, since);
    j.user = user;
    j.project = project;
    return j;
  };
  // a1 (2 slots) fits alice's 4 with 2 used; a2 then does not; b1 is bob's, project iha: 2 of
  // 3; b2 would make iha 4 of 3; c1 has no quota at all.
  auto r = Schedule(
      {job("a1", 2, "alice", "", 0), job("a2", 1, "alice", "", 1), job("b1", 2, "bob", "iha", 2),
       job("b2", 2, "bob", "iha", 3), job("c1", 2, "carol", "", 4)},
      {Worker("w", 16, 16)}, o, 1000, q);
  std::set<std::string> placed;
  for (const auto& p : r.placed) placed.insert(p.job_id);
  EXPECT_EQ(placed, (std::set<std::string>{"a1", "b1", "c1"}));
  EXPECT_EQ(r.waiting.at("a2"), "quota: alice uses 4 of 4 slots");
  EXPECT_EQ(r.waiting.at("b2"), "quota: project iha uses 2 of 3 slots; this job needs 2");
  EXPECT_EQ(OverQuota(job("x", 5, "dan", "", 0), q), "") << "no quota, no limit";
}

}  // namespace
}  // namespace loom::coordinator
