#include "coordinator/credentials.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace loom::coordinator {

std::string NewCredential() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[32] = {};
  in.read(reinterpret_cast<char*>(bytes), sizeof(bytes));
  if (!in) {  // no /dev/urandom: std::random_device is the kernel's generator on Linux too
    std::random_device rd;
    for (auto& b : bytes) b = static_cast<unsigned char>(rd());
  }
  std::string out;
  for (unsigned char b : bytes) absl::StrAppendFormat(&out, "%02x", b);
  return out;
}

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
