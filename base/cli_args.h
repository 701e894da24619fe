// Minimal flag parsing for the loom-train subcommands: --name value or --name=value, known
// flags only, and errors that name the flag.
#ifndef LOOM_BASE_CLI_ARGS_H_
#define LOOM_BASE_CLI_ARGS_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace loom {

// The command line itself is wrong (an unknown flag, a missing or malformed value):
// InvalidArgument with this payload, so a program can tell it from bad input files (loom-data
// exits 2 for the first, 1 for the second).
inline constexpr char kUsageErrorPayload[] = "type.loom.dev/usage";
absl::Status UsageError(absl::string_view message);
bool IsUsageError(const absl::Status& s);

class CliArgs {
 public:
  // Parses argv[first..argc). `flags` take a value; `switches` take none; `repeatable` flags
  // take a value each time they are given (GetAll).
  static absl::StatusOr<CliArgs> Parse(int argc, char** argv, int first,
                                       const std::set<std::string>& flags,
                                       const std::set<std::string>& switches = {},
                                       const std::set<std::string>& repeatable = {});

  // Flags parsed elsewhere (the loom CLI parses with CLI11): name -> value, "true" for switches.
  static CliArgs FromValues(std::map<std::string, std::string> values) {
    CliArgs args;
    args.values_ = std::move(values);
    return args;
  }

  bool Has(const std::string& name) const {
    return values_.count(name) > 0 || repeated_.count(name) > 0;
  }
  // Every value of a repeatable flag, in the order given.
  std::vector<std::string> GetAll(const std::string& name) const;
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  absl::StatusOr<std::string> Require(const std::string& name) const;
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t fallback, int64_t min,
                                 int64_t max) const;
  absl::StatusOr<double> GetDouble(const std::string& name, double fallback, double min,
                                   double max) const;
  // A comma-separated list of integers, each in [min, max] ("1,2,4"); fallback is such a list.
  absl::StatusOr<std::vector<int64_t>> GetIntList(const std::string& name,
                                                  const std::string& fallback, int64_t min,
                                                  int64_t max) const;

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, std::vector<std::string>> repeated_;
};

}  // namespace loom

#endif  // LOOM_BASE_CLI_ARGS_H_
