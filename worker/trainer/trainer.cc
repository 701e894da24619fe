#include "worker/trainer/trainer.h"

#include <ATen/record_function.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/blas_core.h"
#include "base/status_macros.h"
#include "worker/trainer/autocast.h"
#include "worker/trainer/devices.h"
#include "worker/trainer/gpu_stats.h"
#include "worker/trainer/job_tokenizer.h"
#include "worker/trainer/plugin_factory.h"

namespace loom::trainer {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::atomic<bool> g_stop_requested{false};

}  // namespace

double LearningRateAt(const v1::OptimizerConfig& o, int64_t total_steps, int64_t step) {
  if (step < o.warmup_steps()) return o.lr() * static_cast<double>(step + 1) / o.warmup_steps();
  const double span = std::max<int64_t>(1, total_steps - o.warmup_steps());
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup_steps()) / span);
  return o.min_lr() + 0.5 * (o.lr() - o.min_lr()) * (1.0 + std::cos(M_PI * progress));
}

void RequestStop(bool stop) { g_stop_requested.store(stop, std::memory_order_relaxed); }

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const v1::JobSpec& resolved,
                                                         const PluginLoader& loader,
                                                         TrainerOptions options) {
  std::unique_ptr<Trainer> t(new Trainer(resolved, std::move(options)));
  try {
    LOOM_RETURN_IF_ERROR(t->Setup(loader));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("trainer setup: ", e.what()));
  }
  return t;
}

Trainer::~Trainer() = default;

// ---- Setup ----

absl::Status Trainer::Setup(const PluginLoader& loader) {
  if (spec_.threads() > 0) torch::set_num_threads(spec_.threads());
  LOOM_RETURN_IF_ERROR(SetupCommunicator());
  LOOM_RETURN_IF_ERROR(SetupDevice());
  LOOM_RETURN_IF_ERROR(SetupModel(loader));
  LOOM_RETURN_IF_ERROR(SetupObjective(loader));
  if (spec_.kind() != "eval") {  // eval jobs only generate
    const LogFn log = [this](const std::string& line) { LogLine(line); };
    LOOM_ASSIGN_OR_RETURN(data_, BuildTrainingData(spec_, tokenizer_.get(), objective_.get(), log));
  }
  forward_flops_per_token_ = model_->ForwardFlopsPerToken(spec_.seq_len());
  // data.splits: an epoch is one pass's worth of steps over the train split (every rank draws
  // from the same global order, so world_size ranks together take micro_batch x world_size).
  examples_per_step_ = spec_.micro_batch() * spec_.grad_accum() * comm_->world_size();
  tokens_per_step_ = examples_per_step_ * spec_.seq_len();
  if (splits()) {
    steps_per_epoch_ =
        (spec_.data().splits().train() + examples_per_step_ - 1) / examples_per_step_;
  }
  evaluator_ = std::make_unique<Evaluator>(
      model_.get(), [this](const TrainBatch& b) { return Forward(b); }, spec_.micro_batch(),
      spec_.eval().batches());
  LOOM_RETURN_IF_ERROR(reporter_->StartExporter());
  return SetupCheckpointer();
}

absl::Status Trainer::SetupCommunicator() {
  LOOM_ASSIGN_OR_RETURN(
      DistributedConfig dist,
      DistributedConfigFromEnv(spec_.dist_backend(),
                               std::chrono::seconds(spec_.dist_timeout_seconds())));
  LOOM_ASSIGN_OR_RETURN(comm_, Communicator::Create(dist));
  if (comm_->rank() != 0) {  // one rank speaks for the job: logs, JSONL, metrics port, checkpoints
    options_.log = nullptr;
    spec_.mutable_metrics()->set_jsonl("");
    spec_.mutable_metrics()->set_port(0);
  }
  StepReporter::Options reporting;
  reporting.console = options_.log;
  reporting.progress_bar = options_.progress_bar;
  reporting.loss_scaling = spec_.loss_scale().mode() == "dynamic";
  reporter_ = std::make_unique<StepReporter>(spec_, comm_->rank(), reporting);
  return absl::OkStatus();
}

absl::Status Trainer::SetupDevice() {
  const bool cuda = torch::cuda::is_available();
  if (spec_.device() == "cuda" && !cuda) {
    return absl::FailedPreconditionError(
        "device: cuda requested, but this LibTorch has no CUDA or no GPU is visible");
  }
  if (spec_.device() == "cuda" || (spec_.device() == "auto" && cuda)) {
    // The model, the data and NCCL all use this rank's GPU (CudaDeviceForRank).
    LOOM_ASSIGN_OR_RETURN(const int gpu,
                          CudaDeviceForRank(std::getenv("LOCAL_RANK"),
                                            static_cast<int>(torch::cuda::device_count())));
    device_ = torch::Device(torch::kCUDA, static_cast<int8_t>(gpu));
  }
  if (spec_.precision() == "fp16" && !device_.is_cuda()) {
    return absl::FailedPreconditionError(
        "precision: fp16 autocast needs a CUDA device (this run is on the CPU); use bf16");
  }
  dtype_ = spec_.precision() == "fp64" ? torch::kFloat64 : torch::kFloat32;
  if (spec_.precision() == "bf16" && device_.is_cpu() && !DetectCpuVectorFeatures().avx512) {
    // LibTorch's CPU bf16 GEMMs need AVX-512 (oneDNN); without it they fall back to scalar
    // loops (measured 16x slower than fp32 on an AVX2 EPYC).
    LogLine(
        "precision: bf16 on a CPU without AVX-512: LibTorch's bf16 matmuls fall back to a "
        "slow path here (about 10-16x fp32's time); fp32 is faster on this machine");
  }
  return absl::OkStatus();
}

absl::Status Trainer::SetupModel(const PluginLoader& loader) {
  LOOM_ASSIGN_OR_RETURN(model_, Transformer::Create(spec_.model(), loader));
  model_->to(device_, dtype_);
  params_ = model_->parameters();
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& p : model_->named_parameters()) params.emplace_back(p.key(), p.value());
  zero_ = spec_.zero_stage() == 1 && comm_->world_size() > 1;
  if (comm_->world_size() > 1) {
    reducer_ = std::make_unique<GradientReducer>(comm_.get(), params_, spec_.dist_bucket_bytes());
  }
  std::function<bool(const std::string&)> owns;
  if (zero_) {
    // Greedy balance by size, in parameter order: deterministic, so every rank agrees.
    std::vector<int64_t> load(static_cast<size_t>(comm_->world_size()), 0);
    for (const auto& [name, p] : params) {
      const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      owner_[name] = r;
      load[r] += p.numel();
    }
    owns = [this](const std::string& name) { return owner_.at(name) == comm_->rank(); };
  }
  const auto& o = spec_.optimizer();
  optimizer_ = std::make_unique<AdamW>(
      params, AdamWConfig{o.beta1(), o.beta2(), o.eps(), o.weight_decay()}, owns);
  if (spec_.loss_scale().mode() == "dynamic") {
    LossScaler::Options scaling;
    scaling.initial = spec_.loss_scale().initial();
    scaling.growth_interval = spec_.loss_scale().growth_interval();
    loss_scaler_ = std::make_unique<LossScaler>(scaling);
  }
  return absl::OkStatus();
}

absl::Status Trainer::SetupObjective(const PluginLoader& loader) {
  if (spec_.kind() != "pretrain" || spec_.data().source() == "corpus") {
    LOOM_ASSIGN_OR_RETURN(tokenizer_, JobTokenizer(spec_));
  }
  if (spec_.kind() == "pretrain") return absl::OkStatus();
  // The chat objective: data.format for sft training and its eval, reasoning_eval.format for
  // eval jobs; the tokenizer's own chat tokens when it has them.
  const bool sft = spec_.kind() == "sft";
  const std::string& format = sft ? spec_.data().format() : spec_.reasoning_eval().format();
  LOOM_ASSIGN_OR_RETURN(objective_, CreateSftObjective(loader, format,
                                                       sft ? spec_.data().format_options()
                                                           : google::protobuf::Struct(),
                                                       ChatTokensOf(*tokenizer_)));
  if (spec_.model().vocab_size() < objective_->VocabSize()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.vocab_size: ", spec_.model().vocab_size(), " is smaller than the ",
                     format, " objective's vocabulary of ", objective_->VocabSize()));
  }
  return absl::OkStatus();
}

absl::Status Trainer::SetupCheckpointer() {
  CheckpointedState state;
  state.model = model_.get();
  state.optimizer = optimizer_.get();
  state.data = data_.train.get();
  state.early_stop = splits() ? &early_ : nullptr;
  state.loss_scaler = loss_scaler_.get();
  state.progress = &progress_;
  Checkpointer::Options o;
  o.apply_retention = options_.apply_retention;
  o.zero = zero_;
  o.device = device_;
  const TrainerTestHooks& test = options_.test;
  if (test.checkpoint_pause_ms > 0) {
    o.before_commit = [this, test](int64_t step) {
      if (step != test.checkpoint_pause_step) return;
      LogLine(absl::StrCat("checkpoint: step ", step, " shards written, pausing before commit"));
      std::this_thread::sleep_for(std::chrono::milliseconds(test.checkpoint_pause_ms));
    };
  }
  checkpointer_ =
      std::make_unique<Checkpointer>(spec_, state, comm_.get(), reporter_.get(), std::move(o));
  const StartFrom from{options_.resume, options_.init_from, options_.resume_if_any};
  LOOM_RETURN_IF_ERROR(checkpointer_->Start(from));
  // Opened after the restore: a run that cannot start leaves the event log alone.
  LOOM_RETURN_IF_ERROR(reporter_->OpenEventLog(!options_.resume.empty()));
  checkpointer_->ReportStart(from);  // what --resume-if-any found, for the control plane
  return absl::OkStatus();
}

// ---- The loop ----

absl::StatusOr<TrainSummary> Trainer::Run() {
  if (spec_.kind() == "eval") return RunEvalJob();
  TrainSummary summary;
  LogRunStart();
  // Resumed from the checkpoint an early stop wrote: nothing left to train.
  stop_early_ = splits() && early_.Exhausted(spec_.eval().patience());
  if (progress_.step == 0) summary.first_eval_loss = Validate(&summary).loss;
  first_step_ = progress_.step;
  reporter_->StartRun(first_step_, spec_.steps());
  try {
    while (!Finished()) {
      LOOM_ASSIGN_OR_RETURN(const StepRecord r, TrainStep(&summary));
      summary.steps.push_back(r);
      if (r.step % spec_.metrics().log_every() == 0 || r.step == spec_.steps()) ReportGpuMemory();
      reporter_->Step(r, progress_.tokens_seen, tokens_per_step_);
      if (progress_.consecutive_nan >= spec_.max_nan_skips()) {
        return absl::DataLossError(
            absl::StrCat("step ", progress_.step, ": ", progress_.consecutive_nan,
                         " consecutive non-finite steps (max_nan_skips = ", spec_.max_nan_skips(),
                         "); stopping"));
      }
      LOOM_ASSIGN_OR_RETURN(const StepSignals signals, AgreeAfterStep());
      LOOM_RETURN_IF_ERROR(AfterStep(&summary, signals.checkpoint));
      if (stop_early_) break;
      if (signals.stop) return StopOnRequest();
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("step ", progress_.step + 1, ": ", e.what()));
  }
  reporter_->EndRun();
  LOOM_RETURN_IF_ERROR(FinishRun(&summary));
  return summary;
}

bool Trainer::Finished() const {
  const int64_t step = progress_.step;
  return step >= spec_.steps() || stop_early_ ||
         (options_.stop_after > 0 && step >= options_.stop_after);
}

void Trainer::LogRunStart() const {
  LogLine(absl::StrFormat(
      "loom-train: %d layers, d_model %d, %d heads, %d parameters; %d steps x %d tokens "
      "on %s, %s, %d threads, %d rank(s); %.3g forward FLOPs/token",
      spec_.model().n_layers(), spec_.model().d_model(), spec_.model().n_heads(),
      model_->NumParameters(), spec_.steps(), tokens_per_step_, device_.str(), spec_.precision(),
      torch::get_num_threads(), comm_->world_size(), forward_flops_per_token_));
  if (!splits()) return;
  LogLine(absl::StrFormat(
      "splits: %d train examples, %d per step: %d steps per epoch, at most %d epochs; patience %d",
      spec_.data().splits().train(), examples_per_step_, steps_per_epoch_, EpochOf(spec_.steps()),
      spec_.eval().patience()));
}

namespace {
// This process's user and system CPU seconds so far.
std::pair<double, double> ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * t.tv_usec; };
  return {s(u.ru_utime), s(u.ru_stime)};
}
}  // namespace

// One optimizer step: forward and backward over grad_accum micro-batches, gradients reduced
// across ranks, clipped, and the update applied (or skipped when non-finite).
absl::StatusOr<StepRecord> Trainer::TrainStep(TrainSummary* summary) {
  const auto start = Clock::now();
  const auto [user0, sys0] = ProcessCpuSeconds();
  StepRecord r;
  r.step = progress_.step + 1;
  r.lr = LearningRateAt(spec_.optimizer(), spec_.steps(), progress_.step);
  LOOM_ASSIGN_OR_RETURN(r.loss, ForwardBackward());
  const auto& nan_at = options_.test.nan_at_steps;
  if (std::find(nan_at.begin(), nan_at.end(), r.step) != nan_at.end()) r.loss = std::nan("");
  LOOM_RETURN_IF_ERROR(ApplyUpdate(&r, summary));
  ++progress_.step;
  progress_.tokens_seen += tokens_per_step_;
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const auto [user1, sys1] = ProcessCpuSeconds();
  r.cpu_user_s = user1 - user0;
  r.cpu_sys_s = sys1 - sys0;
  r.tokens_per_second = static_cast<double>(tokens_per_step_) / r.seconds;
  const double flops_per_step =
      3.0 * forward_flops_per_token_ * static_cast<double>(tokens_per_step_);
  const double peak = spec_.metrics().peak_flops();
  r.mfu = peak > 0 ? flops_per_step / r.seconds / peak : 0;
  // Cumulative (tokens_seen resumes from the checkpoint), so runs of different widths and
  // attention plugins line up by compute spent.
  r.train_flops = 3.0 * forward_flops_per_token_ * static_cast<double>(progress_.tokens_seen);
  return r;
}

absl::StatusOr<double> Trainer::ForwardBackward() {
  for (auto& p : params_) p.mutable_grad() = torch::Tensor();
  const int64_t accum = spec_.grad_accum();
  double loss_sum = 0;
  for (int64_t micro = 0; micro < accum; ++micro) {
    // Only the last micro-batch's backward communicates (no redundant all-reduces).
    if (reducer_ && micro == accum - 1) reducer_->Arm();
    TrainBatch batch = [&] {
      RECORD_USER_SCOPE("loom::next_batch");  // named in profiles (op_profile.h)
      return NextLocalBatch();
    }();
    torch::Tensor loss = ScoreBatch(Forward(batch), batch, false).loss;
    torch::Tensor scaled = loss_scaler_ ? loss_scaler_->Scale(loss) : loss;
    (scaled / static_cast<double>(accum)).backward();
    loss_sum += loss.item<double>();
  }
  const double loss = loss_sum / static_cast<double>(accum);
  if (comm_->world_size() == 1) return loss;
  // The buckets started during the last backward; wait for them: gradients become the mean.
  LOOM_RETURN_IF_ERROR(reducer_->Finish());
  if (progress_.step == first_step_) {
    LogLine(absl::StrFormat(
        "gradient all-reduce: %d bucket(s) of <= %d bytes, %d started during backward",
        reducer_->buckets(), spec_.dist_bucket_bytes(), reducer_->started_during_backward()));
  }
  return comm_->AllReduceMean(loss);
}

absl::Status Trainer::ApplyUpdate(StepRecord* r, TrainSummary* summary) {
  RECORD_USER_SCOPE("loom::clip_and_update");
  const double clip = spec_.optimizer().clip_norm() > 0 ? spec_.optimizer().clip_norm()
                                                        : std::numeric_limits<double>::infinity();
  if (loss_scaler_) {
    r->loss_scale = loss_scaler_->scale();
    loss_scaler_->Unscale(params_);  // the reduced gradients are identical on every rank
  }
  r->grad_norm = torch::nn::utils::clip_grad_norm_(params_, clip);
  const bool finite = std::isfinite(r->loss) && std::isfinite(r->grad_norm);
  if (loss_scaler_) UpdateLossScale(finite, r, summary);
  if (finite) {
    optimizer_->Step(r->lr);
    if (zero_) LOOM_RETURN_IF_ERROR(BroadcastOwnedParameters());
    progress_.consecutive_nan = 0;
    return absl::OkStatus();
  }
  r->skipped = true;
  if (r->overflowed) return absl::OkStatus();  // scaled gradients overflowed: not a divergence
  ++progress_.consecutive_nan;
  ++summary->nan_skipped;
  reporter_->registry().Increment("loom_train_nan_skipped_steps_total", 1, reporter_->labels());
  LogLine(absl::StrFormat(
      "step %d: non-finite loss %g or gradient norm %g; update skipped (%d in a row)", r->step,
      r->loss, r->grad_norm, progress_.consecutive_nan));
  return absl::OkStatus();
}

// After the gradient norm: a finite loss with non-finite gradients is an overflow of the scaled
// backward pass; the step is skipped (not counted as a divergence) and the scale backed off.
void Trainer::UpdateLossScale(bool finite, StepRecord* r, TrainSummary* summary) {
  r->overflowed = !finite && std::isfinite(r->loss);
  const double before = loss_scaler_->scale();
  const bool changed = loss_scaler_->Update(finite);
  metrics::Registry& registry = reporter_->registry();
  registry.Set("loom_train_loss_scale", loss_scaler_->scale(), reporter_->labels());
  if (r->overflowed) {
    ++summary->loss_scale_overflows;
    registry.Increment("loom_train_loss_scale_overflows_total", 1, reporter_->labels());
    LogLine(absl::StrFormat(
        "step %d: gradients overflowed at loss scale %g; update skipped, loss scale now %g",
        r->step, before, loss_scaler_->scale()));
  } else if (changed && finite) {
    LogLine(absl::StrFormat("step %d: loss scale %g -> %g after %d clean steps", r->step, before,
                            loss_scaler_->scale(), spec_.loss_scale().growth_interval()));
  }
}

absl::Status Trainer::BroadcastOwnedParameters() {
  // ZeRO-1: each rank updated only its share; every share travels from its owner to the others.
  for (int r = 0; r < comm_->world_size(); ++r) {
    std::vector<torch::Tensor> share;
    for (const auto& p : model_->named_parameters()) {
      if (owner_.at(p.key()) == r) share.push_back(p.value());
    }
    LOOM_RETURN_IF_ERROR(comm_->Broadcast(share, r));
  }
  return absl::OkStatus();
}

absl::Status Trainer::AfterStep(TrainSummary* summary, bool checkpoint_now) {
  const int64_t step = progress_.step, total = spec_.steps();
  if (splits()) {
    if (step % steps_per_epoch_ == 0 || step == total) EndEpoch(summary);
  } else if (spec_.eval().interval() > 0 && step % spec_.eval().interval() == 0 && step < total) {
    Validate(summary);
  }
  if (checkpointer_->Due(step) || checkpoint_now) LOOM_RETURN_IF_ERROR(checkpointer_->Save());
  return checkpointer_->Poll();  // uploads finished meanwhile (object stores)
}

absl::Status Trainer::StopOnRequest() {
  const bool checkpoints = checkpointer_->enabled();
  if (checkpoints && !checkpointer_->SavedAtCurrentStep()) {
    LOOM_RETURN_IF_ERROR(checkpointer_->Save());
  }
  LOOM_RETURN_IF_ERROR(checkpointer_->Flush());  // in the store before the process exits
  return absl::CancelledError(absl::StrCat(
      "stopped at step ", progress_.step, " on request (SIGTERM)",
      checkpoints ? absl::StrCat("; checkpoint ", checkpointer_->last_checkpoint(), " written")
                  : std::string("; no checkpoint directory, nothing saved")));
}

absl::Status Trainer::FinishRun(TrainSummary* summary) {
  const int64_t step = progress_.step;
  if (last_eval_step_ != step) Validate(summary);
  if (step >= spec_.steps() && comm_->rank() == 0) EvaluateLengths(summary);
  if (splits()) SummarizeSplits(summary);
  if (checkpointer_->enabled() && !checkpointer_->SavedAtCurrentStep()) {
    LOOM_RETURN_IF_ERROR(checkpointer_->Save());
  }
  LOOM_RETURN_IF_ERROR(checkpointer_->Flush());
  summary->last_checkpoint = checkpointer_->last_checkpoint();
  summary->final_step = step;
  if (spec_.kind() == "sft" && spec_.reasoning_eval().when() == "end" && step >= spec_.steps()) {
    try {
      LOOM_RETURN_IF_ERROR(ReasoningEvaluate(summary));
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("reasoning eval: ", e.what()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainSummary> Trainer::RunEvalJob() {
  TrainSummary summary;  // no training: score the init-from weights
  if (options_.init_from.empty())
    LogLine("reasoning eval: no --init-from; scoring freshly initialised weights");
  try {
    LOOM_RETURN_IF_ERROR(ReasoningEvaluate(&summary));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("reasoning eval: ", e.what()));
  }
  summary.final_step = progress_.step;
  return summary;
}

absl::StatusOr<Trainer::StepSignals> Trainer::AgreeAfterStep() {
  const bool stop = g_stop_requested.load(std::memory_order_relaxed);
  const bool by_time = comm_->rank() == 0 && checkpointer_->DueByTime();
  const int world = comm_->world_size();
  if (world == 1) return StepSignals{stop, by_time};
  // One scalar per step (a signal may reach some ranks and not others): the ranks' sum, the
  // SIGTERMed ranks plus (world + 1) if rank 0's clock says so, decodes exactly from the mean.
  LOOM_ASSIGN_OR_RETURN(const double mean,
                        comm_->AllReduceMean((stop ? 1.0 : 0.0) + (by_time ? world + 1.0 : 0.0)));
  const int64_t sum = std::llround(mean * world);
  return StepSignals{sum % (world + 1) > 0, sum >= world + 1};
}
// ---- Evaluation ----

int64_t Trainer::EpochOf(int64_t step) const {
  return splits() ? (step + steps_per_epoch_ - 1) / steps_per_epoch_ : 0;
}

EvalResult Trainer::Validate(TrainSummary* summary) {
  const int64_t step = progress_.step;
  EvalResult e;
  if (splits()) {
    e = EvaluateSplit(*data_.validation, "validation", EpochOf(step));
  } else {
    e = evaluator_->Batches(*data_.make_eval());
    reporter_->Eval(e, step, {});
  }
  last_eval_step_ = step;
  summary->last_eval_loss = e.loss;
  summary->last_eval_accuracy = e.accuracy;
  summary->last_eval_exact_match = e.exact_match;
  const std::string& source = spec_.data().source();
  LogLine(source == "task" || source == "chat"
              ? absl::StrFormat("%s at step %d: loss %.4f  accuracy %.4f  exact match %.4f",
                                splits() ? "validation" : "eval", step, e.loss, e.accuracy,
                                e.exact_match)
              : absl::StrFormat("eval loss at step %d: %.4f", step, e.loss));
  return e;
}

EvalResult Trainer::EvaluateSplit(const TaskSplit& split, const std::string& name, int64_t epoch) {
  const EvalResult r = evaluator_->Split(split);
  reporter_->Eval(r, progress_.step, {name, epoch, 0});
  return r;
}

// The end of an epoch (or of the run): validate; on a lower validation loss, test and remember
// it; after `patience` epochs without one, stop.
void Trainer::EndEpoch(TrainSummary* summary) {
  const int64_t epoch = EpochOf(progress_.step), step = progress_.step;
  const EvalResult v = Validate(summary);
  EarlyStopping& es = early_;
  if (es.Improves(v.loss, epoch, step)) {
    es.test = EvaluateSplit(*data_.test, "test", epoch);
    es.has_test = true;
    LogLine(absl::StrFormat(
        "epoch %d (step %d): validation loss %.4f, best so far; test loss %.4f  accuracy %.4f  "
        "exact match %.4f",
        epoch, step, v.loss, es.test.loss, es.test.accuracy, es.test.exact_match));
    return;
  }
  LogLine(absl::StrFormat(
      "epoch %d (step %d): validation loss %.4f, no improvement on %.4f (epoch %d) for %d "
      "epoch(s)",
      epoch, step, v.loss, es.best_loss, es.best_epoch, es.bad_epochs));
  if (es.Exhausted(spec_.eval().patience())) stop_early_ = true;
}

void Trainer::EvaluateLengths(TrainSummary* summary) {
  for (const auto& [length, make] : data_.length_evals) {
    const EvalResult e = evaluator_->Batches(*make());
    reporter_->Eval(e, progress_.step, {"", 0, length});
    summary->length_evals.push_back({length, e.loss, e.accuracy, e.exact_match});
    LogLine(absl::StrFormat("eval at length %d: loss %.4f  accuracy %.4f  exact match %.4f", length,
                            e.loss, e.accuracy, e.exact_match));
  }
}

void Trainer::SummarizeSplits(TrainSummary* summary) const {
  summary->epochs = EpochOf(progress_.step);
  summary->early_stopped = stop_early_;
  summary->best_epoch = early_.best_epoch;
  if (!early_.has_test) return;
  summary->best_validation_loss = early_.best_loss;
  summary->test_loss = early_.test.loss;
  summary->test_accuracy = early_.test.accuracy;
  summary->test_exact_match = early_.test.exact_match;
  LogLine(absl::StrFormat(
      "%s after epoch %d (step %d); best validation loss %.4f at epoch %d (step %d): test "
      "loss %.4f  accuracy %.4f  exact match %.4f",
      stop_early_ ? "early stopping" : "training ended", summary->epochs, progress_.step,
      early_.best_loss, early_.best_epoch, early_.best_step, early_.test.loss, early_.test.accuracy,
      early_.test.exact_match));
}

absl::Status Trainer::ReasoningEvaluate(TrainSummary* summary) {
  if (comm_->rank() != 0) return absl::OkStatus();
  const int64_t step = progress_.step;
  const v1::ReasoningEvalConfig& c = spec_.reasoning_eval();
  LOOM_ASSIGN_OR_RETURN(std::vector<EvalProblem> problems, LoadEvalProblems(c, *objective_));
  LogLine(absl::StrFormat(
      "reasoning eval at step %d: %d problems (%s) x %d samples, %s, max %d new tokens", step,
      problems.size(), c.source() == "builtin" ? "builtin:" + c.task() : c.path(), c.samples(),
      c.generation().greedy() ? std::string("greedy")
                              : absl::StrFormat("T = %g, top-p %g", c.generation().temperature(),
                                                c.generation().top_p()),
      c.generation().max_new_tokens()));
  LOOM_ASSIGN_OR_RETURN(ReasoningEvalSummary s,
                        RunReasoningEval(*model_, problems, c, *objective_, *tokenizer_));
  summary->reasoning_pass_at_1 = s.pass_at_1;
  summary->reasoning_maj_at_k = s.maj_at_k;
  summary->reasoning_answered = s.answered;
  // Every sample and vote, next to the checkpoints (or the metrics log) for inspection.
  std::string dir = spec_.checkpoint().dir();
  if (dir.empty() && !spec_.metrics().jsonl().empty())
    dir = fs::path(spec_.metrics().jsonl()).parent_path().string();
  if (!dir.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    const std::string path =
        (fs::path(dir) / absl::StrFormat("reasoning-eval-step-%08d.json", step)).string();
    std::ofstream out(path, std::ios::trunc);
    out << ReasoningEvalJson(s, step, true) << "\n";
    if (out.good()) summary->reasoning_details = path;
  }
  reporter_->Event(ReasoningEvalEvent(s, step, summary->reasoning_details));
  reporter_->registry().Set("loom_train_reasoning_pass_at_1_ratio", s.pass_at_1,
                            reporter_->labels());
  reporter_->registry().Set("loom_train_reasoning_maj_at_k_ratio", s.maj_at_k, reporter_->labels());
  LogLine(absl::StrFormat(
      "reasoning eval at step %d: Pass@1 %.4f  Maj@%d %.4f  answered %.3f  (%d problems, %d "
      "skipped; %d tokens in %.1f s, %.0f tok/s, KV cache peak %.1f MiB)%s",
      step, s.pass_at_1, s.samples, s.maj_at_k, s.answered, s.problems, s.skipped,
      s.generation.generated_tokens, s.generation.seconds,
      s.generation.generated_tokens / std::max(1e-9, s.generation.seconds),
      s.generation.peak_cache_bytes / 1048576.0,
      summary->reasoning_details.empty() ? "" : "; samples in " + summary->reasoning_details));
  return absl::OkStatus();
}

// ---- Batches and the model ----

TrainBatch Trainer::NextLocalBatch() {
  // Every rank draws the same global micro-batch (the sampler state is replicated) and keeps its
  // own rows, so W ranks with micro-batch b see exactly what one rank with W·b would.
  const int64_t b = spec_.micro_batch(), world = comm_->world_size();
  TrainBatch global = data_.train->Next(b * world);
  return world == 1 ? global : RowsOfRank(global, comm_->rank(), b);
}

torch::Tensor Trainer::Forward(const TrainBatch& batch) {
  AutocastScope precision(spec_.precision(), device_);
  return model_->forward(Inputs(batch));
}

ModelInputs Trainer::Inputs(const TrainBatch& batch) const {
  ModelInputs in;
  in.tokens = batch.inputs.to(device_);
  if (batch.rows.defined()) {
    in.grid_rows = batch.rows.to(device_);
    in.grid_cols = batch.cols.to(device_);
  }
  if (batch.segments.defined()) {
    in.positions = batch.positions.to(device_);
    in.segments = batch.segments.to(device_);
  }
  return in;
}

void Trainer::ReportGpuMemory() {
  const std::optional<GpuMemory> m = ReadGpuMemory(device_);
  if (!m) return;
  metrics::Labels labels = reporter_->labels();
  labels["gpu"] = std::to_string(device_.index());
  metrics::Registry& registry = reporter_->registry();
  registry.Set("loom_train_gpu_memory_allocated_bytes", static_cast<double>(m->allocated), labels);
  registry.Set("loom_train_gpu_memory_reserved_bytes", static_cast<double>(m->reserved), labels);
  registry.Set("loom_train_gpu_memory_peak_bytes", static_cast<double>(m->peak), labels);
  if (const char* path = std::getenv("LOOM_GPU_STATS_FILE"); path != nullptr && *path != '\0')
    ReplaceStatusFile(path, GpuMemoryJson(*m));
}

}  // namespace loom::trainer
