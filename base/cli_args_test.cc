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

}  // namespace
}  // namespace loom
