// Tokenizers: the byte-level default (vocabulary 256, no files) and SentencePiece models.
#ifndef LOOM_DATA_TOKENIZER_H_
#define LOOM_DATA_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace loom::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<uint32_t> Encode(std::string_view text) const = 0;
  virtual std::string Decode(const std::vector<uint32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t eos_id() const = 0;  // -1 when the tokenizer has none
  // "byte", "sentencepiece:<model path>" or "bpe:<tokenizer.json path>".
  virtual std::string Describe() const = 0;
};

// The byte-level tokenizer (in loom_data: usable without libsentencepiece).
std::unique_ptr<Tokenizer> MakeByteTokenizer();
// Its encoding as a function (one id per byte), for callers that take an encoder.
std::vector<uint32_t> EncodeBytes(std::string_view text);

// kind "byte" (model ignored), "sentencepiece" (model = path of a .model file), "bpe" (model =
// a Hugging Face tokenizer.json; bpe_tokenizer.h) or the path of a tokenizer.json itself.
absl::StatusOr<std::unique_ptr<Tokenizer>> MakeTokenizer(const std::string& kind,
                                                         const std::string& model);

// Trains a SentencePiece unigram model on text files (for tests and small experiments).
absl::Status TrainSentencePiece(const std::vector<std::string>& inputs, int vocab_size,
                                const std::string& model_prefix);

}  // namespace loom::data

#endif  // LOOM_DATA_TOKENIZER_H_
