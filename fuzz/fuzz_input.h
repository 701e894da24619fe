// What the harnesses share. An input of several parts (a tokenizer.json and a text, a config and
// an index) holds them separated by kPartSeparator, so seed files stay readable text. A broken
// invariant aborts: libFuzzer reports it as a crash and writes the input.
#ifndef LOOM_FUZZ_FUZZ_INPUT_H_
#define LOOM_FUZZ_FUZZ_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace loom::fuzz {

inline constexpr std::string_view kPartSeparator = "\n@@@@\n";

// The first n - 1 separators split the input; missing parts are empty.
inline std::vector<std::string> SplitParts(const uint8_t* data, size_t size, size_t n) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> parts;
  while (parts.size() + 1 < n) {
    const size_t at = rest.find(kPartSeparator);
    if (at == std::string_view::npos) break;
    parts.emplace_back(rest.substr(0, at));
    rest.remove_prefix(at + kPartSeparator.size());
  }
  parts.emplace_back(rest);
  parts.resize(n);
  return parts;
}

inline std::string AsString(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

[[noreturn]] inline void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz invariant broken: %s: %.2000s\n", what, detail.c_str());
  std::abort();
}

}  // namespace loom::fuzz

#define LOOM_FUZZ_CHECK(cond, detail)                 \
  do {                                                \
    if (!(cond)) ::loom::fuzz::Fail(#cond, (detail)); \
  } while (0)

#endif  // LOOM_FUZZ_FUZZ_INPUT_H_
