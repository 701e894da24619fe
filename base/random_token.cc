#include "base/random_token.h"

#include <openssl/err.h>
#include <openssl/rand.h>

#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace loom {

absl::StatusOr<std::string> RandomHexToken(int bytes) {
  if (bytes < 1 || bytes > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("token of ", bytes, " bytes (1 to 1024)"));
  }
  std::vector<unsigned char> raw(static_cast<size_t>(bytes));
  if (RAND_bytes(raw.data(), bytes) != 1) {
    char why[256];
    ERR_error_string_n(ERR_get_error(), why, sizeof why);
    return absl::InternalError(absl::StrCat("no random token: RAND_bytes: ", why));
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(raw.data()), raw.size()));
}

}  // namespace loom
