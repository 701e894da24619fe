// The trainer's evaluator: scores batches (loss, accuracy, exact match), runs the held-out
// evaluations (fixed batches of a fresh-seeded source, or a whole fixed split in order), and keeps
// data.splits' early-stopping state (App. D: validate every epoch, test at each new best).
#ifndef LOOM_WORKER_TRAINER_EVALUATOR_H_
#define LOOM_WORKER_TRAINER_EVALUATOR_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "worker/trainer/batch_source.h"
#include "worker/trainer/model.h"

namespace loom::trainer {

// Loss and scores of one batch: mean cross-entropy (decoder, multi-class encoder) or binary
// cross-entropy with logits (encoder, one output) over scored positions; accuracy over scored
// positions; exact match = every scored position of an example right.
struct BatchScore {
  torch::Tensor loss;
  int64_t scored = 0, correct = 0, examples = 0, exact = 0;
};
BatchScore ScoreBatch(const torch::Tensor& logits, const TrainBatch& batch, bool with_accuracy);

struct EvalResult {
  double loss = 0, accuracy = 0, exact_match = 0;
};

class Evaluator {
 public:
  // forward: the model's logits for a batch (under the job's autocast).
  using Forward = std::function<torch::Tensor(const TrainBatch&)>;
  Evaluator(Transformer* model, Forward forward, int64_t micro_batch, int64_t batches)
      : model_(model), forward_(std::move(forward)), micro_batch_(micro_batch), batches_(batches) {}

  // eval.batches fixed micro-batches of `source`; the loss is the mean of their losses.
  EvalResult Batches(BatchSource& source);
  // Every example of `split` once, in order; the loss is the mean over all scored positions.
  EvalResult Split(const TaskSplit& split);

 private:
  Transformer* model_;
  Forward forward_;
  int64_t micro_batch_, batches_;
};

// data.splits: the best validation epoch so far and the test metrics there. Saved in checkpoints
// ("split.early_stop") so a resumed run stops where the uninterrupted one would.
struct EarlyStopping {
  double best_loss = std::numeric_limits<double>::infinity();
  int64_t best_epoch = 0, best_step = 0, bad_epochs = 0;
  EvalResult test;  // at the best validation epoch
  bool has_test = false;

  // True when `loss` is a new best (the caller then tests and records it); else counts a bad epoch.
  bool Improves(double loss, int64_t epoch, int64_t step);
  bool Exhausted(int64_t patience) const { return patience > 0 && bad_epochs >= patience; }
  std::string State() const;
  absl::Status Restore(const std::string& state);
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_EVALUATOR_H_
