// Where a job's checkpoints live: a POSIX directory (local disk, NFS, Lustre) or a prefix in an
// S3-compatible object store ("s3://bucket/prefix"). Both hold the same layout
// (checkpoint.h: step-NNNNNNNN/ with its shards and manifest.json) and keep the same promise:
// a checkpoint exists only once its manifest does, and a load verifies every shard.
//
// On an object store, which has no rename, the manifest is the commit point: Upload puts the
// shards first and the manifest last, after deleting any older manifest of that step (so a
// reader never pairs an old manifest with new shards); Delete removes the manifest first.
// Loads download the manifest, then each shard into a local cache named by the shard's CRC-32C
// and size (content-addressed: a shard already there is checked and reused, not fetched
// again), and verify them as on disk. docs/storage.md says what is promised and how it is
// tested.
#ifndef LOOM_STORAGE_CHECKPOINT_STORE_H_
#define LOOM_STORAGE_CHECKPOINT_STORE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/checkpoint.h"

namespace loom::storage {

class CheckpointStore {
 public:
  virtual ~CheckpointStore() = default;
  // The root as given: a path or "s3://bucket/prefix".
  virtual const std::string& root() const = 0;
  virtual bool remote() const = 0;
  // Requests to the store retried so far (5xx, SlowDown, timeouts, dropped connections).
  virtual int64_t request_retries() const { return 0; }
  // Committed checkpoints (with a manifest), oldest first; `dir` is a path or an s3:// URL.
  virtual absl::StatusOr<std::vector<CheckpointRef>> List() = 0;
  // Loads and verifies the checkpoint at `dir` (one of List's, or a step given by a user).
  virtual absl::StatusOr<LoadedCheckpoint> Load(const std::string& dir) = 0;
  // Removes what never committed (temporary directories; steps without a manifest).
  virtual absl::StatusOr<int> CleanIncomplete() = 0;
  // Removes one step, its manifest first.
  virtual absl::Status Delete(const std::string& dir) = 0;
  // Puts a committed local checkpoint (a step directory with its manifest) under the root with
  // the commit protocol; `before_commit` runs before the manifest goes in (its error aborts the
  // commit). Returns where it is now.
  virtual absl::StatusOr<std::string> Upload(
      const std::string& local_dir, const std::function<absl::Status()>& before_commit = {}) = 0;

  // Sharded commits (ZeRO-1: every rank writes its own shard, on its own node). Uncommit
  // deletes the step's manifest (before any shard of a rerun changes); each rank puts its
  // shard with UploadShard; CommitManifest (rank 0) waits until every shard the manifest lists
  // is in the store with its size, runs before_commit and puts the manifest. give_up() ends
  // the wait (Cancelled). Object stores only.
  virtual absl::Status Uncommit(int64_t step);
  virtual absl::Status UploadShard(int64_t step, const std::string& local_file,
                                   const ShardInfo& info);
  virtual absl::StatusOr<std::string> CommitManifest(
      const Manifest& manifest, const std::function<bool()>& give_up,
      const std::function<absl::Status()>& before_commit);

  // The newest checkpoint that verifies; the error of each newer one is appended to `skipped`.
  absl::StatusOr<LoadedCheckpoint> LoadLatest(std::vector<absl::Status>* skipped);
  // Keeps the newest keep_last (at least 1) and every keep_every-th (0: none); deletes the rest.
  absl::Status ApplyRetention(int keep_last, int64_t keep_every);
};

// A POSIX root, or an s3:// one with the options of the environment (S3OptionsFromEnvironment)
// and the download cache of LocalCacheDir().
absl::StatusOr<std::unique_ptr<CheckpointStore>> OpenCheckpointStore(const std::string& root);

// Where downloads are cached: $LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom, else ~/.cache/loom.
std::string LocalCacheDir();

// The checkpoint `where` names: a step (a directory with a manifest, or an s3:// prefix ending
// in step-NNNNNNNN), or a root whose newest intact checkpoint is taken (errors of newer damaged
// ones appended to `skipped`). What --resume, --init-from, export-hf and loom-serve accept.
absl::StatusOr<LoadedCheckpoint> LoadCheckpointAt(const std::string& where,
                                                  std::vector<absl::Status>* skipped);
// LoadCheckpointAt for a checkpoint a user names (export-hf, loom-serve, generate): NotFound
// "checkpoint: '<where>' is not a directory" when a local `where` is neither a step nor a root.
absl::StatusOr<LoadedCheckpoint> LoadNamedCheckpoint(const std::string& where);

// "s3://..." (no I/O).
bool IsRemoteLocation(const std::string& where);
// InvalidArgument, saying why, when `url` is no well-formed s3://bucket/key.
absl::Status CheckRemoteLocation(const std::string& url);

// The manifest.json text of the step at `dir` (a path or an s3:// URL), for the coordinator's
// eval jobs that take their model from a checkpoint.
absl::StatusOr<std::string> ReadManifestText(const std::string& dir);

// Deletes the step at `dir`, wherever it lives (the coordinator's retention).
absl::Status DeleteCheckpoint(const std::string& dir);

}  // namespace loom::storage

#endif  // LOOM_STORAGE_CHECKPOINT_STORE_H_
