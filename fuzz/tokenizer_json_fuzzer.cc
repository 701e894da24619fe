// A Hugging Face tokenizer.json (loom-data, loom-train's data.tokenizer_path, loom-serve) and a
// text: load, encode, decode. Every id is inside the vocabulary, and decoding gives back the text
// (invalid UTF-8 replaced, as the tokenizer documents). Input: tokenizer.json, separator, text.
#include <string>

#include "data/bpe_tokenizer.h"
#include "fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = loom::fuzz::SplitParts(data, size, 2);
  auto tokenizer = loom::data::BpeTokenizer::FromJson(parts[0], "tokenizer.json");
  if (!tokenizer.ok()) return 0;
  const auto& t = **tokenizer;
  const std::vector<uint32_t> ids = t.Encode(parts[1]);
  for (uint32_t id : ids) LOOM_FUZZ_CHECK(id < t.vocab_size(), std::to_string(id));
  const std::string decoded = t.Decode(ids);
  LOOM_FUZZ_CHECK(decoded == loom::data::SanitizeUtf8(parts[1]), decoded);
  return 0;
}
