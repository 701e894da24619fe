// A loom-data dataset's index.json (data.source shards: datasets anyone with write access to the
// storage root may have made): parse; what parses is consistent (token counts add up, shard
// files are plain names inside the dataset directory).
#include <string>

#include "data/token_shards.h"
#include "fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = loom::fuzz::AsString(data, size);
  auto index = loom::data::ParseTokenIndex(text, "index.json");
  if (!index.ok()) return 0;
  uint64_t sum = 0;
  for (const auto& s : index->shards) {
    LOOM_FUZZ_CHECK(s.file.find('/') == std::string::npos && s.file.find("..") == std::string::npos,
                    s.file);
    sum += s.tokens;
  }
  LOOM_FUZZ_CHECK(sum == index->total_tokens, text);
  return 0;
}
