// kind: serve jobs in the coordinator's state machine: what a submission must hold, a job that is
// `scheduled` until its server answers and `running` after, the endpoint the agent reports (its
// token kept in memory, never shown, and refused when it could break a header), and where the
// proxy may send a request in each state and for whom.
#include "coordinator/coordinator_test_fixture.h"
#include "loom/proto_json.h"
#include "loom/spec.h"

namespace loom::coordinator {
namespace {

constexpr char kServerToken[] = "0123456789abcdef0123456789abcdef";

class ServeJobTest : public CoordinatorTest {
 protected:
  // A finished micro job with a checkpoint at step 10 whose manifest records its spec.
  void SetUp() override {
    CoordinatorTest::SetUp();
    worker_ = RegisterWorker("a", 1);
    parent_ = Submit(MicroJob(1));
    c_->Tick();
    storage::Manifest m;
    m.step = 10;
    m.shards.push_back({0, "shard-0.safetensors", 1, "00000000"});
    m.state["spec"] = MessageToJsonText(Job(parent_).spec());
    fs::create_directories(CheckpointPath(parent_, 10));
    std::ofstream(fs::path(CheckpointPath(parent_, 10)) / "manifest.json")
        << storage::ManifestToJson(m);
    Beat(worker_, parent_, 1, {{0, -1}}, {10}, 30000);
    Beat(worker_, parent_, 1, {{0, 0}});
    ASSERT_EQ(Job(parent_).state(), "succeeded");
  }
  v1::SubmitJobRequest ServeJob() {
    v1::SubmitJobRequest r;
    r.mutable_spec()->set_kind("serve");
    r.set_init_from(parent_ + "/10");
    return r;
  }
  // A heartbeat of the serve job's first attempt, its rank running, with what the agent says of
  // the server.
  void ServeBeat(const std::string& id, int port, const std::string& token, bool ready) {
    v1::HeartbeatRequest req;
    req.set_worker_id(worker_);
    v1::AttemptReport* a = req.add_attempts();
    a->set_job_id(id);
    a->set_attempt(1);
    a->add_ranks()->set_running(true);
    a->mutable_serve()->set_port(port);
    a->mutable_serve()->set_token(token);
    a->mutable_serve()->set_ready(ready);
    ASSERT_TRUE(c_->Heartbeat(req, worker_).ok());
  }
  absl::StatusCode TargetCode(const std::string& id, const std::string& scope = "") {
    return c_->ServeTargetOf(id, scope).status().code();
  }

  std::string worker_, parent_;
};

TEST_F(ServeJobTest, ASubmissionNamesWhatAServeJobCannotHave) {
  struct Case {
    std::function<void(v1::SubmitJobRequest&)> edit;
    std::string says;
  };
  const std::vector<Case> cases = {
      {[](auto& r) { r.clear_init_from(); }, "init_from: is required for kind serve"},
      {[](auto& r) { r.set_world_size(2); }, "world_size: a serve job is one server"},
      {[](auto& r) { r.mutable_spec()->set_preset("micro"); }, "spec.model: a serve job serves"},
      {[](auto& r) { r.mutable_spec()->set_steps(10); }, "spec.steps: serve jobs do not train"},
      {[](auto& r) { r.mutable_spec()->mutable_data()->set_source("shards"); },
       "spec.data: serve jobs read no data"},
      {[](auto& r) { r.mutable_spec()->mutable_reasoning_eval(); },
       "spec.reasoning_eval: serve jobs do not evaluate"},
      {[](auto& r) { r.mutable_spec()->mutable_serve()->set_max_batch(5000); },
       "spec.serve.max_batch: must be in [0, 1024]"},
      {[](auto& r) { r.mutable_spec()->mutable_serve()->set_unhealthy_seconds(-1); },
       "spec.serve.unhealthy_seconds"},
      {[](auto& r) { r.mutable_spec()->mutable_serve()->set_model_name("a b"); },
       "spec.serve.model_name"},
  };
  for (const Case& c : cases) {
    v1::SubmitJobRequest r = ServeJob();
    c.edit(r);
    auto s = c_->Submit(r, "alice");
    ASSERT_FALSE(s.ok()) << c.says;
    EXPECT_NE(s.status().message().find(c.says), std::string::npos) << s.status();
  }
  v1::SubmitJobRequest train = MicroJob(1);
  train.mutable_spec()->mutable_serve();
  EXPECT_NE(c_->Submit(train, "alice").status().message().find("spec.serve: is for kind serve"),
            std::string::npos);
  // Accepted: the model is the checkpoint's, and clients name it by the checkpoint's id.
  const v1::Job job = Job(Submit(ServeJob()));
  EXPECT_EQ(job.spec().model().n_layers(), Job(parent_).spec().model().n_layers());
  EXPECT_EQ(job.spec().serve().model_name(), parent_ + ".10");
  EXPECT_EQ(job.spec().steps(), 0);
}

TEST_F(ServeJobTest, RunsOnceItsServerAnswersAndIsReachedOnlyThen) {
  const std::string id = Submit(ServeJob());
  EXPECT_EQ(TargetCode(id), absl::StatusCode::kUnavailable) << "queued";
  c_->Tick();
  ASSERT_EQ(Job(id).placement(0).worker_id(), worker_);
  ServeBeat(id, 0, "", false);  // started, not listening yet
  EXPECT_EQ(Job(id).state(), "scheduled");
  EXPECT_FALSE(Job(id).has_serve());
  // A token that could end the Authorization header is not taken, nor a port out of range.
  ServeBeat(id, 4242, "0123456789abcdef\r\nX-Evil: 1", true);
  ServeBeat(id, 70000, kServerToken, true);
  EXPECT_FALSE(Job(id).has_serve());
  EXPECT_EQ(Job(id).state(), "scheduled");
  ServeBeat(id, 4242, kServerToken, false);  // listening, /healthz not answered yet
  EXPECT_EQ(Job(id).state(), "scheduled");
  EXPECT_EQ(Job(id).serve().address(), "127.0.0.1:4242");
  EXPECT_EQ(TargetCode(id), absl::StatusCode::kUnavailable);
  ServeBeat(id, 4242, kServerToken, true);
  const v1::Job job = Job(id);
  EXPECT_EQ(job.state(), "running");
  EXPECT_NE(job.reason().find("loom-serve answering on"), std::string::npos) << job.reason();
  EXPECT_EQ(job.serve().base_path(), "/v1/jobs/" + id + "/serve/v1");
  EXPECT_TRUE(job.serve().ready());
  EXPECT_EQ(job.serve().model(), parent_ + ".10");
  EXPECT_EQ(MessageToJsonText(job).find(kServerToken), std::string::npos) << "token shown";
  auto target = c_->ServeTargetOf(id, "");
  ASSERT_TRUE(target.ok()) << target.status();
  EXPECT_EQ(target->host, "127.0.0.1");
  EXPECT_EQ(target->port, 4242);
  EXPECT_EQ(target->token, kServerToken);
  // --private-jobs: its owner's (alice's) only. Training jobs have no server.
  EXPECT_TRUE(c_->ServeTargetOf(id, "alice").ok());
  EXPECT_EQ(TargetCode(id, "bob"), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(TargetCode(parent_), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(TargetCode("job-000099"), absl::StatusCode::kNotFound);
}

TEST_F(ServeJobTest, AServerThatDiesIsNotReachedUntilItsNextAttemptAnswers) {
  const std::string id = Submit(ServeJob());
  c_->Tick();
  ServeBeat(id, 4242, kServerToken, true);
  ASSERT_EQ(Job(id).state(), "running");
  Beat(worker_, id, 1, {{0, 137}});  // kill -9 of the rank
  EXPECT_NE(Job(id).state(), "running");
  EXPECT_FALSE(Job(id).has_serve());
  EXPECT_EQ(TargetCode(id), absl::StatusCode::kUnavailable);
  // Restarted and cancelled: it serves no more.
  ASSERT_TRUE(c_->Cancel(id, Caller{"alice", false}).ok());
  EXPECT_EQ(TargetCode(id), absl::StatusCode::kFailedPrecondition);
}

// A server holds its slot like a trainer: it counts against its owner's quota, and the owner's
// next job waits for it with the reason.
TEST_F(ServeJobTest, AServerCountsAgainstItsOwnersQuota) {
  RegisterWorker("big", 4);
  v1::Quota q;
  q.set_kind("user");
  q.set_name("alice");
  q.set_slots(1);
  ASSERT_TRUE(c_->SetQuota(q, Caller{"root", true}).ok());
  const std::string serve = Submit(ServeJob());
  c_->Tick();
  ASSERT_EQ(Job(serve).placement_size(), 1);
  const std::string train = Submit(MicroJob(1));
  c_->Tick();
  EXPECT_EQ(Job(train).state(), "queued");
  EXPECT_EQ(Job(train).reason(), "quota: alice uses 1 of 1 slots");
  ASSERT_TRUE(c_->Cancel(serve, Caller{"alice", false}).ok());
}

}  // namespace
}  // namespace loom::coordinator
