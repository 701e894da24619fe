// Uploads committed local checkpoints to a remote store from a thread of its own, one at a time,
// so that training goes on while a step travels (torchtitan's asynchronous checkpointing, for
// object stores). The trainer commits a step to local disk (fast), hands it here and carries on;
// the step counts as a checkpoint (reported to the control plane) only once its manifest is in
// the store. At most one upload is in flight: the next Submit waits for it, and says how long.
//
// An upload that fails for a reason retrying can fix (the store unreachable, 5xx after the
// client's own retries) is tried again after a backoff that grows to 30 s, for as long as it
// takes; any other error (credentials, a missing bucket, a damaged local shard) ends it, and
// the trainer stops with that error.
#ifndef LOOM_STORAGE_CHECKPOINT_UPLOADER_H_
#define LOOM_STORAGE_CHECKPOINT_UPLOADER_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "storage/checkpoint_store.h"

namespace loom::storage {

class CheckpointUploader {
 public:
  struct Finished {
    int64_t step = 0;
    std::string where;  // the step in the store
    uint64_t bytes = 0;
    double seconds = 0;           // from Submit to the manifest in the store
    int retries = 0;              // whole-upload retries
    int64_t request_retries = 0;  // requests the S3 client retried during this upload
    absl::Status status;
  };
  struct Hooks {
    std::function<absl::Status()> before_commit;  // before each manifest goes in (the lease)
    std::function<void()> after_upload;           // on the upload thread (retention)
    double max_backoff_s = 30;
  };
  CheckpointUploader(CheckpointStore* store, Hooks hooks);
  ~CheckpointUploader();  // finishes the upload in flight

  // Waits for the upload in flight, then starts uploading `local_dir`; returns the seconds
  // waited.
  double Submit(int64_t step, std::string local_dir, uint64_t bytes);
  // ZeRO-1: this rank's shard, committed locally as the one shard of `local_dir`, goes up as
  // `shard` of the step; with `commit` (rank 0), that manifest follows once every rank's shard
  // is in the store (CheckpointStore::CommitManifest). Returns the seconds waited.
  double SubmitShard(int64_t step, std::string local_dir, ShardInfo shard,
                     std::optional<Manifest> commit, uint64_t bytes);
  // Waits until nothing is in flight; returns the seconds waited.
  double Wait();
  // Uploads finished (or given up) since the last call, and lines for the log.
  std::vector<Finished> TakeFinished();
  std::vector<std::string> TakeNotes();

 private:
  struct Job {
    int64_t step;
    std::string local_dir;
    uint64_t bytes;
    std::chrono::steady_clock::time_point submitted;
    std::optional<ShardInfo> shard;  // ZeRO-1: this rank's shard only
    std::optional<Manifest> commit;  // and, on rank 0, the manifest after all of them
  };
  void Loop();
  double Start(Job job);
  Finished Upload(const Job& job);
  absl::StatusOr<std::string> TryOnce(const Job& job);

  CheckpointStore* store_;
  Hooks hooks_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Job> job_;  // in flight
  bool stop_ = false;
  std::vector<Finished> finished_;
  std::vector<std::string> notes_;
  std::thread thread_;
};

}  // namespace loom::storage

#endif  // LOOM_STORAGE_CHECKPOINT_UPLOADER_H_
