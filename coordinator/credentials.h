// Worker heartbeat credentials: 256 random bits handed to the agent once, stored only as their
// SHA-256, so the state directory (and a copy of it) holds no usable credential. With that much
// entropy no salt or slow hash is needed.
#ifndef LOOM_COORDINATOR_CREDENTIALS_H_
#define LOOM_COORDINATOR_CREDENTIALS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace loom::coordinator {

inline constexpr absl::string_view kCredentialDigestPrefix = "sha256:";

// A fresh credential: 64 hex digits from OpenSSL's CSPRNG (base/random_token.h).
absl::StatusOr<std::string> NewCredential();
// "sha256:<64 hex digits>".
std::string CredentialDigest(const std::string& credential);
// Compared in constant time.
bool SameDigest(const std::string& a, const std::string& b);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_CREDENTIALS_H_
