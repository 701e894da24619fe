#include "base/read_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace loom {
namespace {

namespace fs = std::filesystem;

class ReadFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("loom-read-file-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(ReadFileTest, ReadsEveryByte) {
  std::string bytes(200000, '\0');  // more than one block, with NULs
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
  std::ofstream(Path("f"), std::ios::binary) << bytes;
  absl::StatusOr<std::string> read = ReadFile(Path("f"), "--model");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, bytes);
  std::ofstream(Path("empty"), std::ios::binary).flush();
  EXPECT_EQ(*ReadFile(Path("empty"), "--model"), "");
}

TEST_F(ReadFileTest, ErrorsNameWhatAndWhere) {
  absl::StatusOr<std::string> missing = ReadFile(Path("missing"), "--model");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), "--model: cannot open '" + Path("missing") + "'");
  EXPECT_EQ(ReadFile(dir_.string(), "--model").status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(ReadFileTest, NonEmptyRejectsEmptyAndMissing) {
  std::ofstream(Path("empty"), std::ios::binary).flush();
  std::ofstream(Path("cert"), std::ios::binary) << "PEM";
  EXPECT_EQ(*ReadNonEmptyFile(Path("cert"), "--tls-cert"), "PEM");
  absl::StatusOr<std::string> empty = ReadNonEmptyFile(Path("empty"), "--tls-cert");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(empty.status().message(), "--tls-cert: cannot read '" + Path("empty") + "'");
  EXPECT_EQ(ReadNonEmptyFile(Path("missing"), "--tls-cert").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace loom
