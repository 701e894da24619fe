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

// A pass with its reasons in words.
struct Outcome {
  std::vector<GangPlacement> placed;
  std::map<std::string, std::string> waiting;
  std::vector<Preemption> preempt;
};

Outcome Pass(const std::vector<QueuedJob>& queue, std::vector<FreeWorker> workers,
             const SchedulerOptions& o, int64_t now, Quotas q = {}, const FairShare& share = {},
             const std::vector<RunningJob>& running = {}) {
  ScheduleResult r = Schedule(queue, std::move(workers), o, now, std::move(q), share, running);
  return {r.placed, Explain(r, queue), r.preempt};
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
  auto r = Pass({Job("a", 3, 0, 0)}, {Worker("w1", 2, 2), Worker("w2", 2, 1)}, o, 1000);
  ASSERT_EQ(r.placed.size(), 1u);
  const auto& p = r.placed[0].workers;
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].first, "w1");
  EXPECT_EQ(p[0].second, (std::vector<int>{0, 1}));
  EXPECT_EQ(p[1].first, "w2");
  EXPECT_EQ(p[1].second, (std::vector<int>{2}));

  // 4 ranks but only 3 free: nothing placed, and the reason says so.
  r = Pass({Job("b", 4, 0, 0)}, {Worker("w1", 2, 2), Worker("w2", 2, 1)}, o, 1000);
  EXPECT_TRUE(r.placed.empty());
  EXPECT_NE(r.waiting.at("b").find("waiting for 4 slots (3 free of 4"), std::string::npos);
}

TEST(SchedulerTest, PoolsAreSelectedByLabels) {
  SchedulerOptions o;
  auto r = Pass(
      {Job("gpu", 1, 0, 0, {{"pool", "gpu"}}), Job("cpu", 1, 0, 1, {{"pool", "cpu"}})},
      {Worker("c", 1, 1, {{"pool", "cpu"}}), Worker("g", 1, 1, {{"pool", "gpu"}, {"zone", "a"}})},
      o, 1000);
  ASSERT_EQ(r.placed.size(), 2u);
  for (const auto& p : r.placed) EXPECT_EQ(p.workers[0].first, p.job_id == "gpu" ? "g" : "c");
  r = Pass({Job("x", 1, 0, 0, {{"pool", "tpu"}})}, {Worker("c", 1, 1, {{"pool", "cpu"}})}, o, 1000);
  EXPECT_TRUE(r.placed.empty());
  EXPECT_NE(r.waiting.at("x").find("no live worker matches pool {pool=tpu}"), std::string::npos);
  // A gang never spans pools: 2 ranks, one matching worker with 1 slot.
  r = Pass({Job("y", 2, 0, 0, {{"pool", "cpu"}})},
           {Worker("c", 1, 1, {{"pool", "cpu"}}), Worker("g", 4, 4, {{"pool", "gpu"}})}, o, 1000);
  EXPECT_TRUE(r.placed.empty());
  EXPECT_NE(r.waiting.at("y").find("has 1 on live workers"), std::string::npos);
}

TEST(SchedulerTest, PriorityThenAgeDecideTheOrder) {
  SchedulerOptions o;
  o.aging_seconds = 10;
  // One slot: the higher priority wins...
  auto r = Pass({Job("low", 1, 0, 0), Job("high", 1, 5, 0)}, {Worker("w", 1, 1)}, o, 1000);
  ASSERT_EQ(r.placed.size(), 1u);
  EXPECT_EQ(r.placed[0].job_id, "high");
  // ...unless the low one has waited 60 s more (6 points of aging beat 5 of priority).
  r = Pass({Job("low", 1, 0, 0), Job("high", 1, 5, 60000)}, {Worker("w", 1, 1)}, o, 60000);
  ASSERT_EQ(r.placed.size(), 1u);
  EXPECT_EQ(r.placed[0].job_id, "low");
  // Equal priority: first come first served.
  r = Pass({Job("b", 1, 0, 20), Job("a", 1, 0, 10)}, {Worker("w", 1, 1)}, o, 20);
  EXPECT_EQ(r.placed[0].job_id, "a");
}

TEST(SchedulerTest, SmallJobsBackfillUntilTheLargeJobReserves) {
  SchedulerOptions o;
  o.aging_seconds = 1e9;  // no aging: isolate the reservation rule
  o.reserve_after_ms = 5000;
  // Large job (4 ranks) waits; 2 slots free; a small job behind it backfills.
  auto r = Pass({Job("large", 4, 0, 0), Job("small", 2, 0, 100)}, {Worker("w", 4, 2)}, o, 1000);
  ASSERT_EQ(r.placed.size(), 1u);
  EXPECT_EQ(r.placed[0].job_id, "small");
  // After 5 s the large job holds the free slots: the small job waits instead of starving it.
  r = Pass({Job("large", 4, 0, 0), Job("small", 2, 0, 100)}, {Worker("w", 4, 2)}, o, 6000);
  EXPECT_TRUE(r.placed.empty());
  EXPECT_NE(r.waiting.at("large").find("reserving"), std::string::npos);
  // Once all 4 slots are free the large job runs.
  r = Pass({Job("large", 4, 0, 0), Job("small", 2, 0, 100)}, {Worker("w", 4, 4)}, o, 7000);
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
    auto r = Pass(queue, {Worker("w", 4, 4 - used)}, o, t);
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
  auto r = Pass(
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

QueuedJob UserJob(const std::string& id, const std::string& user, int64_t since, int world = 1,
                  int priority = 0) {
  QueuedJob j = Job(id, world, priority, since);
  j.user = user;
  return j;
}

std::vector<std::string> Ids(const std::vector<GangPlacement>& placed) {
  std::vector<std::string> ids;
  for (const auto& p : placed) ids.push_back(p.job_id);
  return ids;
}

// Fair share: within a band the user with the lowest (held + decayed average) / weight goes
// next, and each placement raises its user's score; a higher band still goes first.
TEST(SchedulerTest, FairShareTakesTurnsByUsageOverWeight) {
  SchedulerOptions o;
  o.aging_seconds = 1e9;
  std::vector<QueuedJob> queue;
  for (int i = 0; i < 4; ++i) queue.push_back(UserJob("a" + std::to_string(i), "alice", i));
  for (int i = 0; i < 4; ++i) queue.push_back(UserJob("b" + std::to_string(i), "bob", 10 + i));
  // No history: alice and bob alternate (ties go to the earlier job, alice's).
  auto r = Pass(queue, {Worker("w", 4, 4)}, o, 100);
  EXPECT_EQ(Ids(r.placed), (std::vector<std::string>{"a0", "b0", "a1", "b1"}));
  // Alice held 2 slots on average lately: bob catches up first, then they alternate.
  FairShare share;
  share.average["alice"] = 2;
  r = Pass(queue, {Worker("w", 4, 4)}, o, 100, {}, share);
  EXPECT_EQ(Ids(r.placed), (std::vector<std::string>{"b0", "b1", "a0", "b2"}));
  // With weight 2 her score halves: (0 + 2) / 2 = 1, so bob gets one job first.
  share.weight["alice"] = 2;
  r = Pass(queue, {Worker("w", 4, 4)}, o, 100, {}, share);
  EXPECT_EQ(Ids(r.placed), (std::vector<std::string>{"b0", "a0", "b1", "a1"}));
  // Weight 2 and no history: two slots for alice per slot for bob.
  share.average.clear();
  r = Pass(queue, {Worker("w", 6, 6)}, o, 100, {}, share);
  EXPECT_EQ(Ids(r.placed), (std::vector<std::string>{"a0", "b0", "a1", "a2", "b1", "a3"}));
  // Slots held now count like history.
  FairShare holding;
  holding.held["bob"] = 3;
  r = Pass(queue, {Worker("w", 4, 4)}, o, 100, {}, holding);
  EXPECT_EQ(Ids(r.placed), (std::vector<std::string>{"a0", "a1", "a2", "a3"}));
  // A higher priority goes before any fair-share turn.
  queue.push_back(UserJob("urgent", "bob", 50, 1, 3));
  r = Pass(queue, {Worker("w", 4, 1)}, o, 100, {}, holding);
  EXPECT_EQ(Ids(r.placed), (std::vector<std::string>{"urgent"}));
}

TEST(SchedulerTest, UsageLedgerDecaysWithItsHalfLife) {
  UsageLedger ledger(/*half_life_s=*/100);
  ledger.Advance(1000, {});
  ledger.Advance(101000, {{"alice", 4}});  // 4 slots for one half-life: average 2
  EXPECT_NEAR(ledger.averages().at("alice"), 2.0, 1e-9);
  ledger.Advance(201000, {});  // nothing held for another half-life: halves
  EXPECT_NEAR(ledger.averages().at("alice"), 1.0, 1e-9);
  // Rebuilt from the interval afterwards, the same value.
  UsageLedger rebuilt(100);
  rebuilt.Advance(201000, {});
  rebuilt.AddInterval("alice", 4, 1000, 101000);
  EXPECT_NEAR(rebuilt.averages().at("alice"), 1.0, 1e-9);
}

// A sweep's jobs go seed-major (every cell's seed 0 before any cell's seed 1) whatever order
// they are queued in, and max_concurrent caps its active jobs.
TEST(SchedulerTest, SweepsAdvanceRoundRobinOverSeedsUpToMaxConcurrent) {
  SchedulerOptions o;
  std::vector<QueuedJob> queue;
  const std::vector<std::string> cells = {"a", "b", "c"};
  for (int c = 0; c < 3; ++c) {
    for (int seed = 0; seed < 2; ++seed) {
      QueuedJob j = UserJob(cells[c] + std::to_string(seed), "alice", 0);
      j.sweep = "sweep-000001";
      j.sweep_order = seed * 3 + c;
      queue.push_back(j);
    }
  }
  auto r = Pass(queue, {Worker("w", 3, 3)}, o, 100);
  EXPECT_EQ(Ids(r.placed), (std::vector<std::string>{"a0", "b0", "c0"}));
  Quotas q;
  q.sweep_limit["sweep-000001"] = 2;
  q.sweep_active["sweep-000001"] = 1;
  r = Pass(queue, {Worker("w", 8, 8)}, o, 100, q);
  EXPECT_EQ(Ids(r.placed), (std::vector<std::string>{"a0"}));
  EXPECT_EQ(r.waiting.at("b0"),
            "sweep sweep-000001 has 2 of max_concurrent 2 jobs scheduled or running");
}

RunningJob Running(const std::string& id, int priority, int ranks, int64_t checkpoint_age_s,
                   const std::string& worker = "w") {
  RunningJob r;
  r.id = id;
  r.priority = priority;
  r.slots = {{worker, ranks}};
  r.checkpoint_age_ms = checkpoint_age_s * 1000;
  return r;
}

std::set<std::string> Victims(const std::vector<Preemption>& preempt) {
  std::set<std::string> out;
  for (const auto& p : preempt) out.insert(p.victim);
  return out;
}

// Preemption: after the grace, strictly lower priorities only, the least work lost first (then
// fewest ranks), as few victims as free the gang, never a protected one; jobs already stopping
// count as slots to come.
TEST(SchedulerTest, PreemptionChoosesTheVictimsThatLoseTheLeastWork) {
  SchedulerOptions o;
  o.preempt_after_ms = 30000;
  o.aging_seconds = 1e9;
  const std::vector<QueuedJob> urgent = {Job("urgent", 4, 5, 0)};
  const std::vector<FreeWorker> full = {Worker("w", 10, 0)};
  std::vector<RunningJob> running = {Running("old", 0, 4, 600), Running("fresh-a", 0, 2, 10),
                                     Running("fresh-b", 1, 2, 10), Running("peer", 5, 2, 1)};
  // Before the grace: nothing.
  auto r = Pass(urgent, full, o, 20000, {}, {}, running);
  EXPECT_TRUE(r.preempt.empty());
  // After: the two fresh jobs (10 s of work each) rather than the old one; never the peer of
  // equal priority.
  r = Pass(urgent, full, o, 30000, {}, {}, running);
  EXPECT_EQ(Victims(r.preempt), (std::set<std::string>{"fresh-a", "fresh-b"}));
  for (const auto& p : r.preempt) EXPECT_EQ(p.for_job, "urgent");
  EXPECT_NE(r.waiting.at("urgent").find("preempting 2 lower-priority jobs"), std::string::npos)
      << r.waiting.at("urgent");
  // Once they are stopping, the next pass asks nobody else and reserves what frees up.
  running[1].stopping = running[2].stopping = true;
  r = Pass(urgent, {Worker("w", 10, 2)}, o, 31000, {}, {}, running);
  EXPECT_TRUE(r.preempt.empty());
  EXPECT_NE(r.waiting.at("urgent").find("reserving"), std::string::npos);
  // A protected job (restarted after a preemption less than min_run ago) is spared: the old one
  // goes instead, alone, since its 4 ranks are enough.
  running[1].stopping = running[2].stopping = false;
  running[1].protected_until_ms = 60000;
  r = Pass(urgent, full, o, 30000, {}, {}, running);
  EXPECT_EQ(Victims(r.preempt), (std::set<std::string>{"old"}));
  // Victims on workers outside the job's pool free nothing for it.
  r = Pass({Job("gpu", 2, 5, 0, {{"pool", "gpu"}})},
           {Worker("w", 10, 0), Worker("g", 2, 0, {{"pool", "gpu"}})}, o, 30000, {}, {},
           {Running("cpu-job", 0, 2, 1, "w"), Running("gpu-job", 0, 2, 900, "g")});
  EXPECT_EQ(Victims(r.preempt), (std::set<std::string>{"gpu-job"}));
  // Nothing lower to take: no preemption, and nothing is asked to stop in vain.
  r = Pass(urgent, full, o, 30000, {}, {}, {Running("peer", 5, 10, 1)});
  EXPECT_TRUE(r.preempt.empty());
  o.preempt_after_ms = -1;
  r = Pass(urgent, full, o, 1 << 30, {}, {}, running);
  EXPECT_TRUE(r.preempt.empty()) << "preemption off";
}

TEST(SchedulerTest, PreemptionSparesVictimsItTurnsOutNotToNeed) {
  SchedulerOptions o;
  o.preempt_after_ms = 0;
  // Cheapest first: "tiny" (1 rank) then "big" (4); big alone frees 4, so tiny is spared.
  auto r = Pass({Job("urgent", 4, 1, 0)}, {Worker("w", 5, 0)}, o, 1000, {}, {},
                {Running("tiny", 0, 1, 1), Running("big", 0, 4, 2)});
  EXPECT_EQ(Victims(r.preempt), (std::set<std::string>{"big"}));
}

}  // namespace
}  // namespace loom::coordinator
