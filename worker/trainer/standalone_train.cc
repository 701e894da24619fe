#include "standalone_train.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "corpus.h"

namespace loom::trainer {
namespace {

double EvalLoss(Transformer& model, const std::vector<int64_t>& tokens, const TrainOptions& o) {
  torch::NoGradGuard no_grad;
  model.eval();
  std::mt19937_64 rng(o.data_seed ^ 0x9e3779b97f4a7c15ULL);  // same windows every call
  double total = 0;
  for (int64_t i = 0; i < o.eval_batches; ++i) {
    auto [inputs, targets] = SampleWindows(tokens, o.batch, o.seq_len, rng);
    torch::Tensor logits = model.forward({inputs});
    total += torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                  targets.reshape({-1}))
                 .item<double>();
  }
  model.train();
  return total / static_cast<double>(o.eval_batches);
}

}  // namespace

double LearningRateAt(const TrainOptions& o, int64_t step) {
  if (step < o.warmup_steps) return o.lr * static_cast<double>(step + 1) / o.warmup_steps;
  const double span = std::max<int64_t>(1, o.steps - o.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup_steps) / span);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * progress));
}

absl::StatusOr<TrainResult> TrainLanguageModel(Transformer& model,
                                               const std::vector<int64_t>& train_tokens,
                                               const std::vector<int64_t>& eval_tokens,
                                               const TrainOptions& o, std::ostream* log) {
  if (model.config().mode() != "decoder") {
    return absl::InvalidArgumentError("model.mode: language-model training needs a decoder");
  }
  if (o.steps <= 0) return absl::InvalidArgumentError("steps: must be >= 1");
  if (o.batch <= 0) return absl::InvalidArgumentError("batch: must be >= 1");
  if (o.seq_len <= 0 || o.seq_len > model.config().max_seq_len()) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len: must be in [1, max_seq_len = ", model.config().max_seq_len(), "]"));
  }
  if (!(o.lr > 0) || !(o.min_lr >= 0) || o.min_lr > o.lr) {
    return absl::InvalidArgumentError("lr: need lr > 0 and 0 <= min_lr <= lr");
  }
  if (o.warmup_steps < 0) return absl::InvalidArgumentError("warmup_steps: must be >= 0");
  for (const auto* t : {&train_tokens, &eval_tokens}) {
    if (static_cast<int64_t>(t->size()) < o.seq_len + 1) {
      return absl::InvalidArgumentError("data: corpus shorter than one training window");
    }
  }
  for (int64_t tok : train_tokens) {
    if (tok < 0 || tok >= model.config().vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("data: token ", tok, " outside vocabulary"));
    }
  }

  // Weight decay on matrices only: decaying norm gains and biases pulls them to zero for no
  // regularisation benefit (as in GPT-2/3 and most open recipes).
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : model.named_parameters()) {
    (p.value().dim() >= 2 ? decay : no_decay).push_back(p.value());
  }
  auto make_options = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).weight_decay(wd).eps(1e-8));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, make_options(o.weight_decay));
  groups.emplace_back(no_decay, make_options(0.0));
  torch::optim::AdamW optimizer(groups, torch::optim::AdamWOptions(o.lr));

  TrainResult result;
  result.eval_loss_before = EvalLoss(model, eval_tokens, o);
  if (log) {
    *log << "model: " << model.NumParameters() << " parameters, "
         << absl::StrFormat("%.3g", model.ForwardFlopsPerToken(o.seq_len))
         << " forward FLOPs/token at context " << o.seq_len << "\n";
    *log << absl::StrFormat("eval loss before training: %.4f\n", result.eval_loss_before);
  }
  std::mt19937_64 rng(o.data_seed);
  model.train();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < o.steps; ++step) {
    const double lr = LearningRateAt(o, step);
    for (auto& group : optimizer.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    }
    auto [inputs, targets] = SampleWindows(train_tokens, o.batch, o.seq_len, rng);
    optimizer.zero_grad();
    torch::Tensor logits = model.forward({inputs});
    torch::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                              targets.reshape({-1}));
    loss.backward();
    double grad_norm = 0;
    if (o.clip_norm > 0) {
      grad_norm = torch::nn::utils::clip_grad_norm_(model.parameters(), o.clip_norm);
    }
    optimizer.step();
    const double value = loss.item<double>();
    if (!std::isfinite(value)) {
      return absl::InternalError(absl::StrCat("step ", step + 1, ": loss is not finite"));
    }
    result.losses.push_back(value);
    if (log && o.log_every > 0 && ((step + 1) % o.log_every == 0 || step == 0)) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double tps = static_cast<double>((step + 1) * o.batch * o.seq_len) / seconds;
      *log << absl::StrFormat("step %5d/%d  loss %.4f  lr %.2e  grad_norm %.3f  tokens/s %.0f\n",
                              step + 1, o.steps, value, lr, grad_norm, tps);
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.tokens_per_second = static_cast<double>(o.steps * o.batch * o.seq_len) / seconds;
  result.eval_loss_after = EvalLoss(model, eval_tokens, o);
  if (log) {
    *log << absl::StrFormat("eval loss after training: %.4f (before %.4f)\n",
                            result.eval_loss_after, result.eval_loss_before);
  }
  return result;
}

}  // namespace loom::trainer
