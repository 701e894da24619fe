#include "storage/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/json_integer.h"
#include "storage/confined_files.h"
#include "storage/crc32c.h"

namespace loom::storage {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kManifest[] = "manifest.json";
constexpr char kStepPrefix[] = "step-";
constexpr char kTempPrefix[] = ".tmp-step-";

int ExchangePaths(const char* a, const char* b) {
  return ::renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE);
}

void FsyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::string ShardName(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "shard-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

// Parses "step-00000100" -> 100; nullopt for anything else.
std::optional<int64_t> StepOf(const std::string& name) {
  if (name.rfind(kStepPrefix, 0) != 0 || name.size() <= sizeof(kStepPrefix) - 1)
    return std::nullopt;
  int64_t step = 0;
  for (size_t i = sizeof(kStepPrefix) - 1; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (INT64_MAX - 9) / 10) return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

}  // namespace

std::string CheckpointDirName(int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%s%08lld", kStepPrefix, static_cast<long long>(step));
  return buf;
}

std::string ManifestToJson(const Manifest& m) {
  json shards = json::array();
  for (const ShardInfo& s : m.shards) {
    shards.push_back(
        {{"rank", s.rank}, {"file", s.file}, {"bytes", s.bytes}, {"crc32c", s.crc32c}});
  }
  json j = {{"format_version", m.format_version},
            {"step", m.step},
            {"tokens_seen", m.tokens_seen},
            {"world_size", m.world_size},
            {"spec_hash", m.spec_hash},
            {"parent", m.parent},
            {"kind", m.kind},
            {"created_unix_ms", m.created_unix_ms},
            {"state", m.state},
            {"shards", shards}};
  return j.dump(2) + "\n";
}

absl::Status CheckShardInfo(const ShardInfo& s, const std::string& where) {
  if (s.file.empty() || s.file == "." || s.file.find('/') != std::string::npos ||
      s.file.find("..") != std::string::npos) {
    return absl::DataLossError(
        absl::StrCat(where, ": shard file name '", s.file, "' is not a plain name"));
  }
  if (!IsCrc32cHex(s.crc32c)) {
    return absl::DataLossError(
        absl::StrCat(where, ": shard '", s.file, "' has checksum '", s.crc32c, "', no CRC-32C"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Manifest> ManifestFromJson(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(source, ": ", what));
  };
  if (j.is_discarded() || !j.is_object()) return bad("manifest is not a JSON object");
  Manifest m;
  try {
    m.format_version = ExactIntegerAt<int>(j, "format_version");
    if (m.format_version != 1)
      return bad(absl::StrCat("unsupported format_version ", m.format_version));
    m.step = ExactIntegerAt<int64_t>(j, "step");
    m.tokens_seen = ExactIntegerAt<int64_t>(j, "tokens_seen");
    m.world_size = ExactIntegerAt<int>(j, "world_size");
    m.spec_hash = j.at("spec_hash").get<std::string>();
    m.parent = j.at("parent").get<std::string>();
    m.kind = j.at("kind").get<std::string>();
    m.created_unix_ms = ExactIntegerAt<int64_t>(j, "created_unix_ms");
    m.state = j.at("state").get<std::map<std::string, std::string>>();
    for (const json& s : j.at("shards")) {
      ShardInfo info;
      info.rank = ExactIntegerAt<int>(s, "rank");
      info.file = s.at("file").get<std::string>();
      info.bytes = ExactIntegerAt<uint64_t>(s, "bytes");
      info.crc32c = s.at("crc32c").get<std::string>();
      m.shards.push_back(std::move(info));
    }
  } catch (const std::exception& e) {  // json's, and ExactIntegerAt's (names the key)
    return bad(absl::StrCat("malformed manifest: ", e.what()));
  }
  if (m.world_size < 1 || static_cast<int>(m.shards.size()) != m.world_size) {
    return bad(
        absl::StrCat("manifest lists ", m.shards.size(), " shards for world size ", m.world_size));
  }
  std::sort(m.shards.begin(), m.shards.end(),
            [](const ShardInfo& a, const ShardInfo& b) { return a.rank < b.rank; });
  for (int r = 0; r < m.world_size; ++r) {
    if (m.shards[r].rank != r) return bad(absl::StrCat("manifest has no shard for rank ", r));
    if (absl::Status s = CheckShardInfo(m.shards[r], source); !s.ok()) return s;
  }
  return m;
}

absl::StatusOr<CheckpointWriter> CheckpointWriter::Begin(const std::string& root, int64_t step,
                                                         int world_size, const std::string& token,
                                                         bool create) {
  if (step < 0) return absl::InvalidArgumentError("checkpoint step must be >= 0");
  if (world_size < 1) return absl::InvalidArgumentError("checkpoint world size must be >= 1");
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return absl::InternalError(absl::StrCat(root, ": cannot create: ", ec.message()));
  CheckpointWriter w;
  w.root_ = root;
  w.step_ = step;
  w.world_size_ = world_size;
  w.final_dir_ = (fs::path(root) / CheckpointDirName(step)).string();
  w.temp_dir_ = (fs::path(root) / absl::StrCat(kTempPrefix, step, "-",
                                               token.empty() ? std::to_string(getpid()) : token))
                    .string();
  if (!create) {
    if (!fs::is_directory(w.temp_dir_)) {
      return absl::FailedPreconditionError(
          absl::StrCat(w.temp_dir_, ": not created by the writing rank"));
    }
    return w;
  }
  fs::remove_all(w.temp_dir_, ec);
  if (!fs::create_directory(w.temp_dir_, ec) || ec) {
    return absl::InternalError(absl::StrCat(w.temp_dir_, ": cannot create: ", ec.message()));
  }
  return w;
}

absl::Status CheckpointWriter::WriteShard(int rank, const std::vector<TensorToWrite>& tensors,
                                          const std::map<std::string, std::string>& metadata) {
  if (rank < 0 || rank >= world_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside world size ", world_size_));
  }
  auto bytes = Serialize(tensors, metadata);
  if (!bytes.ok()) return bytes.status();
  ShardInfo info;
  info.rank = rank;
  info.file = ShardName(rank, world_size_);
  info.bytes = bytes->size();
  info.crc32c = Crc32cHex(Crc32c(bytes->data(), bytes->size()));
  if (absl::Status s = WriteFileAtomically((fs::path(temp_dir_) / info.file).string(), *bytes);
      !s.ok()) {
    return s;
  }
  shards_[rank] = info;
  return absl::OkStatus();
}

absl::Status CheckpointWriter::AdoptShard(int rank) {
  if (rank < 0 || rank >= world_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside world size ", world_size_));
  }
  ShardInfo info;
  info.rank = rank;
  info.file = ShardName(rank, world_size_);
  const std::string path = (fs::path(temp_dir_) / info.file).string();
  auto bytes = ReadConfinedFile(path);
  if (!bytes.ok())
    return absl::DataLossError(
        absl::StrCat("shard ", path, ": missing (rank ", rank, " did not write it)"));
  info.bytes = bytes->size();
  info.crc32c = Crc32cHex(Crc32c(bytes->data(), bytes->size()));
  shards_[rank] = info;
  return absl::OkStatus();
}

CommitRenames SystemCommitRenames() { return {ExchangePaths, ::rename}; }

absl::StatusOr<std::string> CheckpointWriter::Commit(Manifest manifest) {
  if (static_cast<int>(shards_.size()) != world_size_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint step ", step_, ": ", shards_.size(), " of ", world_size_, " shards written"));
  }
  manifest.step = step_;
  manifest.world_size = world_size_;
  manifest.shards.clear();
  for (const auto& [rank, info] : shards_) manifest.shards.push_back(info);
  if (manifest.created_unix_ms == 0) {
    manifest.created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count();
  }
  if (absl::Status s =
          WriteFileAtomically((fs::path(temp_dir_) / kManifest).string(), ManifestToJson(manifest));
      !s.ok()) {
    return s;
  }
  FsyncDir(temp_dir_);
  std::error_code ec;
  if (fs::exists(final_dir_, ec)) {
    if (absl::Status s = Replace(); !s.ok()) return s;
  } else if (renames_.rename(temp_dir_.c_str(), final_dir_.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat(final_dir_, ": commit rename failed: ", std::strerror(errno)));
  }
  FsyncDir(root_);
  return final_dir_;
}

// A committed checkpoint of the same step (a rerun after a crash past this point): the new one
// replaces it only once it is complete, which is now, and never leaves the step without one.
absl::Status CheckpointWriter::Replace() {
  std::error_code ec;
  if (renames_.exchange(temp_dir_.c_str(), final_dir_.c_str()) == 0) {
    FsyncDir(root_);
    fs::remove_all(temp_dir_, ec);  // now the old copy; CleanIncomplete removes it if this fails
    return absl::OkStatus();
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    return absl::InternalError(
        absl::StrCat(final_dir_, ": commit exchange failed: ", std::strerror(errno)));
  }
  // No RENAME_EXCHANGE on this filesystem: aside, in, then drop the old one.
  const std::string old = final_dir_ + ".replaced";
  fs::remove_all(old, ec);
  if (ec) return absl::InternalError(absl::StrCat(old, ": cannot remove: ", ec.message()));
  if (renames_.rename(final_dir_.c_str(), old.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat(final_dir_, ": cannot move aside: ", std::strerror(errno)));
  }
  if (renames_.rename(temp_dir_.c_str(), final_dir_.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    if (renames_.rename(old.c_str(), final_dir_.c_str()) != 0) {
      return absl::InternalError(absl::StrCat(final_dir_, ": commit rename failed (", why,
                                              "); the previous copy is at ", old,
                                              " until the next start puts it back"));
    }
    return absl::InternalError(absl::StrCat(final_dir_, ": commit rename failed: ", why));
  }
  FsyncDir(root_);
  fs::remove_all(old, ec);  // CleanIncomplete removes it if this fails
  return absl::OkStatus();
}

void CheckpointWriter::Abort() {
  std::error_code ec;
  fs::remove_all(temp_dir_, ec);
}

absl::StatusOr<std::vector<CheckpointRef>> ListCheckpoints(const std::string& root) {
  std::vector<CheckpointRef> out;
  std::error_code ec;
  if (!fs::exists(root, ec)) return out;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    auto step = StepOf(name);
    if (!step || !entry.is_directory()) continue;
    if (!fs::exists(entry.path() / kManifest)) continue;  // never committed
    out.push_back({*step, entry.path().string()});
  }
  if (ec) return absl::InternalError(absl::StrCat(root, ": cannot list: ", ec.message()));
  std::sort(out.begin(), out.end(),
            [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; });
  return out;
}

std::optional<int64_t> StepOfDirName(const std::string& name) { return StepOf(name); }

std::string ShardFileName(int rank, int world) { return ShardName(rank, world); }

absl::StatusOr<SafetensorsFile> VerifyShard(std::string bytes, const ShardInfo& info,
                                            const std::string& where) {
  if (bytes.size() != info.bytes) {
    return absl::DataLossError(absl::StrCat("shard ", where, ": size ", bytes.size(),
                                            " differs from the manifest's ", info.bytes));
  }
  const std::string crc = Crc32cHex(Crc32c(bytes.data(), bytes.size()));
  if (crc != info.crc32c) {
    return absl::DataLossError(absl::StrCat("shard ", where, ": checksum ", crc,
                                            " differs from the manifest's ", info.crc32c));
  }
  auto parsed = SafetensorsFile::Parse(std::move(bytes), where);
  if (!parsed.ok()) return absl::DataLossError(std::string(parsed.status().message()));
  return parsed;
}

// Reads go through the confining root (confined_files.h): checkpoints given as init_from are job
// input.
absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& dir) {
  const std::string manifest_path = (fs::path(dir) / kManifest).string();
  auto text = ReadConfinedFile(manifest_path);
  if (!text.ok()) {
    return absl::NotFoundError(absl::StrCat(dir, ": no manifest (checkpoint never committed)"));
  }
  auto manifest = ManifestFromJson(*text, manifest_path);
  if (!manifest.ok()) return manifest.status();
  LoadedCheckpoint loaded;
  loaded.dir = dir;
  for (const ShardInfo& info : manifest->shards) {
    const std::string path = (fs::path(dir) / info.file).string();
    auto bytes = ReadConfinedFile(path);
    if (!bytes.ok()) return absl::DataLossError(absl::StrCat("shard ", path, ": missing"));
    auto parsed = VerifyShard(std::move(*bytes), info, path);
    if (!parsed.ok()) return parsed.status();
    loaded.shards.push_back(std::move(*parsed));
  }
  loaded.manifest = std::move(*manifest);
  return loaded;
}

absl::StatusOr<LoadedCheckpoint> LoadLatestCheckpoint(const std::string& root,
                                                      std::vector<absl::Status>* skipped) {
  auto list = ListCheckpoints(root);
  if (!list.ok()) return list.status();
  for (auto it = list->rbegin(); it != list->rend(); ++it) {
    auto loaded = LoadCheckpoint(it->dir);
    if (loaded.ok()) return loaded;
    if (skipped) skipped->push_back(loaded.status());
  }
  return absl::NotFoundError(absl::StrCat("no complete checkpoint under ", root));
}

absl::StatusOr<int> CleanIncomplete(const std::string& root) {
  std::error_code ec;
  if (!fs::exists(root, ec)) return 0;
  auto directories = [&] {
    std::vector<fs::path> out;
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      if (entry.is_directory()) out.push_back(entry.path());
    }
    return out;
  };
  // First the copies a replacing commit moved aside: after a crash between its renames, the
  // step's previous copy is the only complete one when the step itself is missing or was never
  // completed, and goes back under the step's name.
  for (const fs::path& p : directories()) {
    const std::string name = p.filename().string();
    const size_t replaced = name.find(".replaced");
    if (replaced == std::string::npos || !StepOf(name.substr(0, replaced))) continue;
    const fs::path step = p.parent_path() / name.substr(0, replaced);
    if (fs::exists(step / kManifest) || !fs::exists(p / kManifest)) continue;
    fs::remove_all(step, ec);
    fs::rename(p, step, ec);
    if (ec)
      return absl::InternalError(absl::StrCat(p.string(), ": cannot put back: ", ec.message()));
    FsyncDir(root);
  }
  int removed = 0;
  for (const fs::path& p : directories()) {
    const std::string name = p.filename().string();
    const size_t replaced = name.find(".replaced");
    const bool temp = name.rfind(kTempPrefix, 0) == 0 ||
                      (replaced != std::string::npos && StepOf(name.substr(0, replaced)));
    const bool uncommitted = StepOf(name) && !fs::exists(p / kManifest);
    if (!temp && !uncommitted) continue;
    fs::remove_all(p, ec);
    if (ec) return absl::InternalError(absl::StrCat(p.string(), ": cannot remove: ", ec.message()));
    ++removed;
  }
  return removed;
}

absl::Status ApplyRetention(const std::string& root, int keep_last, int64_t keep_every) {
  auto list = ListCheckpoints(root);
  if (!list.ok()) return list.status();
  keep_last = std::max(keep_last, 1);
  const size_t n = list->size();
  for (size_t i = 0; i < n; ++i) {
    const CheckpointRef& c = (*list)[i];
    const bool recent = i + static_cast<size_t>(keep_last) >= n;
    const bool milestone = keep_every > 0 && c.step % keep_every == 0;
    if (recent || milestone) continue;
    std::error_code ec;
    // Remove the manifest first: a crash mid-delete leaves an uncommitted directory, not a
    // committed checkpoint with missing shards.
    fs::remove(fs::path(c.dir) / kManifest, ec);
    FsyncDir(c.dir);
    fs::remove_all(c.dir, ec);
    if (ec) return absl::InternalError(absl::StrCat(c.dir, ": cannot remove: ", ec.message()));
  }
  FsyncDir(root);
  return absl::OkStatus();
}

}  // namespace loom::storage
