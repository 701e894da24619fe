#include "worker/trainer/job_tokenizer.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "data/bpe_tokenizer.h"
#include "data/token_shards.h"

namespace loom::trainer {

absl::StatusOr<std::unique_ptr<data::Tokenizer>> JobTokenizer(const v1::JobSpec& spec) {
  const v1::DataConfig& d = spec.data();
  if (d.tokenizer() == "bpe") {
    absl::StatusOr<std::unique_ptr<data::BpeTokenizer>> bpe =
        data::BpeTokenizer::Load(d.tokenizer_path());
    if (!bpe.ok())
      return absl::InvalidArgumentError(
          absl::StrCat("data.tokenizer_path: ", bpe.status().message()));
    return std::unique_ptr<data::Tokenizer>(std::move(*bpe));
  }
  if (d.source() != "shards") return data::MakeByteTokenizer();
  LOOM_ASSIGN_OR_RETURN(auto shards, data::TokenShards::Open(d.path(), false));
  const std::string& described = shards->index().tokenizer;
  if (described == "byte") return data::MakeByteTokenizer();
  if (absl::StartsWith(described, "bpe:")) {
    LOOM_ASSIGN_OR_RETURN(auto bpe, data::BpeTokenizer::Load(described.substr(4)));
    return std::unique_ptr<data::Tokenizer>(std::move(bpe));
  }
  return absl::UnimplementedError(
      absl::StrCat("the dataset ", d.path(), " uses tokenizer '", described,
                   "'; inference supports byte and byte-level BPE models only for now"));
}

data::ChatTemplate ChatTokensOf(const data::Tokenizer& tokenizer) {
  const auto* bpe = dynamic_cast<const data::BpeTokenizer*>(&tokenizer);
  if (bpe == nullptr) return data::ChatTemplateFor(tokenizer.vocab_size(), nullptr);
  return data::ChatTemplateFor(tokenizer.vocab_size(),
                               [bpe](std::string_view token) { return bpe->TokenId(token); });
}

}  // namespace loom::trainer
