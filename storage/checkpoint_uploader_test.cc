// The uploader's promises with a real POSIX store as the destination, wrapped to fail or hold
// uploads on cue: one upload in flight (the next Submit waits and says how long), transient
// failures retried, permanent ones reported, and a retrying upload given up at exit.
#include "storage/checkpoint_uploader.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

namespace loom::storage {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The real store under `root`, whose next uploads fail with `fail` (while `failures` > 0) or
// take `hold` longer.
class ScriptedStore : public CheckpointStore {
 public:
  explicit ScriptedStore(const std::string& root) : real_(*OpenCheckpointStore(root)) {}
  const std::string& root() const override { return real_->root(); }
  bool remote() const override { return true; }
  absl::StatusOr<std::vector<CheckpointRef>> List() override { return real_->List(); }
  absl::StatusOr<LoadedCheckpoint> Load(const std::string& d) override { return real_->Load(d); }
  absl::StatusOr<int> CleanIncomplete() override { return real_->CleanIncomplete(); }
  absl::Status Delete(const std::string& d) override { return real_->Delete(d); }
  absl::StatusOr<std::string> Upload(const std::string& local,
                                     const std::function<absl::Status()>& before) override {
    ++calls;
    std::this_thread::sleep_for(hold);
    if (failures > 0) {
      --failures;
      return fail;
    }
    return real_->Upload(local, before);
  }
  std::atomic<int> calls{0}, failures{0};
  absl::Status fail = absl::UnavailableError("store down");
  std::chrono::milliseconds hold{0};

 private:
  std::unique_ptr<CheckpointStore> real_;
};

class UploaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() /
            ("loom_uploader_" + std::to_string(getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
  }
  void TearDown() override { fs::remove_all(base_); }
  // A committed local step with one shard.
  std::string Staged(int64_t step) {
    auto w = CheckpointWriter::Begin((base_ / "staging").string(), step, 1);
    std::vector<float> data(16, static_cast<float>(step));
    EXPECT_TRUE(w->WriteShard(0, {{"w", DType::kF32, {16}, data.data(), data.size() * 4}}).ok());
    auto dir = w->Commit(Manifest{});
    EXPECT_TRUE(dir.ok()) << dir.status();
    return *dir;
  }
  std::string Store() const { return (base_ / "store").string(); }
  fs::path base_;
};

TEST_F(UploaderTest, OneInFlightAndTheWaitIsMeasured) {
  ScriptedStore store(Store());
  store.hold = std::chrono::milliseconds(300);
  CheckpointUploader up(&store, {});
  EXPECT_LT(up.Submit(10, Staged(10), 64), 0.05);  // nothing in flight: no wait
  const double waited = up.Submit(20, Staged(20), 64);
  EXPECT_GT(waited, 0.15);  // step 10's upload was still going
  up.Wait();
  auto done = up.TakeFinished();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_TRUE(done[0].status.ok() && done[1].status.ok());
  EXPECT_EQ(done[0].step, 10);
  EXPECT_EQ(done[1].where, (fs::path(Store()) / "step-00000020").string());
  EXPECT_EQ(store.List()->size(), 2u);
}

TEST_F(UploaderTest, TransientFailuresAreRetriedWholeAndNoted) {
  ScriptedStore store(Store());
  store.failures = 2;
  CheckpointUploader::Hooks hooks;
  hooks.max_backoff_s = 0.05;
  CheckpointUploader up(&store, hooks);
  up.Submit(10, Staged(10), 64);
  up.Wait();
  auto done = up.TakeFinished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].status.ok()) << done[0].status;
  EXPECT_EQ(done[0].retries, 2);
  EXPECT_EQ(store.calls, 3);
  EXPECT_EQ(up.TakeNotes().size(), 2u);
}

TEST_F(UploaderTest, PermanentFailuresEndTheUpload) {
  ScriptedStore store(Store());
  store.failures = 100;
  store.fail = absl::PermissionDeniedError("s3://b/k: PUT: HTTP 403 InvalidAccessKeyId");
  CheckpointUploader up(&store, {});
  up.Submit(10, Staged(10), 64);
  up.Wait();
  auto done = up.TakeFinished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(absl::IsPermissionDenied(done[0].status)) << done[0].status;
  EXPECT_EQ(store.calls, 1);  // no retry loop
}

TEST_F(UploaderTest, ARetryingUploadIsAbandonedAtExit) {
  ScriptedStore store(Store());
  store.failures = 1000000;
  const auto start = Clock::now();
  {
    CheckpointUploader up(&store, {});
    up.Submit(10, Staged(10), 64);
    while (store.calls < 1) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }  // destroyed while it waits to try again
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0);
  EXPECT_TRUE(store.List()->empty());
}

}  // namespace
}  // namespace loom::storage
