// The coordinator's state machine on a real RocksDB in a temporary directory: validation,
// persistence across a reopen, the attempt lifecycle driven by agent heartbeats (start,
// checkpoints, rank failure -> restart from the newest checkpoint, success), lost workers, the
// coordinator's own pauses and partitions, and job logs. Time is a ManualClock the tests move on:
// heartbeat silence, leases and fencing take no real waiting.
#include "coordinator/coordinator_test_fixture.h"
#include "coordinator/job_logs.h"

namespace loom::coordinator {
namespace {

TEST_F(CoordinatorTest, RejectsBadSubmissionsNamingTheField) {
  struct Case {
    std::function<void(v1::SubmitJobRequest&)> edit;
    std::string field;
  };
  std::vector<Case> cases = {
      {[](auto& r) { r.clear_spec(); }, "spec: is required"},
      {[](auto& r) { r.set_world_size(-1); }, "world_size"},
      {[](auto& r) { r.set_world_size(5000); }, "world_size"},
      {[](auto& r) { r.set_priority(1001); }, "priority"},
      {[](auto& r) { r.set_max_restarts(-2); }, "max_restarts"},
      {[](auto& r) { (*r.mutable_pool())["bad key!"] = "x"; }, "pool"},
      {[](auto& r) { r.set_request_id("spaces are bad"); }, "request_id"},
      {[](auto& r) { r.set_init_from("job-000042/10"); }, "init_from"},
      {[](auto& r) { r.mutable_spec()->mutable_model()->set_n_heads(3); }, "spec.model"},
      {[](auto& r) { r.mutable_spec()->mutable_checkpoint()->set_dir("../../etc"); },
       "spec.checkpoint.dir"},
      {[](auto& r) { r.mutable_spec()->mutable_checkpoint()->set_dir("/etc/loom"); },
       "spec.checkpoint.dir"},
      {[](auto& r) {
         r.mutable_spec()->mutable_data()->set_source("shards");
         r.mutable_spec()->mutable_data()->set_path("/etc/passwd");
       },
       "spec.data.path"},
      {[](auto& r) { r.mutable_spec()->mutable_metrics()->set_jsonl("/tmp/x.jsonl"); },
       "spec.metrics.jsonl"},
      {[](auto& r) { r.mutable_spec()->mutable_metrics()->set_port(9400); }, "spec.metrics.port"},
      // A built-in task is checked as the trainer builds it: its options, the sequence length
      // and the model's fit.
      {[](auto& r) { KHop(r, R"({"nodes": 8, "hops": 3, "walks": "loops"})"); },
       "spec.data.task_options.walks"},
      {[](auto& r) { KHop(r, R"({"nodes": 8, "colour": "red"})"); },
       "spec.data.task_options.colour"},
      {[](auto& r) { KHop(r, R"({"nodes": 8, "hops": {"deep": 1}})"); },
       "spec.data.task_options.hops"},
      {[](auto& r) {
         KHop(r, R"({"nodes": 26, "queries": 26})");
         r.mutable_spec()->set_seq_len(64);
       },
       "spec.seq_len"},
      {[](auto& r) {
         KHop(r, "{}");
         r.mutable_spec()->mutable_data()->set_task("relation_binary");  // an encoder task
       },
       "spec.model.mode"},
      {[](auto& r) {
         KHop(r, R"({"nodes": 8, "hops": 3})");
         r.mutable_spec()->mutable_eval()->add_lengths(20);  // too short for the graph
       },
       "spec.eval.lengths: 20"},
  };
  for (const auto& c : cases) {
    v1::SubmitJobRequest r = MicroJob();
    c.edit(r);
    auto s = c_->Submit(r, "alice");
    ASSERT_FALSE(s.ok()) << c.field;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(s.status().message().find(c.field), std::string::npos) << s.status();
  }
  // Nothing was stored.
  auto list = c_->ListJobs("", 500, "");
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->jobs_size(), 0);
}

TEST_F(CoordinatorTest, PathsStayInsideTheStorageRoot) {
  const std::string root = fs::weakly_canonical(options_.storage_root).string();
  // Checkpoints always go to the job's own directory; a client may not choose one (another
  // job's directory would let it run retention there).
  v1::SubmitJobRequest r = MicroJob();
  r.mutable_spec()->mutable_checkpoint()->set_dir("jobs/job-000001/checkpoints");
  auto refused = c_->Submit(r, "alice");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("spec.checkpoint.dir"), std::string::npos);
  const std::string id = Submit(MicroJob());
  EXPECT_EQ(Job(id).spec().checkpoint().dir(), root + "/jobs/" + id + "/checkpoints");
  // Relative data paths resolve inside the root; a symlink inside it that leads out is refused.
  fs::create_directories(fs::path(root) / "data" / "set");
  fs::create_symlink("/etc", fs::path(root) / "data" / "escape");
  r = MicroJob();
  r.mutable_spec()->mutable_data()->set_source("shards");
  r.mutable_spec()->mutable_data()->set_path("data/set");
  EXPECT_EQ(Job(Submit(r)).spec().data().path(), root + "/data/set");
  // A dangling link is refused too: the file it names may exist only on the workers (their
  // credential; weakly_canonical used to return such a link's own in-root path). So is a
  // relative link that climbs out, and a chain whose last link leaves.
  fs::create_symlink("/var/lib/loom-worker/worker-credential", fs::path(root) / "data" / "cred");
  fs::create_symlink("../../..", fs::path(root) / "data" / "up");
  fs::create_symlink("escape", fs::path(root) / "data" / "chain");
  for (const std::string path : {"data/escape/passwd", "data/escape", "../outside", "/etc",
                                 "data/cred", "data/up/etc", "data/chain/passwd"}) {
    r.mutable_spec()->mutable_data()->set_path(path);
    auto s = c_->Submit(r, "alice");
    ASSERT_FALSE(s.ok()) << path;
    EXPECT_NE(s.status().message().find("spec.data.path"), std::string::npos) << s.status();
  }
  EXPECT_NE(c_->Submit(r, "alice").status().message().find("symlink"), std::string::npos);
  r.mutable_spec()->mutable_data()->set_path("data/cred");
  EXPECT_NE(c_->Submit(r, "alice").status().message().find("resolves to nothing"),
            std::string::npos);
  // A link that stays inside the root is fine, and the path is kept as given (not resolved).
  fs::create_symlink("set", fs::path(root) / "data" / "alias");
  r.mutable_spec()->mutable_data()->set_path("data/alias");
  EXPECT_EQ(Job(Submit(r)).spec().data().path(), root + "/data/alias");
  v1::SubmitJobRequest eval = MicroJob();
  eval.mutable_spec()->set_kind("eval");
  eval.mutable_spec()->set_steps(0);
  eval.mutable_spec()->clear_checkpoint();
  eval.mutable_spec()->mutable_model()->set_vocab_size(260);
  eval.mutable_spec()->mutable_reasoning_eval()->set_source("gsm8k");
  eval.mutable_spec()->mutable_reasoning_eval()->set_path("/etc/passwd");
  auto s = c_->Submit(eval, "alice");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("spec.reasoning_eval.path"), std::string::npos) << s.status();
}

TEST_F(CoordinatorTest, StateSurvivesAReopen) {
  v1::SubmitJobRequest r = MicroJob();
  r.set_request_id("client-1:attempt");
  const std::string a = Submit(r);
  const std::string b = Submit(MicroJob());
  ASSERT_TRUE(c_->Cancel(b, Caller{"bob", true}).ok());  // an admin
  const std::string w = RegisterWorker("node-a", 4);
  Reopen();
  EXPECT_EQ(Job(a).state(), "queued");
  v1::Job jb = Job(b);
  EXPECT_EQ(jb.state(), "cancelled");
  EXPECT_EQ(States(jb), (std::vector<std::string>{"queued", "cancelled"}));
  EXPECT_EQ(jb.events(1).reason(), "cancelled by bob");
  // The idempotency key still maps to the same job; the counter continues.
  auto again = c_->Submit(r, "alice");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->id(), a);
  EXPECT_EQ(Submit(MicroJob()), "job-000003");
  auto workers = *c_->ListWorkers();
  ASSERT_EQ(workers.workers_size(), 1);
  EXPECT_EQ(workers.workers(0).id(), w);
  EXPECT_EQ(workers.workers(0).slots(), 4);
}

TEST_F(CoordinatorTest, AttemptLifecycleRestartsFromTheNewestCheckpoint) {
  const std::string w1 = RegisterWorker("a", 1), w2 = RegisterWorker("b", 1);
  v1::SubmitJobRequest r = MicroJob(2);
  r.set_max_restarts(1);
  const std::string id = Submit(r);
  c_->Tick();
  v1::Job job = Job(id);
  ASSERT_EQ(job.state(), "scheduled");
  ASSERT_EQ(job.placement_size(), 2);
  const std::string rank0 = job.placement(0).worker_id(), rank1 = job.placement(1).worker_id();
  // The rank-1 worker waits for the rendezvous port; the rank-0 worker gets its assignment.
  EXPECT_EQ(Beat(rank1, "", 0, {}).assignments_size(), 0);
  auto hb = Beat(rank0, "", 0, {});
  ASSERT_EQ(hb.assignments_size(), 1);
  EXPECT_EQ(hb.assignments(0).master_port(), 0);
  Beat(rank0, id, 1, {{0, -1}}, {}, 29555);
  hb = Beat(rank1, "", 0, {});
  ASSERT_EQ(hb.assignments_size(), 1);
  EXPECT_EQ(hb.assignments(0).master_port(), 29555);
  EXPECT_EQ(hb.assignments(0).ranks(0), 1);
  // Once the worker reports the attempt, the assignment is not sent again.
  EXPECT_EQ(Beat(rank1, id, 1, {{1, -1}}).assignments_size(), 0);
  EXPECT_EQ(Job(id).state(), "running");
  Beat(rank0, id, 1, {{0, -1}}, {10, 20}, 29555);
  // Rank 1 dies: the attempt fails, the job requeues and resumes from step 20.
  Beat(rank1, id, 1, {{1, 137}});
  job = Job(id);
  EXPECT_EQ(job.state(), "queued");
  EXPECT_EQ(job.restarts(), 1);
  EXPECT_NE(job.reason().find("from step 20"), std::string::npos) << job.reason();
  // Rank 0 of the old attempt is still running: it is told to stop, and its slot stays taken.
  hb = Beat(rank0, id, 1, {{0, -1}}, {}, 29555);
  ASSERT_EQ(hb.cancels_size(), 1);
  EXPECT_EQ(hb.cancels(0).attempt(), 1);
  c_->Tick();
  EXPECT_EQ(Job(id).state(), "queued") << "placed while an old rank still held a slot";
  Beat(rank0, id, 1, {{0, 143}});  // exited after SIGTERM: reported, then forgotten
  Beat(rank1, "", 0, {});
  c_->Tick();
  job = Job(id);
  ASSERT_EQ(job.state(), "scheduled");
  EXPECT_EQ(job.attempt(), 2);
  EXPECT_EQ(job.resume_from(), CheckpointPath(id, 20));
  const std::string r0 = job.placement(0).worker_id(), r1 = job.placement(1).worker_id();
  Beat(r0, id, 2, {{0, -1}}, {}, 29600);
  Beat(r1, id, 2, {{1, -1}});
  Beat(r0, id, 2, {{0, 0}}, {40});
  EXPECT_EQ(Job(id).state(), "running");  // one worker done, the other still running
  Beat(r1, id, 2, {{1, 0}});
  job = Job(id);
  EXPECT_EQ(job.state(), "succeeded");
  // The success arrived with a progress update in the same heartbeat: both are on disk, and the
  // final state wins.
  Reopen();
  job = Job(id);
  EXPECT_EQ(job.state(), "succeeded");
  EXPECT_EQ(States(job), (std::vector<std::string>{"queued", "scheduled", "running", "retrying",
                                                   "queued", "scheduled", "running", "succeeded"}));
  auto cat = c_->ListCheckpoints(id);
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->checkpoints_size(), 3);
  EXPECT_EQ(cat->checkpoints(2).step(), 40);
  // After a reopen nothing is placed until every live worker has reported what it runs.
  const std::string id2 = Submit(MicroJob(1));
  c_->Tick();
  EXPECT_EQ(Job(id2).state(), "queued");
  Beat(w1, "", 0, {});
  Beat(w2, "", 0, {});
  c_->Tick();
  ASSERT_EQ(Job(id2).state(), "scheduled");
  const std::string w = Job(id2).placement(0).worker_id();
  r = MicroJob(1);
  Beat(w, id2, 1, {{0, 1}});
  job = Job(id2);
  EXPECT_EQ(job.state(), "queued");  // max_restarts defaults to 3
  (void)w1;
  (void)w2;
}

// The lease longer than loss detection: the worker is lost after lost_after, but its job is
// placed again only once the ranks' lease has certainly run out (last heartbeat + lease) and the
// termination grace after it.
TEST_F(CoordinatorTest, ALostWorkersJobWaitsForItsLeaseToLapse) {
  OneOfTwo placed;
  ASSERT_NO_FATAL_FAILURE(PlaceOnOneOfTwo(/*lease_ms=*/2000, &placed));
  const std::string &w2 = placed.w2, &id = placed.id;
  const int64_t last_heard = clock_->NowMs();  // w1's last beat: registering w2 takes no time
  while (Job(id).state() != "queued") {
    ASSERT_LT(clock_->NowMs() - last_heard, 3000);
    clock_->Advance(50);
    Beat(w2, "", 0, {});
    c_->Tick();
  }
  EXPECT_LT(clock_->NowMs() - last_heard, 1000)
      << "lost detection follows lost_after, not the lease";
  EXPECT_EQ(Job(id).not_before_ms(), last_heard + 2000 + 400);
  while (Job(id).state() == "queued") {
    ASSERT_LT(clock_->NowMs() - last_heard, 6000);
    clock_->Advance(50);
    Beat(w2, "", 0, {});
    c_->Tick();
  }
  EXPECT_GE(clock_->NowMs(), last_heard + 2000 + 400) << "placed while the old lease may hold";
  EXPECT_EQ(Job(id).placement(0).worker_id(), w2);
}

// The other side: the coordinator's own pause (its loop could not run, the steady clock moved)
// is not its workers' silence. The same wall-clock silence without a pause marks them lost.
TEST_F(CoordinatorTest, TheCoordinatorsOwnPauseIsForgiven) {
  options_.heartbeat_interval_ms = 100;
  options_.lost_after_ms = 1000;
  Reopen();
  const std::string w = RegisterWorker("a", 1);
  c_->Tick();                                                    // the loop's first run
  std::this_thread::sleep_for(std::chrono::milliseconds(2300));  // paused: no tick ran
  clock_->Advance(2300);
  c_->Tick();
  EXPECT_EQ(c_->ListWorkers()->workers(0).state(), "alive") << "lost for the coordinator's pause";
  clock_->Advance(1100);  // then silent while the coordinator runs: lost
  c_->Tick();
  EXPECT_EQ(c_->ListWorkers()->workers(0).state(), "lost");
  (void)w;
}

// Every alive worker silent at once looks like the coordinator's own partition: none is marked
// lost (their ranks train on) and nothing new is placed on them, until one is heard again (the
// others are then lost as usual) or the lease of the newest heartbeat lapses.
TEST_F(CoordinatorTest, AWholeClusterFallingSilentIsHeldUntilTheLeaseLapses) {
  options_.heartbeat_interval_ms = 100;
  options_.lost_after_ms = 1000;
  options_.lease_ms = 5000;
  options_.term_grace_ms = 400;
  Reopen();
  const auto [id, w1, w2] = OneJobOnTwoWorkers();  // w1 runs the job
  Beat(w1, id, 1, {{0, -1}}, {10}, 30000);
  Beat(w2, "", 0, {});
  const int64_t cut = clock_->NowMs();
  for (int i = 0; i < 30; ++i) {  // 3 s of silence from both: held
    clock_->Advance(100);
    c_->Tick();
  }
  const std::string queued = Submit(MicroJob(1));
  c_->Tick();
  EXPECT_EQ(WorkerState(w1), "alive");
  EXPECT_EQ(WorkerState(w2), "alive");
  EXPECT_EQ(Job(id).state(), "running");
  EXPECT_EQ(Job(queued).state(), "queued") << "placed on a worker nobody has heard for 3 s";
  // w2 is heard again: the link is back. w1 gets lost_after from then to be heard too (its beat
  // follows within a probe), and is lost after that; its fence still counts from its last beat.
  Beat(w2, "", 0, {});
  c_->Tick();
  const int64_t heal = clock_->NowMs();
  while (WorkerState(w1) == "alive") {
    ASSERT_LE(clock_->NowMs() - heal, 1000) << "w1 still alive";
    clock_->Advance(100);
    Beat(w2, "", 0, {});
    c_->Tick();
  }
  EXPECT_GT(clock_->NowMs() - heal, 1000) << "lost before lost_after from the heal";
  EXPECT_EQ(WorkerState(w1), "lost");
  EXPECT_EQ(WorkerState(w2), "alive");
  EXPECT_EQ(Job(id).not_before_ms(), cut + 5000 + 400) << "the fence is unchanged by the hold";
  // Two silent again (a third worker joins w2): held only until the newest heartbeat's lease.
  const std::string w3 = RegisterWorker("c", 1);
  const int64_t last = clock_->NowMs();
  while (clock_->NowMs() - last <= 5000) {
    EXPECT_EQ(WorkerState(w2), "alive") << (clock_->NowMs() - last) << " ms in";
    clock_->Advance(100);
    c_->Tick();
  }
  EXPECT_EQ(WorkerState(w2), "lost");
  EXPECT_EQ(WorkerState(w3), "lost");
  // Off: the same silence marks workers lost after lost_after.
  options_.all_silent_min_workers = 0;
  Reopen();
  const std::string w4 = RegisterWorker("d", 1);
  const std::string w5 = RegisterWorker("e", 1);
  Beat(w4, "", 0, {});
  Beat(w5, "", 0, {});
  clock_->Advance(1100);
  c_->Tick();
  EXPECT_EQ(WorkerState(w4), "lost");
  EXPECT_EQ(WorkerState(w5), "lost");
}

// Group commit: heartbeats that change state (here each catalogues a checkpoint) from many
// workers at once are all answered, share fsyncs of the log, and are all on disk after a reopen.
TEST_F(CoordinatorTest, ConcurrentHeartbeatsShareTheirFsyncs) {
  constexpr int kWorkers = 8, kBeats = 25;
  std::vector<std::string> workers, jobs(kWorkers);
  for (int i = 0; i < kWorkers; ++i) workers.push_back(RegisterWorker("w" + std::to_string(i), 1));
  for (int i = 0; i < kWorkers; ++i) Submit(MicroJob(1));
  c_->Tick();
  for (const std::string& w : workers) {
    for (int j = 1; j <= kWorkers; ++j) {
      char id[16];
      std::snprintf(id, sizeof(id), "job-%06d", j);
      if (Job(id).placement(0).worker_id() == w) jobs[&w - &workers[0]] = id;
    }
  }
  std::vector<std::string> dirs;
  for (const std::string& j : jobs) dirs.push_back(Job(j).spec().checkpoint().dir());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kWorkers; ++i) {
    threads.emplace_back([&, i] {
      for (int b = 1; b <= kBeats; ++b) {
        v1::HeartbeatRequest req;
        req.set_worker_id(workers[i]);
        v1::AttemptReport* a = req.add_attempts();
        a->set_job_id(jobs[i]);
        a->set_attempt(1);
        a->set_master_port(30000);
        v1::RankStatus* r = a->add_ranks();
        r->set_rank(0);
        r->set_running(true);
        a->mutable_progress()->set_step(10 * b);
        v1::CheckpointReport* c = a->add_checkpoints();
        c->set_step(10 * b);
        c->set_path((fs::path(dirs[i]) / storage::CheckpointDirName(10 * b)).string());
        if (!c_->Heartbeat(req, workers[i]).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures, 0);
  const std::string metrics = c_->RenderMetrics();
  const size_t at = metrics.find("\nloom_coordinator_log_syncs_total ");
  ASSERT_NE(at, std::string::npos) << metrics;
  const double syncs = std::stod(metrics.substr(at + 34));
  EXPECT_GT(syncs, 0);
  EXPECT_LT(syncs, kWorkers * kBeats) << "no heartbeat shared an fsync";
  std::cout << kWorkers * kBeats << " state-changing heartbeats, " << syncs << " fsyncs\n";
  Reopen();
  for (const std::string& j : jobs) {
    auto cat = c_->ListCheckpoints(j);
    ASSERT_TRUE(cat.ok()) << cat.status();
    ASSERT_GT(cat->checkpoints_size(), 0) << j;
    EXPECT_EQ(cat->checkpoints(cat->checkpoints_size() - 1).step(), 10 * kBeats) << j;
  }
}

// An NTP step of the wall clock, an hour either way, moves neither loss detection nor fences:
// both run on the steady clock. (On the wall clock, +1 h marked every worker lost and requeued
// every job; -1 h delayed both by an hour.)
TEST_F(CoordinatorTest, AWallClockStepMovesNeitherLivenessNorFences) {
  options_.lost_after_ms = 1000;
  options_.lease_ms = 2000;
  options_.term_grace_ms = 400;
  Reopen();
  const auto [id, w1, w2] = OneJobOnTwoWorkers();  // w1 runs the job
  Beat(w1, id, 1, {{0, -1}}, {10}, 30000);
  Beat(w2, "", 0, {});
  clock_->StepWall(3600 * 1000);  // forward
  c_->Tick();
  EXPECT_EQ(WorkerState(w1), "alive");
  EXPECT_EQ(WorkerState(w2), "alive");
  EXPECT_EQ(Job(id).state(), "running");
  clock_->StepWall(-2 * 3600 * 1000);  // and back, an hour behind
  Beat(w2, "", 0, {});
  c_->Tick();
  EXPECT_EQ(WorkerState(w1), "alive");
  // w1 falls silent: lost after lost_after of real time, placed again after lease + grace.
  const int64_t silent = clock_->SteadyMs();
  while (Job(id).state() != "queued") {
    ASSERT_LT(clock_->SteadyMs() - silent, 1500) << "loss detection delayed by the step";
    clock_->Advance(100);
    Beat(w2, "", 0, {});
    c_->Tick();
  }
  EXPECT_EQ(WorkerState(w1), "lost");
  while (Job(id).state() == "queued") {
    ASSERT_LT(clock_->SteadyMs() - silent, 3000) << "the fence moved with the step";
    clock_->Advance(100);
    Beat(w2, "", 0, {});
    c_->Tick();
  }
  EXPECT_GE(clock_->SteadyMs() - silent, 2400) << "placed before lease + grace";
  EXPECT_EQ(Job(id).placement(0).worker_id(), w2);
}

// A job's log keeps its first max_job_log_bytes: the chunk that crosses is cut there and a line
// and an event say so; later chunks are acknowledged (no resend) and dropped.
TEST_F(CoordinatorTest, AJobsLogIsCappedAndSaysSo) {
  options_.max_job_log_bytes = 4096;
  Reopen();
  const std::string w = RegisterWorker("a", 1);
  const std::string id = Submit(MicroJob(1));
  c_->Tick();
  ASSERT_EQ(Job(id).placement_size(), 1) << Job(id).state() << ": " << Job(id).reason();
  ASSERT_EQ(Job(id).placement(0).worker_id(), w);
  int64_t offset = 0;
  for (int i = 0; i < 20; ++i) {
    v1::HeartbeatRequest req;
    req.set_worker_id(w);
    v1::AttemptReport* a = req.add_attempts();
    a->set_job_id(id);
    a->set_attempt(1);
    a->set_master_port(30000);
    v1::RankStatus* r = a->add_ranks();
    r->set_rank(0);
    r->set_running(true);
    a->set_log_offset(offset);
    // The chunk that crosses the cap holds two-byte characters, the cap inside one of them.
    std::string text = std::string(999, static_cast<char>('a' + i % 26)) + "\n";
    if (i == 4) {
      text = "x";
      for (int k = 0; k < 499; ++k) text += "\xC3\xA9";  // é
      text += "\n";
    }
    a->set_log(text);
    offset += 1000;
    ASSERT_TRUE(c_->Heartbeat(req, w).ok());
  }
  auto log = c_->ReadLog(id, 0, 1 << 20);
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_GE(log->data.size(), 4096u);
  EXPECT_LT(log->data.size(), 4096u + 200) << "grew past the cap";
  EXPECT_EQ(log->data.substr(0, 1000), std::string(999, 'a') + "\n");
  EXPECT_NE(log->data.find("[coordinator] this job's log reached 4096 bytes"), std::string::npos);
  const size_t note = log->data.find("\n[coordinator]");
  ASSERT_NE(note, std::string::npos);
  EXPECT_EQ(log->data.substr(note - 2, 2), "\xC3\xA9") << "a character cut in two at the cap";
  int notes = 0;
  const v1::Job job = Job(id);
  for (const v1::JobEvent& e : job.events()) {
    notes += e.reason().find("log reached 4096 bytes") != std::string::npos;
  }
  EXPECT_EQ(notes, 1);
}

// Tokens seen and training FLOPs (what the console's compare view aligns runs by) go from the
// agent's report to the series file and back, through a reopen; a series file written before
// they were kept still reads, with 0 for both.
TEST_F(CoordinatorTest, StepPointsKeepTokensAndFlopsThroughAReopen) {
  const std::string w = RegisterWorker("a", 1);
  const std::string id = Submit(MicroJob(1));
  c_->Tick();
  ASSERT_EQ(Job(id).placement_size(), 1) << Job(id).state() << ": " << Job(id).reason();
  const std::string series = JobSeriesPath(options_.data_dir, id);
  std::filesystem::create_directories(std::filesystem::path(series).parent_path());
  ASSERT_TRUE(AppendToFile(series, "1\t1\t5.5\t0.001\t100\t1.5\t1000\n"));  // the old layout
  v1::HeartbeatRequest req;
  req.set_worker_id(w);
  v1::AttemptReport* a = req.add_attempts();
  a->set_job_id(id);
  a->set_attempt(1);
  a->add_ranks()->set_running(true);
  a->set_steps_offset(0);
  const double flops_per_token = 3 * 123456789.123;  // not a short decimal: kept exactly
  for (int step = 2; step <= 3; ++step) {
    v1::StepPoint* p = a->add_steps();
    p->set_step(step);
    p->set_loss(5.0);
    p->set_time_ms(1000 + step);
    p->set_tokens_seen((int64_t{1} << 36) * step);  // past 2^32
    p->set_train_flops(flops_per_token * static_cast<double>(p->tokens_seen()));
  }
  ASSERT_TRUE(c_->Heartbeat(req, w).ok());
  Reopen();
  auto m = c_->JobMetrics(id, 2000);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->series_size(), 1);
  ASSERT_EQ(m->series(0).points_size(), 3);
  const v1::StepPoint& old = m->series(0).points(0);
  EXPECT_EQ(old.step(), 1);
  EXPECT_DOUBLE_EQ(old.grad_norm(), 1.5);
  EXPECT_EQ(old.tokens_seen(), 0);
  EXPECT_EQ(old.train_flops(), 0);
  for (int i = 1; i <= 2; ++i) {
    const v1::StepPoint& p = m->series(0).points(i);
    EXPECT_EQ(p.step(), i + 1);
    EXPECT_EQ(p.tokens_seen(), (int64_t{1} << 36) * (i + 1));
    EXPECT_EQ(p.train_flops(), flops_per_token * static_cast<double>(p.tokens_seen()));
  }
}

}  // namespace
}  // namespace loom::coordinator
