// Sharded checkpoints on a POSIX file system (local disk, NFS, Lustre).
//
// Layout under a checkpoint root:
//   step-00000100/
//     shard-00000-of-00002.safetensors    one per rank: the tensors that rank owns
//     shard-00001-of-00002.safetensors
//     manifest.json                       written last
// A checkpoint exists only once its directory has a manifest. Commit protocol: shards and the
// manifest are written into `.tmp-step-00000100-<pid>/`, each file fsync'ed, the directory
// fsync'ed, then renamed to `step-00000100/` and the root fsync'ed. A crash at any point leaves
// either the previous state or a temporary directory that CleanIncomplete() removes; loaders
// never look at directories without a manifest.
//
// The manifest records step, tokens seen, the job spec's hash, world size, the parent checkpoint,
// free-form trainer state (data cursor, RNG states: opaque strings), and each shard's size and
// CRC-32C. Load verifies every shard against it and names the one that does not match.
#ifndef LOOM_STORAGE_CHECKPOINT_H_
#define LOOM_STORAGE_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "storage/safetensors.h"

namespace loom::storage {

struct ShardInfo {
  int rank = 0;
  std::string file;  // relative to the checkpoint directory
  uint64_t bytes = 0;
  std::string crc32c;  // 8 hex digits
};

struct Manifest {
  int format_version = 1;
  int64_t step = 0;
  int64_t tokens_seen = 0;
  int world_size = 1;
  std::string spec_hash;
  std::string parent;  // directory of the checkpoint this run started from, or ""
  std::string kind;    // job kind that wrote it ("pretrain", "sft", ...)
  int64_t created_unix_ms = 0;
  std::map<std::string, std::string> state;  // data cursor, RNG states, ...
  std::vector<ShardInfo> shards;
};

std::string ManifestToJson(const Manifest& m);
// The one parser of manifest.json: every field present and exact, a shard per rank, each
// passing CheckShardInfo. DataLoss naming `source` otherwise.
absl::StatusOr<Manifest> ManifestFromJson(const std::string& text, const std::string& source);
// A shard entry from outside this process (a manifest read back, the sizes and CRC-32Cs other
// ranks sent): a plain file name, never a path, and a CRC-32C as Crc32cHex writes it. DataLoss
// naming `where` otherwise.
absl::Status CheckShardInfo(const ShardInfo& s, const std::string& where);

// "step-00000100"
std::string CheckpointDirName(int64_t step);
// "shard-00001-of-00004.safetensors"
std::string ShardFileName(int rank, int world);
// "step-00000100" -> 100; nullopt for any other name.
std::optional<int64_t> StepOfDirName(const std::string& name);
inline constexpr char kManifestFile[] = "manifest.json";

// The two renames a commit makes, as syscalls (0 or -1 with errno). Tests replace them to fail
// one and check what is left on disk (storage/checkpoint_test.cc).
struct CommitRenames {
  // renameat2(RENAME_EXCHANGE): swaps two existing paths atomically.
  std::function<int(const char* a, const char* b)> exchange;
  std::function<int(const char* from, const char* to)> rename;
};
CommitRenames SystemCommitRenames();

class CheckpointWriter {
 public:
  // Creates the temporary directory for `step` under `root` (creating root if needed). Ranks
  // that write shards of one checkpoint pass the same `token` (default: this process id); one of
  // them creates the directory, the others join it (create = false) once it exists.
  static absl::StatusOr<CheckpointWriter> Begin(const std::string& root, int64_t step,
                                                int world_size, const std::string& token = "",
                                                bool create = true);

  // Writes rank's shard (safetensors, fsync'ed) and records its size and checksum.
  absl::Status WriteShard(int rank, const std::vector<TensorToWrite>& tensors,
                          const std::map<std::string, std::string>& metadata = {});

  // Records a shard another process wrote into the temporary directory (size and CRC-32C are
  // computed from the file).
  absl::Status AdoptShard(int rank);

  // Writes the manifest (shards filled in from WriteShard), fsyncs and renames into place.
  // Every rank's shard must have been written. Returns the final directory. A step committed
  // before is replaced atomically (RENAME_EXCHANGE; where the filesystem lacks it, moved aside
  // first and moved back on failure): at every instant one complete copy of the step exists,
  // under its name or, after a crash between two renames, as "<step>.replaced", which
  // CleanIncomplete puts back.
  absl::StatusOr<std::string> Commit(Manifest manifest);
  void set_renames_for_testing(CommitRenames renames) { renames_ = std::move(renames); }

  // Removes the temporary directory (on error paths).
  void Abort();

  // What WriteShard or AdoptShard recorded for `rank` (size, CRC-32C); NotFound before.
  absl::StatusOr<ShardInfo> shard(int rank) const {
    auto it = shards_.find(rank);
    if (it == shards_.end()) return absl::NotFoundError("no shard written for that rank");
    return it->second;
  }

  const std::string& temp_dir() const { return temp_dir_; }

 private:
  std::string root_, temp_dir_, final_dir_;
  int64_t step_ = 0;
  int world_size_ = 1;
  std::map<int, ShardInfo> shards_;
  CommitRenames renames_ = SystemCommitRenames();

  absl::Status Replace();  // final_dir_ exists: put temp_dir_ in its place
};

struct CheckpointRef {
  int64_t step;
  std::string dir;
};

// Committed checkpoints (directories with a manifest) under root, oldest first.
absl::StatusOr<std::vector<CheckpointRef>> ListCheckpoints(const std::string& root);

struct LoadedCheckpoint {
  std::string dir;
  Manifest manifest;
  std::vector<SafetensorsFile> shards;  // indexed by rank, checksums verified
};

// One shard's bytes checked against the manifest (size, CRC-32C) and parsed; DataLoss names
// `where` (a path or a URL) otherwise.
absl::StatusOr<SafetensorsFile> VerifyShard(std::string bytes, const ShardInfo& info,
                                            const std::string& where);

// Loads and verifies one checkpoint directory: manifest present and well-formed, every shard
// present with the recorded size and CRC-32C, parseable as safetensors. DataLoss names the shard.
absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& dir);

// The newest checkpoint under root that verifies. Each newer one that does not is skipped and
// its error appended to `skipped` (when not null). NotFound when none verifies.
absl::StatusOr<LoadedCheckpoint> LoadLatestCheckpoint(const std::string& root,
                                                      std::vector<absl::Status>* skipped);

// Removes temporary directories and step directories without a manifest. Returns how many.
absl::StatusOr<int> CleanIncomplete(const std::string& root);

// Keeps the newest `keep_last` committed checkpoints plus every one whose step is a multiple
// of `keep_every` (0 = none); deletes the rest. keep_last < 1 is treated as 1.
absl::Status ApplyRetention(const std::string& root, int keep_last, int64_t keep_every);

}  // namespace loom::storage

#endif  // LOOM_STORAGE_CHECKPOINT_H_
