#include "worker/trainer/evaluator.h"

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace loom::trainer {
namespace {

// Batch scores summed over an evaluation; the loss is a weighted mean of batch losses.
struct ScoreTotals {
  double weighted_loss = 0, weight = 0;
  int64_t scored = 0, correct = 0, examples = 0, exact = 0;

  void Add(const BatchScore& s, double w) {
    weighted_loss += s.loss.item<double>() * w;
    weight += w;
    scored += s.scored;
    correct += s.correct;
    examples += s.examples;
    exact += s.exact;
  }
  void Into(double* loss, double* accuracy, double* exact_match) const {
    *loss = weight > 0 ? weighted_loss / weight : 0;
    *accuracy = scored > 0 ? static_cast<double>(correct) / static_cast<double>(scored) : 0;
    *exact_match = examples > 0 ? static_cast<double>(exact) / static_cast<double>(examples) : 0;
  }
};

// Switches the model to eval mode without gradients for one evaluation.
class EvalMode {
 public:
  explicit EvalMode(Transformer* model) : model_(model) { model_->eval(); }
  ~EvalMode() { model_->train(); }

 private:
  torch::NoGradGuard no_grad_;
  Transformer* model_;
};

}  // namespace

BatchScore ScoreBatch(const torch::Tensor& model_logits, const TrainBatch& batch,
                      bool with_accuracy) {
  // Under bf16 autocast the head's logits are bf16: the loss is taken in fp32.
  const torch::Tensor logits = model_logits.is_floating_point() && model_logits.element_size() < 4
                                   ? model_logits.to(torch::kFloat32)
                                   : model_logits;
  BatchScore score;
  const torch::Tensor targets = batch.targets.to(logits.device());
  const torch::Tensor mask = targets >= 0;
  if (logits.size(-1) == 1) {  // one binary logit per position
    torch::Tensor z = logits.squeeze(-1);
    torch::Tensor per = torch::binary_cross_entropy_with_logits(
        z, targets.clamp_min(0).to(z.dtype()), {}, {}, at::Reduction::None);
    score.loss = (per * mask.to(per.dtype())).sum() / mask.sum().clamp_min(1).to(per.dtype());
  } else {
    score.loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
  }
  if (with_accuracy) {
    torch::NoGradGuard no_grad;
    torch::Tensor predicted =
        logits.size(-1) == 1 ? (logits.squeeze(-1) > 0).to(torch::kInt64) : logits.argmax(-1);
    torch::Tensor right = (predicted == targets) & mask;
    score.scored = mask.sum().item<int64_t>();
    score.correct = right.sum().item<int64_t>();
    score.examples = targets.size(0);
    // An example is exact when no scored position is wrong.
    score.exact = ((mask & ~right).sum(1) == 0).sum().item<int64_t>();
  }
  return score;
}

EvalResult Evaluator::Batches(BatchSource& source) {
  EvalMode mode(model_);
  ScoreTotals totals;
  for (int64_t i = 0; i < batches_; ++i) {
    TrainBatch batch = source.Next(micro_batch_);
    totals.Add(ScoreBatch(forward_(batch), batch, true), 1.0);
  }
  EvalResult r;
  totals.Into(&r.loss, &r.accuracy, &r.exact_match);
  return r;
}

EvalResult Evaluator::Split(const TaskSplit& split) {
  EvalMode mode(model_);
  ScoreTotals totals;
  const size_t n = split.examples.size(), b = static_cast<size_t>(micro_batch_);
  for (size_t from = 0; from < n; from += b) {
    std::vector<const data::Example*> refs;
    for (size_t i = from; i < std::min(n, from + b); ++i) refs.push_back(&split.examples[i]);
    TrainBatch batch = TaskBatch(refs, split.mask_padding);
    BatchScore s = ScoreBatch(forward_(batch), batch, true);
    totals.Add(s, static_cast<double>(s.scored));
  }
  EvalResult r;
  totals.Into(&r.loss, &r.accuracy, &r.exact_match);
  return r;
}

bool EarlyStopping::Improves(double loss, int64_t epoch, int64_t step) {
  if (!(loss < best_loss)) {
    ++bad_epochs;
    return false;
  }
  best_loss = loss;
  best_epoch = epoch;
  best_step = step;
  bad_epochs = 0;
  return true;
}

std::string EarlyStopping::State() const {
  return absl::StrFormat("%.17g %d %d %d %d %.17g %.17g %.17g", best_loss, best_epoch, best_step,
                         bad_epochs, has_test ? 1 : 0, test.loss, test.accuracy, test.exact_match);
}

absl::Status EarlyStopping::Restore(const std::string& state) {
  std::vector<std::string> parts = absl::StrSplit(state, ' ', absl::SkipEmpty());
  EarlyStopping e;
  int64_t has = 0;
  if (parts.size() != 8 || !absl::SimpleAtod(parts[0], &e.best_loss) ||
      !absl::SimpleAtoi(parts[1], &e.best_epoch) || !absl::SimpleAtoi(parts[2], &e.best_step) ||
      !absl::SimpleAtoi(parts[3], &e.bad_epochs) || !absl::SimpleAtoi(parts[4], &has) ||
      !absl::SimpleAtod(parts[5], &e.test.loss) || !absl::SimpleAtod(parts[6], &e.test.accuracy) ||
      !absl::SimpleAtod(parts[7], &e.test.exact_match)) {
    return absl::DataLossError("split.early_stop: malformed early-stopping state in the manifest");
  }
  e.has_test = has != 0;
  *this = e;
  return absl::OkStatus();
}

}  // namespace loom::trainer
