// The trainer: runs a resolved JobSpec on one rank. Owns the model (plugins from the loader),
// AdamW, the data sampler, evaluation, checkpoints (storage/checkpoint.h), the JSON-lines
// metrics log and the Prometheus registry/exporter.
//
// Exact resume: a checkpoint holds the weights, AdamW moments and step, the data sampler's RNG
// state (the data cursor) and LibTorch's CPU generator; the learning rate is a function of the
// step. Resuming on the same build and thread count reproduces an uninterrupted run bit for bit.
#ifndef LOOM_WORKER_TRAINER_TRAINER_H_
#define LOOM_WORKER_TRAINER_TRAINER_H_

#include <cstdint>
#include <fstream>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "adamw.h"
#include "checkpoint.h"
#include "corpus.h"
#include "http_exporter.h"
#include "loom/v1/job.pb.h"
#include "model.h"
#include "prometheus.h"

namespace loom::trainer {

// Learning rate at 0-based `step`: linear warm-up to lr over warmup_steps, then cosine to min_lr
// at the last step.
double LearningRateAt(const v1::OptimizerConfig& o, int64_t total_steps, int64_t step);

// Uniformly random training windows over a token stream; its whole state is one RNG, saved in
// checkpoints as the data cursor.
class WindowSampler {
 public:
  WindowSampler(std::shared_ptr<const TokenStream> tokens, uint64_t seed)
      : tokens_(std::move(tokens)), rng_(seed) {}
  // {inputs, targets}, int64 [batch, seq_len] each.
  std::pair<torch::Tensor, torch::Tensor> Next(int64_t batch, int64_t seq_len);
  std::string State() const;
  absl::Status Restore(const std::string& state);

 private:
  std::shared_ptr<const TokenStream> tokens_;
  std::mt19937_64 rng_;
};

struct TrainerOptions {
  std::string resume;      // checkpoint root or step directory to continue from ("" = fresh)
  std::string init_from;   // checkpoint root or step directory to take weights from
  int64_t stop_after = 0;  // stop (with a checkpoint) once this step is reached; 0 = run to the end
  std::ostream* log = nullptr;  // progress lines; null = silent
  bool progress_bar = false;    // redraw one line (a terminal) instead of printing lines
};

struct StepRecord {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0, tokens_per_second = 0, mfu = 0;
  bool skipped = false;
};

struct TrainSummary {
  std::vector<StepRecord> steps;  // this run's steps
  double first_eval_loss = 0, last_eval_loss = 0;
  int64_t final_step = 0;
  std::string last_checkpoint;
  int64_t nan_skipped = 0;
};

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const v1::JobSpec& resolved,
                                                         const PluginLoader& loader,
                                                         TrainerOptions options);
  ~Trainer();

  absl::StatusOr<TrainSummary> Run();

  Transformer& model() { return *model_; }
  const metrics::Registry& registry() const { return registry_; }
  int metrics_port() const { return exporter_ ? exporter_->port() : 0; }
  int64_t step() const { return step_; }

 private:
  Trainer(v1::JobSpec spec, TrainerOptions options)
      : spec_(std::move(spec)), options_(std::move(options)) {}
  absl::Status Setup(const PluginLoader& loader);
  absl::Status SetupData();
  absl::Status Restore(const std::string& where, bool weights_only);
  absl::StatusOr<std::string> SaveCheckpoint();
  double Evaluate();
  void LogLine(const std::string& line);
  void WriteJsonl(const std::string& json);

  v1::JobSpec spec_;
  TrainerOptions options_;
  torch::Device device_{torch::kCPU};
  torch::ScalarType dtype_ = torch::kFloat32;
  std::shared_ptr<Transformer> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<WindowSampler> train_data_;
  std::shared_ptr<const TokenStream> eval_tokens_;
  int64_t step_ = 0, tokens_seen_ = 0, consecutive_nan_ = 0;
  std::string parent_;
  std::string model_hash_, spec_hash_;
  double forward_flops_per_token_ = 0;
  std::vector<int64_t> inject_nan_at_;  // test hook: LOOM_TEST_INJECT_NAN_AT_STEPS
  int64_t checkpoint_pause_step_ = -1,
          checkpoint_pause_ms_ = 0;  // test hook: LOOM_TEST_CHECKPOINT_PAUSE
  std::ofstream jsonl_;
  metrics::Registry registry_;
  metrics::Labels labels_;
  std::unique_ptr<metrics::HttpExporter> exporter_;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_TRAINER_H_
