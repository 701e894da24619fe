#include "data/sentencepiece_bridge.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <exception>

namespace loom::data {

struct SentencePieceModel::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

SentencePieceModel::SentencePieceModel() : impl_(new Impl) {}
SentencePieceModel::~SentencePieceModel() = default;

std::unique_ptr<SentencePieceModel> SentencePieceModel::FromBytes(const std::string& bytes,
                                                                  std::string* error) {
  std::unique_ptr<SentencePieceModel> m(new SentencePieceModel());
  // libsentencepiece reports a malformed model as a status, except where its trie builder
  // (darts) throws (the fuzz harness found a model whose pieces it cannot insert).
  try {
    auto status = m->impl_->processor.LoadFromSerializedProto(bytes);
    if (status.ok()) return m;
    *error = status.ToString();
  } catch (const std::exception& e) {
    *error = std::string("malformed model: ") + e.what();
  }
  return nullptr;
}

std::vector<int> SentencePieceModel::Encode(const std::string& text) const {
  std::vector<int> ids;
  impl_->processor.Encode(text, &ids).IgnoreError();
  return ids;
}

std::string SentencePieceModel::Decode(const std::vector<int>& ids) const {
  std::string out;
  impl_->processor.Decode(ids, &out).IgnoreError();
  return out;
}

int SentencePieceModel::vocab_size() const { return impl_->processor.GetPieceSize(); }
int SentencePieceModel::eos_id() const { return impl_->processor.eos_id(); }

std::string TrainSentencePieceModel(const std::string& args) {
  auto status = sentencepiece::SentencePieceTrainer::Train(args);
  return status.ok() ? "" : status.ToString();
}

}  // namespace loom::data
