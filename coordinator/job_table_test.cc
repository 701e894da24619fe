// The coordinator's state core alone, on a real RocksDB in a temporary directory and without any
// HTTP or scheduling: a committed change survives a reopen, a failed one leaves memory as it was
// and runs none of its effects, terminal states run the hook, credentials roll back with the
// change, and state written by older coordinators is migrated on open.
#include "coordinator/job_table.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "base/test_directory.h"
#include "coordinator/credentials.h"

namespace fs = std::filesystem;

namespace loom::coordinator {
namespace {

class JobTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDirectory("loom-job-table-test");
    Reopen();
  }
  void TearDown() override {
    table_.reset();
    fs::remove_all(dir_);
  }
  void Reopen() {
    table_.reset();
    auto t = JobTable::Open(dir_.string(), clock_, registry_);
    ASSERT_TRUE(t.ok()) << t.status();
    table_ = *std::move(t);
  }
  // A queued job under the next id, with a request key, in `txn`.
  std::string AddJob(JobTable::Txn& txn) {
    const std::string id = table_->NextJobId();
    v1::Job job;
    job.set_id(id);
    job.set_submitted_by("alice");
    table_->Save(txn, job);
    v1::Job& stored = table_->jobs()[id] = job;
    table_->SetState(txn, stored, JobState::kQueued, "submitted by alice");
    table_->TakeJobIds(txn, 1);
    table_->PutRequestId(txn, "alice\x1fr1", id);
    return id;
  }

  fs::path dir_;
  std::shared_ptr<ManualClock> clock_ = std::make_shared<ManualClock>(1000000);
  metrics::Registry registry_{"test"};
  std::unique_ptr<JobTable> table_;
};

TEST_F(JobTableTest, CommittedChangeSurvivesReopen) {
  JobTable::Txn txn;
  const std::string id = AddJob(txn);
  EXPECT_EQ(id, "job-000001");
  ASSERT_TRUE(table_->Commit(txn).ok());
  EXPECT_EQ(table_->NextJobId(), "job-000002");
  Reopen();
  ASSERT_EQ(table_->jobs().count(id), 1u);
  EXPECT_EQ(table_->jobs().at(id).state(), "queued");
  EXPECT_EQ(table_->jobs().at(id).update_time_ms(), 1000000);
  EXPECT_EQ(table_->NextJobId(), "job-000002");
  EXPECT_EQ(table_->RequestId("alice\x1fr1"), id);
  auto events = table_->store().Events(id);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].state(), "queued");
}

TEST_F(JobTableTest, FailedCommitRestoresMemoryAndRunsNoEffect) {
  JobTable::Txn first;
  const std::string id = AddJob(first);
  ASSERT_TRUE(table_->Commit(first).ok());

  JobTable::Txn txn;
  table_->SetState(txn, table_->jobs().at(id), JobState::kCancelled, "cancelled by alice");
  const std::string second = AddJob(txn);
  bool ran = false;
  txn.on_commit.push_back([&] { ran = true; });
  txn.no_space = true;  // what a job-log append that found the disk full sets
  const absl::Status s = table_->Commit(txn);
  EXPECT_TRUE(IsStorageFull(s)) << s;
  EXPECT_TRUE(table_->storage_full());
  EXPECT_FALSE(ran);
  EXPECT_EQ(table_->jobs().at(id).state(), "queued");
  EXPECT_EQ(table_->jobs().count(second), 0u);
  EXPECT_EQ(table_->NextJobId(), "job-000002");

  // The next change that reaches the disk clears the flag; the event sequence went back too.
  JobTable::Txn retry;
  table_->SetState(retry, table_->jobs().at(id), JobState::kCancelled, "cancelled by alice");
  ASSERT_TRUE(table_->Commit(retry).ok());
  EXPECT_FALSE(table_->storage_full());
  auto events = table_->store().Events(id);
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 2u);
  EXPECT_EQ((*events)[1].seq(), 1);
  EXPECT_EQ((*events)[1].state(), "cancelled");
}

TEST_F(JobTableTest, TerminalStateRunsTheHookAndClosesTheAttempt) {
  std::vector<std::string> ended;
  table_->set_on_terminal(
      [&](JobTable::Txn&, const v1::Job& job) { ended.push_back(job.id() + ":" + job.state()); });
  JobTable::Txn txn;
  const std::string id = AddJob(txn);
  ASSERT_TRUE(table_->Commit(txn).ok());
  EXPECT_TRUE(ended.empty());

  v1::Job& job = table_->jobs().at(id);
  job.add_history()->set_attempt(1);
  job.add_placement()->set_worker_id("w-1");
  clock_->Advance(2500);
  JobTable::Txn end;
  table_->SetState(end, job, JobState::kFailed, "rank 0 exited 1");
  ASSERT_TRUE(table_->Commit(end).ok());
  EXPECT_EQ(ended, std::vector<std::string>{id + ":failed"});
  EXPECT_EQ(job.end_time_ms(), 1002500);
  EXPECT_EQ(job.placement_size(), 0);
  EXPECT_EQ(job.history(0).end_reason(), "failed: rank 0 exited 1");
  EXPECT_EQ(job.history(0).end_time_ms(), 1002500);
}

TEST_F(JobTableTest, CredentialsRollBackWithTheChange) {
  JobTable::Txn issue;
  table_->SetCredential(issue, "w-1", CredentialDigest("first"));
  ASSERT_TRUE(table_->Commit(issue).ok());
  EXPECT_EQ(table_->WorkerOfDigest(CredentialDigest("first")), "w-1");

  JobTable::Txn replace;
  table_->SetCredential(replace, "w-1", CredentialDigest("second"));
  EXPECT_EQ(table_->WorkerOfDigest(CredentialDigest("first")), "");
  EXPECT_EQ(table_->WorkerOfDigest(CredentialDigest("second")), "w-1");
  table_->Rollback(replace);
  EXPECT_EQ(table_->WorkerOfDigest(CredentialDigest("first")), "w-1");
  EXPECT_EQ(table_->WorkerOfDigest(CredentialDigest("second")), "");

  JobTable::Txn revoke;
  table_->RevokeCredential(revoke, "w-1");
  ASSERT_TRUE(table_->Commit(revoke).ok());
  Reopen();
  EXPECT_EQ(table_->DigestOf("w-1"), "");
  EXPECT_EQ(table_->WorkerOfDigest(CredentialDigest("first")), "");
}

TEST_F(JobTableTest, OlderStateIsMigratedOnOpen) {
  {
    auto store = StateStore::Open(dir_.string() + "-old");
    ASSERT_TRUE(store.ok()) << store.status();
    StateStore::Batch batch;
    v1::CheckpointEntry e;
    e.set_id("job-000001/150");  // the old "<job>/<step>" spelling
    e.set_job_id("job-000001");
    e.set_step(150);
    batch.PutCheckpoint(e);
    batch.PutCredential("w-1", "clear-credential");  // stored in clear by an older coordinator
    ASSERT_TRUE((*store)->Commit(batch, true).ok());
  }
  table_.reset();
  fs::remove_all(dir_);
  fs::rename(dir_.string() + "-old", dir_);
  Reopen();
  ASSERT_EQ(table_->checkpoints().count("job-000001.150"), 1u);
  EXPECT_EQ(table_->checkpoints().count("job-000001/150"), 0u);
  EXPECT_EQ(table_->DigestOf("w-1"), CredentialDigest("clear-credential"));
  Reopen();  // the migration was written, not redone in memory only
  EXPECT_EQ(table_->checkpoints().count("job-000001.150"), 1u);
  EXPECT_EQ(table_->WorkerOfDigest(CredentialDigest("clear-credential")), "w-1");
}

}  // namespace
}  // namespace loom::coordinator
