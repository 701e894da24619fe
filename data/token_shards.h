// Packed token shards: what `loom-data pack` writes and the trainer reads.
//
// A dataset directory holds shard-00000.bin, shard-00001.bin, … (token ids, little-endian uint16
// when the vocabulary fits, else uint32, documents back to back, optionally separated by the
// tokenizer's EOS) and index.json, written last: format version, dtype, vocabulary size,
// tokenizer, document and token counts, and each shard's token count and CRC-32C. Readers
// memory-map the shards, check every size against the index and, by default, every checksum.
#ifndef LOOM_DATA_TOKEN_SHARDS_H_
#define LOOM_DATA_TOKEN_SHARDS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace loom::data {

struct ShardEntry {
  std::string file;
  uint64_t tokens = 0;
  std::string crc32c;
};

struct TokenIndex {
  int version = 1;
  std::string dtype;  // "uint16" | "uint32"
  int64_t vocab_size = 0;
  std::string tokenizer;
  uint64_t documents = 0;
  uint64_t total_tokens = 0;
  std::vector<ShardEntry> shards;
};

class TokenShardWriter {
 public:
  // Fails if `dir` already holds a dataset (an index.json). shard_tokens: tokens per shard file.
  static absl::StatusOr<std::unique_ptr<TokenShardWriter>> Create(const std::string& dir,
                                                                  int64_t vocab_size,
                                                                  const std::string& tokenizer,
                                                                  uint64_t shard_tokens);
  // Appends a document; every id must be < vocab_size.
  absl::Status AddDocument(const std::vector<uint32_t>& ids);
  // Flushes the last shard and writes index.json.
  absl::StatusOr<TokenIndex> Finish();

 private:
  absl::Status Flush();
  std::string dir_;
  TokenIndex index_;
  uint64_t shard_tokens_ = 0;
  std::vector<uint32_t> pending_;
};

class TokenShards {
 public:
  static absl::StatusOr<std::shared_ptr<TokenShards>> Open(const std::string& dir,
                                                           bool verify_checksums = true);
  ~TokenShards();
  TokenShards(const TokenShards&) = delete;
  TokenShards& operator=(const TokenShards&) = delete;

  const TokenIndex& index() const { return index_; }
  int64_t size() const { return static_cast<int64_t>(index_.total_tokens); }
  // Copies tokens [start, start + n) of the concatenated stream (crossing shards as needed).
  void Copy(int64_t start, int64_t n, int64_t* out) const;

 private:
  TokenShards() = default;
  struct Mapping {
    const uint8_t* data = nullptr;
    size_t bytes = 0;
    uint64_t first_token = 0, tokens = 0;
  };
  TokenIndex index_;
  size_t width_ = 2;
  std::vector<Mapping> maps_;
};

absl::StatusOr<TokenIndex> ReadTokenIndex(const std::string& dir);
// The same from the index file's text; `path` names it in errors.
absl::StatusOr<TokenIndex> ParseTokenIndex(const std::string& text, const std::string& path);

}  // namespace loom::data

#endif  // LOOM_DATA_TOKEN_SHARDS_H_
