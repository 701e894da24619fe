#include "base/cli_args.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace loom {

absl::Status UsageError(absl::string_view message) {
  absl::Status s = absl::InvalidArgumentError(message);
  s.SetPayload(kUsageErrorPayload, absl::Cord("usage"));
  return s;
}

bool IsUsageError(const absl::Status& s) { return s.GetPayload(kUsageErrorPayload).has_value(); }

absl::StatusOr<CliArgs> CliArgs::Parse(int argc, char** argv, int first,
                                       const std::set<std::string>& flags,
                                       const std::set<std::string>& switches,
                                       const std::set<std::string>& repeatable) {
  CliArgs args;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) {
      return UsageError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (switches.count(name)) {
      if (has_value) return UsageError(absl::StrCat("--", name, " takes no value"));
      args.values_[name] = "true";
      continue;
    }
    if (!flags.count(name) && !repeatable.count(name))
      return UsageError(absl::StrCat("unknown flag --", name));
    if (!has_value) {
      if (i + 1 >= argc) return UsageError(absl::StrCat("--", name, " needs a value"));
      value = argv[++i];
    }
    if (repeatable.count(name)) {
      args.repeated_[name].push_back(value);
      continue;
    }
    if (args.values_.count(name)) {
      return UsageError(absl::StrCat("--", name, " given twice"));
    }
    args.values_[name] = value;
  }
  return args;
}

std::string CliArgs::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

std::vector<std::string> CliArgs::GetAll(const std::string& name) const {
  auto it = repeated_.find(name);
  return it == repeated_.end() ? std::vector<std::string>{} : it->second;
}

absl::StatusOr<std::string> CliArgs::Require(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end() || it->second.empty()) {
    return UsageError(absl::StrCat("--", name, " is required"));
  }
  return it->second;
}

absl::StatusOr<int64_t> CliArgs::GetInt(const std::string& name, int64_t fallback, int64_t min,
                                        int64_t max) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0' || errno == ERANGE) {
    return UsageError(absl::StrCat("--", name, ": '", it->second, "' is not an integer"));
  }
  if (v < min || v > max) {
    return UsageError(absl::StrCat("--", name, ": ", v, " is out of range [", min, ", ", max, "]"));
  }
  return v;
}

absl::StatusOr<double> CliArgs::GetDouble(const std::string& name, double fallback, double min,
                                          double max) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(it->second.c_str(), &end);
  if (it->second.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) {
    return UsageError(absl::StrCat("--", name, ": '", it->second, "' is not a number"));
  }
  if (v < min || v > max) {
    return UsageError(absl::StrCat("--", name, ": ", v, " is out of range [", min, ", ", max, "]"));
  }
  return v;
}

absl::StatusOr<std::vector<int64_t>> CliArgs::GetIntList(const std::string& name,
                                                         const std::string& fallback, int64_t min,
                                                         int64_t max) const {
  const std::string list = Get(name, fallback);
  std::vector<int64_t> out;
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(item, &v) || v < min || v > max) {
      return UsageError(absl::StrCat("--", name, ": '", item, "' is not an integer in [", min, ", ",
                                     max, "] (a comma-separated list)"));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace loom
