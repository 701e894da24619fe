#include "storage/checkpoint_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/env.h"
#include "base/read_file.h"
#include "base/status_macros.h"
#include "storage/crc32c.h"
#include "storage/object_cache.h"
#include "storage/s3/s3_client.h"

namespace loom::storage {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kMaxManifestBytes = 64 << 20;

class PosixCheckpointStore : public CheckpointStore {
 public:
  explicit PosixCheckpointStore(std::string root) : root_(std::move(root)) {}
  const std::string& root() const override { return root_; }
  bool remote() const override { return false; }
  absl::StatusOr<std::vector<CheckpointRef>> List() override { return ListCheckpoints(root_); }
  absl::StatusOr<LoadedCheckpoint> Load(const std::string& dir) override {
    return LoadCheckpoint(dir);
  }
  absl::StatusOr<int> CleanIncomplete() override { return storage::CleanIncomplete(root_); }
  absl::Status Delete(const std::string& dir) override {
    std::error_code ec;
    fs::remove(fs::path(dir) / kManifestFile, ec);  // uncommitted first
    fs::remove_all(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat(dir, ": cannot remove: ", ec.message()));
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Upload(const std::string& local_dir,
                                     const std::function<absl::Status()>& before_commit) override;

 private:
  std::string root_;
};

// A copy through CheckpointWriter: the same atomic commit as a trainer's.
absl::StatusOr<std::string> PosixCheckpointStore::Upload(
    const std::string& local_dir, const std::function<absl::Status()>& before_commit) {
  const std::string manifest_path = (fs::path(local_dir) / kManifestFile).string();
  LOOM_ASSIGN_OR_RETURN(std::string text, ReadNonEmptyFile(manifest_path, "checkpoint manifest"));
  LOOM_ASSIGN_OR_RETURN(Manifest m, ManifestFromJson(text, manifest_path));
  LOOM_ASSIGN_OR_RETURN(CheckpointWriter w,
                        CheckpointWriter::Begin(root_, m.step, m.world_size, "upload"));
  for (const ShardInfo& s : m.shards) {
    std::error_code ec;
    fs::copy_file(fs::path(local_dir) / s.file, fs::path(w.temp_dir()) / s.file,
                  fs::copy_options::overwrite_existing, ec);
    absl::Status st =
        ec ? absl::InternalError(absl::StrCat(s.file, ": ", ec.message())) : w.AdoptShard(s.rank);
    if (!st.ok()) {
      w.Abort();
      return st;
    }
  }
  if (before_commit) {
    if (absl::Status s = before_commit(); !s.ok()) {
      w.Abort();
      return s;
    }
  }
  auto dir = w.Commit(m);
  if (!dir.ok()) w.Abort();
  return dir;
}

class S3CheckpointStore : public CheckpointStore {
 public:
  S3CheckpointStore(std::string root, S3Location loc, S3Options options)
      : root_(std::move(root)), loc_(std::move(loc)), client_(std::move(options)) {}
  const std::string& root() const override { return root_; }
  bool remote() const override { return true; }
  int64_t request_retries() const override { return client_.retries(); }
  absl::StatusOr<std::vector<CheckpointRef>> List() override;
  absl::StatusOr<LoadedCheckpoint> Load(const std::string& dir) override;
  absl::StatusOr<int> CleanIncomplete() override;
  absl::Status Delete(const std::string& dir) override;
  absl::StatusOr<std::string> Upload(const std::string& local_dir,
                                     const std::function<absl::Status()>& before_commit) override;
  absl::Status Uncommit(int64_t step) override {
    return client_.Delete(loc_.bucket, StepKey(step, kManifestFile));
  }
  absl::Status UploadShard(int64_t step, const std::string& local_file,
                           const ShardInfo& info) override;
  absl::StatusOr<std::string> CommitManifest(
      const Manifest& manifest, const std::function<bool()>& give_up,
      const std::function<absl::Status()>& before_commit) override;

 private:
  std::string StepKey(int64_t step, const std::string& file) const {
    return loc_.Key(absl::StrCat(CheckpointDirName(step), "/", file));
  }
  // The objects under the root, by step directory name ("step-00000100" → keys).
  absl::StatusOr<std::map<std::string, std::vector<std::string>>> StepObjects();
  absl::StatusOr<SafetensorsFile> FetchShard(const S3Location& step, const ShardInfo& info);

  std::string root_;
  S3Location loc_;
  S3Client client_;
};

absl::StatusOr<std::map<std::string, std::vector<std::string>>> S3CheckpointStore::StepObjects() {
  const std::string prefix = loc_.prefix.empty() ? "" : loc_.prefix + "/";
  LOOM_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, client_.List(loc_.bucket, prefix));
  std::map<std::string, std::vector<std::string>> out;
  for (const ObjectInfo& o : objects) {
    const std::string rel = o.key.substr(prefix.size());
    const size_t slash = rel.find('/');
    if (slash == std::string::npos || !StepOfDirName(rel.substr(0, slash))) continue;
    out[rel.substr(0, slash)].push_back(o.key);
  }
  return out;
}

absl::StatusOr<std::vector<CheckpointRef>> S3CheckpointStore::List() {
  LOOM_ASSIGN_OR_RETURN(auto steps, StepObjects());
  std::vector<CheckpointRef> out;
  for (const auto& [name, keys] : steps) {
    const std::string manifest = loc_.Key(absl::StrCat(name, "/", kManifestFile));
    if (std::find(keys.begin(), keys.end(), manifest) == keys.end()) continue;  // uncommitted
    out.push_back({*StepOfDirName(name), loc_.Url(name)});
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; });
  return out;
}

absl::StatusOr<SafetensorsFile> S3CheckpointStore::FetchShard(const S3Location& step,
                                                              const ShardInfo& info) {
  const std::string url = step.Url(info.file);
  auto path = FetchVerified(url, info.crc32c, info.bytes);
  if (absl::IsDataLoss(path.status())) {
    return absl::DataLossError(absl::StrCat("shard ", path.status().message()));
  }
  if (!path.ok()) return path.status();
  LOOM_ASSIGN_OR_RETURN(std::string bytes, ReadNonEmptyFile(*path, "cached shard"));
  auto parsed = SafetensorsFile::Parse(std::move(bytes), url);
  if (!parsed.ok()) return absl::DataLossError(std::string(parsed.status().message()));
  return parsed;
}

absl::StatusOr<LoadedCheckpoint> S3CheckpointStore::Load(const std::string& dir) {
  LOOM_ASSIGN_OR_RETURN(S3Location step, ParseS3Url(dir));
  const std::string manifest_url = step.Url(kManifestFile);
  auto text = client_.GetString(step.bucket, step.Key(kManifestFile), kMaxManifestBytes);
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(absl::StrCat(dir, ": no manifest (checkpoint never committed)"));
  }
  if (!text.ok()) return text.status();
  LOOM_ASSIGN_OR_RETURN(Manifest manifest, ManifestFromJson(*text, manifest_url));
  LoadedCheckpoint loaded;
  loaded.dir = dir;
  for (const ShardInfo& info : manifest.shards) {
    LOOM_ASSIGN_OR_RETURN(SafetensorsFile shard, FetchShard(step, info));
    loaded.shards.push_back(std::move(shard));
  }
  loaded.manifest = std::move(manifest);
  TrimObjectCache();
  return loaded;
}

absl::StatusOr<int> S3CheckpointStore::CleanIncomplete() {
  LOOM_ASSIGN_OR_RETURN(auto steps, StepObjects());
  int removed = 0;
  for (const auto& [name, keys] : steps) {
    const std::string manifest = loc_.Key(absl::StrCat(name, "/", kManifestFile));
    if (std::find(keys.begin(), keys.end(), manifest) != keys.end()) continue;
    for (const std::string& key : keys) LOOM_RETURN_IF_ERROR(client_.Delete(loc_.bucket, key));
    ++removed;
  }
  return removed;
}

absl::Status S3CheckpointStore::Delete(const std::string& dir) {
  LOOM_ASSIGN_OR_RETURN(S3Location step, ParseS3Url(dir));
  const std::string name = fs::path(step.prefix).filename().string();
  if (step.bucket != loc_.bucket || step.prefix != loc_.Key(name) || !StepOfDirName(name)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": not a step under ", root_));
  }
  // Uncommitted first: a crash mid-way leaves shards without a manifest, which nothing reads.
  LOOM_RETURN_IF_ERROR(client_.Delete(step.bucket, step.Key(kManifestFile)));
  LOOM_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects,
                        client_.List(step.bucket, step.prefix + "/"));
  for (const ObjectInfo& o : objects) LOOM_RETURN_IF_ERROR(client_.Delete(step.bucket, o.key));
  return absl::OkStatus();
}

absl::StatusOr<std::string> S3CheckpointStore::Upload(
    const std::string& local_dir, const std::function<absl::Status()>& before_commit) {
  const std::string manifest_path = (fs::path(local_dir) / kManifestFile).string();
  LOOM_ASSIGN_OR_RETURN(std::string text, ReadNonEmptyFile(manifest_path, "checkpoint manifest"));
  LOOM_ASSIGN_OR_RETURN(Manifest m, ManifestFromJson(text, manifest_path));
  const std::string name = CheckpointDirName(m.step);
  S3Location step{loc_.bucket, loc_.Key(name)};
  // The local copy is checked before it leaves: the store must never hold a shard that the
  // manifest would reject.
  for (const ShardInfo& s : m.shards) {
    uint64_t size = 0;
    const std::string path = (fs::path(local_dir) / s.file).string();
    LOOM_ASSIGN_OR_RETURN(std::string crc, FileCrc32c(path, &size));
    if (crc != s.crc32c || size != s.bytes) {
      return absl::DataLossError(absl::StrCat("shard ", path, ": checksum ", crc, " and size ",
                                              size, " differ from the manifest's"));
    }
  }
  // A step uploaded before (a rerun) stops existing before its shards change.
  LOOM_RETURN_IF_ERROR(client_.Delete(step.bucket, step.Key(kManifestFile)));
  for (const ShardInfo& s : m.shards) {
    LOOM_RETURN_IF_ERROR(
        client_.PutFile(step.bucket, step.Key(s.file), (fs::path(local_dir) / s.file).string()));
  }
  if (before_commit) LOOM_RETURN_IF_ERROR(before_commit());
  LOOM_RETURN_IF_ERROR(client_.PutString(step.bucket, step.Key(kManifestFile), text));
  return step.Url();
}

absl::Status S3CheckpointStore::UploadShard(int64_t step, const std::string& local_file,
                                            const ShardInfo& info) {
  LOOM_RETURN_IF_ERROR(CheckShardInfo(info, local_file));
  uint64_t size = 0;
  LOOM_ASSIGN_OR_RETURN(std::string crc, FileCrc32c(local_file, &size));
  if (crc != info.crc32c || size != info.bytes) {
    return absl::DataLossError(absl::StrCat("shard ", local_file, ": checksum ", crc, " and size ",
                                            size, " differ from what was recorded"));
  }
  return client_.PutFile(loc_.bucket, StepKey(step, info.file), local_file);
}

absl::StatusOr<std::string> S3CheckpointStore::CommitManifest(
    const Manifest& manifest, const std::function<bool()>& give_up,
    const std::function<absl::Status()>& before_commit) {
  for (const ShardInfo& s : manifest.shards) {
    LOOM_RETURN_IF_ERROR(CheckShardInfo(s, "manifest"));  // the other ranks' sizes and CRCs
    double wait = 0.2;
    for (;;) {  // the other ranks' uploads
      LOOM_ASSIGN_OR_RETURN(auto head, client_.Head(loc_.bucket, StepKey(manifest.step, s.file)));
      if (head && head->size == s.bytes) break;
      if (give_up && give_up()) {
        return absl::CancelledError(absl::StrCat("step ", manifest.step, ": gave up waiting for ",
                                                 s.file, " of rank ", s.rank));
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(wait));
      wait = std::min(wait * 2, 2.0);
    }
  }
  if (before_commit) LOOM_RETURN_IF_ERROR(before_commit());
  LOOM_RETURN_IF_ERROR(client_.PutString(loc_.bucket, StepKey(manifest.step, kManifestFile),
                                         ManifestToJson(manifest)));
  return loc_.Url(CheckpointDirName(manifest.step));
}

}  // namespace

absl::Status CheckpointStore::Uncommit(int64_t) {
  return absl::UnimplementedError("sharded uploads: object stores only");
}
absl::Status CheckpointStore::UploadShard(int64_t, const std::string&, const ShardInfo&) {
  return absl::UnimplementedError("sharded uploads: object stores only");
}
absl::StatusOr<std::string> CheckpointStore::CommitManifest(const Manifest&,
                                                            const std::function<bool()>&,
                                                            const std::function<absl::Status()>&) {
  return absl::UnimplementedError("sharded uploads: object stores only");
}

absl::StatusOr<LoadedCheckpoint> CheckpointStore::LoadLatest(std::vector<absl::Status>* skipped) {
  LOOM_ASSIGN_OR_RETURN(std::vector<CheckpointRef> refs, List());
  for (auto it = refs.rbegin(); it != refs.rend(); ++it) {
    auto loaded = Load(it->dir);
    if (loaded.ok()) return loaded;
    if (!absl::IsDataLoss(loaded.status()) && !absl::IsNotFound(loaded.status()))
      return loaded.status();  // the store, not the checkpoint: do not pass over it
    if (skipped) skipped->push_back(loaded.status());
  }
  return absl::NotFoundError(absl::StrCat("no complete checkpoint under ", root()));
}

absl::Status CheckpointStore::ApplyRetention(int keep_last, int64_t keep_every) {
  LOOM_ASSIGN_OR_RETURN(std::vector<CheckpointRef> refs, List());
  keep_last = std::max(keep_last, 1);
  for (size_t i = 0; i + static_cast<size_t>(keep_last) < refs.size(); ++i) {
    if (keep_every > 0 && refs[i].step % keep_every == 0) continue;
    LOOM_RETURN_IF_ERROR(Delete(refs[i].dir));
  }
  return absl::OkStatus();
}

std::string LocalCacheDir() {
  if (!EnvOrEmpty("LOOM_CACHE_DIR").empty()) return EnvOrEmpty("LOOM_CACHE_DIR");
  if (!EnvOrEmpty("XDG_CACHE_HOME").empty())
    return (fs::path(EnvOrEmpty("XDG_CACHE_HOME")) / "loom").string();
  if (!EnvOrEmpty("HOME").empty())
    return (fs::path(EnvOrEmpty("HOME")) / ".cache" / "loom").string();
  return absl::StrCat("/tmp/loom-cache-", ::getuid());
}

absl::StatusOr<std::unique_ptr<CheckpointStore>> OpenCheckpointStore(const std::string& root) {
  if (!IsS3Url(root)) return std::make_unique<PosixCheckpointStore>(root);
  LOOM_ASSIGN_OR_RETURN(S3Location loc, ParseS3Url(root));
  LOOM_ASSIGN_OR_RETURN(S3Options options, S3OptionsFromEnvironment());
  return std::make_unique<S3CheckpointStore>(root, std::move(loc), std::move(options));
}

namespace {

// "s3://b/root/step-00000100" → "s3://b/root"; "" when the URL names no step.
std::string S3StepParent(const std::string& url) {
  auto loc = ParseS3Url(url);
  if (!loc.ok() || loc->prefix.empty()) return "";
  const size_t slash = loc->prefix.rfind('/');
  const std::string last = slash == std::string::npos ? loc->prefix : loc->prefix.substr(slash + 1);
  if (!StepOfDirName(last)) return "";
  return absl::StrCat("s3://", loc->bucket,
                      slash == std::string::npos ? "" : "/" + loc->prefix.substr(0, slash));
}

}  // namespace

absl::StatusOr<LoadedCheckpoint> LoadCheckpointAt(const std::string& where,
                                                  std::vector<absl::Status>* skipped) {
  if (IsS3Url(where)) {
    const std::string parent = S3StepParent(where);
    LOOM_ASSIGN_OR_RETURN(auto store, OpenCheckpointStore(parent.empty() ? where : parent));
    if (!parent.empty()) {
      LOOM_ASSIGN_OR_RETURN(S3Location loc, ParseS3Url(where));  // normalised: no trailing '/'
      return store->Load(loc.Url());
    }
    return store->LoadLatest(skipped);
  }
  if (fs::exists(fs::path(where) / kManifestFile)) return LoadCheckpoint(where);
  return LoadLatestCheckpoint(where, skipped);
}

absl::StatusOr<LoadedCheckpoint> LoadNamedCheckpoint(const std::string& where) {
  if (!IsS3Url(where) && !fs::exists(fs::path(where) / kManifestFile) && !fs::is_directory(where)) {
    return absl::NotFoundError(absl::StrCat("checkpoint: '", where, "' is not a directory"));
  }
  return LoadCheckpointAt(where, nullptr);
}

bool IsRemoteLocation(const std::string& where) { return IsS3Url(where); }

absl::Status CheckRemoteLocation(const std::string& url) { return ParseS3Url(url).status(); }

absl::StatusOr<std::string> ReadManifestText(const std::string& dir) {
  if (!IsS3Url(dir))
    return ReadNonEmptyFile((fs::path(dir) / kManifestFile).string(), "checkpoint manifest");
  LOOM_ASSIGN_OR_RETURN(S3Location step, ParseS3Url(dir));
  LOOM_ASSIGN_OR_RETURN(S3Options options, S3OptionsFromEnvironment());
  return S3Client(options).GetString(step.bucket, step.Key(kManifestFile), kMaxManifestBytes);
}

absl::Status DeleteCheckpoint(const std::string& dir) {
  const std::string parent =
      IsS3Url(dir) ? S3StepParent(dir) : fs::path(dir).parent_path().string();
  if (parent.empty()) return absl::InvalidArgumentError(absl::StrCat(dir, ": not a step"));
  LOOM_ASSIGN_OR_RETURN(auto store, OpenCheckpointStore(parent));
  return store->Delete(dir);
}

}  // namespace loom::storage
