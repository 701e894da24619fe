// Tests only: a fresh, empty directory for the running gtest test, named after this process and
// the test, so neither concurrent runs nor two tests of one binary share it. The fixture removes
// it in TearDown.
#ifndef LOOM_BASE_TEST_DIRECTORY_H_
#define LOOM_BASE_TEST_DIRECTORY_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace loom {

inline std::filesystem::path FreshTestDirectory(const std::string& prefix) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      (prefix + "-" + std::to_string(::getpid()) + "-" +
       ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  return dir;
}

}  // namespace loom

#endif  // LOOM_BASE_TEST_DIRECTORY_H_
