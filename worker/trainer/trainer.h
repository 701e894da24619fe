// The trainer: runs a resolved JobSpec on one rank. Owns the model (plugins from the loader),
// AdamW, the data sampler, evaluation, checkpoints (storage/checkpoint.h), the JSON-lines
// metrics log and the Prometheus registry/exporter.
//
// Exact resume: a checkpoint holds the weights, AdamW moments and step, the data sampler's RNG
// state (the data cursor) and LibTorch's CPU generator; the learning rate is a function of the
// step. Resuming on the same build and thread count reproduces an uninterrupted run bit for bit.
#ifndef LOOM_WORKER_TRAINER_TRAINER_H_
#define LOOM_WORKER_TRAINER_TRAINER_H_

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "adamw.h"
#include "chat.h"
#include "checkpoint.h"
#include "corpus.h"
#include "distributed.h"
#include "http_exporter.h"
#include "loom/sft_plugin.h"
#include "loom/v1/job.pb.h"
#include "loss_scaler.h"
#include "model.h"
#include "prometheus.h"
#include "reasoning_eval.h"
#include "tasks.h"
#include "tokenizer.h"

namespace loom::trainer {

// Learning rate at 0-based `step`: linear warm-up to lr over warmup_steps, then cosine to min_lr
// at the last step.
double LearningRateAt(const v1::OptimizerConfig& o, int64_t total_steps, int64_t step);

// One micro-batch. targets: next-token ids (decoder) or classes (encoder); -1 = not scored.
// rows/cols: grid coordinates for encoder grid tasks, else undefined.
struct TrainBatch {
  torch::Tensor inputs, targets, rows, cols;
  torch::Tensor positions, segments;  // packed chat rows: per-example positions and segment ids
};

// Where micro-batches come from. Its whole state is one RNG, saved in checkpoints as the data
// cursor, so a resumed run draws exactly the batches the uninterrupted one would have.
class BatchSource {
 public:
  explicit BatchSource(uint64_t seed) : rng_(seed) {}
  virtual ~BatchSource() = default;
  virtual TrainBatch Next(int64_t batch) = 0;
  virtual std::string State() const;
  virtual absl::Status Restore(const std::string& state);

 protected:
  std::mt19937_64 rng_;
};

// Uniformly random windows of seq_len + 1 tokens over a token stream (corpus or shards).
class WindowSampler : public BatchSource {
 public:
  WindowSampler(std::shared_ptr<const TokenStream> tokens, int64_t seq_len, uint64_t seed)
      : BatchSource(seed), tokens_(std::move(tokens)), seq_len_(seq_len) {}
  TrainBatch Next(int64_t batch) override;

 private:
  std::shared_ptr<const TokenStream> tokens_;
  int64_t seq_len_;
};

// Examples of a built-in task, right-padded to the longest in the batch (padding is never scored).
class TaskSampler : public BatchSource {
 public:
  TaskSampler(std::shared_ptr<const data::Task> task, uint64_t seed)
      : BatchSource(seed), task_(std::move(task)) {}
  TrainBatch Next(int64_t batch) override;

 private:
  std::shared_ptr<const data::Task> task_;
};

// A batch of task examples, right-padded to the longest (padding targets are -1). mask_padding:
// segment ids 1 for real tokens and 0 for padding (with positions), so a bidirectional encoder
// never attends from a real token to padding; used where examples of one batch differ in shape.
TrainBatch TaskBatch(const std::vector<const data::Example*>& examples, bool mask_padding);

// A fixed split of a built-in task (data.splits), materialised once.
struct TaskSplit {
  std::vector<data::Example> examples;
  bool mask_padding = false;  // encoder grid tasks: examples differ in size
};
// `n` examples drawn one at a time (each with its own shape) from a generator seeded with `seed`.
std::shared_ptr<const TaskSplit> MakeTaskSplit(const data::Task& task, int64_t n, uint64_t seed);

// Epochs over a fixed train split: a permutation drawn with the sampler's RNG at the start of each
// pass, batches taken in its order; a batch that runs past the end of the permutation takes its
// remainder from the next one (batches are always full). State: the RNG before the current
// permutation was drawn, the pass number and the cursor, so a resume mid-epoch is exact.
class SplitSampler : public BatchSource {
 public:
  SplitSampler(std::shared_ptr<const TaskSplit> split, uint64_t seed);
  TrainBatch Next(int64_t batch) override;
  std::string State() const override;
  absl::Status Restore(const std::string& state) override;
  int64_t pass() const { return pass_; }
  int64_t cursor() const { return cursor_; }

 private:
  void Shuffle();  // a new permutation from rng_ (saved first in before_)
  std::shared_ptr<const TaskSplit> split_;
  std::vector<int64_t> order_;
  std::mt19937_64 before_;
  int64_t pass_ = 0, cursor_ = 0;
};

// Packed conversations (data/chat.h) for SFT: rows of seq_len + 1 tokens holding whole
// examples; inputs and targets are shifted by one, targets are -1 wherever the next token is
// not scored (prompts, role markers, padding), positions restart at each example and segment
// ids keep packed examples from attending to each other. Rows are drawn uniformly.
class ChatSampler : public BatchSource {
 public:
  ChatSampler(std::shared_ptr<const std::vector<data::PackedRow>> rows, uint64_t seed)
      : BatchSource(seed), rows_(std::move(rows)) {}
  TrainBatch Next(int64_t batch) override;

 private:
  std::shared_ptr<const std::vector<data::PackedRow>> rows_;
};

// Loss and scores of one batch: mean cross-entropy (decoder, multi-class encoder) or binary
// cross-entropy with logits (encoder, one output) over scored positions; accuracy over scored
// positions; exact match = every scored position of an example right.
struct BatchScore {
  torch::Tensor loss;
  int64_t scored = 0, correct = 0, examples = 0, exact = 0;
};
BatchScore ScoreBatch(const torch::Tensor& logits, const TrainBatch& batch, bool with_accuracy);

struct TrainerOptions {
  std::string resume;     // checkpoint root or step directory to continue from ("" = fresh)
  std::string init_from;  // checkpoint root or step directory to take weights from
  // Checkpoint root: continue from its newest checkpoint that verifies, skipping damaged ones;
  // none: start fresh (from init_from when given). What the control plane's agents pass.
  std::string resume_if_any;
  bool apply_retention = true;  // false: the control plane decides what to delete
  int64_t stop_after = 0;  // stop (with a checkpoint) once this step is reached; 0 = run to the end
  std::ostream* log = nullptr;  // progress lines; null = silent
  bool progress_bar = false;    // redraw one line (a terminal) instead of printing lines
};

struct StepRecord {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0, tokens_per_second = 0, mfu = 0;
  double loss_scale = 0;  // the dynamic loss scale this step ran at; 0 without loss scaling
  bool skipped = false;
  bool overflowed = false;  // skipped because the scaled gradients overflowed (loss scaling)
};

struct TrainSummary {
  std::vector<StepRecord> steps;  // this run's steps
  double first_eval_loss = 0, last_eval_loss = 0;
  double last_eval_accuracy = 0, last_eval_exact_match = 0;  // over scored positions / examples
  int64_t final_step = 0;
  std::string last_checkpoint;
  int64_t nan_skipped = 0;
  int64_t loss_scale_overflows = 0;  // steps skipped by the loss scaler (not counted above)
  // eval.lengths: the held-out evaluation at each extra sequence length, at the end of the run.
  struct LengthEval {
    int64_t length = 0;
    double loss = 0, accuracy = 0, exact_match = 0;
  };
  std::vector<LengthEval> length_evals;
  // Reasoning evaluation (eval jobs; sft jobs after training): -1 when none ran.
  double reasoning_pass_at_1 = -1, reasoning_maj_at_k = -1, reasoning_answered = -1;
  std::string reasoning_details;  // JSON file with every sample ("" when not written)
  // data.splits: epochs run, whether early stopping ended the run, the best validation epoch and
  // the test metrics there (test_* are -1 when no test evaluation ran).
  int64_t epochs = 0, best_epoch = 0;
  bool early_stopped = false;
  double best_validation_loss = -1, test_loss = -1, test_accuracy = -1, test_exact_match = -1;
};

// Asks every Trainer in this process to stop: after the current step all ranks agree on it, write
// a checkpoint and Run() returns a Cancelled status (loom-train exits with kExitStopped).
// Async-signal-safe: loom-train calls it from its SIGTERM handler.
void RequestStop(bool stop = true);

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const v1::JobSpec& resolved,
                                                         const PluginLoader& loader,
                                                         TrainerOptions options);
  ~Trainer();
  // Whether any rank was asked to stop (a collective when world_size > 1).
  absl::StatusOr<bool> StopRequested();

  absl::StatusOr<TrainSummary> Run();

  Transformer& model() { return *model_; }
  const metrics::Registry& registry() const { return registry_; }
  int metrics_port() const { return exporter_ ? exporter_->port() : 0; }
  int64_t step() const { return step_; }
  int rank() const { return comm_->rank(); }

 private:
  Trainer(v1::JobSpec spec, TrainerOptions options)
      : spec_(std::move(spec)), options_(std::move(options)) {}
  absl::Status Setup(const PluginLoader& loader);
  absl::Status SetupData();
  absl::Status SetupChatData();  // sft: packed conversations of the SFT objective plugin
  absl::Status Restore(const std::string& where, bool weights_only);
  absl::Status RestoreNewestIntact(const std::string& root);
  absl::Status ApplyCheckpoint(const storage::LoadedCheckpoint& loaded, bool weights_only,
                               std::chrono::steady_clock::time_point start);
  absl::StatusOr<std::string> SaveCheckpoint();
  absl::Status BroadcastOwnedParameters();
  void UpdateLossScale(bool finite, StepRecord* r, TrainSummary* summary);
  // Every rank on a GPU: its CUDA allocator's numbers as loom_train_gpu_memory_* (label gpu: the
  // device index this process sees) and to LOOM_GPU_STATS_FILE for the worker agent.
  void ReportGpuMemory();
  struct EvalResult {
    double loss = 0, accuracy = 0, exact_match = 0;
  };
  EvalResult Evaluate();
  // The fixed held-out batches of `source`; the JSONL eval event names `length` when > 0.
  EvalResult EvaluateBatches(BatchSource& source, int64_t length);
  // The whole validation or test split in order; JSONL eval event with "split" and "epoch".
  EvalResult EvaluateSplit(const TaskSplit& split, const std::string& name, int64_t epoch);
  void RecordEval(const EvalResult& r, const std::string& split, int64_t epoch, int64_t length = 0);
  absl::Status ReasoningEvaluate(TrainSummary* summary);  // rank 0: reasoning_eval, logged
  ModelInputs Inputs(const TrainBatch& batch) const;
  // The model's logits for a batch, under autocast when precision is bf16 or fp16.
  torch::Tensor Forward(const TrainBatch& batch);
  TrainBatch NextLocalBatch();  // this rank's rows of the global micro-batch
  void LogLine(const std::string& line);
  void WriteJsonl(const std::string& json);

  v1::JobSpec spec_;
  TrainerOptions options_;
  torch::Device device_{torch::kCPU};
  torch::ScalarType dtype_ = torch::kFloat32;
  std::shared_ptr<Transformer> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<LossScaler> loss_scaler_;  // loss_scale.mode dynamic; null otherwise
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<GradientReducer> reducer_;  // several ranks: all-reduce overlapped with backward
  bool zero_ = false;                         // ZeRO-1 active (zero_stage 1 and several ranks)
  std::map<std::string, int> owner_;          // ZeRO-1: parameter name -> rank that updates it
  SftObjectivePtr objective_;                 // sft and eval jobs: the chat objective plugin
  std::unique_ptr<data::Tokenizer>
      tokenizer_;  // text sources and the chat objective (JobTokenizer)
  std::unique_ptr<BatchSource> train_data_;
  std::function<std::unique_ptr<BatchSource>()> make_eval_data_;  // a fresh, fixed-seed source
  // eval.lengths: each length with its held-out source (the task built at that length).
  std::vector<std::pair<int64_t, std::function<std::unique_ptr<BatchSource>()>>> length_eval_data_;
  // data.splits: the fixed validation and test splits (null without splits) and the
  // early-stopping state at the last epoch end, saved in checkpoints ("split.early_stop").
  std::shared_ptr<const TaskSplit> validation_split_, test_split_;
  struct EarlyStop {
    double best_loss = std::numeric_limits<double>::infinity();
    int64_t best_epoch = 0, best_step = 0, bad_epochs = 0;
    EvalResult test;  // at the best validation epoch
    bool has_test = false;
  };
  EarlyStop early_;
  std::string EarlyStopState() const;
  absl::Status RestoreEarlyStop(const std::string& state);
  int64_t step_ = 0, tokens_seen_ = 0, consecutive_nan_ = 0;
  std::string parent_;
  std::string model_hash_, spec_hash_;
  double forward_flops_per_token_ = 0;
  std::vector<int64_t> inject_nan_at_;  // test hook: LOOM_TEST_INJECT_NAN_AT_STEPS
  int64_t checkpoint_pause_step_ = -1,
          checkpoint_pause_ms_ = 0;  // test hook: LOOM_TEST_CHECKPOINT_PAUSE
  std::ofstream jsonl_;
  struct CheckpointNote {
    int64_t step = 0;
    std::string dir, reason;
  };
  std::vector<CheckpointNote> skipped_;  // --resume-if-any: damaged checkpoints passed over
  CheckpointNote resumed_;               // and the one restored ("" dir: none)
  metrics::Registry registry_{"trainer"};
  metrics::Labels labels_;
  std::unique_ptr<metrics::HttpExporter> exporter_;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_TRAINER_H_
