// Where a job's micro-batches come from (the trainer's batch source): samplers over token
// streams, built-in tasks, fixed task splits and packed conversations, and BuildTrainingData,
// which makes the train and held-out sources a job's data.* section asks for.
//
// A sampler's whole state is its RNG (plus a cursor for split epochs), saved in checkpoints as the
// data cursor, so a resumed run draws exactly the batches the uninterrupted one would have.
#ifndef LOOM_WORKER_TRAINER_BATCH_SOURCE_H_
#define LOOM_WORKER_TRAINER_BATCH_SOURCE_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "data/chat.h"
#include "data/tasks.h"
#include "data/tokenizer.h"
#include "loom/sft_plugin.h"
#include "loom/v1/job.pb.h"
#include "worker/trainer/corpus.h"

namespace loom::trainer {

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

// This rank's `rows` rows of a global micro-batch drawn identically on every rank.
TrainBatch RowsOfRank(const TrainBatch& global, int rank, int64_t rows);

// What a job trains and evaluates on.
struct TrainingData {
  std::unique_ptr<BatchSource> train;
  std::function<std::unique_ptr<BatchSource>()> make_eval;  // a fresh, fixed-seed source
  // eval.lengths: each length with its held-out source (the task built at that length).
  std::vector<std::pair<int64_t, std::function<std::unique_ptr<BatchSource>()>>> length_evals;
  // data.splits: the fixed validation and test splits (null without splits).
  std::shared_ptr<const TaskSplit> validation, test;
};

using LogFn = std::function<void(const std::string&)>;

// The sources for spec.data (task, corpus, dataset shards or chat). tokenizer: text sources and
// chat; objective: chat. Errors name the spec field that does not fit.
absl::StatusOr<TrainingData> BuildTrainingData(const v1::JobSpec& spec,
                                               const data::Tokenizer* tokenizer,
                                               const SftObjective* objective, const LogFn& log);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_BATCH_SOURCE_H_
