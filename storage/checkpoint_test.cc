#include "storage/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "storage/crc32c.h"

namespace loom::storage {
namespace {

namespace fs = std::filesystem;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = (fs::temp_directory_path() /
             ("loom_ckpt_" + std::to_string(getpid()) + "_" +
              ::testing::UnitTest::GetInstance()->current_test_info()->name()))
                .string();
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // Commits a checkpoint of `world` shards whose tensor "w" holds `value` repeated.
  std::string Commit(int64_t step, int world, float value) {
    auto w = CheckpointWriter::Begin(root_, step, world);
    EXPECT_TRUE(w.ok()) << w.status();
    std::vector<float> data(64, value);
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(w->WriteShard(r, {{"w", DType::kF32, {64}, data.data(), data.size() * 4}}).ok());
    }
    Manifest m;
    m.tokens_seen = step * 100;
    m.spec_hash = "abc";
    m.kind = "pretrain";
    m.state["data.cursor"] = std::to_string(step);
    auto dir = w->Commit(m);
    EXPECT_TRUE(dir.ok()) << dir.status();
    return dir.ok() ? *dir : "";
  }

  // A writer for `step` with its one shard written ("w" = value), ready to commit.
  CheckpointWriter Ready(int64_t step, float value) {
    auto w = CheckpointWriter::Begin(root_, step, 1);
    EXPECT_TRUE(w.ok()) << w.status();
    std::vector<float> data(64, value);
    EXPECT_TRUE(w->WriteShard(0, {{"w", DType::kF32, {64}, data.data(), data.size() * 4}}).ok());
    return *std::move(w);
  }

  // The value of "w" in the committed checkpoint at dir, or NaN when it does not load.
  static float ValueAt(const std::string& dir) {
    auto loaded = LoadCheckpoint(dir);
    if (!loaded.ok()) return std::nanf("");
    float v;
    std::memcpy(&v, loaded->shards[0].Data(*loaded->shards[0].Find("w")).data(), 4);
    return v;
  }

  std::string root_;
};

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8a9136aau);
  // Incremental equals one-shot, across the 8-byte fast path boundary.
  std::string text = "The quick brown fox jumps over the lazy dog, twice over.";
  EXPECT_EQ(Crc32c(text.data() + 13, text.size() - 13, Crc32c(text.data(), 13)),
            Crc32c(text.data(), text.size()));
  EXPECT_EQ(Crc32cHex(0xe3069283u), "e3069283");
}

TEST_F(CheckpointTest, CommitListAndLoadTwoShards) {
  const std::string dir = Commit(100, 2, 1.5f);
  EXPECT_EQ(fs::path(dir).filename(), "step-00000100");
  EXPECT_TRUE(fs::exists(fs::path(dir) / "shard-00000-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "shard-00001-of-00002.safetensors"));
  auto list = ListCheckpoints(root_);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  auto loaded = LoadCheckpoint(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->manifest.step, 100);
  EXPECT_EQ(loaded->manifest.tokens_seen, 10000);
  EXPECT_EQ(loaded->manifest.world_size, 2);
  EXPECT_EQ(loaded->manifest.state.at("data.cursor"), "100");
  ASSERT_EQ(loaded->shards.size(), 2u);
  const TensorInfo* w = loaded->shards[1].Find("w");
  ASSERT_NE(w, nullptr);
  float first;
  std::memcpy(&first, loaded->shards[1].Data(*w).data(), 4);
  EXPECT_EQ(first, 1.5f);
}

TEST_F(CheckpointTest, CommitNeedsEveryShard) {
  auto w = CheckpointWriter::Begin(root_, 5, 2);
  ASSERT_TRUE(w.ok());
  float v = 1;
  ASSERT_TRUE(w->WriteShard(0, {{"w", DType::kF32, {1}, &v, 4}}).ok());
  auto dir = w->Commit(Manifest{});
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(ListCheckpoints(root_)->empty());
}

TEST_F(CheckpointTest, UncommittedDirectoriesAreIgnoredAndCleaned) {
  Commit(10, 1, 1.0f);
  // A writer that died before committing, and a step directory without a manifest.
  auto w = CheckpointWriter::Begin(root_, 20, 1);
  ASSERT_TRUE(w.ok());
  float v = 2;
  ASSERT_TRUE(w->WriteShard(0, {{"w", DType::kF32, {1}, &v, 4}}).ok());
  fs::create_directories(fs::path(root_) / "step-00000030");
  auto list = ListCheckpoints(root_);
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ(list->front().step, 10);
  auto latest = LoadLatestCheckpoint(root_, nullptr);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->manifest.step, 10);
  auto removed = CleanIncomplete(root_);
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, 2);
  EXPECT_FALSE(fs::exists(w->temp_dir()));
  EXPECT_FALSE(fs::exists(fs::path(root_) / "step-00000030"));
  EXPECT_TRUE(fs::exists(fs::path(root_) / "step-00000010"));
}

TEST_F(CheckpointTest, FlippedByteIsDetectedNamedAndSkipped) {
  Commit(1, 2, 1.0f);
  const std::string newest = Commit(2, 2, 2.0f);
  const fs::path shard = fs::path(newest) / "shard-00001-of-00002.safetensors";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(shard) - 3));
    char c;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(shard) - 3));
    c ^= 0x10;
    f.write(&c, 1);
  }
  auto bad = LoadCheckpoint(newest);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("shard-00001-of-00002.safetensors"), std::string::npos)
      << bad.status();
  EXPECT_NE(bad.status().message().find("checksum"), std::string::npos) << bad.status();
  std::vector<absl::Status> skipped;
  auto latest = LoadLatestCheckpoint(root_, &skipped);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->manifest.step, 1);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].message().find("shard-00001"), std::string::npos);
  // A truncated shard and a missing one are named too.
  fs::resize_file(shard, 10);
  EXPECT_NE(LoadCheckpoint(newest).status().message().find("size 10"), std::string::npos);
  fs::remove(shard);
  EXPECT_NE(LoadCheckpoint(newest).status().message().find("missing"), std::string::npos);
}

TEST_F(CheckpointTest, CorruptManifestIsDataLoss) {
  const std::string dir = Commit(7, 1, 1.0f);
  std::ofstream(fs::path(dir) / "manifest.json") << "{\"format_version\": 1, \"step\": ";
  EXPECT_EQ(LoadCheckpoint(dir).status().code(), absl::StatusCode::kDataLoss);
  std::ofstream(fs::path(dir) / "manifest.json")
      << R"({"format_version":1,"step":7,"tokens_seen":0,"world_size":1,"spec_hash":"","parent":"",
            "kind":"","created_unix_ms":0,"state":{},"shards":[{"rank":0,"file":"../../etc/passwd","bytes":1,"crc32c":"0"}]})";
  auto escaped = LoadCheckpoint(dir);
  EXPECT_EQ(escaped.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(escaped.status().message().find("not a plain name"), std::string::npos);
}

TEST_F(CheckpointTest, RetentionKeepsLastKAndEveryMth) {
  for (int64_t step : {5, 10, 15, 20, 25, 30, 35}) Commit(step, 1, 1.0f);
  ASSERT_TRUE(ApplyRetention(root_, 2, 10).ok());
  std::vector<int64_t> steps;
  auto list = ListCheckpoints(root_);
  ASSERT_TRUE(list.ok());
  for (const auto& c : *list) steps.push_back(c.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{10, 20, 30, 35}));
}

TEST_F(CheckpointTest, RecommittingAStepReplacesItWhole) {
  Commit(3, 1, 1.0f);
  const std::string dir = Commit(3, 1, 9.0f);
  auto loaded = LoadCheckpoint(dir);
  ASSERT_TRUE(loaded.ok());
  float v;
  std::memcpy(&v, loaded->shards[0].Data(*loaded->shards[0].Find("w")).data(), 4);
  EXPECT_EQ(v, 9.0f);
  EXPECT_EQ(ListCheckpoints(root_)->size(), 1u);
}

// A rename that fails as the n-th call (1-based) with `error`; the others are real.
CommitRenames FailingRename(int n, int error, bool exchange_supported) {
  auto calls = std::make_shared<int>(0);
  CommitRenames r = SystemCommitRenames();
  if (!exchange_supported) {
    r.exchange = [](const char*, const char*) {
      errno = EINVAL;  // as on a filesystem without RENAME_EXCHANGE
      return -1;
    };
  }
  r.rename = [calls, n, error](const char* from, const char* to) {
    if (++*calls == n) {
      errno = error;
      return -1;
    }
    return ::rename(from, to);
  };
  return r;
}

// Every failure of a replacing commit's renames is an error, and the step's previous copy is
// still there (or, when even the move back failed, put back at the next start). It used to
// report success after deleting the previous copy when the second rename failed.
TEST_F(CheckpointTest, AFailedRecommitKeepsThePreviousCopy) {
  const std::string dir = Commit(3, 1, 1.0f);
  struct Case {
    const char* what;
    CommitRenames renames;
    bool put_back_at_start;
  };
  CommitRenames exchange_fails = SystemCommitRenames();
  exchange_fails.exchange = [](const char*, const char*) {
    errno = EIO;
    return -1;
  };
  std::vector<Case> cases = {
      {"the exchange fails", exchange_fails, false},
      {"moving the old copy aside fails", FailingRename(1, EIO, false), false},
      {"moving the new copy in fails", FailingRename(2, EIO, false), false},
      {"moving in and moving back both fail", FailingRename(2, EIO, false), true},
  };
  cases[3].renames.rename = [calls = std::make_shared<int>(0)](const char* from, const char* to) {
    if (++*calls >= 2) {
      errno = EIO;
      return -1;
    }
    return ::rename(from, to);
  };
  for (Case& c : cases) {
    CheckpointWriter w = Ready(3, 9.0f);
    w.set_renames_for_testing(c.renames);
    auto committed = w.Commit(Manifest{});
    EXPECT_FALSE(committed.ok()) << c.what;
    if (c.put_back_at_start) {
      EXPECT_NE(committed.status().message().find("until the next start puts it back"),
                std::string::npos)
          << committed.status();
      EXPECT_FALSE(fs::exists(dir)) << c.what;
      ASSERT_TRUE(CleanIncomplete(root_).ok());
    }
    EXPECT_EQ(ValueAt(dir), 1.0f) << c.what;
    w.Abort();
    ASSERT_TRUE(CleanIncomplete(root_).ok());
    ASSERT_EQ(ListCheckpoints(root_)->size(), 1u) << c.what;
  }
}

// SIGKILL right after each rename of the commit protocol (a child process commits; its rename
// kills it once done): after CleanIncomplete the step has one complete copy, old or new.
TEST_F(CheckpointTest, AKillAfterAnyRenameLeavesACompleteStep) {
  struct Case {
    const char* what;
    bool recommit, exchange_supported;
    int kill_after;  // 1-based rename call (the exchange counts as one)
  };
  const std::vector<Case> cases = {{"a first commit's rename", false, true, 1},
                                   {"a recommit's exchange", true, true, 1},
                                   {"moving the old copy aside", true, false, 1},
                                   {"moving the new copy in", true, false, 2}};
  for (const Case& c : cases) {
    fs::remove_all(root_);
    const std::string dir = (fs::path(root_) / "step-00000003").string();
    if (c.recommit) Commit(3, 1, 1.0f);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      CheckpointWriter w = Ready(3, 9.0f);
      auto calls = std::make_shared<int>(0);
      const int kill_after = c.kill_after;
      auto then_die = [calls, kill_after](int rc) {
        if (++*calls == kill_after) ::raise(SIGKILL);
        return rc;
      };
      CommitRenames r;
      r.exchange = [then_die, &c](const char* a, const char* b) {
        if (!c.exchange_supported) {
          errno = EINVAL;
          return -1;
        }
        return then_die(SystemCommitRenames().exchange(a, b));
      };
      r.rename = [then_die](const char* from, const char* to) {
        return then_die(::rename(from, to));
      };
      w.set_renames_for_testing(r);
      (void)w.Commit(Manifest{});
      ::_exit(0);  // not killed: the case did not happen
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << c.what;
    ASSERT_TRUE(CleanIncomplete(root_).ok()) << c.what;
    const float v = ValueAt(dir);
    EXPECT_TRUE(v == 9.0f || (c.recommit && v == 1.0f)) << c.what << ": " << v;
    EXPECT_EQ(ListCheckpoints(root_)->size(), 1u) << c.what;
    for (const auto& e : fs::directory_iterator(root_)) {
      EXPECT_EQ(e.path().filename().string(), "step-00000003") << c.what << ": left behind";
    }
  }
}

}  // namespace
}  // namespace loom::storage
