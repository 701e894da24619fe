// The standalone training loop: a decoder language model on a token stream with AdamW,
// linear warm-up then cosine decay, global-norm clipping, and a fixed held-out evaluation
// before and after. The full trainer (job spec, checkpoints, metrics) grows from this.
#ifndef LOOM_WORKER_TRAINER_STANDALONE_TRAIN_H_
#define LOOM_WORKER_TRAINER_STANDALONE_TRAIN_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model.h"

namespace loom::trainer {

struct TrainOptions {
  int64_t steps = 300;
  int64_t batch = 16;
  int64_t seq_len = 64;
  double lr = 3e-3;
  double min_lr = 3e-4;  // cosine floor
  int64_t warmup_steps = 20;
  double weight_decay = 0.1;  // on matrices (Linear weights, embeddings); never on norms/biases
  double beta1 = 0.9, beta2 = 0.95;
  double clip_norm = 1.0;  // 0 = no clipping
  uint64_t data_seed = 1;
  int64_t eval_batches = 8;  // fixed held-out windows, evaluated before and after training
  int64_t log_every = 25;    // 0 = silent
};

struct TrainResult {
  std::vector<double> losses;  // training loss per step
  double eval_loss_before = 0;
  double eval_loss_after = 0;
  double tokens_per_second = 0;
};

// Learning rate at `step` (0-based): linear warm-up to lr, then cosine to min_lr at the end.
double LearningRateAt(const TrainOptions& options, int64_t step);

// Trains `model` (decoder mode) on `train_tokens`, evaluating on `eval_tokens`. Progress lines go
// to `log` when it is not null.
absl::StatusOr<TrainResult> TrainLanguageModel(Transformer& model,
                                               const std::vector<int64_t>& train_tokens,
                                               const std::vector<int64_t>& eval_tokens,
                                               const TrainOptions& options, std::ostream* log);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_STANDALONE_TRAIN_H_
