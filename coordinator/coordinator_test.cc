// The coordinator's state machine on a real RocksDB in a temporary directory: validation,
// persistence across a reopen, scheduling, the attempt lifecycle driven by agent heartbeats
// (start, checkpoints, rank failure -> restart from the newest checkpoint, success), lost
// workers, cancellation; and api/openapi.yaml against the served route table. Time is a
// ManualClock the tests move on: heartbeat silence, leases and fencing take no real waiting.
#include "coordinator/coordinator.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <set>
#include <thread>
#include <tuple>

#include "coordinator/clock.h"
#include "coordinator/http_api.h"
#include "storage/checkpoint.h"

namespace fs = std::filesystem;

namespace loom::coordinator {
namespace {

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom-coordinator-test-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    options_.data_dir = (dir_ / "data").string();
    options_.storage_root = (dir_ / "storage").string();
    options_.lost_after_ms = 60000;
    options_.clock = clock_;
    Reopen();
  }
  void TearDown() override {
    c_.reset();
    fs::remove_all(dir_);
  }
  void Reopen() {
    c_.reset();
    auto c = Coordinator::Open(options_);
    ASSERT_TRUE(c.ok()) << c.status();
    c_ = *std::move(c);
  }
  v1::SubmitJobRequest MicroJob(int world = 1) {
    v1::SubmitJobRequest r;
    r.mutable_spec()->set_preset("micro");
    r.mutable_spec()->set_steps(40);
    r.mutable_spec()->mutable_checkpoint()->set_interval(10);
    r.set_world_size(world);
    return r;
  }
  std::string Submit(const v1::SubmitJobRequest& r) {
    auto s = c_->Submit(r, "alice");
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->id() : "";
  }
  std::string RegisterWorker(const std::string& name, int slots, const std::string& id = "") {
    v1::RegisterWorkerRequest r;
    r.set_worker_id(id);
    r.set_name(name);
    r.set_address("127.0.0.1");
    r.set_slots(slots);
    auto s = c_->Register(r);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->worker_id() : "";
  }
  // The state of worker `id` ("?" when it is not listed).
  std::string WorkerState(const std::string& id) {
    const absl::StatusOr<v1::ListWorkersResponse> list = c_->ListWorkers();
    if (!list.ok()) return list.status().ToString();
    for (const v1::Worker& w : list->workers()) {
      if (w.id() == id) return w.state();
    }
    return "?";
  }
  // Two one-slot workers and a one-rank job placed on one of them: (job, its worker, the other).
  std::tuple<std::string, std::string, std::string> OneJobOnTwoWorkers() {
    const std::string a = RegisterWorker("a", 1);
    const std::string b = RegisterWorker("b", 1);
    const std::string id = Submit(MicroJob(1));
    c_->Tick();
    const std::string runs = Job(id).placement(0).worker_id();
    return {id, runs, runs == a ? b : a};
  }
  v1::Job Job(const std::string& id) {
    auto j = c_->GetJob(id);
    EXPECT_TRUE(j.ok()) << j.status();
    return j.ok() ? *j : v1::Job();
  }
  // A heartbeat reporting one attempt on `worker`.
  v1::HeartbeatResponse Beat(
      const std::string& worker, const std::string& job, int attempt,
      std::vector<std::pair<int, int>> ranks /* rank, exit code or -1 running */,
      std::vector<int64_t> checkpoints = {}, int port = 0) {
    v1::HeartbeatRequest req;
    req.set_worker_id(worker);
    if (!job.empty()) {
      v1::AttemptReport* a = req.add_attempts();
      a->set_job_id(job);
      a->set_attempt(attempt);
      a->set_master_port(port);
      // Every report carries fresh progress, as a running trainer's does.
      a->mutable_progress()->set_step(static_cast<int64_t>(++beats_));
      a->mutable_progress()->set_update_time_ms(1000 + beats_);
      bool finished = true;
      for (auto [rank, code] : ranks) {
        v1::RankStatus* s = a->add_ranks();
        s->set_rank(rank);
        s->set_running(code < 0);
        s->set_exit_code(code < 0 ? 0 : code);
        s->set_detail(code < 0 ? "" : "exited " + std::to_string(code));
        finished &= code >= 0;
      }
      a->set_finished(finished);
      for (int64_t step : checkpoints) {
        v1::CheckpointReport* c = a->add_checkpoints();
        c->set_step(step);
        c->set_path(CheckpointPath(job, step));
      }
    }
    auto r = c_->Heartbeat(req, worker);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : v1::HeartbeatResponse();
  }
  // Where the trainer of `job` writes its checkpoint of `step`.
  std::string CheckpointPath(const std::string& job, int64_t step) {
    return (fs::path(Job(job).spec().checkpoint().dir()) / storage::CheckpointDirName(step))
        .string();
  }
  // A committed-looking checkpoint on disk (a manifest is what the coordinator checks).
  void WriteCheckpointDir(const std::string& job, int64_t step) {
    fs::create_directories(CheckpointPath(job, step));
    std::ofstream(fs::path(CheckpointPath(job, step)) / "manifest.json") << "{}";
  }
  // The report of `sweep` with `query` is a 400 whose message holds `says`.
  void ExpectReportRefused(const std::string& sweep, const Coordinator::ReportQuery& query,
                           const std::string& says) {
    auto refused = c_->ReportSweep(sweep, query);
    ASSERT_FALSE(refused.ok()) << says;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << says;
    EXPECT_NE(refused.status().message().find(says), std::string::npos) << refused.status();
  }
  std::vector<std::string> States(const v1::Job& job) {
    std::vector<std::string> s;
    for (const auto& e : job.events()) {
      if (!e.state().empty()) s.push_back(e.state());
    }
    return s;
  }

  fs::path dir_;
  int beats_ = 0;
  std::shared_ptr<ManualClock> clock_ = std::make_shared<ManualClock>(1700000000000);
  CoordinatorOptions options_;
  std::unique_ptr<Coordinator> c_;
};

// data.source task, task khop with these options (JSON).
void KHop(v1::SubmitJobRequest& r, const std::string& options) {
  v1::DataConfig* d = r.mutable_spec()->mutable_data();
  d->set_source("task");
  d->set_task("khop");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(options, d->mutable_task_options()).ok());
}

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
  options_.lost_after_ms = 300;
  options_.lease_ms = 2000;
  options_.term_grace_ms = 400;
  Reopen();
  const std::string w1 = RegisterWorker("a", 1);
  const std::string id = Submit(MicroJob(1));
  c_->Tick();
  ASSERT_EQ(Job(id).placement(0).worker_id(), w1);
  Beat(w1, id, 1, {{0, -1}}, {10}, 30000);
  const int64_t last_heard = clock_->NowMs();
  const std::string w2 = RegisterWorker("b", 1);
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

TEST_F(CoordinatorTest, LostWorkerFailsItsAttemptAndTheJobMoves) {
  options_.lost_after_ms = 300;
  options_.lease_ms = 150;
  options_.term_grace_ms = 400;
  Reopen();
  const std::string w1 = RegisterWorker("a", 1);
  const std::string id = Submit(MicroJob(1));
  c_->Tick();
  ASSERT_EQ(Job(id).placement(0).worker_id(), w1);
  Beat(w1, id, 1, {{0, -1}}, {10}, 30000);
  const std::string w2 = RegisterWorker("b", 1);
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
      if (private_jobs) EXPECT_NE(r.body.find("belongs to alice"), std::string::npos) << r.body;
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
TEST(UserTokensTest, RolesAreReadAndCheckedByLine) {
  const fs::path path = fs::temp_directory_path() / ("loom-users-" + std::to_string(::getpid()));
  std::ofstream(path)
      << "# the group\nalice alice-token-0123456789 admin\n\nbob\tbob-token-0123456789ab\n";
  auto users = ReadUserTokens(path.string());
  ASSERT_TRUE(users.ok()) << users.status();
  EXPECT_EQ(users->tokens.at("alice-token-0123456789"), "alice");
  EXPECT_EQ(users->tokens.at("bob-token-0123456789ab"), "bob");
  EXPECT_EQ(users->admins, (std::set<std::string>{"alice"}));
  for (const std::string bad : {"carol carol-token-0123456789 root\n", "dan short\n",
                                "eve eve-token-0123456789ab admin extra\n"}) {
    std::ofstream(path) << bad;
    auto refused = ReadUserTokens(path.string());
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find(":1: expected '<user> <token> [admin]'"),
              std::string::npos)
        << refused.status();
  }
  fs::remove(path);
}

TEST_F(CoordinatorTest, CancelStopsRanksAndRejectsTerminalJobs) {
  const std::string w = RegisterWorker("a", 2);
  const std::string id = Submit(MicroJob(2));
  c_->Tick();
  Beat(w, id, 1, {{0, -1}, {1, -1}}, {}, 31000);
  auto cancelled = c_->Cancel(id, Caller{"alice"});
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->state(), "cancelled");
  auto hb = Beat(w, id, 1, {{0, -1}, {1, -1}});
  ASSERT_EQ(hb.cancels_size(), 1);
  EXPECT_EQ(hb.assignments_size(), 0);
  auto again = c_->Cancel(id, Caller{"alice"});
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->Cancel("job-999999", Caller{"alice"}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c_->Cancel("../etc", Caller{"alice"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Until the ranks are reported gone their slots stay in use.
  auto workers = *c_->ListWorkers();
  EXPECT_EQ(workers.workers(0).used_slots(), 2);
  Beat(w, id, 1, {{0, 143}, {1, 143}});
  workers = *c_->ListWorkers();
  EXPECT_EQ(workers.workers(0).used_slots(), 0);
}

TEST_F(CoordinatorTest, ForgedReportsAreRefusedAndChangeNothing) {
  const std::string a = RegisterWorker("a", 1), b = RegisterWorker("b", 1);
  const std::string id = Submit(MicroJob(1));
  c_->Tick();
  const std::string host = Job(id).placement(0).worker_id();
  const std::string other = host == a ? b : a;
  Beat(host, id, 1, {{0, -1}}, {}, 30100);
  const v1::Job before = Job(id);
  auto forge = [&](const std::string& worker, std::function<void(v1::AttemptReport&)> edit) {
    v1::HeartbeatRequest req;
    req.set_worker_id(worker);
    v1::AttemptReport* r = req.add_attempts();
    r->set_job_id(id);
    r->set_attempt(1);
    v1::RankStatus* rank = r->add_ranks();
    rank->set_rank(0);
    rank->set_exit_code(0);
    r->set_finished(true);
    edit(*r);
    return c_->Heartbeat(req, worker).status();
  };
  // Another worker claims the attempt finished: not placed there.
  absl::Status s = forge(other, [](auto&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find("not placed on worker"), std::string::npos) << s;
  // A credential bound to one worker cannot speak for another.
  v1::HeartbeatRequest as_other;
  as_other.set_worker_id(host);
  EXPECT_EQ(c_->Heartbeat(as_other, other).status().code(), absl::StatusCode::kPermissionDenied);
  // The host itself: checkpoints outside the job's directory, a step that does not match.
  for (const std::string& path :
       {std::string("/etc"), CheckpointPath(id, 5) + "/../../../../job-000009/checkpoints",
        CheckpointPath(id, 6)}) {
    s = forge(host, [&](v1::AttemptReport& r) {
      r.set_finished(false);
      r.mutable_ranks(0)->set_running(true);
      v1::CheckpointReport* c = r.add_checkpoints();
      c->set_step(5);
      c->set_path(path);
    });
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << path;
  }
  // A future attempt, a rank that is not placed there.
  EXPECT_EQ(forge(host, [](auto& r) { r.set_attempt(7); }).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(forge(host, [](auto& r) { r.mutable_ranks(0)->set_rank(3); }).code(),
            absl::StatusCode::kInvalidArgument);
  // "Finished" with no rank reported is not a success.
  EXPECT_TRUE(forge(host, [](auto& r) { r.clear_ranks(); }).ok());
  const v1::Job after = Job(id);
  EXPECT_EQ(after.state(), "running");
  EXPECT_EQ(after.checkpoints_size(), before.checkpoints_size());
  auto cat = c_->ListCheckpoints("");
  ASSERT_TRUE(cat.ok());
  EXPECT_EQ(cat->checkpoints_size(), 0);
}

TEST_F(CoordinatorTest, BadInputFailsAtOnceLeaseExpiryAndStopsAreInfrastructure) {
  const std::string w = RegisterWorker("a", 2);
  const std::string id = Submit(MicroJob(1));
  c_->Tick();
  Beat(w, id, 1, {{0, kExitLeaseExpired}});
  v1::Job job = Job(id);
  EXPECT_EQ(job.state(), "queued");
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.infra_restarts(), 1);
  c_->Tick();
  ASSERT_EQ(Job(id).state(), "scheduled");
  // Stopped by SIGTERM after a checkpoint (preemption): infrastructure too.
  Beat(w, id, 2, {{0, kExitStopped}});
  job = Job(id);
  EXPECT_EQ(job.state(), "queued");
  EXPECT_EQ(job.restarts(), 0);
  EXPECT_EQ(job.infra_restarts(), 2);
  c_->Tick();
  ASSERT_EQ(Job(id).state(), "scheduled");
  Beat(w, id, 3, {{0, kExitBadInput}});
  job = Job(id);
  EXPECT_EQ(job.state(), "failed");
  EXPECT_NE(job.reason().find("bad input"), std::string::npos) << job.reason();
  EXPECT_EQ(job.restarts(), 0);
  ASSERT_EQ(job.history_size(), 3);
  EXPECT_FALSE(job.history(2).end_reason().empty());
}

TEST_F(CoordinatorTest, ListsPageWithOpaqueTokensBoundToTheirListAndFilter) {
  for (int i = 0; i < 3; ++i) RegisterWorker(absl::StrCat("w", i), 1);
  std::vector<std::string> submitted;
  for (int i = 0; i < 5; ++i) submitted.push_back(Submit(MicroJob(1)));
  std::vector<std::string> jobs, workers;
  std::string token, first_token;
  do {
    auto page = c_->ListJobs("", 2, token);
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_LE(page->jobs_size(), 2);
    for (const auto& j : page->jobs()) jobs.push_back(j.id());
    token = page->next_page_token();
    if (first_token.empty()) first_token = token;
    EXPECT_EQ(token.find("job-"), std::string::npos) << "tokens are opaque: " << token;
  } while (!token.empty());
  EXPECT_EQ(jobs, submitted);
  do {
    auto page = c_->ListWorkers(2, token);
    ASSERT_TRUE(page.ok()) << page.status();
    for (const auto& w : page->workers()) workers.push_back(w.name());
    token = page->next_page_token();
  } while (!token.empty());
  EXPECT_EQ(workers.size(), 3u);
  // A token only continues the list and the filter it came from.
  auto other_filter = c_->ListJobs("queued", 2, first_token);
  EXPECT_EQ(other_filter.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(other_filter.status().message().find("page_token"), std::string::npos);
  EXPECT_EQ(c_->ListWorkers(2, first_token).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->ListJobs("", 2, "job-000001").status().code(),
            absl::StatusCode::kInvalidArgument);  // the old raw-id form
  EXPECT_EQ(c_->ListJobs("", 2, "%%%").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->ListSweeps(0).status().code(), absl::StatusCode::kInvalidArgument);
}

// Only digests of worker credentials reach the disk, in a directory only the owner can enter
// (whatever the umask); a credential an older coordinator stored in clear is converted at open
// and keeps working.
TEST_F(CoordinatorTest, CredentialsAreStoredAsDigestsInAPrivateDirectory) {
  v1::RegisterWorkerRequest r;
  r.set_name("a");
  r.set_address("127.0.0.1");
  r.set_slots(1);
  auto registered = c_->Register(r);
  ASSERT_TRUE(registered.ok()) << registered.status();
  const std::string credential = registered->credential();
  ASSERT_EQ(credential.size(), 64u);
  EXPECT_EQ(*c_->WorkerForCredential(credential), registered->worker_id());
  const fs::path state = fs::path(options_.data_dir) / "state";
  EXPECT_EQ(fs::status(state).permissions(), fs::perms::owner_all);
  c_.reset();  // closed: its WAL and table files hold everything it wrote
  auto holds = [&](const std::string& needle) {
    for (const auto& e : fs::directory_iterator(state)) {
      std::ifstream in(e.path(), std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      if (bytes.find(needle) != std::string::npos) return true;
    }
    return false;
  };
  EXPECT_FALSE(holds(credential)) << "a worker credential in clear under " << state;
  EXPECT_TRUE(holds("sha256:"));
  // As an older coordinator stored it: in clear.
  const std::string legacy(64, 'c');
  {
    auto store = StateStore::Open(state.string());
    ASSERT_TRUE(store.ok()) << store.status();
    StateStore::Batch b;
    b.PutCredential(registered->worker_id(), legacy);
    ASSERT_TRUE((*store)->Commit(b, true).ok());
  }
  fs::permissions(state, fs::perms::all, fs::perm_options::replace);
  Reopen();
  EXPECT_EQ(fs::status(state).permissions(), fs::perms::owner_all);
  auto owner = c_->WorkerForCredential(legacy);
  ASSERT_TRUE(owner.ok()) << owner.status();
  EXPECT_EQ(*owner, registered->worker_id());
  EXPECT_FALSE(c_->WorkerForCredential(credential).ok()) << "the replaced credential";
  c_.reset();
  {
    auto store = StateStore::Open(state.string());
    ASSERT_TRUE(store.ok());
    auto loaded = (*store)->Load();
    ASSERT_TRUE(loaded.ok());
    EXPECT_EQ(loaded->credentials.at(registered->worker_id()).rfind("sha256:", 0), 0u);
  }
  Reopen();
}

TEST_F(CoordinatorTest, CheckpointIdsArePathSafeAndOldStateIsMigrated) {
  EXPECT_EQ(*CanonicalCheckpointId("job-000001/150", "init_from"), "job-000001.150");
  EXPECT_EQ(*CanonicalCheckpointId("job-000001.150", "init_from"), "job-000001.150");
  for (const char* bad : {"job-000001", "job-000001/", "job-000001/x", "job-000001/1/2", "../x/1",
                          "job-000001/-1", "job-000001/007"}) {
    auto s = CanonicalCheckpointId(bad, "init_from");
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.status().message().find("init_from"), std::string::npos) << bad;
  }
  // State as a coordinator before this change wrote it: "<job>/<step>" everywhere.
  c_.reset();
  {
    auto store = StateStore::Open((fs::path(options_.data_dir) / "state").string());
    ASSERT_TRUE(store.ok()) << store.status();
    StateStore::Batch b;
    v1::CheckpointEntry parent, child;
    parent.set_id("job-000001/10");
    parent.set_job_id("job-000001");
    parent.set_step(10);
    child.set_id("job-000002/5");
    child.set_job_id("job-000002");
    child.set_step(5);
    child.set_parent("job-000001/10");
    b.PutCheckpoint(parent);
    b.PutCheckpoint(child);
    v1::Job job;
    job.set_id("job-000002");
    job.set_state("succeeded");
    job.mutable_request()->set_init_from("job-000001/10");
    job.add_checkpoints("job-000002/5");
    b.PutJob(job);
    ASSERT_TRUE((*store)->Commit(b, true).ok());
  }
  for (int reopen = 0; reopen < 2; ++reopen) {  // migrated once, then stable
    Reopen();
    auto cat = c_->ListCheckpoints("");
    ASSERT_TRUE(cat.ok());
    ASSERT_EQ(cat->checkpoints_size(), 2);
    EXPECT_EQ(cat->checkpoints(0).id(), "job-000001.10");
    EXPECT_EQ(cat->checkpoints(1).id(), "job-000002.5");
    EXPECT_EQ(cat->checkpoints(1).parent(), "job-000001.10");
    const v1::Job job = Job("job-000002");
    EXPECT_EQ(job.request().init_from(), "job-000001.10");
    ASSERT_EQ(job.checkpoints_size(), 1);
    EXPECT_EQ(job.checkpoints(0), "job-000002.5");
  }
}

TEST_F(CoordinatorTest, JobsCheckpointByTimeUnlessTheirSpecSaysOtherwise) {
  options_.checkpoint_interval_seconds = 120;
  Reopen();
  auto with_seconds = [&](int64_t seconds) {
    v1::SubmitJobRequest r = MicroJob();
    r.mutable_spec()->mutable_checkpoint()->set_interval_seconds(seconds);
    return Job(Submit(r)).spec().checkpoint().interval_seconds();
  };
  EXPECT_EQ(with_seconds(0), 120);  // unset: the coordinator's default
  EXPECT_EQ(with_seconds(-1), -1);  // never by time
  EXPECT_EQ(with_seconds(30), 30);
  auto bad = c_->Submit(
      [&] {
        v1::SubmitJobRequest r = MicroJob();
        r.mutable_spec()->mutable_checkpoint()->set_interval_seconds(-5);
        return r;
      }(),
      "alice");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("checkpoint.interval_seconds"), std::string::npos);

  // A job stored before the field existed (0) is assigned with the default.
  v1::Job legacy = Job("job-000001");
  legacy.mutable_spec()->mutable_checkpoint()->clear_interval_seconds();
  c_.reset();
  {
    auto store = StateStore::Open((fs::path(options_.data_dir) / "state").string());
    ASSERT_TRUE(store.ok()) << store.status();
    StateStore::Batch b;
    b.PutJob(legacy);
    ASSERT_TRUE((*store)->Commit(b, true).ok());
  }
  Reopen();
  ASSERT_EQ(Job("job-000001").spec().checkpoint().interval_seconds(), 0);
  const std::string w = RegisterWorker("a", 1);
  c_->Tick();
  const auto hb = Beat(w, "", 0, {});
  ASSERT_EQ(hb.assignments_size(), 1);
  EXPECT_EQ(hb.assignments(0).job_id(), "job-000001");
  EXPECT_EQ(hb.assignments(0).spec().checkpoint().interval_seconds(), 120);
}

TEST_F(CoordinatorTest, RetentionKeepsWhatQueuedJobsStartFrom) {
  const std::string w = RegisterWorker("a", 1);
  v1::SubmitJobRequest r = MicroJob(1);
  r.mutable_spec()->mutable_checkpoint()->set_keep_last(1);
  const std::string parent = Submit(r);
  c_->Tick();
  WriteCheckpointDir(parent, 10);
  Beat(w, parent, 1, {{0, -1}}, {10}, 30200);
  // A fine-tune from step 10 waits in the queue (the only slot is busy).
  v1::SubmitJobRequest child = MicroJob(1);
  child.set_init_from(parent + "/10");
  const std::string child_id = Submit(child);
  for (int64_t step : {20, 30}) {
    WriteCheckpointDir(parent, step);
    Beat(w, parent, 1, {{0, -1}}, {step}, 30200);
    c_->Tick();  // deletes outside the lock
  }
  auto cat = c_->ListCheckpoints(parent);
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->checkpoints_size(), 3);
  EXPECT_TRUE(cat->checkpoints(0).available()) << "the queued child's init_from was deleted";
  ASSERT_EQ(cat->checkpoints(0).pinned_by_size(), 1);
  EXPECT_EQ(cat->checkpoints(0).pinned_by(0), child_id);
  EXPECT_TRUE(cat->checkpoints(1).deleted());
  EXPECT_FALSE(fs::exists(CheckpointPath(parent, 20)));
  EXPECT_TRUE(cat->checkpoints(2).available());
  // One entry per page, following the tokens: the same three, in the same order.
  std::vector<int64_t> paged;
  std::string token;
  do {
    auto page = c_->ListCheckpoints(parent, 1, token);
    ASSERT_TRUE(page.ok()) << page.status();
    for (const auto& e : page->checkpoints()) paged.push_back(e.step());
    token = page->next_page_token();
  } while (!token.empty());
  EXPECT_EQ(paged, (std::vector<int64_t>{10, 20, 30}));
  // Once the child is over, the pin goes and retention removes step 10 too.
  ASSERT_TRUE(c_->Cancel(child_id, Caller{"alice"}).ok());
  c_->Tick();
  EXPECT_FALSE(fs::exists(CheckpointPath(parent, 10)));
  // A deleted checkpoint cannot be started from.
  auto again = c_->Submit(child, "alice");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, DamagedCheckpointsAreMarkedAndSkipped) {
  const std::string w = RegisterWorker("a", 1);
  const std::string id = Submit(MicroJob(1));
  c_->Tick();
  Beat(w, id, 1, {{0, -1}}, {10, 20}, 30300);
  Beat(w, id, 1, {{0, 137}});
  c_->Tick();
  ASSERT_EQ(Job(id).state(), "scheduled");
  // Attempt 2's trainer found step 20 damaged and resumed from step 10.
  v1::HeartbeatRequest req;
  req.set_worker_id(w);
  v1::AttemptReport* a = req.add_attempts();
  a->set_job_id(id);
  a->set_attempt(2);
  a->add_ranks()->set_running(true);
  v1::SkippedCheckpoint* skip = a->add_skipped();
  skip->set_step(20);
  skip->set_path(CheckpointPath(id, 20));
  skip->set_reason("shard-00000-of-00001.safetensors: CRC-32C mismatch");
  a->mutable_resumed()->set_restored(true);
  a->mutable_resumed()->set_step(10);
  a->mutable_resumed()->set_path(CheckpointPath(id, 10));
  ASSERT_TRUE(c_->Heartbeat(req, w).ok());
  auto cat = c_->ListCheckpoints(id);
  ASSERT_TRUE(cat.ok());
  ASSERT_EQ(cat->checkpoints_size(), 2);
  EXPECT_NE(cat->checkpoints(1).damaged().find("CRC-32C"), std::string::npos);
  v1::Job job = Job(id);
  std::string reasons;
  for (const auto& e : job.events()) reasons += e.reason() + "\n";
  EXPECT_NE(reasons.find("checkpoint at step 20 skipped"), std::string::npos) << reasons;
  EXPECT_NE(reasons.find("resumed from step 10"), std::string::npos) << reasons;
  // The next attempt is announced as resuming from step 10, not the damaged 20.
  Beat(w, id, 2, {{0, 1}});
  c_->Tick();
  EXPECT_EQ(Job(id).resume_from(), CheckpointPath(id, 10));
}

TEST_F(CoordinatorTest, WorkerCredentialsAreBoundAndRevoked) {
  options_.lost_after_ms = 200;
  options_.lease_ms = 100;
  Reopen();
  v1::RegisterWorkerRequest r;
  r.set_name("a");
  r.set_address("127.0.0.1");
  r.set_slots(1);
  auto reg = c_->Register(r);
  ASSERT_TRUE(reg.ok());
  EXPECT_EQ(reg->credential().size(), 64u);
  EXPECT_EQ(reg->lease_ms(), 100);
  auto who = c_->WorkerForCredential(reg->credential());
  ASSERT_TRUE(who.ok());
  EXPECT_EQ(*who, reg->worker_id());
  // Taking over a live worker's id needs its credential.
  r.set_worker_id(reg->worker_id());
  EXPECT_EQ(c_->Register(r).status().code(), absl::StatusCode::kFailedPrecondition);
  r.set_credential(reg->credential());
  auto again = c_->Register(r);
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->credential(), reg->credential());
  EXPECT_EQ(c_->WorkerForCredential(reg->credential()).status().code(),
            absl::StatusCode::kUnauthenticated);
  // Credentials survive a restart; a lost worker's stops working.
  Reopen();
  ASSERT_TRUE(c_->WorkerForCredential(again->credential()).ok());
  clock_->Advance(300);
  c_->Tick();
  EXPECT_EQ(c_->WorkerForCredential(again->credential()).status().code(),
            absl::StatusCode::kUnauthenticated);
  r.clear_credential();
  EXPECT_TRUE(c_->Register(r).ok()) << "a lost worker's id can be registered again";
}

TEST_F(CoordinatorTest, SubmittedJobsAlwaysPrint) {
  // Free-form options nested deeper than the limit are refused at the API; what is accepted
  // prints and parses back (agents and GET depend on it).
  v1::SubmitJobRequest r = MicroJob();
  google::protobuf::Struct* opts = r.mutable_spec()->mutable_data()->mutable_task_options();
  for (int i = 0; i < 7; ++i) {
    opts = (*opts->mutable_fields())["k"].mutable_struct_value();
  }
  EXPECT_TRUE(CheckMessageLimits(r).ok());
  const std::string id = Submit(r);
  auto list = c_->ListJobs("", 10, "");
  ASSERT_TRUE(list.ok());
  (*opts->mutable_fields())["k"].mutable_struct_value();
  (*opts->mutable_fields())["k"].mutable_struct_value()->mutable_fields();
  auto deep = r;
  google::protobuf::Struct* d = deep.mutable_spec()->mutable_data()->mutable_task_options();
  for (int i = 0; i < 9; ++i) d = (*d->mutable_fields())["k"].mutable_struct_value();
  absl::Status s = CheckMessageLimits(deep);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("spec.data.task_options"), std::string::npos) << s;
  // An agent's log chunk is bounded by the body limit alone; its other strings are not.
  v1::HeartbeatRequest beat;
  v1::AttemptReport* report = beat.add_attempts();
  report->set_log(std::string(100000, 'l'));
  EXPECT_TRUE(CheckMessageLimits(beat).ok());
  report->add_ranks()->set_detail(std::string(5000, 'd'));
  EXPECT_NE(CheckMessageLimits(beat).message().find("attempts[0].ranks[0].detail: longer than"),
            std::string::npos)
      << CheckMessageLimits(beat);
  v1::SubmitJobRequest long_name = MicroJob();
  long_name.mutable_spec()->set_name(std::string(5000, 'x'));
  s = CheckMessageLimits(long_name);
  EXPECT_NE(s.message().find("spec.name: longer than"), std::string::npos) << s;
  EXPECT_TRUE(CheckJsonDepth(std::string(32, '[') + std::string(32, ']'), 32).ok());
  EXPECT_FALSE(CheckJsonDepth(std::string(33, '[') + std::string(33, ']'), 32).ok());
  EXPECT_TRUE(CheckJsonDepth("\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"", 2).ok());
  (void)id;
}

TEST_F(CoordinatorTest, SweepsExpandIntoTaggedJobsAtomically) {
  v1::SweepSpec sweep;
  sweep.set_name("lr");
  *sweep.mutable_base() = MicroJob();
  auto* lr = &(*sweep.mutable_grid())["optimizer.lr"];
  lr->add_values()->set_number_value(0.001);
  lr->add_values()->set_number_value(0.01);
  for (uint64_t seed : {7, 8, 9}) sweep.add_seeds(seed);
  sweep.set_request_id("sweep-key");
  auto created = c_->CreateSweep(sweep, "alice");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->jobs(), 6);
  auto again = c_->CreateSweep(sweep, "alice");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->id(), created->id());
  // One bad cell refuses the whole sweep, naming the cell; nothing is stored.
  v1::SweepSpec bad = sweep;
  bad.set_request_id("");
  (*bad.mutable_grid())["model.n_heads"].add_values()->set_number_value(3);
  auto refused = c_->CreateSweep(bad, "alice");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("cell 'model.n_heads=3"), std::string::npos)
      << refused.status();
  auto jobs = c_->ListJobs("", 500, "");
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->jobs_size(), 6);
  for (const auto& j : jobs->jobs()) {
    EXPECT_EQ(j.sweep_id(), created->id());
    EXPECT_EQ(j.spec().seed(), j.sweep_seed());
    EXPECT_EQ(j.spec().model().init_seed(), j.sweep_seed());  // seeds vary the init too
  }
  EXPECT_DOUBLE_EQ(jobs->jobs(5).spec().optimizer().lr(), 0.01);
  // It survives a restart; cancelling it cancels its jobs; the report counts them as failed.
  Reopen();
  auto got = c_->GetSweep(created->id());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->state(), "running");
  EXPECT_EQ(got->job_states().at("queued"), 6);
  auto cancelled = c_->CancelSweep(created->id(), Caller{"bob", true});
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->state(), "cancelled");
  EXPECT_EQ(Job(got->jobs(0).job_id()).state(), "cancelled");
  auto report = c_->ReportSweep(created->id());
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->complete());
  EXPECT_EQ(report->cells(0).failed(), 3);
  EXPECT_EQ(c_->ListSweeps()->sweeps_size(), 1);
  EXPECT_EQ(c_->GetSweep("sweep-999999").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Submit(MicroJob()), "job-000007");  // the job counter moved past the sweep's jobs
}

// A report's baseline may be a cell of another sweep: it joins the report as SWEEP_ID/CELL with
// that sweep's jobs (paired by seed; docs/sweeps.md), or the query names what is wrong.
TEST_F(CoordinatorTest, ReportsPairAgainstAnotherSweepsCell) {
  auto sweep_of = [&](const std::vector<uint64_t>& seeds, const std::string& cell) {
    v1::SweepSpec spec;
    *spec.mutable_base() = MicroJob();
    if (cell.empty()) {
      auto* lr = &(*spec.mutable_grid())["optimizer.lr"];
      lr->add_values()->set_number_value(0.001);
      lr->add_values()->set_number_value(0.01);
    } else {
      spec.add_cells()->set_name(cell);
    }
    for (uint64_t seed : seeds) spec.add_seeds(seed);
    auto created = c_->CreateSweep(spec, "alice");
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->id() : std::string();
  };
  const std::string a = sweep_of({7, 8, 9}, ""), b = sweep_of({8, 9, 10}, "x");
  ASSERT_TRUE(c_->CancelSweep(b, Caller{"alice"}).ok());
  Coordinator::ReportQuery query;
  query.baseline = b + "/x";
  auto r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->baseline(), b + "/x");
  ASSERT_EQ(r->cells_size(), 3);
  EXPECT_EQ(r->cells(2).cell(), b + "/x");
  EXPECT_EQ(r->cells(2).sweep_id(), b);
  EXPECT_EQ(r->cells(2).failed(), 3);  // b's three cancelled jobs, not a's
  EXPECT_EQ(r->cells(0).pending(), 3);
  EXPECT_TRUE(r->cells(0).sweep_id().empty());
  ASSERT_EQ(r->differences_size(), 2);
  EXPECT_EQ(r->differences(0).baseline(), b + "/x");
  // Each of a's cells sets an lr; b's is the default: the pairing compares more than models.
  ASSERT_EQ(r->warnings_size(), 2);
  EXPECT_NE(r->warnings(1).find("cell 'optimizer.lr=0.01' and the baseline '" + b +
                                "/x' differ in more than the model: optimizer"),
            std::string::npos)
      << r->warnings(1);
  // The sweep's own cell, plainly or as SWEEP_ID/CELL of itself.
  for (const std::string& own : {std::string("optimizer.lr=0.01"), a + "/optimizer.lr=0.01"}) {
    query.baseline = own;
    auto self = c_->ReportSweep(a, query);
    ASSERT_TRUE(self.ok()) << self.status();
    EXPECT_EQ(self->baseline(), "optimizer.lr=0.01");
    EXPECT_EQ(self->cells_size(), 2);
  }
  for (const auto& [bad, says] : std::vector<std::pair<std::string, std::string>>{
           {"optimizer.lr=0.5", "no cell named 'optimizer.lr=0.5' (cells: optimizer.lr=0.001; "},
           {"sweep-424242/x", "no sweep 'sweep-424242'"},
           {"../x", "no sweep '..'"},
           {b + "/y", b + " has no cell named 'y' (cells: x)"},
           {std::string(300, 'x'), "longer than 256"}}) {
    query.baseline = bad;
    ExpectReportRefused(a, query, "baseline: " + says);
  }
}

// ?merge=: another sweep's cells join this sweep's cells of the same name as more seeds (a
// replication on new seeds); a seed counts once, and what differs besides the seed is a warning.
TEST_F(CoordinatorTest, ReportsMergeAnotherSweepsSeedsIntoTheSameCells) {
  auto sweep_of = [&](const std::vector<uint64_t>& seeds,
                      std::vector<std::pair<std::string, double>> cells) {
    v1::SweepSpec spec;
    *spec.mutable_base() = MicroJob();
    if (cells.empty()) {
      auto* lr = &(*spec.mutable_grid())["optimizer.lr"];
      lr->add_values()->set_number_value(0.001);
      lr->add_values()->set_number_value(0.01);
    }
    for (const auto& [name, lr] : cells) {
      v1::SweepCellSpec* cell = spec.add_cells();
      cell->set_name(name);
      (*cell->mutable_set()->mutable_fields())["optimizer.lr"].set_number_value(lr);
    }
    for (uint64_t seed : seeds) spec.add_seeds(seed);
    auto created = c_->CreateSweep(spec, "alice");
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->id() : std::string();
  };
  const std::string a = sweep_of({7, 8, 9}, {}), more = sweep_of({10, 11}, {});
  Coordinator::ReportQuery query;
  query.merge = {more};
  auto r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->merged_sweeps_size(), 1);
  EXPECT_EQ(r->merged_sweeps(0), more);
  ASSERT_EQ(r->cells_size(), 2);
  EXPECT_EQ(r->cells(0).pending(), 5);  // seeds 7-9 here and 10-11 there, none run yet
  EXPECT_EQ(r->cells(1).pending(), 5);
  EXPECT_EQ(r->warnings_size(), 0) << r->warnings(0);
  ASSERT_TRUE(c_->CancelSweep(more, Caller{"alice"}).ok());
  r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cells(0).pending(), 3);
  EXPECT_EQ(r->cells(0).failed(), 2);

  // A namesake cell with another lr, and a cell with no namesake: both said, the first merged.
  const std::string odd = sweep_of({12}, {{"optimizer.lr=0.001", 0.003}, {"x", 0.001}});
  query.merge = {more, odd};
  query.baseline = "optimizer.lr=0.01";
  r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->baseline(), "optimizer.lr=0.01");
  EXPECT_EQ(r->cells(0).pending() + r->cells(0).failed(), 6);
  EXPECT_EQ(r->cells(1).pending() + r->cells(1).failed(), 5);
  EXPECT_EQ(
      std::vector<std::string>(r->warnings().begin(), r->warnings().end()),
      (std::vector<std::string>{"cell 'optimizer.lr=0.001' of " + odd + " differs from " + a +
                                    "'s besides the seed: optimizer",
                                odd + "'s cells 'x' have no namesake in " + a + ": not merged"}));
  // With a baseline from another sweep as well.
  query.merge = {more};
  query.baseline = odd + "/x";
  r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cells_size(), 3);
  EXPECT_EQ(r->cells(0).pending() + r->cells(0).failed(), 5);

  const std::string overlap = sweep_of({9, 13}, {}), apart = sweep_of({14}, {{"y", 0.001}});
  query.baseline.clear();
  for (const auto& [merge, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{a}, a + " is the reported sweep"},
           {{more, more}, more + " is listed twice"},
           {{"sweep-424242"}, "no sweep 'sweep-424242'"},
           {{""}, "no sweep ''"},
           {{more, overlap},
            overlap + "'s cell 'optimizer.lr=0.001' has seed 9, which the cell "
                      "has already"},
           {{apart}, apart + " has no cell named like one of " + a + "'s (its cells: y)"},
           {std::vector<std::string>(17, more), "at most 16 sweeps"}}) {
    query.merge = merge;
    ExpectReportRefused(a, query, "merge: " + says);
  }
}

TEST_F(CoordinatorTest, ListsPaginateAndFilter) {
  for (int i = 0; i < 7; ++i) Submit(MicroJob());
  ASSERT_TRUE(c_->Cancel("job-000002", Caller{"alice"}).ok());
  std::set<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    auto page = c_->ListJobs("", 3, token);
    ASSERT_TRUE(page.ok());
    for (const auto& j : page->jobs()) EXPECT_TRUE(seen.insert(j.id()).second);
    token = page->next_page_token();
    ++pages;
  } while (!token.empty());
  EXPECT_EQ(seen.size(), 7u);
  EXPECT_EQ(pages, 3);
  auto cancelled = c_->ListJobs("cancelled", 50, "");
  ASSERT_TRUE(cancelled.ok());
  ASSERT_EQ(cancelled->jobs_size(), 1);
  EXPECT_EQ(cancelled->jobs(0).id(), "job-000002");
  EXPECT_EQ(c_->ListJobs("exploded", 50, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->ListJobs("", 0, "").status().code(), absl::StatusCode::kInvalidArgument);
}

// Rank 0's steps become the job's curves: resent points are dropped, each attempt is its own
// series (a resumed attempt repeats steps), the series survive a reopen, long ones are thinned.
TEST_F(CoordinatorTest, StepPointsBecomePerAttemptCurves) {
  const std::string w = RegisterWorker("a", 1);
  v1::SubmitJobRequest r = MicroJob(1);
  r.set_max_restarts(2);
  const std::string id = Submit(r);
  c_->Tick();
  ASSERT_EQ(Beat(w, "", 0, {}).assignments_size(), 1);
  auto steps = [&](int attempt, int64_t offset, int64_t first, int n, bool finished = false) {
    v1::HeartbeatRequest req;
    req.set_worker_id(w);
    v1::AttemptReport* a = req.add_attempts();
    a->set_job_id(id);
    a->set_attempt(attempt);
    v1::RankStatus* rank = a->add_ranks();
    rank->set_running(!finished);
    rank->set_exit_code(finished ? 137 : 0);
    a->set_finished(finished);
    a->set_steps_offset(offset);
    for (int i = 0; i < n; ++i) {
      v1::StepPoint* p = a->add_steps();
      p->set_step(first + i);
      p->set_loss(5.0 - 0.01 * static_cast<double>(first + i));
      p->set_learning_rate(1e-3);
      p->set_time_ms(1000 + first + i);
    }
    return c_->Heartbeat(req, w);
  };
  ASSERT_TRUE(steps(1, 0, 1, 30).ok());
  ASSERT_TRUE(steps(1, 20, 21, 15).ok());  // a lost reply: points 20..29 come again
  auto m = c_->JobMetrics(id, 2000);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->series_size(), 1);
  ASSERT_EQ(m->series(0).points_size(), 35);
  for (int i = 0; i < 35; ++i) EXPECT_EQ(m->series(0).points(i).step(), i + 1);
  EXPECT_DOUBLE_EQ(m->series(0).points(34).loss(), 5.0 - 0.35);
  // The attempt dies; the next resumes from step 20 and logs 21.. again in its own series.
  ASSERT_TRUE(steps(1, 35, 36, 0, true).ok());
  c_->Tick();
  ASSERT_EQ(Beat(w, "", 0, {}).assignments_size(), 1);
  ASSERT_EQ(Job(id).attempt(), 2);
  ASSERT_TRUE(steps(2, 0, 21, 5).ok());
  Reopen();
  m = c_->JobMetrics(id, 2000);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->series_size(), 2);
  EXPECT_EQ(m->series(1).attempt(), 2);
  EXPECT_EQ(m->series(1).points(0).step(), 21);
  EXPECT_EQ(m->series(0).points_size(), 35);
  // Thinned: every k-th point and the last.
  m = c_->JobMetrics(id, 10);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->series(0).total_points(), 35);
  EXPECT_LE(m->series(0).points_size(), 10);
  EXPECT_EQ(m->series(0).points(m->series(0).points_size() - 1).step(), 35);
  EXPECT_EQ(c_->JobMetrics(id, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->JobMetrics("job-999999", 100).status().code(), absl::StatusCode::kNotFound);
  // A worker cannot flood the coordinator or write negative steps.
  auto flood = steps(2, 5, 26, Coordinator::kMaxStepsPerReport + 1);
  EXPECT_EQ(flood.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(flood.status().message().find("attempts.steps"), std::string::npos);
  EXPECT_EQ(steps(2, 5, -7, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->JobMetrics(id, 2000)->series(1).points_size(), 5);
}

TEST_F(CoordinatorTest, JobListsFilterByUserKindAndSweepNewestFirst) {
  Submit(MicroJob());
  auto bob = c_->Submit(MicroJob(), "bob");
  ASSERT_TRUE(bob.ok()) << bob.status();
  Submit(MicroJob());
  Coordinator::JobFilter f;
  f.user = "bob";
  auto page = c_->ListJobs(f, 10, "");
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_EQ(page->jobs_size(), 1);
  EXPECT_EQ(page->jobs(0).id(), bob->id());
  f = {};
  f.kind = "pretrain";
  EXPECT_EQ(c_->ListJobs(f, 10, "")->jobs_size(), 3);
  f.kind = "sft";
  EXPECT_EQ(c_->ListJobs(f, 10, "")->jobs_size(), 0);
  f = {};
  f.sweep = "sweep-000001";
  EXPECT_EQ(c_->ListJobs(f, 10, "")->jobs_size(), 0);
  // Newest first, paged; a token only continues its own filter and order.
  f = {};
  f.newest_first = true;
  std::vector<std::string> ids;
  std::string token, first;
  do {
    auto p = c_->ListJobs(f, 2, token);
    ASSERT_TRUE(p.ok()) << p.status();
    for (const auto& j : p->jobs()) ids.push_back(j.id());
    token = p->next_page_token();
    if (first.empty()) first = token;
  } while (!token.empty());
  EXPECT_EQ(ids, (std::vector<std::string>{"job-000003", "job-000002", "job-000001"}));
  EXPECT_EQ(c_->ListJobs("", 2, first).status().code(), absl::StatusCode::kInvalidArgument);
  f.user = std::string(200, 'u');
  EXPECT_EQ(c_->ListJobs(f, 2, "").status().code(), absl::StatusCode::kInvalidArgument);
}

// The document against the router itself: the routes the user listener registers
// (InstallUserRoutes), not a second list kept by hand. Agents speak gRPC on their own port
// (agent_service.h, api/loom/v1/agent.proto), which the document does not describe.
TEST_F(CoordinatorTest, OpenApiDocumentsExactlyTheRegisteredRoutes) {
  const char* path = std::getenv("LOOM_OPENAPI");
  ASSERT_NE(path, nullptr);
  YAML::Node doc = YAML::LoadFile(path);
  EXPECT_EQ(doc["openapi"].as<std::string>().substr(0, 2), "3.");
  HttpServer users{HttpServerOptions{}};
  InstallUserRoutes(users, *c_, ApiOptions{});
  std::map<std::string, std::string> served;  // "GET /v1/jobs" -> auth
  for (const auto& r : users.Routes()) served[r.method + " " + r.path] = r.auth;
  std::map<std::string, std::string> documented;  // "GET /v1/jobs" -> none | authenticated
  for (const auto& p : doc["paths"]) {
    for (const auto& op : p.second) {
      const std::string method = op.first.as<std::string>();
      if (method == "parameters") continue;
      std::string upper;
      for (char ch : method) upper += static_cast<char>(std::toupper(ch));
      const bool open = op.second["security"] && op.second["security"].size() == 0;
      documented[upper + " " + p.first.as<std::string>()] = open ? "none" : "authenticated";
    }
  }
  std::set<std::string> served_keys, documented_keys;
  for (const auto& [k, auth] : served) served_keys.insert(k);
  for (const auto& [k, auth] : documented) documented_keys.insert(k);
  EXPECT_EQ(documented_keys, served_keys) << "routes served but not documented, or vice versa";
  for (const auto& [k, auth] : served) {
    if (documented.count(k)) {
      EXPECT_EQ(documented[k] == "none", auth == "none") << k << ": security vs the router";
    }
  }
  EXPECT_GE(served.size(), 16u);
  EXPECT_EQ(users.RouteTemplate("GET", "/v1/jobs/job-000001/logs"), "/v1/jobs/{id}/logs");
  EXPECT_EQ(users.RouteTemplate("GET", "/v1/nope"), "other");
}

}  // namespace
}  // namespace loom::coordinator
