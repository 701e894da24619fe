// An environment variable's value, "" when unset: for settings where unset and empty mean the
// same (the S3 options, the cache directory).
#ifndef LOOM_BASE_ENV_H_
#define LOOM_BASE_ENV_H_

#include <cstdlib>
#include <string>

namespace loom {

inline std::string EnvOrEmpty(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

}  // namespace loom

#endif  // LOOM_BASE_ENV_H_
