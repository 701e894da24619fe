// Secrets Loom hands out (user and enrolment tokens, worker credentials): bytes from OpenSSL's
// CSPRNG as lowercase hex. A failed draw is an error, never a weak or all-zero token.
#ifndef LOOM_BASE_RANDOM_TOKEN_H_
#define LOOM_BASE_RANDOM_TOKEN_H_

#include <string>

#include "absl/status/statusor.h"

namespace loom {

// `bytes` (1 to 1024) random bytes as 2·bytes hex digits; Internal when RAND_bytes fails.
[[nodiscard]] absl::StatusOr<std::string> RandomHexToken(int bytes = 32);

}  // namespace loom

#endif  // LOOM_BASE_RANDOM_TOKEN_H_
