#include "plugins/attention/bench/bench_flags.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace loom::attention::bench {
namespace {

BenchFlags Defaults() { return BenchFlags({{"n", "64,100"}, {"heads", "8"}, {"mask", "none"}}); }

bool Parse(BenchFlags& flags, std::vector<std::string> args) {
  args.insert(args.begin(), "bench");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return flags.Parse(static_cast<int>(argv.size()), argv.data());
}

TEST(BenchFlags, ValuesInBothFormsAndDefaults) {
  BenchFlags flags = Defaults();
  ASSERT_TRUE(Parse(flags, {"--heads", "4", "--mask=causal"})) << flags.error();
  EXPECT_EQ(flags.Int("heads", 1, 64), 4);
  EXPECT_EQ(flags.Choice("mask", {"none", "causal"}), "causal");
  EXPECT_EQ(flags.IntList("n", 1, 65536), (std::vector<int64_t>{64, 100}));
  EXPECT_TRUE(flags.ok());
}

TEST(BenchFlags, MalformedCommandLinesNameWhatIsWrong) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--frob", "1"}, "unknown flag --frob"},
      {{"--heads"}, "--heads needs a value"},
      {{"heads", "4"}, "unexpected argument 'heads'"},
  };
  for (const auto& [args, message] : cases) {
    BenchFlags flags = Defaults();
    EXPECT_FALSE(Parse(flags, args));
    EXPECT_EQ(flags.error(), message);
    EXPECT_FALSE(flags.help());
  }
  BenchFlags help = Defaults();
  EXPECT_FALSE(Parse(help, {"--help"}));
  EXPECT_TRUE(help.help());
  EXPECT_TRUE(help.ok());
}

TEST(BenchFlags, BadValuesAreErrorsNotExceptions) {
  const std::vector<std::pair<std::string, std::string>> heads = {
      {"x", "--heads: 'x' is not an integer in [1, 64]"},
      {"0", "--heads: '0' is not an integer in [1, 64]"},
      {"4x", "--heads: '4x' is not an integer in [1, 64]"},
      {"", "--heads: '' is not an integer in [1, 64]"},
      {"99999999999999999999", "--heads: '99999999999999999999' is not an integer in [1, 64]"},
  };
  for (const auto& [value, message] : heads) {
    BenchFlags flags = Defaults();
    ASSERT_TRUE(Parse(flags, {"--heads", value}));
    EXPECT_EQ(flags.Int("heads", 1, 64), 1);
    EXPECT_EQ(flags.error(), message);
  }
  for (const char* list : {"64,,100", "64,abc", ",", "64,"}) {
    BenchFlags flags = Defaults();
    ASSERT_TRUE(Parse(flags, {"--n", list}));
    EXPECT_TRUE(flags.IntList("n", 1, 65536).empty()) << list;
    EXPECT_NE(flags.error().find("(a comma-separated list)"), std::string::npos) << list;
  }
  BenchFlags flags = Defaults();
  ASSERT_TRUE(Parse(flags, {"--mask", "sideways", "--heads", "x"}));
  EXPECT_EQ(flags.Choice("mask", {"none", "causal"}), "none");
  flags.Int("heads", 1, 64);
  EXPECT_EQ(flags.error(), "--mask: 'sideways' is not one of none, causal");  // the first error
}

// The programs themselves: exit 2 with the flag named on stderr, 0 on --help.
int RunProgram(const char* env, const std::string& args, std::string* output) {
  const char* program = std::getenv(env);
  if (program == nullptr) return -1;
  FILE* pipe = popen((std::string(program) + " " + args + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buf[4096];
  output->clear();
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) output->append(buf, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(BenchFlags, BenchmarksRefuseBadFlagsWithoutCrashing) {
  const std::vector<std::tuple<const char*, std::string, int, std::string>> cases = {
      {"LOOM_BENCH_ATTENTION", "--heads x", 2,
       "loom-bench-attention: --heads: 'x' is not an integer"},
      {"LOOM_BENCH_ATTENTION", "--n 256,abc", 2, "--n: 'abc' is not an integer"},
      {"LOOM_BENCH_ATTENTION", "--dtype fp16", 2, "--dtype: 'fp16' is not one of fp32, bf16"},
      {"LOOM_BENCH_ATTENTION", "--help", 0, "usage: loom-bench-attention"},
      {"LOOM_BENCH_SIMPLICIAL", "--reps 99999999999999999999", 2,
       "loom-bench-simplicial: --reps: '99999999999999999999' is not an integer"},
      {"LOOM_BENCH_SIMPLICIAL", "--segments jagged", 2, "--segments: 'jagged' is not one of"},
      {"LOOM_BENCH_SIMPLICIAL", "--help", 0, "usage: loom-bench-simplicial"},
  };
  for (const auto& [env, args, code, needle] : cases) {
    std::string out;
    ASSERT_EQ(RunProgram(env, args, &out), code) << env << " " << args << ": " << out;
    EXPECT_NE(out.find(needle), std::string::npos) << env << " " << args << ": " << out;
  }
}

}  // namespace
}  // namespace loom::attention::bench
