#include "data/token_shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/json_integer.h"
#include "base/status_macros.h"
#include "storage/checkpoint_store.h"
#include "storage/confined_files.h"
#include "storage/crc32c.h"
#include "storage/object_cache.h"
#include "storage/safetensors.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kIndex[] = "index.json";

std::string ShardFile(size_t i) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "shard-%05zu.bin", i);
  return buf;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenShardWriter>> TokenShardWriter::Create(
    const std::string& dir, int64_t vocab_size, const std::string& tokenizer,
    uint64_t shard_tokens) {
  if (vocab_size <= 0 || vocab_size > (int64_t{1} << 32)) {
    return absl::InvalidArgumentError("vocab_size: must be in [1, 2^32]");
  }
  if (shard_tokens == 0) return absl::InvalidArgumentError("shard_tokens: must be >= 1");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot create: ", ec.message()));
  if (fs::exists(fs::path(dir) / kIndex)) {
    return absl::AlreadyExistsError(absl::StrCat(dir, ": already holds a dataset (index.json)"));
  }
  std::unique_ptr<TokenShardWriter> w(new TokenShardWriter());
  w->dir_ = dir;
  w->shard_tokens_ = shard_tokens;
  w->index_.vocab_size = vocab_size;
  w->index_.dtype = vocab_size <= 65536 ? "uint16" : "uint32";
  w->index_.tokenizer = tokenizer;
  return w;
}

absl::Status TokenShardWriter::AddDocument(const std::vector<uint32_t>& ids) {
  for (uint32_t id : ids) {
    if (static_cast<int64_t>(id) >= index_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " >= vocab_size ", index_.vocab_size));
    }
  }
  pending_.insert(pending_.end(), ids.begin(), ids.end());
  ++index_.documents;
  while (pending_.size() >= shard_tokens_) {
    if (absl::Status s = Flush(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status TokenShardWriter::Flush() {
  const size_t n = std::min<size_t>(pending_.size(), shard_tokens_);
  if (n == 0) return absl::OkStatus();
  std::string bytes;
  const size_t width = index_.dtype == "uint16" ? 2 : 4;
  bytes.resize(n * width);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t v = pending_[i];
    for (size_t b = 0; b < width; ++b)
      bytes[i * width + b] = static_cast<char>((v >> (8 * b)) & 0xff);
  }
  ShardEntry entry{ShardFile(index_.shards.size()), n,
                   storage::Crc32cHex(storage::Crc32c(bytes.data(), bytes.size()))};
  if (absl::Status s = storage::WriteFileAtomically((fs::path(dir_) / entry.file).string(), bytes);
      !s.ok())
    return s;
  index_.shards.push_back(entry);
  index_.total_tokens += n;
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(n));
  return absl::OkStatus();
}

absl::StatusOr<TokenIndex> TokenShardWriter::Finish() {
  if (absl::Status s = Flush(); !s.ok()) return s;
  json shards = json::array();
  for (const ShardEntry& e : index_.shards) {
    shards.push_back({{"file", e.file}, {"tokens", e.tokens}, {"crc32c", e.crc32c}});
  }
  json j = {{"format", "loom-tokens"},
            {"version", index_.version},
            {"dtype", index_.dtype},
            {"vocab_size", index_.vocab_size},
            {"tokenizer", index_.tokenizer},
            {"documents", index_.documents},
            {"total_tokens", index_.total_tokens},
            {"shards", shards}};
  if (absl::Status s =
          storage::WriteFileAtomically((fs::path(dir_) / kIndex).string(), j.dump(2) + "\n");
      !s.ok()) {
    return s;
  }
  return index_;
}

absl::StatusOr<TokenIndex> ReadTokenIndex(const std::string& dir) {
  const bool remote = storage::IsRemoteLocation(dir);
  const std::string path =
      remote ? absl::StrCat(dir, "/", kIndex) : (fs::path(dir) / kIndex).string();
  auto text = remote ? storage::ReadRemoteObject(path, 256 << 20)
                     : storage::ReadConfinedFile(path, 256 << 20);
  if (absl::IsNotFound(text.status()))
    return absl::NotFoundError(
        absl::StrCat(path, ": missing (not a loom-data dataset, or never finished)"));
  if (!text.ok()) return text.status();
  return ParseTokenIndex(*text, path);
}

absl::StatusOr<TokenIndex> ParseTokenIndex(const std::string& text, const std::string& path) {
  json j = json::parse(text, nullptr, false);
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(path, ": ", why));
  };
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  TokenIndex index;
  try {
    if (j.at("format").get<std::string>() != "loom-tokens") return bad("format is not loom-tokens");
    index.version = ExactIntegerAt<int>(j, "version");
    if (index.version != 1) return bad(absl::StrCat("unsupported version ", index.version));
    index.dtype = j.at("dtype").get<std::string>();
    if (index.dtype != "uint16" && index.dtype != "uint32")
      return bad("dtype must be uint16 or uint32");
    index.vocab_size = ExactIntegerAt<int64_t>(j, "vocab_size");
    index.tokenizer = j.at("tokenizer").get<std::string>();
    index.documents = ExactIntegerAt<uint64_t>(j, "documents");
    index.total_tokens = ExactIntegerAt<uint64_t>(j, "total_tokens");
    uint64_t sum = 0;
    for (const json& s : j.at("shards")) {
      ShardEntry e{s.at("file").get<std::string>(), ExactIntegerAt<uint64_t>(s, "tokens"),
                   s.at("crc32c").get<std::string>()};
      // A shard is a file of at most 2^48 bytes: the sum below and tokens x width cannot wrap.
      if (e.tokens > (uint64_t{1} << 46))
        return bad(absl::StrCat("shard '", e.file.substr(0, 80), "': ", e.tokens, " tokens"));
      if (e.file.find('/') != std::string::npos || e.file.find("..") != std::string::npos) {
        return bad(absl::StrCat("shard file '", e.file, "' is not a plain name"));
      }
      sum += e.tokens;
      index.shards.push_back(std::move(e));
    }
    if (sum != index.total_tokens) return bad("shard token counts do not add up to total_tokens");
  } catch (const std::exception& e) {  // json's, and ExactIntegerAt's (names the key)
    return bad(absl::StrCat("malformed index: ", e.what()));
  }
  return index;
}

absl::StatusOr<std::shared_ptr<TokenShards>> TokenShards::Open(const std::string& dir,
                                                               bool verify_checksums) {
  auto index = ReadTokenIndex(dir);
  if (!index.ok()) return index.status();
  std::shared_ptr<TokenShards> t(new TokenShards());
  t->index_ = std::move(*index);
  t->width_ = t->index_.dtype == "uint16" ? 2 : 4;
  uint64_t first = 0;
  // A dataset in an object store: each shard fetched into the node's cache (by its CRC-32C, so
  // a second run or another job reads it from local disk), verified on the way in.
  const bool remote = storage::IsRemoteLocation(dir);
  for (const ShardEntry& e : t->index_.shards) {
    std::string path = (fs::path(dir) / e.file).string();
    if (remote) {
      LOOM_ASSIGN_OR_RETURN(path, storage::FetchVerified(absl::StrCat(dir, "/", e.file), e.crc32c,
                                                         e.tokens * t->width_));
    }
    auto opened = remote ? storage::OpenCachedForRead(path) : storage::OpenForRead(path);
    if (absl::IsNotFound(opened.status()))
      return absl::DataLossError(absl::StrCat("shard ", path, ": missing"));
    if (!opened.ok()) return opened.status();
    int fd = opened->Release();
    struct stat st;
    ::fstat(fd, &st);
    const uint64_t expected = e.tokens * t->width_;
    if (static_cast<uint64_t>(st.st_size) != expected) {
      ::close(fd);
      return absl::DataLossError(
          absl::StrCat("shard ", path, ": ", st.st_size, " bytes, index says ", expected));
    }
    Mapping m;
    m.bytes = expected;
    m.first_token = first;
    m.tokens = e.tokens;
    if (expected > 0) {
      void* p = ::mmap(nullptr, expected, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        return absl::InternalError(absl::StrCat("shard ", path, ": mmap failed"));
      }
      m.data = static_cast<const uint8_t*>(p);
    }
    ::close(fd);
    t->maps_.push_back(m);
    // (A fetched shard was checked on its way into the cache.)
    if (verify_checksums && !remote &&
        storage::Crc32cHex(storage::Crc32c(m.data, m.bytes)) != e.crc32c) {
      return absl::DataLossError(absl::StrCat("shard ", path, ": checksum differs from the index"));
    }
    first += e.tokens;
  }
  if (t->index_.dtype == "uint16" || verify_checksums) {
    // Ids must fit the vocabulary the index claims (cheap for uint16, done with the checksum pass
    // otherwise): a model must never index past its embedding.
    for (const Mapping& m : t->maps_) {
      for (uint64_t i = 0; i < m.tokens; ++i) {
        uint32_t v = 0;
        for (size_t b = 0; b < t->width_; ++b)
          v |= static_cast<uint32_t>(m.data[i * t->width_ + b]) << (8 * b);
        if (static_cast<int64_t>(v) >= t->index_.vocab_size) {
          return absl::DataLossError(
              absl::StrCat(dir, ": token id ", v, " >= vocab_size ", t->index_.vocab_size));
        }
      }
    }
  }
  return t;
}

TokenShards::~TokenShards() {
  for (const Mapping& m : maps_) {
    if (m.data) ::munmap(const_cast<uint8_t*>(m.data), m.bytes);
  }
}

void TokenShards::Copy(int64_t start, int64_t n, int64_t* out) const {
  auto it = std::upper_bound(maps_.begin(), maps_.end(), static_cast<uint64_t>(start),
                             [](uint64_t pos, const Mapping& m) { return pos < m.first_token; });
  size_t shard = static_cast<size_t>(std::distance(maps_.begin(), it)) - 1;
  uint64_t pos = static_cast<uint64_t>(start);
  for (int64_t i = 0; i < n; ++i, ++pos) {
    while (pos >= maps_[shard].first_token + maps_[shard].tokens) ++shard;
    const uint8_t* p = maps_[shard].data + (pos - maps_[shard].first_token) * width_;
    uint32_t v = 0;
    for (size_t b = 0; b < width_; ++b) v |= static_cast<uint32_t>(p[b]) << (8 * b);
    out[i] = v;
  }
}

}  // namespace loom::data
