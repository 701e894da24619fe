// The trainer's checkpointer: what a checkpoint holds, when one is written, and how a run starts
// from one.
//
// A checkpoint (storage/checkpoint.h) holds the weights, the AdamW moments and step, the data
// sampler's state (the data cursor), data.splits' early-stopping state, the loss scale, the NaN
// counter and LibTorch's CPU generator; the learning rate is a function of the step. Resuming on
// the same build and thread count reproduces an uninterrupted run bit for bit. With ZeRO-1 every
// rank writes the moments it owns as its own shard of one checkpoint, and a restore merges shards
// by name, so the world size may change between runs.
#ifndef LOOM_WORKER_TRAINER_CHECKPOINTER_H_
#define LOOM_WORKER_TRAINER_CHECKPOINTER_H_

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "loom/v1/job.pb.h"
#include "storage/checkpoint.h"
#include "storage/checkpoint_store.h"
#include "storage/checkpoint_uploader.h"
#include "worker/trainer/adamw.h"
#include "worker/trainer/batch_source.h"
#include "worker/trainer/distributed.h"
#include "worker/trainer/evaluator.h"
#include "worker/trainer/loss_scaler.h"
#include "worker/trainer/model.h"
#include "worker/trainer/step_reporter.h"
#include "worker/trainer/tensor_io.h"

namespace loom::trainer {

// The trainer's counters a checkpoint carries beside the tensors.
struct TrainProgress {
  int64_t step = 0, tokens_seen = 0, consecutive_nan = 0;
  std::string parent;  // the checkpoint this run's lineage started from
};

// What a checkpoint saves and restores (not owned; early_stop and loss_scaler may be null).
struct CheckpointedState {
  Transformer* model = nullptr;
  AdamW* optimizer = nullptr;
  BatchSource* data = nullptr;
  EarlyStopping* early_stop = nullptr;  // data.splits only
  LossScaler* loss_scaler = nullptr;    // loss_scale.mode dynamic only
  TrainProgress* progress = nullptr;
};

// Where a run starts: loom-train's --resume, --init-from and --resume-if-any.
struct StartFrom {
  std::string resume;     // checkpoint root or step directory to continue from
  std::string init_from;  // checkpoint root or step directory to take weights from
  // Checkpoint root: continue from its newest checkpoint that verifies, skipping damaged ones;
  // none: start fresh (from init_from when given). What the control plane's agents pass.
  std::string resume_if_any;
};

class Checkpointer {
 public:
  struct Options {
    bool apply_retention = true;  // false: the control plane decides what to delete
    bool zero = false;            // ZeRO-1: every rank writes its own shard
    torch::Device device = torch::kCPU;
    // Test seam: runs after the shards are written, before the commit (a window to kill in).
    std::function<void(int64_t step)> before_commit;
  };
  Checkpointer(const v1::JobSpec& spec, CheckpointedState state, Communicator* comm,
               StepReporter* reporter, Options options);

  // Setup: removes incomplete checkpoints (rank 0), then restores what `from` names.
  absl::Status Start(const StartFrom& from);
  // The events of Start for the event log: skipped checkpoints, and what --resume-if-any restored.
  void ReportStart(const StartFrom& from);

  bool enabled() const { return !spec_.checkpoint().dir().empty(); }
  // checkpoint.interval says to save after `step`.
  bool Due(int64_t step) const;
  // checkpoint.interval_seconds have passed since the last save (or the start). Each rank reads
  // its own clock: the trainer lets rank 0's answer decide for all.
  bool DueByTime() const;
  // Writes and commits a checkpoint at the current step (rank 0, or every rank with ZeRO-1), then
  // waits for every rank so none runs ahead of a checkpoint it might be restarted from. On an
  // object store the step is committed to the local staging directory and handed to the
  // uploader (after the previous upload, whose wait is measured); Poll reports it once its
  // manifest is in the store.
  absl::Status Save();
  // Reports uploads finished since the last call (events, metrics, log); an upload given up
  // (credentials, a missing bucket) is the run's error. Every step calls it.
  absl::Status Poll();
  // Waits for the upload in flight, then Poll: before a run ends, so that its last checkpoint
  // is in the store when the process exits.
  absl::Status Flush();
  bool SavedAtCurrentStep() const { return last_saved_ == state_.progress->step; }
  const std::string& last_checkpoint() const { return last_checkpoint_; }

 private:
  struct Note {
    int64_t step = 0;
    std::string dir, reason;
  };
  absl::Status Restore(const std::string& where, bool weights_only);
  absl::Status RestoreNewestIntact(const std::string& root, const std::string& init_from);
  absl::Status Apply(const storage::LoadedCheckpoint& loaded, bool weights_only,
                     std::chrono::steady_clock::time_point start);
  absl::Status ApplyTrainingState(const storage::LoadedCheckpoint& loaded,
                                  std::map<std::string, torch::Tensor>& optim_tensors,
                                  const torch::Tensor* torch_rng, const char* what);
  absl::StatusOr<std::string> Write();
  absl::Status OpenStore();
  // Where steps are committed before their upload: $LOOM_STAGING_DIR (the agent's, per job), or
  // the cache directory's staging/<spec hash>.
  std::string StagingRoot() const;
  void DropStagedBefore(int64_t step);
  absl::StatusOr<std::string> Stage(int64_t step, const std::string& local_dir, double seconds,
                                    uint64_t bytes);
  absl::StatusOr<std::string> WriteShardRemote(int64_t step, const WritableTensors& writable,
                                               const std::string& token,
                                               std::chrono::steady_clock::time_point start);
  absl::StatusOr<std::vector<storage::ShardInfo>> ExchangeShards(const storage::ShardInfo& mine);
  struct Staged {
    double write_seconds = 0, wait_seconds = 0;
  };
  std::map<int64_t, Staged> staged_;  // steps handed to the uploader, not yet reported
  storage::Manifest ManifestNow() const;

  const v1::JobSpec& spec_;
  CheckpointedState state_;
  Communicator* comm_;
  StepReporter* reporter_;
  Options options_;
  std::string model_hash_, spec_hash_;
  int64_t last_saved_ = -1;
  std::chrono::steady_clock::time_point last_save_time_ = std::chrono::steady_clock::now();
  std::string last_checkpoint_;
  std::unique_ptr<storage::CheckpointStore> store_;        // checkpoint.dir's
  std::unique_ptr<storage::CheckpointUploader> uploader_;  // remote stores, on the writing rank
  std::vector<Note> skipped_;  // --resume-if-any: damaged checkpoints passed over
  Note resumed_;               // and the one restored ("" dir: none)
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_CHECKPOINTER_H_
