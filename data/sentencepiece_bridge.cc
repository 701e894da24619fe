#include "data/sentencepiece_bridge.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

namespace loom::data {

struct SentencePieceModel::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

SentencePieceModel::SentencePieceModel() : impl_(new Impl) {}
SentencePieceModel::~SentencePieceModel() = default;

std::unique_ptr<SentencePieceModel> SentencePieceModel::Load(const std::string& path,
                                                             std::string* error) {
  std::unique_ptr<SentencePieceModel> m(new SentencePieceModel());
  auto status = m->impl_->processor.Load(path);
  if (!status.ok()) {
    *error = status.ToString();
    return nullptr;
  }
  return m;
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
