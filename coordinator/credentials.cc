#include "coordinator/credentials.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/random_token.h"

namespace loom::coordinator {

absl::StatusOr<std::string> NewCredential() { return RandomHexToken(32); }

std::string CredentialDigest(const std::string& credential) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(credential.data()), credential.size(), digest);
  std::string out(kCredentialDigestPrefix);
  for (unsigned char b : digest) out += absl::StrFormat("%02x", b);
  return out;
}

bool SameDigest(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace loom::coordinator
