// The attention benchmarks' command-line flags: "--name value" or "--name=value", known names
// only, integers and integer lists checked against a range, choices against their list. Written
// here rather than taken from base/cli_args.h or CLI11 because the attention-only build (a GPU
// machine with nothing but PyTorch: -DLOOM_ATTENTION_ONLY=ON) has neither absl nor CLI11. No
// exceptions: the first malformed value is kept as an error that names its flag.
#ifndef LOOM_PLUGINS_ATTENTION_BENCH_BENCH_FLAGS_H_
#define LOOM_PLUGINS_ATTENTION_BENCH_BENCH_FLAGS_H_

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace loom::attention::bench {

class BenchFlags {
 public:
  // The known flags and their defaults.
  explicit BenchFlags(std::map<std::string, std::string> defaults) : values_(std::move(defaults)) {}

  // argv[1..argc); false after an error, or on --help / -h (help() then says so).
  bool Parse(int argc, char** argv) {
    for (int i = 1; i < argc && ok(); ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        help_ = true;
        return false;
      }
      if (a.rfind("--", 0) != 0) return Fail("unexpected argument '" + a + "'");
      const size_t eq = a.find('=');
      const std::string name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      if (!values_.count(name)) return Fail("unknown flag --" + name);
      if (eq != std::string::npos) {
        values_[name] = a.substr(eq + 1);
      } else if (i + 1 < argc) {
        values_[name] = argv[++i];
      } else {
        return Fail("--" + name + " needs a value");
      }
    }
    return ok();
  }

  // After every flag is read: false when the program goes on; true, after printing the usage
  // (and the error, on stderr), when it exits with *exit_code: 0 on --help, else 2.
  bool Exit(const char* program, const char* usage, int* exit_code) const {
    if (ok() && !help_) return false;
    *exit_code = help_ ? 0 : 2;
    if (!help_) std::fprintf(stderr, "%s: %s\n", program, error_.c_str());
    std::fprintf(help_ ? stdout : stderr, "%s\n", usage);
    return true;
  }

  bool ok() const { return error_.empty(); }
  bool help() const { return help_; }
  const std::string& error() const { return error_; }
  const std::string& Get(const std::string& name) const { return values_.at(name); }

  // The value in [min, max]; min after an error.
  int64_t Int(const std::string& name, int64_t min, int64_t max) {
    int64_t v = min;
    if (!ToInt(Get(name), min, max, &v)) Fail(Range(name, Get(name), min, max));
    return v;
  }

  // A comma-separated list, each in [min, max]; empty after an error.
  std::vector<int64_t> IntList(const std::string& name, int64_t min, int64_t max) {
    std::vector<int64_t> out;
    const std::string& list = Get(name);
    for (size_t start = 0;;) {
      const size_t comma = list.find(',', start);
      const std::string item = list.substr(start, comma - start);
      int64_t v = 0;
      if (!ToInt(item, min, max, &v)) {
        Fail(Range(name, item, min, max) + " (a comma-separated list)");
        return {};
      }
      out.push_back(v);
      if (comma == std::string::npos) return out;
      start = comma + 1;
    }
  }

  // One of `choices`; the first after an error.
  std::string Choice(const std::string& name, const std::vector<std::string>& choices) {
    for (const std::string& c : choices) {
      if (Get(name) == c) return c;
    }
    std::string list;
    for (const std::string& c : choices) list += (list.empty() ? "" : ", ") + c;
    Fail("--" + name + ": '" + Get(name) + "' is not one of " + list);
    return choices.front();
  }

 private:
  static bool ToInt(const std::string& s, int64_t min, int64_t max, int64_t* v) {
    errno = 0;
    char* end = nullptr;
    const long long x = std::strtoll(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || errno == ERANGE || x < min || x > max) return false;
    *v = x;
    return true;
  }
  static std::string Range(const std::string& name, const std::string& value, int64_t min,
                           int64_t max) {
    return "--" + name + ": '" + value + "' is not an integer in [" + std::to_string(min) + ", " +
           std::to_string(max) + "]";
  }
  bool Fail(const std::string& message) {
    if (error_.empty()) error_ = message;
    return false;
  }

  std::map<std::string, std::string> values_;
  std::string error_;
  bool help_ = false;
};

}  // namespace loom::attention::bench

#endif  // LOOM_PLUGINS_ATTENTION_BENCH_BENCH_FLAGS_H_
