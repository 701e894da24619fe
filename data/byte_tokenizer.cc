// The byte-level tokenizer lives in loom_data (not loom_tokenizer) so that processes which load
// libprotobuf — the trainer, loom-serve — can use it without Debian's libsentencepiece.
#include "data/tokenizer.h"

namespace loom::data {
namespace {

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<uint32_t> Encode(std::string_view text) const override { return EncodeBytes(text); }
  std::string Decode(const std::vector<uint32_t>& ids) const override {
    std::string out;
    for (uint32_t id : ids) out.push_back(static_cast<char>(id & 0xff));
    return out;
  }
  int64_t vocab_size() const override { return 256; }
  int64_t eos_id() const override { return -1; }
  std::string Describe() const override { return "byte"; }
};

}  // namespace

std::unique_ptr<Tokenizer> MakeByteTokenizer() { return std::make_unique<ByteTokenizer>(); }

std::vector<uint32_t> EncodeBytes(std::string_view text) {
  std::vector<uint32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

}  // namespace loom::data
