// A SentencePiece .model file (data.tokenizer = sentencepiece): load from its bytes, encode and
// decode a text. Input: the model's bytes, separator, text. Crashes inside libsentencepiece count:
// a hostile model must be refused before it reaches the library, or the library must hold.
#include <string>

#include "data/sentencepiece_bridge.h"
#include "fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = loom::fuzz::SplitParts(data, size, 2);
  std::string error;
  auto model = loom::data::SentencePieceModel::FromBytes(parts[0], &error);
  if (model == nullptr) return 0;
  const std::vector<int> ids = model->Encode(parts[1]);
  for (int id : ids) LOOM_FUZZ_CHECK(id >= 0 && id < model->vocab_size(), std::to_string(id));
  (void)model->Decode(ids);
  return 0;
}
