#include "data/tokenizer.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "data/bpe_tokenizer.h"
#include "data/sentencepiece_bridge.h"
#include "storage/confined_files.h"

namespace loom::data {
namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string path, std::unique_ptr<SentencePieceModel> model)
      : path_(std::move(path)), model_(std::move(model)) {}
  std::vector<uint32_t> Encode(std::string_view text) const override {
    std::vector<int> ids = model_->Encode(std::string(text));
    return std::vector<uint32_t>(ids.begin(), ids.end());
  }
  std::string Decode(const std::vector<uint32_t>& ids) const override {
    return model_->Decode(std::vector<int>(ids.begin(), ids.end()));
  }
  int64_t vocab_size() const override { return model_->vocab_size(); }
  int64_t eos_id() const override { return model_->eos_id(); }
  std::string Describe() const override { return "sentencepiece:" + path_; }

 private:
  std::string path_;
  std::unique_ptr<SentencePieceModel> model_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeTokenizer(const std::string& kind,
                                                         const std::string& model) {
  if (kind == "byte") return MakeByteTokenizer();
  // A Hugging Face tokenizer.json, named by kind bpe + model or by its path alone.
  if (kind == "bpe" || absl::EndsWith(kind, ".json")) {
    const std::string path = kind == "bpe" ? model : kind;
    if (path.empty()) return absl::InvalidArgumentError("tokenizer_model: required for bpe");
    LOOM_ASSIGN_OR_RETURN(auto bpe, BpeTokenizer::Load(path));
    return std::unique_ptr<Tokenizer>(std::move(bpe));
  }
  if (kind == "sentencepiece") {
    if (model.empty())
      return absl::InvalidArgumentError("tokenizer_model: required for sentencepiece");
    auto bytes = storage::ReadConfinedFile(model, 256 << 20);
    if (!bytes.ok())
      return absl::Status(bytes.status().code(), absl::StrCat("tokenizer model '", model,
                                                              "': ", bytes.status().message()));
    std::string error;
    auto loaded = SentencePieceModel::FromBytes(*bytes, &error);
    if (!loaded)
      return absl::InvalidArgumentError(absl::StrCat("tokenizer model '", model, "': ", error));
    return std::make_unique<SentencePieceTokenizer>(model, std::move(loaded));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tokenizer: '", kind, "' is not byte | sentencepiece | bpe | <tokenizer.json>"));
}

absl::Status TrainSentencePiece(const std::vector<std::string>& inputs, int vocab_size,
                                const std::string& model_prefix) {
  const std::string args =
      absl::StrCat("--input=", absl::StrJoin(inputs, ","), " --model_prefix=", model_prefix,
                   " --vocab_size=", vocab_size,
                   " --model_type=unigram --character_coverage=1.0 --minloglevel=2");
  const std::string error = TrainSentencePieceModel(args);
  if (!error.empty())
    return absl::InvalidArgumentError(absl::StrCat("sentencepiece training: ", error));
  return absl::OkStatus();
}

}  // namespace loom::data
