// SentencePiece behind a small interface. Debian's sentencepiece headers declare their own
// `absl::string_view`, which collides with the real Abseil, so only sentencepiece_bridge.cc
// includes them and it includes no Abseil header.
#ifndef LOOM_DATA_SENTENCEPIECE_BRIDGE_H_
#define LOOM_DATA_SENTENCEPIECE_BRIDGE_H_

#include <memory>
#include <string>
#include <vector>

namespace loom::data {

class SentencePieceModel {
 public:
  // From a .model file's bytes (a serialised ModelProto); null with *error set on failure.
  static std::unique_ptr<SentencePieceModel> FromBytes(const std::string& bytes,
                                                       std::string* error);
  ~SentencePieceModel();
  std::vector<int> Encode(const std::string& text) const;
  std::string Decode(const std::vector<int>& ids) const;
  int vocab_size() const;
  int eos_id() const;

 private:
  SentencePieceModel();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Returns "" on success, else the error.
std::string TrainSentencePieceModel(const std::string& args);

}  // namespace loom::data

#endif  // LOOM_DATA_SENTENCEPIECE_BRIDGE_H_
