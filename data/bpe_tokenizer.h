// Byte-level BPE from a Hugging Face `tokenizer.json` (the GPT-2 / Llama-3 family), as the
// `tokenizers` library applies it: added (special) tokens split out first, then the file's
// pre-tokenizer (a Split regex with Unicode classes, PCRE2), each piece's bytes mapped to the
// GPT-2 byte-to-unicode alphabet, then merges by rank (or the whole piece when the file sets
// ignore_merges and the piece is a token). docs/interop.md has the details.
//
// Input that is not valid UTF-8: each maximal invalid subsequence becomes U+FFFD before
// tokenizing (the WHATWG decoder's rule, what a browser or Python's errors="replace" gives), so
// ids match a tokenizer fed the decoded string. Decode gives UTF-8 with the same replacement
// for byte sequences the ids do not complete.
#ifndef LOOM_DATA_BPE_TOKENIZER_H_
#define LOOM_DATA_BPE_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "data/tokenizer.h"

namespace loom::data {

class BpeTokenizer : public Tokenizer {
 public:
  // InvalidArgument naming what in the file is malformed or not supported.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> Load(const std::string& path);
  // The same from a file's text; `path` names it in errors and in Describe().
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> FromJson(std::string_view text,
                                                                const std::string& path);
  ~BpeTokenizer() override;

  std::vector<uint32_t> Encode(std::string_view text) const override;
  std::string Decode(const std::vector<uint32_t>& ids) const override;
  int64_t vocab_size() const override;
  int64_t eos_id() const override;
  std::string Describe() const override { return "bpe:" + path_; }

  // The id of a token (an added token's content, or a vocabulary entry in byte-level form).
  std::optional<uint32_t> TokenId(std::string_view token) const;

  struct Impl;

 private:
  BpeTokenizer(std::string path, std::unique_ptr<Impl> impl);
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> Parse(std::string_view text,
                                                             const std::string& path);
  std::string path_;
  std::unique_ptr<Impl> impl_;
};

// Valid UTF-8, each maximal invalid subsequence replaced by U+FFFD (WHATWG "decode").
std::string SanitizeUtf8(std::string_view bytes);

}  // namespace loom::data

#endif  // LOOM_DATA_BPE_TOKENIZER_H_
