// Keeps LOOM_PLUGIN_ABI_VERSION honest: the digest of the ABI headers (comments and whitespace
// removed) is recorded per version. Changing a struct or an interface without bumping the
// version fails here; after bumping, add the printed digest to kDigests.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>

#include "base/read_file.h"
#include "loom/plugin_abi.h"

namespace {

const std::map<unsigned, std::string> kDigests = {
    {1, "4095cc59aeb98f43"},
    {2, "55a1a3ceacf6c46a"},  // AttentionInputs.segments (packed sequences)
    {3, "68f8e71e7a68cf30"},  // AttentionCache, NewCache / ForwardCached (KV-cache decoding)
    {4, "e4f6e921edd4815f"},  // sft_plugin.h: SFT objective plugins (LOOM_PLUGIN_KIND_SFT)
    {5, "69c822277ec55cdc"},  // one create wrapper and entry macro for every kind
    {6, "89129a5dc5a9d87d"},  // AttentionCache::KeepRows / AppendRows (continuous batching)
    {7, "7b1148cad40ea952"},  // LoomSftSpecV1: the tokenizer's own chat tokens (Llama 3 headers)
                              // (LOOM_DEFINE_PLUGIN)
};

// Drops // and /* */ comments, line continuations and all whitespace, so rewording a comment or
// reformatting does not count as an ABI change. String literals in these headers contain no comment
// markers.
std::string Normalise(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text.compare(i, 2, "//") == 0) {
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (text.compare(i, 2, "/*") == 0) {
      i = text.find("*/", i + 2);
      if (i == std::string::npos) break;
      ++i;
    } else if (text.compare(i, 2, "\\\n") == 0) {
      ++i;
    } else if (!std::isspace(static_cast<unsigned char>(text[i]))) {
      out.push_back(text[i]);
    }
  }
  return out;
}

std::string Fnv1a64Hex(const std::string& data) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : data) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  std::ostringstream os;
  os << std::hex << h;
  return os.str();
}

TEST(PluginAbiVersion, HeadersMatchRecordedDigest) {
  const char* paths = std::getenv("LOOM_ABI_HEADERS");
  ASSERT_NE(paths, nullptr) << "LOOM_ABI_HEADERS not set (run through ctest)";
  std::string all;
  std::stringstream list(paths);
  std::string path;
  while (std::getline(list, path, ':')) {
    absl::StatusOr<std::string> text = loom::ReadFile(path, "ABI header");
    ASSERT_TRUE(text.ok()) << text.status();
    all += Normalise(*text);
  }
  const std::string digest = Fnv1a64Hex(all);
  auto it = kDigests.find(LOOM_PLUGIN_ABI_VERSION);
  ASSERT_NE(it, kDigests.end()) << "no digest recorded for ABI version " << LOOM_PLUGIN_ABI_VERSION
                                << "; record " << digest;
  EXPECT_EQ(it->second, digest)
      << "the plugin ABI headers changed: bump LOOM_PLUGIN_ABI_VERSION in api/loom/plugin_abi.h "
         "and record the new digest for it in api/plugin_abi_version_test.cc";
}

TEST(PluginAbiVersion, BuildStampNamesAbiAndLibrary) {
  const std::string stamp = LOOM_BUILD_STAMP;
  EXPECT_EQ(stamp.rfind("abi=" + std::to_string(LOOM_PLUGIN_ABI_VERSION) + ";torch=", 0), 0u)
      << stamp;
}

}  // namespace
