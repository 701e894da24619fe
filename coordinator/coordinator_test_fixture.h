// The fixture of the coordinator's tests (coordinator_*test.cc, one binary): a Coordinator on a
// real RocksDB in a temporary directory, driven by simulated agent heartbeats on a ManualClock.
#ifndef LOOM_COORDINATOR_COORDINATOR_TEST_FIXTURE_H_
#define LOOM_COORDINATOR_COORDINATOR_TEST_FIXTURE_H_

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

#include "base/read_file.h"
#include "base/test_directory.h"
#include "coordinator/clock.h"
#include "coordinator/coordinator.h"
#include "coordinator/http_api.h"
#include "storage/checkpoint.h"

namespace fs = std::filesystem;

namespace loom::coordinator {

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDirectory("loom-coordinator-test");
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
  // Workers "a" and "b" (a slot each) and a 1-rank job placed on "a", heard at step 10: loss
  // after 300 ms of silence, the ranks' lease `lease_ms`, a 400 ms termination grace.
  struct OneOfTwo {
    std::string w1, w2, id;
  };
  void PlaceOnOneOfTwo(int lease_ms, OneOfTwo* out) {
    options_.lost_after_ms = 300;
    options_.lease_ms = lease_ms;
    options_.term_grace_ms = 400;
    Reopen();
    out->w1 = RegisterWorker("a", 1);
    out->id = Submit(MicroJob(1));
    c_->Tick();
    ASSERT_EQ(Job(out->id).placement(0).worker_id(), out->w1);
    Beat(out->w1, out->id, 1, {{0, -1}}, {10}, 30000);
    out->w2 = RegisterWorker("b", 1);
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
inline void KHop(v1::SubmitJobRequest& r, const std::string& options) {
  v1::DataConfig* d = r.mutable_spec()->mutable_data();
  d->set_source("task");
  d->set_task("khop");
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(options, d->mutable_task_options()).ok());
}

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_COORDINATOR_TEST_FIXTURE_H_
