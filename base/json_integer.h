// Integers read from untrusted JSON, exactly. nlohmann's get<T>() converts whatever number it
// finds: a float out of T's range is undefined behaviour (UBSan: the manifest fuzzer's first
// finding) and a large integer wraps. ExactInteger takes JSON integers inside T's range only.
#ifndef LOOM_BASE_JSON_INTEGER_H_
#define LOOM_BASE_JSON_INTEGER_H_

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>

namespace loom {

template <typename T>
std::optional<T> ExactInteger(const nlohmann::json& v) {
  static_assert(std::numeric_limits<T>::is_integer, "an integer type");
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<T>::max())) return std::nullopt;
    return static_cast<T>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < 0 && (!std::numeric_limits<T>::is_signed ||
                  i < static_cast<int64_t>(std::numeric_limits<T>::min())))
      return std::nullopt;
    if (i > 0 && static_cast<uint64_t>(i) > static_cast<uint64_t>(std::numeric_limits<T>::max()))
      return std::nullopt;
    return static_cast<T>(i);
  }
  return std::nullopt;
}

// object[key] as an exact integer; throws std::out_of_range naming the key when it is missing
// and std::invalid_argument when it is not an integer of T's range (for parsers that turn
// exceptions into one error).
template <typename T>
T ExactIntegerAt(const nlohmann::json& object, const char* key) {
  const std::optional<T> v = ExactInteger<T>(object.at(key));
  if (!v) throw std::invalid_argument(std::string(key) + ": not an integer in range");
  return *v;
}

}  // namespace loom

#endif  // LOOM_BASE_JSON_INTEGER_H_
