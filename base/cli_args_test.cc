#include "base/cli_args.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace loom {
namespace {

absl::StatusOr<CliArgs> Parse(std::vector<std::string> argv) {
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  return CliArgs::Parse(static_cast<int>(cargv.size()), cargv.data(), 0, {"steps"}, {"print"},
                        {"set"});
}

TEST(CliArgs, RepeatableFlagsKeepEveryValueInOrder) {
  auto args = Parse({"--set", "a=1", "--steps", "3", "--set=b=2", "--print", "--set", "a=3"});
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(args->GetAll("set"), (std::vector<std::string>{"a=1", "b=2", "a=3"}));
  EXPECT_TRUE(args->Has("set"));
  EXPECT_EQ(args->Get("steps"), "3");
  EXPECT_TRUE(args->Has("print"));
  EXPECT_TRUE(args->GetAll("steps").empty());  // a plain flag is not a list
}

TEST(CliArgs, OtherFlagsStillOnce) {
  EXPECT_EQ(Parse({"--steps", "1", "--steps", "2"}).status().message(), "--steps given twice");
  EXPECT_EQ(Parse({"--set"}).status().message(), "--set needs a value");
  EXPECT_EQ(Parse({"--frob", "1"}).status().message(), "unknown flag --frob");
  auto none = Parse({});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->Has("set"));
  EXPECT_TRUE(none->GetAll("set").empty());
}

TEST(CliArgs, IntListsNameTheFlag) {
  std::vector<std::string> argv = {"--n", "64,100", "--bad", "3,x", "--big", "1,99999"};
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  auto args = CliArgs::Parse(static_cast<int>(cargv.size()), cargv.data(), 0, {"n", "bad", "big"});
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(*args->GetIntList("n", "1", 1, 65536), (std::vector<int64_t>{64, 100}));
  EXPECT_EQ(*args->GetIntList("absent", "2,4", 1, 8), (std::vector<int64_t>{2, 4}));
  const absl::Status bad = args->GetIntList("bad", "1", 1, 10).status();
  EXPECT_TRUE(IsUsageError(bad));
  EXPECT_EQ(bad.message(), "--bad: 'x' is not an integer in [1, 10] (a comma-separated list)");
  EXPECT_EQ(args->GetIntList("big", "1", 1, 65536).status().message(),
            "--big: '99999' is not an integer in [1, 65536] (a comma-separated list)");
  EXPECT_FALSE(args->GetIntList("absent", "", 1, 2).ok());  // an empty list is no list
}

}  // namespace
}  // namespace loom
