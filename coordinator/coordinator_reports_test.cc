// What the coordinator accepts from users and agents: cancellation, forged and bad reports, paged
// lists, worker credentials, checkpoint ids, retention and damaged checkpoints.
#include "coordinator/coordinator_test_fixture.h"

namespace loom::coordinator {
namespace {

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
      const std::string bytes = loom::ReadFile(e.path().string(), "state file").value_or("");
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

}  // namespace
}  // namespace loom::coordinator
