// Files opened beneath a root (confined_files.h), with openat2 and with the O_NOFOLLOW walk:
// what stays inside opens, every way out is refused, including a directory swapped for a link
// after a first open succeeded.
#include "storage/confined_files.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace loom::storage {
namespace {

namespace fs = std::filesystem;

class ConfinedFilesTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() /
            ("loom-confined-" + std::to_string(::getpid()) + (GetParam() ? "-openat2" : "-walk"));
    fs::remove_all(base_);
    root_ = (base_ / "root").string();
    fs::create_directories(base_ / "root" / "data" / "set");
    fs::create_directories(base_ / "outside");
    Write(base_ / "root" / "data" / "set" / "file", "inside");
    Write(base_ / "outside" / "secret", "secret");
  }
  void TearDown() override {
    ASSERT_TRUE(ConfineReadsTo("").ok());
    fs::remove_all(base_);
  }
  static void Write(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }
  absl::StatusCode Open(const std::string& relative) {
    return OpenBeneath(root_, root_ + "/" + relative, false, GetParam()).status().code();
  }
  fs::path base_;
  std::string root_;
};

TEST_P(ConfinedFilesTest, OpensWhatIsInside) {
  auto fd = OpenBeneath(root_, root_ + "/data/set/file", false, GetParam());
  ASSERT_TRUE(fd.ok()) << fd.status();
  char buf[16] = {};
  EXPECT_EQ(::read(fd->get(), buf, sizeof buf), 6);
  EXPECT_EQ(std::string(buf), "inside");
  EXPECT_TRUE(OpenBeneath(root_, "data/set", true, GetParam()).ok());  // relative to the root
  EXPECT_EQ(Open("data/set/missing"), absl::StatusCode::kNotFound);
}

TEST_P(ConfinedFilesTest, RefusesEveryWayOut) {
  fs::create_symlink(base_ / "outside" / "secret", fs::path(root_) / "data" / "absolute");
  fs::create_symlink("../../outside/secret", fs::path(root_) / "data" / "relative");
  fs::create_symlink("/proc/self/root", fs::path(root_) / "data" / "magic");
  fs::create_symlink("/var/lib/loom-worker/worker-credential", fs::path(root_) / "data" / "cred");
  for (const char* path : {"data/absolute", "data/relative", "data/magic/etc/passwd"})
    EXPECT_EQ(Open(path), absl::StatusCode::kPermissionDenied) << path;
  EXPECT_NE(Open("data/cred"), absl::StatusCode::kOk);
  // Lexically outside: refused before anything is opened.
  EXPECT_EQ(
      OpenBeneath(root_, base_.string() + "/outside/secret", false, GetParam()).status().code(),
      absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Open("../outside/secret"), absl::StatusCode::kPermissionDenied);
}

TEST_P(ConfinedFilesTest, ADirectorySwappedForALinkAfterwardsIsRefused) {
  ASSERT_EQ(Open("data/set/file"), absl::StatusCode::kOk);  // what the coordinator checked
  fs::rename(fs::path(root_) / "data" / "set", base_ / "moved");
  fs::create_symlink(base_ / "outside", fs::path(root_) / "data" / "set");
  Write(base_ / "outside" / "file", "outside");
  EXPECT_EQ(Open("data/set/file"), absl::StatusCode::kPermissionDenied);
}

TEST_P(ConfinedFilesTest, LinksThatStayInside) {
  fs::create_symlink("set", fs::path(root_) / "data" / "alias");
  // openat2 follows a link that stays beneath the root; the fallback walk refuses every link.
  EXPECT_EQ(Open("data/alias/file"),
            GetParam() ? absl::StatusCode::kOk : absl::StatusCode::kPermissionDenied);
}

TEST_P(ConfinedFilesTest, TheProcessWideRoot) {
  // Unconfined: paths open as given.
  auto secret = ReadConfinedFile((base_ / "outside" / "secret").string(), 100);
  ASSERT_TRUE(secret.ok()) << secret.status();
  EXPECT_EQ(*secret, "secret");
  ASSERT_TRUE(ConfineReadsTo(root_).ok());
  EXPECT_EQ(ReadConfinedFile((base_ / "outside" / "secret").string(), 100).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(*ReadConfinedFile(root_ + "/data/set/file", 100), "inside");
  EXPECT_EQ(ReadConfinedFile(root_ + "/data/set/file", 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto stream = OpenConfinedStream(root_ + "/data/set/file");
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::string line;
  std::getline(**stream, line);
  EXPECT_EQ(line, "inside");
  EXPECT_FALSE(ConfineReadsTo((base_ / "nope").string()).ok());
}

INSTANTIATE_TEST_SUITE_P(OpenAt2AndWalk, ConfinedFilesTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "openat2" : "walk"; });

}  // namespace
}  // namespace loom::storage
