// The coordinator's state machine on a real RocksDB in a temporary directory: validation,
// persistence across a reopen, scheduling, the attempt lifecycle driven by agent heartbeats
// (start, checkpoints, rank failure -> restart from the newest checkpoint, success), lost
// workers, cancellation; and api/openapi.yaml against the served route table.
#include "coordinator.h"

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <set>
#include <thread>

#include "http_api.h"

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
        c->set_path("/ckpt/step-" + std::to_string(step));
      }
    }
    auto r = c_->Heartbeat(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : v1::HeartbeatResponse();
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
  CoordinatorOptions options_;
  std::unique_ptr<Coordinator> c_;
};

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
  v1::SubmitJobRequest r = MicroJob();
  r.mutable_spec()->mutable_checkpoint()->set_dir("team/ckpt");
  const std::string id = Submit(r);
  const std::string root = fs::weakly_canonical(options_.storage_root).string();
  EXPECT_EQ(Job(id).spec().checkpoint().dir(), root + "/team/ckpt");
  const std::string id2 = Submit(MicroJob());
  EXPECT_EQ(Job(id2).spec().checkpoint().dir(), root + "/jobs/" + id2 + "/checkpoints");
}

TEST_F(CoordinatorTest, StateSurvivesAReopen) {
  v1::SubmitJobRequest r = MicroJob();
  r.set_request_id("client-1:attempt");
  const std::string a = Submit(r);
  const std::string b = Submit(MicroJob());
  ASSERT_TRUE(c_->Cancel(b, "bob").ok());
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
  auto workers = c_->ListWorkers();
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
  EXPECT_EQ(job.resume_from(), "/ckpt/step-20");
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
  // A second failure with no restarts left fails the job.
  const std::string id2 = Submit(MicroJob(1));
  c_->Tick();
  const std::string w = Job(id2).placement(0).worker_id();
  r = MicroJob(1);
  Beat(w, id2, 1, {{0, 1}});
  job = Job(id2);
  EXPECT_EQ(job.state(), "queued");  // max_restarts defaults to 3
  (void)w1;
  (void)w2;
}

TEST_F(CoordinatorTest, LostWorkerFailsItsAttemptAndTheJobMoves) {
  options_.lost_after_ms = 300;
  Reopen();
  const std::string w1 = RegisterWorker("a", 1);
  const std::string id = Submit(MicroJob(1));
  c_->Tick();
  ASSERT_EQ(Job(id).placement(0).worker_id(), w1);
  Beat(w1, id, 1, {{0, -1}}, {10}, 30000);
  const std::string w2 = RegisterWorker("b", 1);
  // w2 keeps beating, w1 goes silent.
  for (int i = 0; i < 8; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    Beat(w2, "", 0, {});
    c_->Tick();
  }
  v1::Job job = Job(id);
  EXPECT_EQ(job.state(), "scheduled");
  ASSERT_EQ(job.placement_size(), 1);
  EXPECT_EQ(job.placement(0).worker_id(), w2);
  EXPECT_EQ(job.resume_from(), "/ckpt/step-10");
  bool lost_event = false;
  for (const auto& e : job.events())
    lost_event |= e.reason().find("worker " + w1 + " lost") != std::string::npos;
  EXPECT_TRUE(lost_event);
  auto workers = c_->ListWorkers();
  for (const auto& w : workers.workers()) EXPECT_EQ(w.state(), w.id() == w1 ? "lost" : "alive");
  // The lost worker comes back with its stale attempt: it is told to stop it.
  auto hb = Beat(w1, id, 1, {{0, -1}});
  ASSERT_EQ(hb.cancels_size(), 1);
}

TEST_F(CoordinatorTest, CancelStopsRanksAndRejectsTerminalJobs) {
  const std::string w = RegisterWorker("a", 2);
  const std::string id = Submit(MicroJob(2));
  c_->Tick();
  Beat(w, id, 1, {{0, -1}, {1, -1}}, {}, 31000);
  auto cancelled = c_->Cancel(id, "carol");
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->state(), "cancelled");
  auto hb = Beat(w, id, 1, {{0, -1}, {1, -1}});
  ASSERT_EQ(hb.cancels_size(), 1);
  EXPECT_EQ(hb.assignments_size(), 0);
  auto again = c_->Cancel(id, "carol");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c_->Cancel("job-999999", "carol").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c_->Cancel("../etc", "carol").status().code(), absl::StatusCode::kInvalidArgument);
  // Until the ranks are reported gone their slots stay in use.
  auto workers = c_->ListWorkers();
  EXPECT_EQ(workers.workers(0).used_slots(), 2);
  Beat(w, id, 1, {{0, 143}, {1, 143}});
  workers = c_->ListWorkers();
  EXPECT_EQ(workers.workers(0).used_slots(), 0);
}

TEST_F(CoordinatorTest, ListsPaginateAndFilter) {
  for (int i = 0; i < 7; ++i) Submit(MicroJob());
  ASSERT_TRUE(c_->Cancel("job-000002", "x").ok());
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

TEST(OpenApiTest, DocumentsExactlyTheServedRoutes) {
  const char* path = std::getenv("LOOM_OPENAPI");
  ASSERT_NE(path, nullptr);
  YAML::Node doc = YAML::LoadFile(path);
  EXPECT_EQ(doc["openapi"].as<std::string>().substr(0, 2), "3.");
  std::set<std::string> documented, served;
  for (const auto& p : doc["paths"]) {
    for (const auto& op : p.second) {
      const std::string method = op.first.as<std::string>();
      if (method == "parameters") continue;
      std::string upper;
      for (char ch : method) upper += static_cast<char>(std::toupper(ch));
      documented.insert(upper + " " + p.first.as<std::string>());
      // Authentication as documented matches the route table.
      const bool open = op.second["security"] && op.second["security"].size() == 0;
      for (const Route& r : Routes()) {
        if (upper == r.method && p.first.as<std::string>() == r.path) {
          EXPECT_EQ(open, std::string(r.auth) == "none") << r.path;
        }
      }
    }
  }
  for (const Route& r : Routes()) served.insert(std::string(r.method) + " " + r.path);
  EXPECT_EQ(documented, served);
}

}  // namespace
}  // namespace loom::coordinator
