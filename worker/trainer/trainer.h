// The trainer: runs a resolved JobSpec on one rank. `Trainer::Run` is the training loop; the
// work around it lives in components: batch_source.h (samplers, data setup), checkpointer.h
// (save, restore, exact resume), evaluator.h (held-out scores, early stopping) and
// step_reporter.h (metrics, the event log, the console).
#ifndef LOOM_WORKER_TRAINER_TRAINER_H_
#define LOOM_WORKER_TRAINER_TRAINER_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/tokenizer.h"
#include "loom/sft_plugin.h"
#include "loom/v1/job.pb.h"
#include "metrics/prometheus.h"
#include "worker/trainer/adamw.h"
#include "worker/trainer/batch_source.h"
#include "worker/trainer/checkpointer.h"
#include "worker/trainer/distributed.h"
#include "worker/trainer/evaluator.h"
#include "worker/trainer/loss_scaler.h"
#include "worker/trainer/model.h"
#include "worker/trainer/reasoning_eval.h"
#include "worker/trainer/step_reporter.h"

namespace loom::trainer {

// Learning rate at 0-based `step`: linear warm-up to lr over warmup_steps, then cosine to min_lr
// at the last step.
double LearningRateAt(const v1::OptimizerConfig& o, int64_t total_steps, int64_t step);

// Fault injection for tests (worker/trainer/test_hooks.h reads them from LOOM_TEST_* variables in
// builds with LOOM_TEST_HOOKS; release builds compile that out).
struct TrainerTestHooks {
  std::vector<int64_t> nan_at_steps;   // steps whose loss is replaced by NaN
  int64_t checkpoint_pause_step = -1;  // sleep this long between writing that step's shards
  int64_t checkpoint_pause_ms = 0;     // and committing them: a window to kill the rank in
};

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
  TrainerTestHooks test;
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

// One rank of a job: sets up the model, its data and the components below, then runs the loop.
// The batch source (batch_source.h) draws micro-batches, the checkpointer (checkpointer.h) saves
// and restores, the evaluator (evaluator.h) scores held-out data, and the step reporter
// (step_reporter.h) sends every record to metrics, the event log and the console.
class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const v1::JobSpec& resolved,
                                                         const PluginLoader& loader,
                                                         TrainerOptions options);
  ~Trainer();
  absl::StatusOr<TrainSummary> Run();

  Transformer& model() { return *model_; }
  const metrics::Registry& registry() const { return reporter_->registry(); }
  int metrics_port() const { return reporter_->port(); }
  int64_t step() const { return progress_.step; }
  int rank() const { return comm_->rank(); }

 private:
  Trainer(v1::JobSpec spec, TrainerOptions options)
      : spec_(std::move(spec)), options_(std::move(options)) {}
  // Setup, in order.
  absl::Status Setup(const PluginLoader& loader);
  absl::Status SetupCommunicator();
  absl::Status SetupDevice();
  absl::Status SetupModel(const PluginLoader& loader);      // model, ZeRO ownership, optimizer
  absl::Status SetupObjective(const PluginLoader& loader);  // tokenizer, SFT objective
  absl::Status SetupCheckpointer();

  // The loop.
  bool Finished() const;
  absl::StatusOr<StepRecord> TrainStep(TrainSummary* summary);
  absl::StatusOr<double> ForwardBackward();  // the step's mean loss over ranks
  absl::Status ApplyUpdate(StepRecord* r, TrainSummary* summary);
  void UpdateLossScale(bool finite, StepRecord* r, TrainSummary* summary);
  absl::Status BroadcastOwnedParameters();
  // What every rank does after a step, agreed in one collective: stop (SIGTERM reached any
  // rank) and checkpoint by time (rank 0's clock).
  struct StepSignals {
    bool stop = false, checkpoint = false;
  };
  absl::StatusOr<StepSignals> AgreeAfterStep();
  // Evaluation, epoch end, checkpoint (by step, or `checkpoint_now` by time).
  absl::Status AfterStep(TrainSummary* summary, bool checkpoint_now);
  absl::Status StopOnRequest();
  absl::Status FinishRun(TrainSummary* summary);
  absl::StatusOr<TrainSummary> RunEvalJob();
  void LogRunStart() const;

  // Evaluation.
  bool splits() const { return data_.validation != nullptr; }
  int64_t EpochOf(int64_t step) const;
  EvalResult Validate(TrainSummary* summary);  // held-out batches, or the validation split
  EvalResult EvaluateSplit(const TaskSplit& split, const std::string& name, int64_t epoch);
  void EndEpoch(TrainSummary* summary);
  void EvaluateLengths(TrainSummary* summary);
  void SummarizeSplits(TrainSummary* summary) const;
  absl::Status ReasoningEvaluate(TrainSummary* summary);  // rank 0: reasoning_eval, logged

  ModelInputs Inputs(const TrainBatch& batch) const;
  // The model's logits for a batch, under autocast when precision is bf16 or fp16.
  torch::Tensor Forward(const TrainBatch& batch);
  TrainBatch NextLocalBatch();  // this rank's rows of the global micro-batch
  // Every rank on a GPU: its CUDA allocator's numbers as loom_train_gpu_memory_* (label gpu: the
  // device index this process sees) and to LOOM_GPU_STATS_FILE for the worker agent.
  void ReportGpuMemory();
  void LogLine(const std::string& line) const { reporter_->Log(line); }

  v1::JobSpec spec_;
  TrainerOptions options_;
  torch::Device device_{torch::kCPU};
  torch::ScalarType dtype_ = torch::kFloat32;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<StepReporter> reporter_;
  std::shared_ptr<Transformer> model_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<LossScaler> loss_scaler_;   // loss_scale.mode dynamic; null otherwise
  std::unique_ptr<GradientReducer> reducer_;  // several ranks: all-reduce overlapped with backward
  bool zero_ = false;                         // ZeRO-1 active (zero_stage 1 and several ranks)
  std::map<std::string, int> owner_;          // ZeRO-1: parameter name -> rank that updates it
  SftObjectivePtr objective_;                 // sft and eval jobs: the chat objective plugin
  std::unique_ptr<data::Tokenizer> tokenizer_;  // text sources and the chat objective
  TrainingData data_;
  std::unique_ptr<Evaluator> evaluator_;
  std::unique_ptr<Checkpointer> checkpointer_;
  EarlyStopping early_;  // data.splits
  TrainProgress progress_;
  double forward_flops_per_token_ = 0;
  int64_t examples_per_step_ = 0, tokens_per_step_ = 0, steps_per_epoch_ = 0;
  int64_t first_step_ = 0, last_eval_step_ = -1;
  bool stop_early_ = false;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_TRAINER_H_
