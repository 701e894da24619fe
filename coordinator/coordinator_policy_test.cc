// The coordinator's policies: who may change what, quotas, priorities and preemption, fair share,
// sweeps' concurrency, labels and private jobs.
#include "coordinator/coordinator_test_fixture.h"

namespace loom::coordinator {
namespace {

TEST_F(CoordinatorTest, LostWorkerFailsItsAttemptAndTheJobMoves) {
  OneOfTwo placed;
  ASSERT_NO_FATAL_FAILURE(PlaceOnOneOfTwo(/*lease_ms=*/150, &placed));
  const std::string &w1 = placed.w1, &w2 = placed.w2, &id = placed.id;
  // w2 keeps beating, w1 goes silent: lost after 300 ms, but the job is fenced for the
  // termination grace (w1's ranks stop themselves when their lease runs out).
  const int64_t silent = clock_->NowMs();
  while (Job(id).state() != "queued") {
    ASSERT_LT(clock_->NowMs() - silent, 3000);
    clock_->Advance(50);
    Beat(w2, "", 0, {});
    c_->Tick();
  }
  const int64_t lost = clock_->NowMs();
  EXPECT_GT(Job(id).not_before_ms(), 0);
  while (Job(id).state() == "queued") {
    ASSERT_LT(clock_->NowMs() - lost, 3000);
    clock_->Advance(50);
    Beat(w2, "", 0, {});
    c_->Tick();
  }
  EXPECT_GE(clock_->NowMs() - lost, 350) << "placed again before lost-after + termination grace";
  v1::Job job = Job(id);
  EXPECT_EQ(job.state(), "scheduled");
  ASSERT_EQ(job.placement_size(), 1);
  EXPECT_EQ(job.placement(0).worker_id(), w2);
  EXPECT_EQ(job.resume_from(), CheckpointPath(id, 10));
  // Losing a worker is not the job's failure: it does not use up max_restarts.
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.infra_restarts(), 1);
  bool lost_event = false;
  for (const auto& e : job.events())
    lost_event |= e.reason().find("worker " + w1 + " lost") != std::string::npos;
  EXPECT_TRUE(lost_event);
  auto workers = *c_->ListWorkers();
  for (const auto& w : workers.workers()) EXPECT_EQ(w.state(), w.id() == w1 ? "lost" : "alive");
  // The lost worker comes back with its stale attempt: it is told to stop it.
  auto hb = Beat(w1, id, 1, {{0, -1}});
  ASSERT_EQ(hb.cancels_size(), 1);
}

// Guarantee 5: a user changes only their own jobs and sweeps; an admin anyone's.
TEST_F(CoordinatorTest, OnlyTheOwnerOrAnAdminCancels) {
  const std::string id = Submit(MicroJob(1));  // alice's
  auto refused = c_->Cancel(id, Caller{"bob"});
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_NE(refused.status().message().find("belongs to alice"), std::string::npos);
  EXPECT_EQ(Job(id).state(), "queued");
  EXPECT_EQ(States(Job(id)), (std::vector<std::string>{"queued"})) << "nothing recorded";
  v1::SweepSpec sweep;
  *sweep.mutable_base() = MicroJob(1);
  sweep.add_seeds(1);
  auto created = c_->CreateSweep(sweep, "alice");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(c_->CancelSweep(created->id(), Caller{"bob"}).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(c_->Cancel(id, Caller{"carol", true}).ok()) << "an admin may";
  EXPECT_EQ(Job(id).events(1).reason(), "cancelled by carol");
  EXPECT_TRUE(c_->CancelSweep(created->id(), Caller{"alice"}).ok()) << "the owner may";
}

// PATCH /v1/jobs/{id}: priority and retention, owner-or-admin, each change an event.
TEST_F(CoordinatorTest, OwnersChangePriorityAndRetention) {
  const std::string w = RegisterWorker("a", 1);
  const std::string id = Submit(MicroJob(1));
  c_->Tick();
  Beat(w, id, 1, {{0, -1}}, {}, 31000);
  for (int64_t step : {10, 20, 30}) WriteCheckpointDir(id, step);
  Beat(w, id, 1, {{0, -1}}, {10, 20, 30});
  v1::JobUpdate raise;
  raise.set_priority(5);
  EXPECT_EQ(c_->UpdateJob(id, raise, Caller{"bob"}).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Job(id).priority(), 0) << "bob changed nothing";
  auto changed = c_->UpdateJob(id, raise, Caller{"alice"});
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_EQ(changed->priority(), 5);
  EXPECT_EQ(Job(id).events().rbegin()->reason(), "priority 0 -> 5 by alice");
  v1::JobUpdate keep;
  keep.set_keep_last(1);
  ASSERT_TRUE(c_->UpdateJob(id, keep, Caller{"carol", true}).ok()) << "an admin may";
  auto catalogue = c_->ListCheckpoints(id, 100, "", "");
  ASSERT_TRUE(catalogue.ok());
  std::map<int64_t, bool> deleted;
  for (const auto& e : catalogue->checkpoints()) deleted[e.step()] = e.deleted();
  EXPECT_EQ(deleted, (std::map<int64_t, bool>{{10, true}, {20, true}, {30, false}}));
  v1::JobUpdate bad;
  EXPECT_EQ(c_->UpdateJob(id, bad, Caller{"alice"}).status().code(),
            absl::StatusCode::kInvalidArgument)
      << "nothing to change";
  bad.set_keep_last(0);
  EXPECT_EQ(c_->UpdateJob(id, bad, Caller{"alice"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad.clear_keep_last();
  bad.set_priority(5000);
  EXPECT_EQ(c_->UpdateJob(id, bad, Caller{"alice"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(c_->Cancel(id, Caller{"alice"}).ok());
  EXPECT_EQ(c_->UpdateJob(id, raise, Caller{"alice"}).status().code(),
            absl::StatusCode::kFailedPrecondition)
      << "an ended job's priority no longer matters";
  keep.set_keep_last(2);
  EXPECT_TRUE(c_->UpdateJob(id, keep, Caller{"alice"}).ok()) << "its retention still does";
}

// Quotas: set by admins, persisted; a job beyond its owner's or its project's waits with the
// reason and runs once the quota allows; nothing is refused or failed for it.
TEST_F(CoordinatorTest, QuotasHoldJobsQueuedWithTheirReason) {
  RegisterWorker("big", 16);
  v1::Quota q;
  q.set_kind("user");
  q.set_name("alice");
  q.set_slots(4);
  EXPECT_EQ(c_->SetQuota(q, Caller{"alice"}).status().code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(c_->SetQuota(q, Caller{"root", true}).ok());
  v1::Quota bad = q;
  bad.set_kind("group");
  EXPECT_EQ(c_->SetQuota(bad, Caller{"root", true}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string a = Submit(MicroJob(2)), b = Submit(MicroJob(2)), third = Submit(MicroJob(2));
  auto bobs = c_->Submit(MicroJob(2), "bob");
  ASSERT_TRUE(bobs.ok());
  c_->Tick();
  EXPECT_EQ(Job(a).placement_size(), 1);
  EXPECT_EQ(Job(b).placement_size(), 1);
  EXPECT_EQ(Job(bobs->id()).placement_size(), 1) << "bob has no quota";
  EXPECT_EQ(Job(third).state(), "queued");
  EXPECT_EQ(Job(third).reason(), "quota: alice uses 4 of 4 slots");
  auto listed = c_->ListQuotas();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->quotas_size(), 1);
  EXPECT_EQ(listed->quotas(0).used(), 4);
  // A project quota counts the jobs labelled with it, whoever owns them.
  v1::Quota project;
  project.set_kind("project");
  project.set_name("iha");
  project.set_slots(2);
  ASSERT_TRUE(c_->SetQuota(project, Caller{"root", true}).ok());
  v1::SubmitJobRequest labelled = MicroJob(2);
  (*labelled.mutable_labels())["project"] = "iha";
  auto first = c_->Submit(labelled, "bob"), second = c_->Submit(labelled, "carol");
  ASSERT_TRUE(first.ok() && second.ok());
  c_->Tick();
  // Carol goes first by fair share (bob holds 2 slots already, she none).
  EXPECT_EQ(Job(second->id()).placement_size(), 1);
  EXPECT_EQ(Job(first->id()).reason(), "quota: project iha uses 2 of 2 slots");
  // Raising alice's quota lets her third job run.
  q.set_slots(6);
  ASSERT_TRUE(c_->SetQuota(q, Caller{"root", true}).ok());
  c_->Tick();
  EXPECT_EQ(Job(third).placement_size(), 1);
  ASSERT_TRUE(c_->DeleteQuota("project", "iha", Caller{"root", true}).ok());
  EXPECT_EQ(c_->DeleteQuota("project", "iha", Caller{"root", true}).code(),
            absl::StatusCode::kNotFound);
  Reopen();  // persisted: the user quota, not the deleted one
  listed = c_->ListQuotas();
  ASSERT_EQ(listed->quotas_size(), 1);
  EXPECT_EQ(listed->quotas(0).name(), "alice");
  EXPECT_EQ(listed->quotas(0).slots(), 6);
}

// Preemption end to end in the state machine: after the grace, an urgent job that cannot be
// placed has the lower-priority job stopped (its agent is told to cancel the attempt); once its
// ranks exit 76 it is requeued with its place kept and no restart counted, resumes from its
// checkpoint, and is protected from another preemption for min_run.
TEST_F(CoordinatorTest, UrgentJobPreemptsALowerPriorityOneWhichRequeuesUncounted) {
  options_.scheduler.preempt_after_ms = 30000;
  options_.scheduler.min_run_ms = 600000;
  Reopen();
  const std::string w = RegisterWorker("a", 2);
  const std::string low = Submit(MicroJob(2));
  c_->Tick();
  Beat(w, low, 1, {{0, -1}, {1, -1}}, {}, 31000);
  WriteCheckpointDir(low, 10);
  Beat(w, low, 1, {{0, -1}, {1, -1}}, {10});
  v1::SubmitJobRequest urgent_request = MicroJob(2);
  urgent_request.set_priority(5);
  auto urgent = c_->Submit(urgent_request, "bob");
  ASSERT_TRUE(urgent.ok());
  c_->Tick();
  EXPECT_FALSE(Job(low).preempt_requested()) << "not before the grace";
  EXPECT_NE(Job(urgent->id()).reason().find("waiting for 2 slots"), std::string::npos);
  clock_->Advance(30000);
  c_->Tick();
  EXPECT_TRUE(Job(low).preempt_requested());
  EXPECT_EQ(Job(low).preempted_for(), urgent->id());
  EXPECT_NE(Job(urgent->id()).reason().find("preempting 1 lower-priority job"), std::string::npos)
      << Job(urgent->id()).reason();
  // Its agent is told to stop the attempt; the ranks checkpoint and exit 76.
  auto hb = Beat(w, low, 1, {{0, -1}, {1, -1}});
  ASSERT_EQ(hb.cancels_size(), 1);
  EXPECT_EQ(hb.cancels(0).job_id(), low);
  c_->Tick();
  EXPECT_EQ(Job(low).preemptions(), 0) << "nothing is requeued before the ranks are gone";
  WriteCheckpointDir(low, 12);
  Beat(w, low, 1, {{0, kExitStopped}, {1, kExitStopped}}, {12});
  v1::Job requeued = Job(low);
  EXPECT_EQ(requeued.state(), "queued");
  EXPECT_EQ(requeued.preemptions(), 1);
  EXPECT_EQ(requeued.restarts(), 0);
  EXPECT_EQ(requeued.infra_restarts(), 0);
  EXPECT_EQ(requeued.queued_since_ms(), Job(low).submit_time_ms()) << "its place is kept";
  EXPECT_TRUE(requeued.history(0).preempted());
  EXPECT_NE(requeued.reason().find("requeued from step 12"), std::string::npos)
      << requeued.reason();
  c_->Tick();
  EXPECT_EQ(Job(urgent->id()).placement_size(), 1) << Job(urgent->id()).reason();
  // The urgent job finishes; the preempted one resumes from its checkpoint.
  Beat(w, urgent->id(), 1, {{0, 0}, {1, 0}});
  c_->Tick();
  v1::Job resumed = Job(low);
  ASSERT_EQ(resumed.attempt(), 2);
  EXPECT_EQ(resumed.resume_from(), CheckpointPath(low, 12));
  Beat(w, low, 2, {{0, -1}, {1, -1}});
  // A second urgent job cannot preempt it again within min_run, even after the grace.
  auto second = c_->Submit(urgent_request, "bob");
  ASSERT_TRUE(second.ok());
  auto run_for = [&](int minutes) {
    for (int i = 0; i < minutes; ++i) {
      clock_->Advance(60000);
      Beat(w, low, 2, {{0, -1}, {1, -1}});
      c_->Tick();
    }
  };
  run_for(5);
  EXPECT_FALSE(Job(low).preempt_requested()) << "protected for min_run";
  run_for(6);
  EXPECT_TRUE(Job(low).preempt_requested()) << "after min_run it may be preempted again";
  // Never for a job of equal priority.
  EXPECT_EQ(Job(second->id()).priority(), 5);
}

// A victim whose worker is lost while it stops is an infrastructure failure like any other:
// requeued, and its next attempt is not stopped for the old preemption.
TEST_F(CoordinatorTest, APreemptionOfAnAttemptLostMeanwhileIsVoid) {
  options_.scheduler.preempt_after_ms = 0;
  options_.lost_after_ms = 10000;
  Reopen();
  const std::string w = RegisterWorker("a", 1);
  const std::string low = Submit(MicroJob(1));
  c_->Tick();
  Beat(w, low, 1, {{0, -1}}, {}, 31000);
  v1::SubmitJobRequest urgent = MicroJob(1);
  urgent.set_priority(5);
  const std::string high = Submit(urgent);
  c_->Tick();
  ASSERT_TRUE(Job(low).preempt_requested());
  clock_->Advance(11000);  // the worker goes silent: lost
  c_->Tick();
  v1::Job requeued = Job(low);
  EXPECT_EQ(requeued.state(), "queued");
  EXPECT_FALSE(requeued.preempt_requested());
  EXPECT_EQ(requeued.infra_restarts(), 1);
  EXPECT_EQ(requeued.preemptions(), 0);
  (void)high;
}

// A small trace through the real coordinator (state machine, RocksDB, heartbeats, ManualClock):
// 4 workers x 16 slots; alice, bob and carol (weight 2) each queue 40 jobs of 1..4 ranks; later
// two urgent 16-rank jobs of bob's. Agents report ranks running, exiting 0 once a job's work is
// done, or exiting 76 when told to stop. Every job succeeds with no restart counted; while all
// three users wait, carol holds about twice alice's slots and bob about as many; the urgent jobs
// preempt and start within the grace and a stop.
TEST_F(CoordinatorTest, ATraceThroughTheCoordinatorKeepsSharesAndPreempts) {
  options_.scheduler.preempt_after_ms = 30000;
  options_.scheduler.min_run_ms = 60000;
  Reopen();
  v1::Quota carol;
  carol.set_kind("user");
  carol.set_name("carol");
  carol.set_weight(2);
  ASSERT_TRUE(c_->SetQuota(carol, Caller{"root", true}).ok());
  std::vector<std::string> workers;
  for (int i = 0; i < 4; ++i) workers.push_back(RegisterWorker("w" + std::to_string(i), 16));
  std::vector<std::string> ids;
  std::map<std::string, int> work, full;  // ticks of work left, per job
  std::map<std::string, std::string> owner;
  auto submit = [&](const std::string& user, int world, int priority, int ticks) {
    v1::SubmitJobRequest r = MicroJob(world);
    r.set_priority(priority);
    auto job = c_->Submit(r, user);
    ASSERT_TRUE(job.ok()) << job.status();
    ids.push_back(job->id());
    work[job->id()] = full[job->id()] = ticks;
    owner[job->id()] = user;
  };
  for (int i = 0; i < 40; ++i) {
    for (const std::string user : {"alice", "bob", "carol"}) submit(user, 1 + i % 4, 0, 6 + i % 5);
  }
  std::set<std::pair<std::string, int>> told_to_stop;
  std::map<std::string, double> held_while_all_wait;
  std::vector<std::string> urgent;
  int64_t urgent_at = 0;
  for (int tick = 0; tick < 600; ++tick) {
    if (tick == 30) {
      urgent_at = clock_->NowMs();
      submit("bob", 16, 5, 5);
      submit("bob", 16, 5, 5);
      urgent = {ids[ids.size() - 2], ids.back()};
    }
    clock_->Advance(10000);
    c_->Tick();
    std::map<std::string, v1::Job> jobs;
    for (const auto& id : ids) jobs[id] = Job(id);
    for (const std::string& w : workers) {
      v1::HeartbeatRequest req;
      req.set_worker_id(w);
      for (const auto& [id, job] : jobs) {
        if (!IsActive(job)) continue;
        for (const v1::Placement& p : job.placement()) {
          if (p.worker_id() != w) continue;
          v1::AttemptReport* a = req.add_attempts();
          a->set_job_id(id);
          a->set_attempt(job.attempt());
          a->mutable_progress()->set_update_time_ms(clock_->NowMs());
          const int code = told_to_stop.count({id, job.attempt()}) ? kExitStopped
                           : work[id] <= 0                         ? 0
                                                                   : -1;
          for (int rank : p.ranks()) {
            v1::RankStatus* st = a->add_ranks();
            st->set_rank(rank);
            st->set_running(code < 0);
            st->set_exit_code(code < 0 ? 0 : code);
          }
          a->set_finished(code >= 0);
        }
      }
      auto resp = c_->Heartbeat(req, w);
      ASSERT_TRUE(resp.ok()) << resp.status();
      for (const auto& stop : resp->cancels()) told_to_stop.insert({stop.job_id(), stop.attempt()});
    }
    // Work advances for running attempts; a preempted job starts over (no checkpoint here).
    std::map<std::string, int> held;
    std::set<std::string> waiting;
    for (const auto& id : ids) {
      const v1::Job job = Job(id);
      if (job.state() == "running") {
        --work[id];
        held[owner[id]] += job.world_size();
      }
      if (job.state() == "queued") {
        waiting.insert(owner[id]);
        if (job.preemptions() > 0 && work[id] != full[id]) work[id] = full[id];
      }
    }
    if (tick < 30 && waiting.size() == 3) {
      for (const auto& [user, slots] : held) held_while_all_wait[user] += slots;
    }
    bool all_done = true;
    for (const auto& id : ids) all_done &= Job(id).state() == "succeeded";
    if (all_done) break;
  }
  int preemptions = 0;
  for (const auto& id : ids) {
    const v1::Job job = Job(id);
    EXPECT_EQ(job.state(), "succeeded") << id << ": " << job.reason();
    EXPECT_EQ(job.restarts(), 0) << id;
    EXPECT_EQ(job.infra_restarts(), 0) << id;
    preemptions += job.preemptions();
  }
  EXPECT_GT(preemptions, 0);
  for (const auto& id : urgent) {
    const v1::Job job = Job(id);
    ASSERT_GT(job.history_size(), 0);
    EXPECT_LE(job.history(0).start_time_ms() - urgent_at, 30000 + 4 * 10000)
        << id << ": the grace, a stop, a pass";
  }
  ASSERT_GT(held_while_all_wait["alice"], 0);
  const double carol_ratio = held_while_all_wait["carol"] / held_while_all_wait["alice"];
  const double bob_ratio = held_while_all_wait["bob"] / held_while_all_wait["alice"];
  EXPECT_GT(carol_ratio, 1.4) << "weight 2";
  EXPECT_LT(carol_ratio, 2.8);
  EXPECT_GT(bob_ratio, 0.6);
  EXPECT_LT(bob_ratio, 1.6);
}

TEST_F(CoordinatorTest, NoPreemptionForEqualPriorityOrWhenDisabled) {
  options_.scheduler.preempt_after_ms = 0;
  Reopen();
  const std::string w = RegisterWorker("a", 1);
  const std::string first = Submit(MicroJob(1));
  c_->Tick();
  Beat(w, first, 1, {{0, -1}}, {}, 31000);
  const std::string second = Submit(MicroJob(1));
  clock_->Advance(3600000);
  c_->Tick();
  EXPECT_FALSE(Job(first).preempt_requested()) << "equal priority";
  options_.scheduler.preempt_after_ms = -1;
  Reopen();
  v1::SubmitJobRequest urgent = MicroJob(1);
  urgent.set_priority(9);
  Submit(urgent);
  Beat(w, first, 1, {{0, -1}}, {}, 31000);
  clock_->Advance(3600000);
  c_->Tick();
  EXPECT_FALSE(Job(first).preempt_requested()) << "--preempt-after-s -1";
}

// Fair share through the coordinator: weights are set like quotas (a user entry with a weight
// alone limits nothing), and the usage history survives a restart (rebuilt from attempts).
TEST_F(CoordinatorTest, FairShareFollowsWeightsAndHistoryAcrossARestart) {
  options_.fair_share_half_life_s = 3600;
  Reopen();
  v1::Quota weight;
  weight.set_kind("user");
  weight.set_name("bob");
  weight.set_weight(3);
  auto set = c_->SetQuota(weight, Caller{"root", true});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_FALSE(set->has_slots());
  weight.set_kind("project");
  EXPECT_EQ(c_->SetQuota(weight, Caller{"root", true}).status().code(),
            absl::StatusCode::kInvalidArgument);
  weight.set_kind("user");
  weight.set_weight(std::nan(""));
  EXPECT_EQ(c_->SetQuota(weight, Caller{"root", true}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Alice runs a 4-slot job for an hour; then it ends.
  const std::string w = RegisterWorker("a", 4);
  const std::string history = Submit(MicroJob(4));
  c_->Tick();
  Beat(w, history, 1, {{0, -1}, {1, -1}, {2, -1}, {3, -1}}, {}, 31000);
  for (int i = 0; i < 60; ++i) {
    clock_->Advance(60000);
    c_->Tick();
    Beat(w, history, 1, {{0, -1}, {1, -1}, {2, -1}, {3, -1}});
  }
  Beat(w, history, 1, {{0, 0}, {1, 0}, {2, 0}, {3, 0}});
  ASSERT_EQ(Job(history).state(), "succeeded");
  Reopen();  // the usage is rebuilt from the attempt's start and end
  Beat(w, "", 0, {});
  // Two one-slot jobs each, alice's queued first: bob (no usage, weight 3) gets three turns
  // before alice's history lets her have one.
  std::vector<std::string> alice, bob;
  for (int i = 0; i < 4; ++i) alice.push_back(Submit(MicroJob(1)));
  for (int i = 0; i < 4; ++i) bob.push_back(c_->Submit(MicroJob(1), "bob")->id());
  c_->Tick();
  int alice_placed = 0, bob_placed = 0;
  for (const auto& id : alice) alice_placed += Job(id).placement_size();
  for (const auto& id : bob) bob_placed += Job(id).placement_size();
  // Alice's decayed average: 4 slots for one half-life = 2, score 2; bob's four jobs take him to
  // 4/3 only.
  EXPECT_EQ(bob_placed, 4) << "alice held 4 slots for an hour: bob catches up first";
  EXPECT_EQ(alice_placed, 0);
}

// Usage accrues on every pass, also while nothing waits: an hour of alice's 4 slots with an
// empty queue still counts when bob and she next compete.
TEST_F(CoordinatorTest, UsageAccruesWhileTheQueueIsEmpty) {
  options_.fair_share_half_life_s = 3600;
  Reopen();
  const std::string w = RegisterWorker("a", 4);
  const std::string history = Submit(MicroJob(4));
  c_->Tick();
  for (int i = 0; i < 60; ++i) {
    Beat(w, history, 1, {{0, -1}, {1, -1}, {2, -1}, {3, -1}});
    clock_->Advance(60000);
    c_->Tick();
  }
  Beat(w, history, 1, {{0, 0}, {1, 0}, {2, 0}, {3, 0}});
  ASSERT_EQ(Job(history).state(), "succeeded");
  std::vector<std::string> alice, bob;
  for (int i = 0; i < 4; ++i) alice.push_back(Submit(MicroJob(1)));
  for (int i = 0; i < 4; ++i) bob.push_back(c_->Submit(MicroJob(1), "bob")->id());
  c_->Tick();
  int bob_placed = 0;
  for (const auto& id : bob) bob_placed += Job(id).placement_size();
  EXPECT_GE(bob_placed, 3) << "alice's hour alone counts: bob goes first";
}

// A sweep's cells advance round-robin over seeds (seed-major), and max_concurrent caps it.
TEST_F(CoordinatorTest, SweepsRunSeedMajorUpToMaxConcurrent) {
  RegisterWorker("a", 8);
  v1::SweepSpec sweep;
  *sweep.mutable_base() = MicroJob(1);
  auto* lr = &(*sweep.mutable_grid())["optimizer.lr"];
  lr->add_values()->set_number_value(0.001);
  lr->add_values()->set_number_value(0.002);
  lr->add_values()->set_number_value(0.004);
  for (int seed = 1; seed <= 3; ++seed) sweep.add_seeds(seed);
  sweep.set_max_concurrent(4);
  auto created = c_->CreateSweep(sweep, "alice");
  ASSERT_TRUE(created.ok()) << created.status();
  c_->Tick();
  auto got = c_->GetSweep(created->id());
  ASSERT_TRUE(got.ok()) << got.status();
  std::map<uint64_t, int> placed_by_seed;
  int waiting = 0;
  for (const auto& j : got->jobs()) {
    const v1::Job job = Job(j.job_id());
    if (job.placement_size() > 0) {
      ++placed_by_seed[j.seed()];
    } else {
      ++waiting;
      EXPECT_NE(job.reason().find("of max_concurrent 4"), std::string::npos) << job.reason();
    }
  }
  EXPECT_EQ(placed_by_seed, (std::map<uint64_t, int>{{1, 3}, {2, 1}}))
      << "every cell's first seed before any cell's second";
  EXPECT_EQ(waiting, 5);
  sweep.set_max_concurrent(-1);
  EXPECT_EQ(c_->CreateSweep(sweep, "alice").status().code(), absl::StatusCode::kInvalidArgument);
}

// Labels and a description on jobs and sweeps; lists filter by labels; a sweep's go to its jobs.
TEST_F(CoordinatorTest, LabelsFilterJobsAndSweeps) {
  v1::SubmitJobRequest r = MicroJob(1);
  (*r.mutable_labels())["project"] = "iha";
  (*r.mutable_labels())["stage"] = "ablation-2";
  r.set_description("p = 2 against MHA at equal parameters");
  const std::string labelled = Submit(r);
  const std::string plain = Submit(MicroJob(1));
  EXPECT_EQ(Job(labelled).request().description(), "p = 2 against MHA at equal parameters");
  auto ids = [&](const std::string& selector) {
    Coordinator::JobFilter f;
    f.labels = selector;
    auto list = c_->ListJobs(f, 100, "");
    EXPECT_TRUE(list.ok()) << list.status();
    std::vector<std::string> out;
    if (list.ok())
      for (const auto& j : list->jobs()) out.push_back(j.id());
    return out;
  };
  EXPECT_EQ(ids("project=iha"), (std::vector<std::string>{labelled}));
  EXPECT_EQ(ids("project=iha,stage=ablation-2"), (std::vector<std::string>{labelled}));
  EXPECT_TRUE(ids("project=mha").empty());
  EXPECT_EQ(ids("").size(), 2u) << plain;
  Coordinator::JobFilter bad;
  bad.labels = "project";
  EXPECT_EQ(c_->ListJobs(bad, 100, "").status().code(), absl::StatusCode::kInvalidArgument);
  for (const auto& [key, value] : std::vector<std::pair<std::string, std::string>>{
           {"Project", "x"}, {"-x", "y"}, {"ok", "has space"}, {std::string(64, 'k'), "v"}}) {
    v1::SubmitJobRequest b = MicroJob(1);
    (*b.mutable_labels())[key] = value;
    auto refused = c_->Submit(b, "alice");
    ASSERT_FALSE(refused.ok()) << key << "=" << value;
    EXPECT_EQ(refused.status().message().rfind("labels", 0), 0u) << refused.status();
  }
  v1::SubmitJobRequest long_text = MicroJob(1);
  long_text.set_description(std::string(1025, 'x'));
  EXPECT_FALSE(c_->Submit(long_text, "alice").ok());
  v1::SweepSpec sweep;
  *sweep.mutable_base() = r;
  sweep.add_seeds(1);
  sweep.add_seeds(2);
  (*sweep.mutable_labels())["sweep-set"] = "nightly";
  auto created = c_->CreateSweep(sweep, "alice");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(ids("sweep-set=nightly,project=iha").size(), 2u) << "the sweep's jobs carry both";
  auto sweeps = c_->ListSweeps(100, "", "", "sweep-set=nightly");
  ASSERT_TRUE(sweeps.ok()) << sweeps.status();
  ASSERT_EQ(sweeps->sweeps_size(), 1);
  EXPECT_EQ(c_->ListSweeps(100, "", "", "sweep-set=weekly")->sweeps_size(), 0);
}

// --private-jobs, through the real router (HttpServer::Answer, no socket): a user reads only
// their own jobs and sweeps; an admin reads all; without the flag everyone reads everything.
// --max-user-priority, through the real router: a user's submission, sweep base or PATCH above
// the ceiling is 403 and stores nothing; an admin's is not limited.
TEST_F(CoordinatorTest, PrioritiesAboveTheUserCeilingAreForAdmins) {
  const std::string alice = "alice-token-0123456789", root = "root-token-0123456789ab";
  net::HttpServer server(net::HttpServerOptions{});
  ApiOptions api;
  api.user_tokens = {{alice, "alice"}, {root, "root"}};
  api.admins = {"root"};
  api.max_user_priority = 0;
  InstallUserRoutes(server, *c_, api);
  auto send = [&](const std::string& token, const std::string& method, const std::string& target,
                  const std::string& body) {
    return server.Answer(method, target,
                         {{"host", "127.0.0.1"},
                          {"authorization", "Bearer " + token},
                          {"content-type", "application/json"},
                          {"content-length", std::to_string(body.size())}},
                         body);
  };
  const std::string job = R"({"spec": {"preset": "micro", "steps": 4}, "world_size": 1)";
  auto r = send(alice, "POST", "/v1/jobs", job + R"(, "priority": 5})");
  EXPECT_EQ(r.status, 403) << r.body;
  EXPECT_NE(r.body.find("--max-user-priority"), std::string::npos) << r.body;
  r = send(alice, "POST", "/v1/sweeps",
           R"({"base": )" + job + R"(, "priority": 1}, "seeds": [1]})");
  EXPECT_EQ(r.status, 403) << r.body;
  r = send(alice, "POST", "/v1/jobs", job + "}");
  ASSERT_EQ(r.status, 201) << r.body;
  const std::string id = "job-000001";
  EXPECT_EQ(send(alice, "PATCH", "/v1/jobs/" + id, R"({"priority": 3})").status, 403);
  EXPECT_EQ(send(alice, "PATCH", "/v1/jobs/" + id, R"({"priority": -5})").status, 200)
      << "lowering is always allowed";
  EXPECT_EQ(send(root, "PATCH", "/v1/jobs/" + id, R"({"priority": 50})").status, 200);
  EXPECT_EQ(Job(id).priority(), 50);
  EXPECT_EQ(send(root, "POST", "/v1/jobs", job + R"(, "priority": 9})").status, 201);
}

TEST_F(CoordinatorTest, PrivateJobsAreReadByTheirOwnerOrAnAdminOnly) {
  const std::string alices = Submit(MicroJob(1));
  auto b = c_->Submit(MicroJob(1), "bob");
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string bobs = b->id();
  v1::SweepSpec sweep;
  *sweep.mutable_base() = MicroJob(1);
  sweep.add_seeds(1);
  auto created = c_->CreateSweep(sweep, "alice");
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string sweep_id = created->id();
  const std::string alice = "alice-token-0123456789", bob = "bob-token-0123456789ab",
                    carol = "carol-token-0123456789";
  for (const bool private_jobs : {true, false}) {
    net::HttpServer server(net::HttpServerOptions{});
    ApiOptions api;
    api.user_tokens = {{alice, "alice"}, {bob, "bob"}, {carol, "carol"}};
    api.admins = {"carol"};
    api.private_jobs = private_jobs;
    InstallUserRoutes(server, *c_, api);
    auto get = [&](const std::string& token, const std::string& target) {
      return server.Answer("GET", target,
                           {{"host", "127.0.0.1"}, {"authorization", "Bearer " + token}}, "");
    };
    const int other = private_jobs ? 403 : 200;
    for (const std::string& path :
         {"/v1/jobs/" + alices, "/v1/jobs/" + alices + "/logs", "/v1/jobs/" + alices + "/metrics",
          "/v1/sweeps/" + sweep_id, "/v1/sweeps/" + sweep_id + "/report"}) {
      auto r = get(bob, path);
      EXPECT_EQ(r.status, other) << path << ": " << r.body;
      if (private_jobs) {
        EXPECT_NE(r.body.find("belongs to alice"), std::string::npos) << r.body;
      }
      EXPECT_EQ(get(carol, path).status, 200) << "an admin reads " << path;
      EXPECT_EQ(get(alice, path).status, 200) << "the owner reads " << path;
    }
    const std::string listed = get(bob, "/v1/jobs").body;
    EXPECT_NE(listed.find(bobs), std::string::npos);
    EXPECT_EQ(listed.find(alices) != std::string::npos, !private_jobs) << listed;
    EXPECT_EQ(get(bob, "/v1/jobs?user=alice").status, other);
    EXPECT_EQ(get(bob, "/v1/sweeps").body.find(sweep_id) != std::string::npos, !private_jobs);
    EXPECT_NE(get(carol, "/v1/jobs").body.find(alices), std::string::npos);
    EXPECT_NE(get(carol, "/v1/sweeps").body.find(sweep_id), std::string::npos);
  }
}

// The --user-tokens file: "<user> <token> [admin]"; a file without roles reads as before.

}  // namespace
}  // namespace loom::coordinator
