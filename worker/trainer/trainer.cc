#include "trainer.h"

#include <ATen/record_function.h>
#include <google/protobuf/util/json_util.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "autocast.h"
#include "corpus.h"
#include "devices.h"
#include "gpu_stats.h"
#include "job_tokenizer.h"
#include "lease.h"
#include "loom/blas_core.h"
#include "loom/spec.h"
#include "loom/status_macros.h"
#include "plugin_factory.h"
#include "tensor_io.h"
#include "token_shards.h"

namespace loom::trainer {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr char kModelPrefix[] = "model.";
constexpr char kOptimPrefix[] = "optim.";
constexpr char kTorchRng[] = "rng.torch_cpu";

int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string JsonNumber(double v) { return std::isfinite(v) ? absl::StrFormat("%.17g", v) : "null"; }

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
      continue;
    }
    out += c;
  }
  return out + "\"";
}

std::string Duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds);
  return s >= 3600 ? absl::StrFormat("%d:%02d:%02d", s / 3600, s / 60 % 60, s % 60)
                   : absl::StrFormat("%d:%02d", s / 60, s % 60);
}

std::vector<int64_t> ParseStepList(const char* text) {
  std::vector<int64_t> out;
  if (text == nullptr) return out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v;
    if (absl::SimpleAtoi(part, &v)) out.push_back(v);
  }
  return out;
}

}  // namespace

double LearningRateAt(const v1::OptimizerConfig& o, int64_t total_steps, int64_t step) {
  if (step < o.warmup_steps()) return o.lr() * static_cast<double>(step + 1) / o.warmup_steps();
  const double span = std::max<int64_t>(1, total_steps - o.warmup_steps());
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup_steps()) / span);
  return o.min_lr() + 0.5 * (o.lr() - o.min_lr()) * (1.0 + std::cos(M_PI * progress));
}

TrainBatch WindowSampler::Next(int64_t batch) {
  auto [inputs, targets] = SampleWindows(*tokens_, batch, seq_len_, rng_);
  return {inputs, targets, {}, {}};
}

TrainBatch ChatSampler::Next(int64_t batch) {
  const int64_t len = static_cast<int64_t>(rows_->front().tokens.size()) - 1;
  TrainBatch out;
  out.inputs = torch::empty({batch, len}, torch::kInt64);
  out.targets = torch::empty({batch, len}, torch::kInt64);
  out.positions = torch::empty({batch, len}, torch::kInt64);
  out.segments = torch::empty({batch, len}, torch::kInt64);
  std::uniform_int_distribution<size_t> pick(0, rows_->size() - 1);
  for (int64_t b = 0; b < batch; ++b) {
    const data::PackedRow& row = (*rows_)[pick(rng_)];
    int64_t* in = out.inputs[b].data_ptr<int64_t>();
    int64_t* tg = out.targets[b].data_ptr<int64_t>();
    int64_t* pos = out.positions[b].data_ptr<int64_t>();
    int64_t* seg = out.segments[b].data_ptr<int64_t>();
    for (int64_t i = 0; i < len; ++i) {
      in[i] = row.tokens[i];
      tg[i] = row.loss_mask[i + 1] ? static_cast<int64_t>(row.tokens[i + 1]) : -1;
      seg[i] = row.segment[i];
      pos[i] = (i > 0 && row.segment[i] == row.segment[i - 1]) ? pos[i - 1] + 1 : 0;
    }
  }
  return out;
}

TrainBatch TaskBatch(const std::vector<const data::Example*>& examples, bool mask_padding) {
  size_t len = 0;
  for (const data::Example* e : examples) len = std::max(len, e->tokens.size());
  const int64_t b = static_cast<int64_t>(examples.size()), n = static_cast<int64_t>(len);
  TrainBatch out;
  out.inputs = torch::zeros({b, n}, torch::kInt64);
  out.targets = torch::full({b, n}, -1, torch::kInt64);
  const bool grid = !examples.empty() && !examples[0]->rows.empty();
  if (grid) {
    out.rows = torch::zeros({b, n}, torch::kInt64);
    out.cols = torch::zeros({b, n}, torch::kInt64);
  }
  bool ragged = false;
  for (const data::Example* e : examples) ragged |= e->tokens.size() != len;
  if (mask_padding && ragged) {
    out.segments = torch::zeros({b, n}, torch::kInt64);
    out.positions = torch::arange(n, torch::kInt64).unsqueeze(0).expand({b, n}).contiguous();
  }
  for (int64_t i = 0; i < b; ++i) {
    const data::Example& e = *examples[static_cast<size_t>(i)];
    const int64_t m = static_cast<int64_t>(e.tokens.size());
    auto copy = [&](const std::vector<int64_t>& v, torch::Tensor& t) {
      t.select(0, i).narrow(0, 0, m).copy_(torch::tensor(v, torch::kInt64));
    };
    copy(e.tokens, out.inputs);
    copy(e.targets, out.targets);
    if (grid) {
      copy(e.rows, out.rows);
      copy(e.cols, out.cols);
    }
    if (out.segments.defined()) out.segments.select(0, i).narrow(0, 0, m).fill_(1);
  }
  return out;
}

TrainBatch TaskSampler::Next(int64_t batch) {
  std::vector<data::Example> examples = task_->Batch(batch, rng_);
  std::vector<const data::Example*> refs;
  for (const auto& e : examples) refs.push_back(&e);
  return TaskBatch(refs, false);
}

std::shared_ptr<const TaskSplit> MakeTaskSplit(const data::Task& task, int64_t n, uint64_t seed) {
  auto split = std::make_shared<TaskSplit>();
  std::mt19937_64 rng(seed);
  split->examples.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    std::vector<data::Example> one = task.Batch(1, rng);
    split->examples.push_back(std::move(one.front()));
  }
  split->mask_padding = task.info().encoder;
  return split;
}

SplitSampler::SplitSampler(std::shared_ptr<const TaskSplit> split, uint64_t seed)
    : BatchSource(seed), split_(std::move(split)) {
  Shuffle();
}

void SplitSampler::Shuffle() {
  before_ = rng_;
  order_.resize(split_->examples.size());
  for (size_t i = 0; i < order_.size(); ++i) order_[i] = static_cast<int64_t>(i);
  // Fisher-Yates with the sampler's generator (std::shuffle's draws are library-specific).
  for (size_t i = order_.size(); i > 1; --i) {
    std::swap(order_[i - 1], order_[static_cast<size_t>(rng_() % i)]);
  }
  cursor_ = 0;
  ++pass_;
}

TrainBatch SplitSampler::Next(int64_t batch) {
  std::vector<const data::Example*> refs;
  while (static_cast<int64_t>(refs.size()) < batch) {
    if (cursor_ == static_cast<int64_t>(order_.size())) Shuffle();
    refs.push_back(&split_->examples[static_cast<size_t>(order_[static_cast<size_t>(cursor_++)])]);
  }
  return TaskBatch(refs, split_->mask_padding);
}

std::string SplitSampler::State() const {
  std::ostringstream s;
  s << "split " << pass_ << " " << cursor_ << " " << before_;
  return s.str();
}

absl::Status SplitSampler::Restore(const std::string& state) {
  std::istringstream s(state);
  std::string tag;
  int64_t pass = 0, cursor = 0;
  std::mt19937_64 before;
  s >> tag >> pass >> cursor >> before;
  if (s.fail() || tag != "split" || pass < 1 || cursor < 0 ||
      cursor > static_cast<int64_t>(split_->examples.size())) {
    return absl::DataLossError("data cursor: malformed split sampler state");
  }
  rng_ = before;
  Shuffle();  // the same permutation again, and rng_ where it was after drawing it
  pass_ = pass;
  cursor_ = cursor;
  return absl::OkStatus();
}

std::string BatchSource::State() const {
  std::ostringstream s;
  s << rng_;
  return s.str();
}

absl::Status BatchSource::Restore(const std::string& state) {
  std::istringstream s(state);
  std::mt19937_64 rng;
  s >> rng;
  if (s.fail()) return absl::DataLossError("data cursor: malformed sampler state");
  rng_ = rng;
  return absl::OkStatus();
}

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

absl::Status Trainer::Setup(const PluginLoader& loader) {
  if (spec_.threads() > 0) torch::set_num_threads(spec_.threads());
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

  LOOM_ASSIGN_OR_RETURN(model_, Transformer::Create(spec_.model(), loader));
  model_->to(device_, dtype_);
  std::vector<std::pair<std::string, torch::Tensor>> params;
  for (const auto& p : model_->named_parameters()) params.emplace_back(p.key(), p.value());
  const auto& o = spec_.optimizer();
  zero_ = spec_.zero_stage() == 1 && comm_->world_size() > 1;
  if (comm_->world_size() > 1) {
    reducer_ = std::make_unique<GradientReducer>(comm_.get(), model_->parameters(),
                                                 spec_.dist_bucket_bytes());
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
  optimizer_ = std::make_unique<AdamW>(
      params, AdamWConfig{o.beta1(), o.beta2(), o.eps(), o.weight_decay()}, owns);
  if (spec_.precision() == "bf16" && device_.is_cpu() && !DetectCpuVectorFeatures().avx512) {
    // LibTorch's CPU bf16 GEMMs need AVX-512 (oneDNN); without it they fall back to scalar
    // loops (measured 16x slower than fp32 on an AVX2 EPYC).
    LogLine(
        "precision: bf16 on a CPU without AVX-512: LibTorch's bf16 matmuls fall back to a "
        "slow path here (about 10-16x fp32's time); fp32 is faster on this machine");
  }
  if (spec_.loss_scale().mode() == "dynamic") {
    LossScaler::Options scaling;
    scaling.initial = spec_.loss_scale().initial();
    scaling.growth_interval = spec_.loss_scale().growth_interval();
    loss_scaler_ = std::make_unique<LossScaler>(scaling);
  }

  if (spec_.kind() != "pretrain" || spec_.data().source() == "corpus") {
    LOOM_ASSIGN_OR_RETURN(tokenizer_, JobTokenizer(spec_));
  }
  if (spec_.kind() != "pretrain") {
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
  }
  if (spec_.kind() != "eval") LOOM_RETURN_IF_ERROR(SetupData());  // eval jobs only generate
  model_hash_ = ModelHash(spec_);
  spec_hash_ = SpecHash(spec_);
  forward_flops_per_token_ = model_->ForwardFlopsPerToken(spec_.seq_len());
  inject_nan_at_ = ParseStepList(std::getenv("LOOM_TEST_INJECT_NAN_AT_STEPS"));
  if (const char* pause = std::getenv("LOOM_TEST_CHECKPOINT_PAUSE")) {  // "STEP:MILLISECONDS"
    std::vector<std::string> parts = absl::StrSplit(pause, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &checkpoint_pause_step_) ||
        !absl::SimpleAtoi(parts[1], &checkpoint_pause_ms_)) {
      return absl::InvalidArgumentError("LOOM_TEST_CHECKPOINT_PAUSE: want STEP:MILLISECONDS");
    }
  }

  labels_ = {{metrics::kJobLabel, spec_.name().empty() ? "standalone" : spec_.name()},
             {"rank", std::to_string(comm_->rank())}};
  if (const char* worker = std::getenv("LOOM_WORKER_NAME"); worker && *worker) {
    registry_.SetConstantLabels({{"worker", worker}});
  }
  metrics::DeclareTrainMetrics(registry_);
  registry_.Set("loom_train_total_steps", static_cast<double>(spec_.steps()), labels_);
  if (spec_.metrics().port() != 0) {
    LOOM_ASSIGN_OR_RETURN(exporter_,
                          metrics::HttpExporter::Start(&registry_, spec_.metrics().bind(),
                                                       std::max(0, spec_.metrics().port())));
    LogLine(absl::StrCat("metrics: http://", spec_.metrics().bind(), ":", exporter_->port(),
                         "/metrics"));
  }

  const std::string& ckpt_dir = spec_.checkpoint().dir();
  if (!ckpt_dir.empty() && comm_->rank() == 0) {
    LOOM_ASSIGN_OR_RETURN(int removed, storage::CleanIncomplete(ckpt_dir));
    if (removed > 0)
      LogLine(
          absl::StrCat("checkpoint: removed ", removed, " incomplete checkpoint(s) in ", ckpt_dir));
  }
  if (!options_.resume.empty() && !options_.init_from.empty()) {
    return absl::InvalidArgumentError("--resume and --init-from are exclusive");
  }
  if (!options_.resume.empty() && !options_.resume_if_any.empty()) {
    return absl::InvalidArgumentError("--resume and --resume-if-any are exclusive");
  }
  if (!options_.resume_if_any.empty()) {
    LOOM_RETURN_IF_ERROR(RestoreNewestIntact(options_.resume_if_any));
  } else {
    if (!options_.resume.empty()) LOOM_RETURN_IF_ERROR(Restore(options_.resume, false));
    if (!options_.init_from.empty()) LOOM_RETURN_IF_ERROR(Restore(options_.init_from, true));
  }

  if (!spec_.metrics().jsonl().empty()) {
    jsonl_.open(spec_.metrics().jsonl(), options_.resume.empty() ? std::ios::trunc : std::ios::app);
    if (!jsonl_)
      return absl::InvalidArgumentError(
          absl::StrCat("metrics.jsonl: cannot open '", spec_.metrics().jsonl(), "'"));
    // What --resume-if-any found, for the control plane's catalogue and the job's events.
    for (const auto& k : skipped_) {
      WriteJsonl(absl::StrCat("{\"event\":\"checkpoint_skipped\",\"step\":", k.step, ",\"dir\":",
                              JsonString(k.dir), ",\"reason\":", JsonString(k.reason), "}"));
    }
    if (!options_.resume_if_any.empty()) {
      WriteJsonl(absl::StrCat("{\"event\":\"resumed\",\"step\":", resumed_.step,
                              ",\"dir\":", JsonString(resumed_.dir), "}"));
    }
  }
  return absl::OkStatus();
}

// A slice [begin, begin + length) of a dataset's token stream.
class ShardSlice : public TokenStream {
 public:
  ShardSlice(std::shared_ptr<const data::TokenShards> shards, int64_t begin, int64_t length)
      : shards_(std::move(shards)), begin_(begin), length_(length) {}
  int64_t size() const override { return length_; }
  void Copy(int64_t start, int64_t n, int64_t* out) const override {
    shards_->Copy(begin_ + start, n, out);
  }

 private:
  std::shared_ptr<const data::TokenShards> shards_;
  int64_t begin_, length_;
};

absl::Status Trainer::SetupData() {
  const auto& d = spec_.data();
  const int64_t seq_len = spec_.seq_len();
  const uint64_t eval_seed =
      d.seed() ^ 0x9e3779b97f4a7c15ULL;  // the same held-out batches every time
  if (spec_.model().mode() == "encoder" && d.source() != "task") {
    return absl::InvalidArgumentError("model.mode: encoder models train on built-in tasks only");
  }
  if (d.source() == "chat") return SetupChatData();
  if (d.source() == "task") {
    LOOM_ASSIGN_OR_RETURN(auto options, OptionsAsText(d.task_options()));
    std::map<std::string, std::string> text(options.begin(), options.end());
    LOOM_ASSIGN_OR_RETURN(std::unique_ptr<data::Task> made,
                          data::MakeTask(d.task(), text, seq_len));
    std::shared_ptr<const data::Task> task = std::move(made);
    const data::TaskInfo& info = task->info();
    const v1::ModelConfig& m = spec_.model();
    if (info.encoder != (m.mode() == "encoder")) {
      return absl::InvalidArgumentError(absl::StrCat("model.mode: task ", info.name, " needs ",
                                                     info.encoder ? "an encoder" : "a decoder"));
    }
    if (info.encoder && m.num_classes() != info.num_classes) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.num_classes: task ", info.name, " needs ", info.num_classes));
    }
    if (info.grid > 0 && (m.grid_max_rows() < info.grid || m.grid_max_cols() < info.grid)) {
      return absl::InvalidArgumentError(absl::StrCat("model.grid_max_rows: task ", info.name,
                                                     " needs grid positions of at least ",
                                                     info.grid));
    }
    if (m.vocab_size() < info.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.vocab_size: task ", info.name, " needs ", info.vocab_size));
    }
    if (info.max_len > m.max_seq_len()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.max_seq_len: task ", info.name, " needs ", info.max_len));
    }
    if (d.has_splits()) {
      // App. D: fixed splits drawn once. Train from data.seed, validation from the held-out seed,
      // test from a third derivation; the epoch order from a fourth.
      const auto& sp = d.splits();
      auto train = MakeTaskSplit(*task, sp.train(), d.seed());
      validation_split_ = MakeTaskSplit(*task, sp.validation(), eval_seed);
      test_split_ = MakeTaskSplit(*task, sp.test(), d.seed() ^ 0xbf58476d1ce4e5b9ULL);
      train_data_ = std::make_unique<SplitSampler>(train, d.seed() ^ 0x94d049bb133111ebULL);
      LogLine(absl::StrCat("data: ", info.name, " splits of ", sp.train(), " / ", sp.validation(),
                           " / ", sp.test(), " examples (train / validation / test)"));
    } else {
      train_data_ = std::make_unique<TaskSampler>(task, d.seed());
    }
    make_eval_data_ = [task, eval_seed] { return std::make_unique<TaskSampler>(task, eval_seed); };
    for (int64_t length : spec_.eval().lengths()) {  // made now: a bad length fails before training
      auto at = data::MakeTask(d.task(), text, length);
      if (!at.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("eval.lengths: ", length, ": ", at.status().message()));
      }
      std::shared_ptr<const data::Task> sized = std::move(*at);
      length_eval_data_.emplace_back(
          length, [sized, eval_seed] { return std::make_unique<TaskSampler>(sized, eval_seed); });
    }
    return absl::OkStatus();
  }
  std::shared_ptr<const TokenStream> train, eval;
  if (d.source() == "corpus") {
    if (tokenizer_->vocab_size() > spec_.model().vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model.vocab_size: ", spec_.model().vocab_size(), " is smaller than the tokenizer's ",
          tokenizer_->vocab_size(), " (", tokenizer_->Describe(), ")"));
    }
    auto tokens = [this](const std::string& text) {
      const std::vector<uint32_t> ids = tokenizer_->Encode(text);
      return std::vector<int64_t>(ids.begin(), ids.end());
    };
    train = std::make_shared<VectorTokenStream>(tokens(GenerateCorpus(d.seed(), d.corpus_bytes())));
    eval = std::make_shared<VectorTokenStream>(
        tokens(GenerateCorpus(d.seed() + 1000003, std::max<int64_t>(1 << 16, 8 * (seq_len + 1)))));
    if (train->size() < 4 * (seq_len + 1) || eval->size() < seq_len + 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data.corpus_bytes: ", d.corpus_bytes(), " bytes make ", train->size(), " tokens with ",
          tokenizer_->Describe(), ", too few for training windows of ", seq_len));
    }
  } else {
    // A loom-data dataset: the last 1% of its tokens (at least one evaluation's worth) are held
    // out.
    LOOM_ASSIGN_OR_RETURN(std::shared_ptr<data::TokenShards> shards,
                          data::TokenShards::Open(d.path()));
    if (shards->index().vocab_size > spec_.model().vocab_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.vocab_size: ", spec_.model().vocab_size(),
                       " is smaller than the dataset's vocabulary ", shards->index().vocab_size,
                       " (", shards->index().tokenizer, ")"));
    }
    const int64_t total = shards->size();
    const int64_t held =
        std::max(total / 100, spec_.eval().batches() * spec_.micro_batch() * (seq_len + 1));
    if (total - held < 4 * (seq_len + 1)) {
      return absl::InvalidArgumentError(absl::StrCat("data.path: ", d.path(), " holds ", total,
                                                     " tokens, too few for training windows of ",
                                                     seq_len, " plus a held-out set of ", held));
    }
    train = std::make_shared<ShardSlice>(shards, 0, total - held);
    eval = std::make_shared<ShardSlice>(shards, total - held, held);
    LogLine(absl::StrCat("data: ", d.path(), ": ", total, " tokens (", shards->index().tokenizer,
                         "), ", held, " held out"));
  }
  train_data_ = std::make_unique<WindowSampler>(train, seq_len, d.seed());
  make_eval_data_ = [eval, seq_len, eval_seed] {
    return std::make_unique<WindowSampler>(eval, seq_len, eval_seed);
  };
  return absl::OkStatus();
}

absl::Status Trainer::SetupChatData() {
  const auto& d = spec_.data();
  LOOM_ASSIGN_OR_RETURN(auto options, OptionsAsText(d.task_options()));
  std::map<std::string, std::string> opt(options.begin(), options.end());
  std::vector<data::Conversation> conversations;
  if (!d.path().empty()) {
    const bool skip = opt.count("skip_malformed") == 0 || opt["skip_malformed"] != "false";
    data::ChatReadReport report;
    auto parse = [this](std::string_view line,
                        int64_t line_no) -> absl::StatusOr<data::Conversation> {
      data::Conversation c;
      std::string error;
      if (!objective_->ParseLine(line, line_no, &c, &error))
        return absl::InvalidArgumentError(error);
      return c;
    };
    LOOM_ASSIGN_OR_RETURN(conversations, data::ReadChatJsonl(d.path(), skip, &report, parse));
    LogLine(absl::StrCat("data: ", d.path(), ": ", report.conversations, " conversations from ",
                         report.lines, " lines (", report.skipped, " malformed skipped, ",
                         report.blank, " blank)"));
    for (const std::string& e : report.errors) LogLine(absl::StrCat("data: skipped ", e));
  } else {
    int64_t count = 2000;
    if (opt.count("count") &&
        (!absl::SimpleAtoi(opt["count"], &count) || count < 10 || count > 10000000)) {
      return absl::InvalidArgumentError("data.task_options.count: an integer in 10..10000000");
    }
    data::ReasoningOptions difficulty;
    if (opt.count("ops")) {
      LOOM_ASSIGN_OR_RETURN(difficulty, data::ParseReasoningOps(opt["ops"]));
    }
    for (auto& ex : data::GenerateReasoning(d.task(), count, d.seed(), data::ReasoningSplit::kTrain,
                                            difficulty)) {
      conversations.push_back(std::move(ex.conversation));
    }
  }
  // Hold out the last 5% (at least one conversation) after a seeded shuffle.
  std::mt19937_64 rng(d.seed());
  std::shuffle(conversations.begin(), conversations.end(), rng);
  const size_t held = std::max<size_t>(1, conversations.size() / 20);
  if (conversations.size() < held + 1) {
    return absl::InvalidArgumentError(
        "data.path: too few conversations to train and hold some out");
  }
  const TextEncoder encode = [this](std::string_view text) { return tokenizer_->Encode(text); };
  auto pack = [&](size_t from, size_t to) {
    std::vector<data::EncodedChat> encoded;
    for (size_t i = from; i < to; ++i) {
      data::EncodedChat e = objective_->Encode(conversations[i], encode);
      if (objective_->Truncate(&e, spec_.seq_len() + 1)) encoded.push_back(std::move(e));
    }
    return std::make_shared<const std::vector<data::PackedRow>>(
        data::Pack(encoded, spec_.seq_len() + 1, 0));
  };
  auto train = pack(0, conversations.size() - held);
  auto eval = pack(conversations.size() - held, conversations.size());
  if (train->empty() || eval->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len: ", spec_.seq_len(), " leaves no conversation with a scored token"));
  }
  LogLine(absl::StrCat("data: ", conversations.size() - held, " conversations packed into ",
                       train->size(), " rows of ", spec_.seq_len() + 1, " tokens; ", held,
                       " held out (", eval->size(), " rows)"));
  const uint64_t eval_seed = d.seed() ^ 0x9e3779b97f4a7c15ULL;
  train_data_ = std::make_unique<ChatSampler>(train, d.seed());
  make_eval_data_ = [eval, eval_seed] { return std::make_unique<ChatSampler>(eval, eval_seed); };
  return absl::OkStatus();
}

TrainBatch Trainer::NextLocalBatch() {
  // Every rank draws the same global micro-batch (the sampler state is replicated) and keeps its
  // own rows, so W ranks with micro-batch b see exactly what one rank with W·b would.
  const int64_t b = spec_.micro_batch(), world = comm_->world_size();
  TrainBatch global = train_data_->Next(b * world);
  if (world == 1) return global;
  auto rows = [&](const torch::Tensor& t) {
    return t.defined() ? t.narrow(0, comm_->rank() * b, b).contiguous() : t;
  };
  return {rows(global.inputs), rows(global.targets),   rows(global.rows),
          rows(global.cols),   rows(global.positions), rows(global.segments)};
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

absl::Status Trainer::Restore(const std::string& where, bool weights_only) {
  const auto start = Clock::now();
  absl::StatusOr<storage::LoadedCheckpoint> loaded;
  if (fs::exists(fs::path(where) / "manifest.json")) {
    loaded = storage::LoadCheckpoint(where);
  } else {
    std::vector<absl::Status> skipped;
    loaded = storage::LoadLatestCheckpoint(where, &skipped);
    for (const absl::Status& s : skipped) {
      LogLine(absl::StrCat("checkpoint: skipping a damaged checkpoint: ", s.message()));
    }
  }
  const char* what = weights_only ? "--init-from" : "--resume";
  if (!loaded.ok())
    return absl::Status(loaded.status().code(),
                        absl::StrCat(what, ": ", loaded.status().message()));
  return ApplyCheckpoint(*loaded, weights_only, start);
}

// --resume-if-any: the newest checkpoint under `root` that verifies and restores; each newer
// one that does not is skipped and reported (JSON lines "checkpoint_skipped") so the control
// plane marks it. None at all: a fresh start (or --init-from).
absl::Status Trainer::RestoreNewestIntact(const std::string& root) {
  LOOM_ASSIGN_OR_RETURN(std::vector<storage::CheckpointRef> refs, storage::ListCheckpoints(root));
  for (auto it = refs.rbegin(); it != refs.rend(); ++it) {
    const auto start = Clock::now();
    absl::StatusOr<storage::LoadedCheckpoint> loaded = storage::LoadCheckpoint(it->dir);
    absl::Status s = loaded.ok() ? ApplyCheckpoint(*loaded, false, start) : loaded.status();
    if (s.ok()) {
      resumed_ = {it->step, it->dir, ""};
      return absl::OkStatus();
    }
    if (absl::IsInvalidArgument(s)) return s;  // the spec does not fit its own checkpoints
    LogLine(absl::StrCat("checkpoint: skipping ", it->dir, ": ", s.message()));
    skipped_.push_back({it->step, it->dir, std::string(s.message())});
  }
  resumed_ = {0, "", ""};
  if (!options_.init_from.empty()) return Restore(options_.init_from, true);
  return absl::OkStatus();
}

absl::Status Trainer::ApplyCheckpoint(const storage::LoadedCheckpoint& loaded, bool weights_only,
                                      Clock::time_point start) {
  const char* what = weights_only ? "--init-from" : "--resume";
  const storage::Manifest& m = loaded.manifest;
  // Shards are merged by name: parameters live in shard 0, AdamW moments in the shard of the rank
  // that owned them. Each rank then takes what its own partition needs, whatever the world size
  // that wrote the checkpoint (resharding needs no conversion step).
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& shard : loaded.shards) {
    LOOM_ASSIGN_OR_RETURN(auto part, TensorsFromFile(shard));
    tensors.insert(part.begin(), part.end());
  }
  std::map<std::string, torch::Tensor> model_tensors, optim_tensors;
  for (auto& [name, t] : tensors) {
    if (name.rfind(kModelPrefix, 0) == 0) model_tensors[name.substr(sizeof(kModelPrefix) - 1)] = t;
    if (name.rfind(kOptimPrefix, 0) == 0) optim_tensors[name.substr(sizeof(kOptimPrefix) - 1)] = t;
  }
  if (!weights_only) {
    auto it = m.state.find("model_hash");
    if (it == m.state.end() || it->second != model_hash_) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": ", loaded.dir, " holds a different model (hash ",
                       it == m.state.end() ? "none" : it->second, ", this spec ", model_hash_,
                       "); use --init-from to start a new run from its weights"));
    }
  }
  if (absl::Status s = LoadIntoModule(*model_, model_tensors); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", loaded.dir, ": model: ", s.message()));
  }
  if (weights_only) {
    parent_ = loaded.dir;
    LogLine(absl::StrCat("init-from: weights of ", loaded.dir, " (step ", m.step,
                         "); fresh optimizer"));
  } else {
    auto get = [&](const std::string& key) -> absl::StatusOr<std::string> {
      auto it = m.state.find(key);
      if (it == m.state.end())
        return absl::DataLossError(absl::StrCat(what, ": manifest lacks state '", key, "'"));
      return it->second;
    };
    LOOM_ASSIGN_OR_RETURN(std::string optim_step, get("optim.step"));
    LOOM_ASSIGN_OR_RETURN(std::string data_rng, get("data.rng"));
    LOOM_ASSIGN_OR_RETURN(std::string nan_run, get("nan.consecutive"));
    int64_t optim_step_value = 0;
    if (!absl::SimpleAtoi(optim_step, &optim_step_value) ||
        !absl::SimpleAtoi(nan_run, &consecutive_nan_)) {
      return absl::DataLossError(
          absl::StrCat(what, ": malformed optimizer step or NaN counter in the manifest"));
    }
    for (auto& [name, t] : optim_tensors) t = t.to(device_);
    LOOM_RETURN_IF_ERROR(optimizer_->LoadState(optim_tensors, optim_step_value));
    LOOM_RETURN_IF_ERROR(train_data_->Restore(data_rng));
    if (validation_split_) {
      LOOM_ASSIGN_OR_RETURN(std::string early, get("split.early_stop"));
      LOOM_RETURN_IF_ERROR(RestoreEarlyStop(early));
    }
    if (loss_scaler_) {
      // A checkpoint written without loss scaling resumes at the configured initial scale.
      auto it = m.state.find("loss_scale");
      if (it != m.state.end()) LOOM_RETURN_IF_ERROR(loss_scaler_->Restore(it->second));
    }
    auto rng = tensors.find(kTorchRng);
    if (rng == tensors.end())
      return absl::DataLossError(absl::StrCat(what, ": shard lacks ", kTorchRng));
    at::Generator generator = at::detail::getDefaultCPUGenerator();  // a handle to the global one
    generator.set_state(rng->second);
    step_ = m.step;
    tokens_seen_ = m.tokens_seen;
    parent_ = m.parent;
    LogLine(
        absl::StrCat("resume: ", loaded.dir, " at step ", step_, " (", tokens_seen_, " tokens)"));
  }
  registry_.Observe("loom_train_checkpoint_load_seconds",
                    std::chrono::duration<double>(Clock::now() - start).count(), labels_);
  return absl::OkStatus();
}

absl::StatusOr<std::string> Trainer::SaveCheckpoint() {
  const auto start = Clock::now();
  NamedTensors tensors;
  if (comm_->rank() == 0) {
    for (auto& [name, t] : ModuleTensors(*model_)) tensors.emplace_back(kModelPrefix + name, t);
    tensors.emplace_back(kTorchRng, at::detail::getDefaultCPUGenerator().get_state());
  }
  for (auto& [name, t] : optimizer_->StateTensors()) tensors.emplace_back(kOptimPrefix + name, t);
  LOOM_ASSIGN_OR_RETURN(WritableTensors writable, ToWritable(tensors));
  // ZeRO-1: every rank writes its shard into one temporary directory that rank 0 creates and
  // commits; otherwise rank 0 alone writes the (replicated) state.
  const int world = zero_ ? comm_->world_size() : 1, rank = comm_->rank();
  // Per attempt: a fenced attempt's half-written directory never mixes with the next one's.
  const char* attempt = std::getenv("LOOM_ATTEMPT");
  const std::string token =
      absl::StrCat("run", spec_hash_, attempt ? "-a" : "", attempt ? attempt : "");
  if (zero_ && rank != 0)
    LOOM_RETURN_IF_ERROR(comm_->Barrier());  // rank 0 has created the directory
  LOOM_ASSIGN_OR_RETURN(
      storage::CheckpointWriter writer,
      storage::CheckpointWriter::Begin(spec_.checkpoint().dir(), step_, world, token, rank == 0));
  if (zero_ && rank == 0) LOOM_RETURN_IF_ERROR(comm_->Barrier());
  if (absl::Status s = writer.WriteShard(rank, writable.items, {{"format", "pt"}}); !s.ok()) {
    if (rank == 0) writer.Abort();
    return s;
  }
  if (zero_) {
    LOOM_RETURN_IF_ERROR(comm_->Barrier());  // every shard is on disk
    if (rank != 0) return std::string();
    for (int r = 1; r < world; ++r) LOOM_RETURN_IF_ERROR(writer.AdoptShard(r));
  }
  if (checkpoint_pause_ms_ > 0 &&
      step_ == checkpoint_pause_step_) {  // test hook: a window to kill in
    LogLine(absl::StrCat("checkpoint: step ", step_, " shards written, pausing before commit"));
    std::this_thread::sleep_for(std::chrono::milliseconds(checkpoint_pause_ms_));
  }
  storage::Manifest manifest;
  manifest.tokens_seen = tokens_seen_;
  manifest.spec_hash = spec_hash_;
  manifest.parent = parent_;
  manifest.kind = spec_.kind();
  std::string spec_json;
  google::protobuf::util::JsonPrintOptions print;
  print.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(spec_, &spec_json, print);
  manifest.state = {{"optim.step", std::to_string(optimizer_->step())},
                    {"data.rng", train_data_->State()},
                    {"nan.consecutive", std::to_string(consecutive_nan_)},
                    {"model_hash", model_hash_},
                    {"zero_stage", zero_ ? "1" : "0"},
                    {"spec", spec_json}};
  if (validation_split_) manifest.state["split.early_stop"] = EarlyStopState();
  if (loss_scaler_) manifest.state["loss_scale"] = loss_scaler_->State();
  RequireLease("before a checkpoint commit");
  auto dir = writer.Commit(manifest);
  if (!dir.ok()) {
    writer.Abort();
    return dir.status();
  }
  if (options_.apply_retention) {
    LOOM_RETURN_IF_ERROR(storage::ApplyRetention(
        spec_.checkpoint().dir(), spec_.checkpoint().keep_last(), spec_.checkpoint().keep_every()));
  }
  uint64_t bytes = 0;
  for (const auto& item : writable.items) bytes += item.size_bytes;
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  registry_.Observe("loom_train_checkpoint_write_seconds", seconds, labels_);
  registry_.Increment("loom_train_checkpoint_bytes_total", static_cast<double>(bytes), labels_);
  WriteJsonl(absl::StrCat("{\"event\":\"checkpoint\",\"step\":", step_,
                          ",\"dir\":", JsonString(*dir), ",\"seconds\":", JsonNumber(seconds),
                          ",\"bytes\":", bytes, "}"));
  return *dir;
}

// After the gradient norm: a finite loss with non-finite gradients is an overflow of the scaled
// backward pass; the step is skipped (not counted as a divergence) and the scale backed off.
void Trainer::UpdateLossScale(bool finite, StepRecord* r, TrainSummary* summary) {
  r->overflowed = !finite && std::isfinite(r->loss);
  const double before = loss_scaler_->scale();
  const bool changed = loss_scaler_->Update(finite);
  registry_.Set("loom_train_loss_scale", loss_scaler_->scale(), labels_);
  if (r->overflowed) {
    ++summary->loss_scale_overflows;
    registry_.Increment("loom_train_loss_scale_overflows_total", 1, labels_);
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

}  // namespace

Trainer::EvalResult Trainer::Evaluate() { return EvaluateBatches(*make_eval_data_(), 0); }

Trainer::EvalResult Trainer::EvaluateBatches(BatchSource& source, int64_t length) {
  torch::NoGradGuard no_grad;
  model_->eval();
  ScoreTotals totals;  // the mean of the fixed held-out batches' losses
  for (int64_t i = 0; i < spec_.eval().batches(); ++i) {
    TrainBatch batch = source.Next(spec_.micro_batch());
    totals.Add(ScoreBatch(Forward(batch), batch, true), 1.0);
  }
  model_->train();
  EvalResult r;
  totals.Into(&r.loss, &r.accuracy, &r.exact_match);
  RecordEval(r, "", 0, length);
  return r;
}

Trainer::EvalResult Trainer::EvaluateSplit(const TaskSplit& split, const std::string& name,
                                           int64_t epoch) {
  torch::NoGradGuard no_grad;
  model_->eval();
  // Every example once, in order; the loss is the mean over all scored positions of the split.
  ScoreTotals totals;
  const size_t n = split.examples.size(), b = static_cast<size_t>(spec_.micro_batch());
  for (size_t from = 0; from < n; from += b) {
    std::vector<const data::Example*> refs;
    for (size_t i = from; i < std::min(n, from + b); ++i) refs.push_back(&split.examples[i]);
    TrainBatch batch = TaskBatch(refs, split.mask_padding);
    BatchScore s = ScoreBatch(Forward(batch), batch, true);
    totals.Add(s, static_cast<double>(s.scored));
  }
  model_->train();
  EvalResult r;
  totals.Into(&r.loss, &r.accuracy, &r.exact_match);
  RecordEval(r, name, epoch);
  return r;
}

void Trainer::RecordEval(const EvalResult& r, const std::string& split, int64_t epoch,
                         int64_t length) {
  if (split != "test" && length == 0) {  // the gauges follow the held-out (validation) evaluations
    registry_.Set("loom_train_eval_loss", r.loss, labels_);
    registry_.Set("loom_train_eval_accuracy_ratio", r.accuracy, labels_);
    registry_.Set("loom_train_eval_exact_match_ratio", r.exact_match, labels_);
  }
  std::string where =
      split.empty() ? "" : absl::StrCat(",\"split\":", JsonString(split), ",\"epoch\":", epoch);
  if (length > 0) absl::StrAppend(&where, ",\"length\":", length);
  WriteJsonl(absl::StrCat("{\"event\":\"eval\"", where, ",\"step\":", step_, ",\"eval_loss\":",
                          JsonNumber(r.loss), ",\"accuracy\":", JsonNumber(r.accuracy),
                          ",\"exact_match\":", JsonNumber(r.exact_match), "}"));
}

std::string Trainer::EarlyStopState() const {
  const EarlyStop& e = early_;
  return absl::StrFormat("%.17g %d %d %d %d %.17g %.17g %.17g", e.best_loss, e.best_epoch,
                         e.best_step, e.bad_epochs, e.has_test ? 1 : 0, e.test.loss,
                         e.test.accuracy, e.test.exact_match);
}

absl::Status Trainer::RestoreEarlyStop(const std::string& state) {
  std::vector<std::string> parts = absl::StrSplit(state, ' ', absl::SkipEmpty());
  EarlyStop e;
  int64_t has_test = 0;
  if (parts.size() != 8 || !absl::SimpleAtod(parts[0], &e.best_loss) ||
      !absl::SimpleAtoi(parts[1], &e.best_epoch) || !absl::SimpleAtoi(parts[2], &e.best_step) ||
      !absl::SimpleAtoi(parts[3], &e.bad_epochs) || !absl::SimpleAtoi(parts[4], &has_test) ||
      !absl::SimpleAtod(parts[5], &e.test.loss) || !absl::SimpleAtod(parts[6], &e.test.accuracy) ||
      !absl::SimpleAtod(parts[7], &e.test.exact_match)) {
    return absl::DataLossError("split.early_stop: malformed early-stopping state in the manifest");
  }
  e.has_test = has_test != 0;
  early_ = e;
  return absl::OkStatus();
}

void Trainer::ReportGpuMemory() {
  const std::optional<GpuMemory> m = ReadGpuMemory(device_);
  if (!m) return;
  metrics::Labels labels = labels_;
  labels["gpu"] = std::to_string(device_.index());
  registry_.Set("loom_train_gpu_memory_allocated_bytes", static_cast<double>(m->allocated), labels);
  registry_.Set("loom_train_gpu_memory_reserved_bytes", static_cast<double>(m->reserved), labels);
  registry_.Set("loom_train_gpu_memory_peak_bytes", static_cast<double>(m->peak), labels);
  if (const char* path = std::getenv("LOOM_GPU_STATS_FILE"); path != nullptr && *path != '\0')
    ReplaceStatusFile(path, GpuMemoryJson(*m));
}

void Trainer::LogLine(const std::string& line) {
  if (options_.log == nullptr) return;
  if (options_.progress_bar) *options_.log << "\r\033[K";
  *options_.log << line << "\n" << std::flush;
}

void Trainer::WriteJsonl(const std::string& json) {
  if (jsonl_.is_open()) jsonl_ << json << "\n" << std::flush;
}

absl::Status Trainer::ReasoningEvaluate(TrainSummary* summary) {
  if (comm_->rank() != 0) return absl::OkStatus();
  const v1::ReasoningEvalConfig& c = spec_.reasoning_eval();
  LOOM_ASSIGN_OR_RETURN(std::vector<EvalProblem> problems, LoadEvalProblems(c, *objective_));
  LogLine(absl::StrFormat(
      "reasoning eval at step %d: %d problems (%s) x %d samples, %s, max %d new tokens", step_,
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
        (fs::path(dir) / absl::StrFormat("reasoning-eval-step-%08d.json", step_)).string();
    std::ofstream out(path, std::ios::trunc);
    out << ReasoningEvalJson(s, step_, true) << "\n";
    if (out.good()) summary->reasoning_details = path;
  }
  std::string line = ReasoningEvalJson(s, step_, false);
  if (!summary->reasoning_details.empty()) {
    line.pop_back();  // '}'
    line += absl::StrCat(",\"details\":", JsonString(summary->reasoning_details), "}");
  }
  WriteJsonl(line);
  registry_.Set("loom_train_reasoning_pass_at_1_ratio", s.pass_at_1, labels_);
  registry_.Set("loom_train_reasoning_maj_at_k_ratio", s.maj_at_k, labels_);
  LogLine(absl::StrFormat(
      "reasoning eval at step %d: Pass@1 %.4f  Maj@%d %.4f  answered %.3f  (%d problems, %d "
      "skipped; %d tokens in %.1f s, %.0f tok/s, KV cache peak %.1f MiB)%s",
      step_, s.pass_at_1, s.samples, s.maj_at_k, s.answered, s.problems, s.skipped,
      s.generation.generated_tokens, s.generation.seconds,
      s.generation.generated_tokens / std::max(1e-9, s.generation.seconds),
      s.generation.peak_cache_bytes / 1048576.0,
      summary->reasoning_details.empty() ? "" : "; samples in " + summary->reasoning_details));
  return absl::OkStatus();
}

namespace {
std::atomic<bool> g_stop_requested{false};
}  // namespace

void RequestStop(bool stop) { g_stop_requested.store(stop, std::memory_order_relaxed); }

absl::StatusOr<bool> Trainer::StopRequested() {
  const bool local = g_stop_requested.load(std::memory_order_relaxed);
  if (comm_->world_size() == 1) return local;
  // One scalar per step: a signal may reach some ranks and not others (other nodes).
  LOOM_ASSIGN_OR_RETURN(const double any, comm_->AllReduceMean(local ? 1.0 : 0.0));
  return any > 0;
}

absl::StatusOr<TrainSummary> Trainer::Run() {
  TrainSummary summary;
  if (spec_.kind() == "eval") {  // no training: score the init-from weights
    if (options_.init_from.empty())
      LogLine("reasoning eval: no --init-from; scoring freshly initialised weights");
    try {
      LOOM_RETURN_IF_ERROR(ReasoningEvaluate(&summary));
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("reasoning eval: ", e.what()));
    }
    summary.final_step = step_;
    return summary;
  }
  const int64_t total = spec_.steps();
  const int64_t tokens_per_step =
      spec_.micro_batch() * spec_.grad_accum() * spec_.seq_len() * comm_->world_size();
  const double flops_per_step =
      3.0 * forward_flops_per_token_ * static_cast<double>(tokens_per_step);
  const bool checkpoints = !spec_.checkpoint().dir().empty();
  int64_t last_saved = -1;
  auto save = [&]() -> absl::Status {
    // Data-parallel state is replicated: rank 0 writes it, the others wait so no rank runs ahead
    // of a checkpoint it might be restarted from.
    if (comm_->rank() == 0 || zero_) {
      LOOM_ASSIGN_OR_RETURN(summary.last_checkpoint, SaveCheckpoint());
    }
    LOOM_RETURN_IF_ERROR(comm_->Barrier());
    last_saved = step_;
    if (comm_->rank() == 0) {
      LogLine(absl::StrCat("checkpoint: step ", step_, " committed to ", summary.last_checkpoint));
    }
    return absl::OkStatus();
  };
  LogLine(absl::StrFormat(
      "loom-train: %d layers, d_model %d, %d heads, %d parameters; %d steps x %d tokens "
      "on %s, %s, %d threads, %d rank(s); %.3g forward FLOPs/token",
      spec_.model().n_layers(), spec_.model().d_model(), spec_.model().n_heads(),
      model_->NumParameters(), total, tokens_per_step, device_.str(), spec_.precision(),
      torch::get_num_threads(), comm_->world_size(), forward_flops_per_token_));
  const bool task = spec_.data().source() == "task" || spec_.data().source() == "chat";
  // data.splits: an epoch is one pass's worth of steps over the train split (every rank draws
  // from the same global order, so world_size ranks together take micro_batch x world_size).
  const bool splits = validation_split_ != nullptr;
  const int64_t examples_per_step = spec_.micro_batch() * spec_.grad_accum() * comm_->world_size();
  const int64_t steps_per_epoch =
      splits ? (spec_.data().splits().train() + examples_per_step - 1) / examples_per_step : 0;
  auto epoch_of = [&](int64_t step) {
    return splits ? (step + steps_per_epoch - 1) / steps_per_epoch : 0;
  };
  int64_t last_eval_step = -1;
  auto evaluate = [&]() {
    EvalResult e =
        splits ? EvaluateSplit(*validation_split_, "validation", epoch_of(step_)) : Evaluate();
    last_eval_step = step_;
    summary.last_eval_loss = e.loss;
    summary.last_eval_accuracy = e.accuracy;
    summary.last_eval_exact_match = e.exact_match;
    LogLine(task ? absl::StrFormat("%s at step %d: loss %.4f  accuracy %.4f  exact match %.4f",
                                   splits ? "validation" : "eval", step_, e.loss, e.accuracy,
                                   e.exact_match)
                 : absl::StrFormat("eval loss at step %d: %.4f", step_, e.loss));
    return e;
  };
  if (splits) {
    LogLine(absl::StrFormat(
        "splits: %d train examples, %d per step: %d steps per epoch, at most %d epochs; "
        "patience %d",
        spec_.data().splits().train(), examples_per_step, steps_per_epoch, epoch_of(total),
        spec_.eval().patience()));
  }
  bool stop_early = false;
  // The end of an epoch (or of the run): validate; on a lower validation loss, test and remember
  // it; after `patience` epochs without one, stop.
  auto epoch_end = [&]() {
    const int64_t epoch = epoch_of(step_);
    const EvalResult v = evaluate();
    EarlyStop& es = early_;
    if (v.loss < es.best_loss) {
      es.best_loss = v.loss;
      es.best_epoch = epoch;
      es.best_step = step_;
      es.bad_epochs = 0;
      es.test = EvaluateSplit(*test_split_, "test", epoch);
      es.has_test = true;
      LogLine(absl::StrFormat(
          "epoch %d (step %d): validation loss %.4f, best so far; test loss %.4f  accuracy %.4f  "
          "exact match %.4f",
          epoch, step_, v.loss, es.test.loss, es.test.accuracy, es.test.exact_match));
    } else {
      ++es.bad_epochs;
      LogLine(absl::StrFormat(
          "epoch %d (step %d): validation loss %.4f, no improvement on %.4f (epoch %d) for %d "
          "epoch(s)",
          epoch, step_, v.loss, es.best_loss, es.best_epoch, es.bad_epochs));
      if (spec_.eval().patience() > 0 && es.bad_epochs >= spec_.eval().patience()) {
        stop_early = true;
      }
    }
  };
  // Resumed from the checkpoint an early stop wrote: nothing left to train.
  if (splits && spec_.eval().patience() > 0 && early_.bad_epochs >= spec_.eval().patience()) {
    stop_early = true;
  }
  if (step_ == 0) summary.first_eval_loss = evaluate().loss;
  std::vector<torch::Tensor> params = model_->parameters();
  const auto run_start = Clock::now();
  const int64_t first_step = step_;
  try {
    while (step_ < total && !stop_early &&
           !(options_.stop_after > 0 && step_ >= options_.stop_after)) {
      const auto step_start = Clock::now();
      const double lr = LearningRateAt(spec_.optimizer(), total, step_);
      for (auto& p : params) p.mutable_grad() = torch::Tensor();
      double loss_sum = 0;
      for (int64_t micro = 0; micro < spec_.grad_accum(); ++micro) {
        // Only the last micro-batch's backward communicates (no redundant all-reduces).
        if (reducer_ && micro == spec_.grad_accum() - 1) reducer_->Arm();
        TrainBatch batch = [&] {
          RECORD_USER_SCOPE("loom::next_batch");  // named in profiles (op_profile.h)
          return NextLocalBatch();
        }();
        torch::Tensor loss = ScoreBatch(Forward(batch), batch, false).loss;
        torch::Tensor scaled = loss_scaler_ ? loss_scaler_->Scale(loss) : loss;
        (scaled / static_cast<double>(spec_.grad_accum())).backward();
        loss_sum += loss.item<double>();
      }
      StepRecord r;
      r.step = step_ + 1;
      r.lr = lr;
      r.loss = loss_sum / static_cast<double>(spec_.grad_accum());
      if (comm_->world_size() > 1) {
        // The buckets started during the last backward; wait for them: gradients become the
        // global mean.
        LOOM_RETURN_IF_ERROR(reducer_->Finish());
        if (step_ == first_step) {
          LogLine(absl::StrFormat(
              "gradient all-reduce: %d bucket(s) of <= %d bytes, %d started during backward",
              reducer_->buckets(), spec_.dist_bucket_bytes(), reducer_->started_during_backward()));
        }
        LOOM_ASSIGN_OR_RETURN(r.loss, comm_->AllReduceMean(r.loss));
      }
      if (std::find(inject_nan_at_.begin(), inject_nan_at_.end(), r.step) != inject_nan_at_.end()) {
        r.loss = std::nan("");  // test hook
      }
      const double clip = spec_.optimizer().clip_norm() > 0
                              ? spec_.optimizer().clip_norm()
                              : std::numeric_limits<double>::infinity();
      RECORD_USER_SCOPE("loom::clip_and_update");
      if (loss_scaler_) {
        r.loss_scale = loss_scaler_->scale();
        loss_scaler_->Unscale(params);  // the reduced gradients are identical on every rank
      }
      r.grad_norm = torch::nn::utils::clip_grad_norm_(params, clip);
      const bool finite = std::isfinite(r.loss) && std::isfinite(r.grad_norm);
      if (loss_scaler_) UpdateLossScale(finite, &r, &summary);
      if (finite) {
        optimizer_->Step(lr);
        if (zero_) LOOM_RETURN_IF_ERROR(BroadcastOwnedParameters());
        consecutive_nan_ = 0;
      } else if (r.overflowed) {
        r.skipped = true;  // a finite loss whose scaled gradients overflowed: not a divergence
      } else {
        r.skipped = true;
        ++consecutive_nan_;
        ++summary.nan_skipped;
        registry_.Increment("loom_train_nan_skipped_steps_total", 1, labels_);
        LogLine(absl::StrFormat(
            "step %d: non-finite loss %g or gradient norm %g; update skipped (%d in a row)", r.step,
            r.loss, r.grad_norm, consecutive_nan_));
      }
      ++step_;
      tokens_seen_ += tokens_per_step;
      r.seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
      r.tokens_per_second = static_cast<double>(tokens_per_step) / r.seconds;
      r.mfu = spec_.metrics().peak_flops() > 0
                  ? flops_per_step / r.seconds / spec_.metrics().peak_flops()
                  : 0;
      summary.steps.push_back(r);

      registry_.Set("loom_train_loss", r.loss, labels_);
      registry_.Set("loom_train_learning_rate", r.lr, labels_);
      registry_.Set("loom_train_grad_norm", r.grad_norm, labels_);
      registry_.Set("loom_train_tokens_per_second", r.tokens_per_second, labels_);
      registry_.Set("loom_train_mfu_ratio", r.mfu, labels_);
      registry_.Set("loom_train_step", static_cast<double>(step_), labels_);
      registry_.Increment("loom_train_tokens_total", static_cast<double>(tokens_per_step), labels_);
      registry_.Observe("loom_train_step_seconds", r.seconds, labels_);
      if (step_ % spec_.metrics().log_every() == 0 || step_ == total) ReportGpuMemory();
      WriteJsonl(absl::StrCat(
          "{\"event\":\"step\",\"step\":", r.step, ",\"loss\":", JsonNumber(r.loss),
          ",\"lr\":", JsonNumber(r.lr), ",\"grad_norm\":", JsonNumber(r.grad_norm),
          ",\"step_seconds\":", JsonNumber(r.seconds), ",\"tokens_per_second\":",
          JsonNumber(r.tokens_per_second), ",\"mfu\":", JsonNumber(r.mfu),
          ",\"tokens_seen\":", tokens_seen_, ",\"skipped\":", r.skipped ? "true" : "false",
          loss_scaler_ ? absl::StrCat(",\"loss_scale\":", JsonNumber(r.loss_scale),
                                      ",\"overflowed\":", r.overflowed ? "true" : "false")
                       : "",
          ",\"time_unix_ms\":", UnixMillis(), "}"));

      if (consecutive_nan_ >= spec_.max_nan_skips()) {
        return absl::DataLossError(absl::StrCat("step ", step_, ": ", consecutive_nan_,
                                                " consecutive non-finite steps (max_nan_skips = ",
                                                spec_.max_nan_skips(), "); stopping"));
      }
      const int64_t every = spec_.metrics().log_every();
      if (options_.log && (step_ % every == 0 || step_ == total || step_ == first_step + 1)) {
        const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
        const double eta =
            elapsed / static_cast<double>(step_ - first_step) * static_cast<double>(total - step_);
        std::string line =
            absl::StrFormat("step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s", step_,
                            total, r.loss, r.lr, r.grad_norm, r.tokens_per_second);
        if (r.mfu > 0) line += absl::StrFormat("  mfu %.1f%%", 100 * r.mfu);
        line += "  ETA " + Duration(eta);
        if (options_.progress_bar) {
          const int width = 24, filled = static_cast<int>(width * step_ / total);
          *options_.log << "\r\033[K[" << std::string(filled, '#')
                        << std::string(width - filled, '.') << "] " << line << std::flush;
        } else {
          LogLine(line);
        }
      }
      if (splits) {
        if (step_ % steps_per_epoch == 0 || step_ == total) epoch_end();
      } else if (spec_.eval().interval() > 0 && step_ % spec_.eval().interval() == 0 &&
                 step_ < total) {
        evaluate();
      }
      if (checkpoints && spec_.checkpoint().interval() > 0 &&
          step_ % spec_.checkpoint().interval() == 0) {
        LOOM_RETURN_IF_ERROR(save());
      }
      if (stop_early) break;
      LOOM_ASSIGN_OR_RETURN(const bool stop, StopRequested());
      if (stop) {
        if (checkpoints && last_saved != step_) LOOM_RETURN_IF_ERROR(save());
        return absl::CancelledError(absl::StrCat(
            "stopped at step ", step_, " on request (SIGTERM)",
            checkpoints ? absl::StrCat("; checkpoint ", summary.last_checkpoint, " written")
                        : std::string("; no checkpoint directory, nothing saved")));
      }
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("step ", step_ + 1, ": ", e.what()));
  }
  if (options_.progress_bar && options_.log) *options_.log << "\n";
  if ((step_ >= total || stop_early || (options_.stop_after > 0 && step_ >= options_.stop_after)) &&
      last_eval_step != step_) {
    evaluate();
  }
  if (step_ >= total && comm_->rank() == 0) {
    for (const auto& [length, make] : length_eval_data_) {
      const EvalResult e = EvaluateBatches(*make(), length);
      summary.length_evals.push_back({length, e.loss, e.accuracy, e.exact_match});
      LogLine(absl::StrFormat("eval at length %d: loss %.4f  accuracy %.4f  exact match %.4f",
                              length, e.loss, e.accuracy, e.exact_match));
    }
  }
  if (splits) {
    summary.epochs = epoch_of(step_);
    summary.early_stopped = stop_early;
    summary.best_epoch = early_.best_epoch;
    if (early_.has_test) {
      summary.best_validation_loss = early_.best_loss;
      summary.test_loss = early_.test.loss;
      summary.test_accuracy = early_.test.accuracy;
      summary.test_exact_match = early_.test.exact_match;
      LogLine(absl::StrFormat(
          "%s after epoch %d (step %d); best validation loss %.4f at epoch %d (step %d): test "
          "loss %.4f  accuracy %.4f  exact match %.4f",
          stop_early ? "early stopping" : "training ended", summary.epochs, step_, early_.best_loss,
          early_.best_epoch, early_.best_step, early_.test.loss, early_.test.accuracy,
          early_.test.exact_match));
    }
  }
  if (checkpoints && last_saved != step_) LOOM_RETURN_IF_ERROR(save());
  summary.final_step = step_;
  if (spec_.kind() == "sft" && spec_.reasoning_eval().when() == "end" && step_ >= total) {
    try {
      LOOM_RETURN_IF_ERROR(ReasoningEvaluate(&summary));
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("reasoning eval: ", e.what()));
    }
  }
  return summary;
}

}  // namespace loom::trainer
