#include "worker/trainer/checkpointer.h"

#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "loom/proto_json.h"
#include "loom/spec.h"
#include "worker/trainer/lease.h"
#include "worker/trainer/tensor_io.h"

namespace loom::trainer {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr char kModelPrefix[] = "model.";
constexpr char kOptimPrefix[] = "optim.";
constexpr char kTorchRng[] = "rng.torch_cpu";

// The shards' tensors merged by name and split into the model's and AdamW's (prefixes dropped).
// Parameters live in shard 0, moments in the shard of the rank that owned them.
struct SplitTensors {
  std::map<std::string, torch::Tensor> model, optim;
  std::map<std::string, torch::Tensor> all;
};
absl::StatusOr<SplitTensors> ReadTensors(const storage::LoadedCheckpoint& loaded) {
  SplitTensors out;
  for (const auto& shard : loaded.shards) {
    LOOM_ASSIGN_OR_RETURN(auto part, TensorsFromFile(shard));
    out.all.insert(part.begin(), part.end());
  }
  for (auto& [name, t] : out.all) {
    if (name.rfind(kModelPrefix, 0) == 0) out.model[name.substr(sizeof(kModelPrefix) - 1)] = t;
    if (name.rfind(kOptimPrefix, 0) == 0) out.optim[name.substr(sizeof(kOptimPrefix) - 1)] = t;
  }
  return out;
}

}  // namespace

Checkpointer::Checkpointer(const v1::JobSpec& spec, CheckpointedState state, Communicator* comm,
                           StepReporter* reporter, Options options)
    : spec_(spec),
      state_(state),
      comm_(comm),
      reporter_(reporter),
      options_(std::move(options)),
      model_hash_(ModelHash(spec)),
      spec_hash_(SpecHash(spec)) {}

absl::Status Checkpointer::OpenStore() {
  const std::string& dir = spec_.checkpoint().dir();
  LOOM_ASSIGN_OR_RETURN(store_, storage::OpenCheckpointStore(dir));
  if (!store_->remote()) return absl::OkStatus();
  // ZeRO-1: every rank uploads its own shard; otherwise rank 0 alone writes.
  if (comm_->rank() != 0 && !options_.zero) return absl::OkStatus();
  storage::CheckpointUploader::Hooks hooks;
  hooks.before_commit = [] {
    RequireLease("before a checkpoint commit");
    return absl::OkStatus();
  };
  if (options_.apply_retention) {
    hooks.after_upload = [this] {
      (void)store_->ApplyRetention(spec_.checkpoint().keep_last(), spec_.checkpoint().keep_every());
    };
  }
  uploader_ = std::make_unique<storage::CheckpointUploader>(store_.get(), std::move(hooks));
  return absl::OkStatus();
}

std::string Checkpointer::StagingRoot() const {
  const char* staging = std::getenv("LOOM_STAGING_DIR");
  fs::path root = staging != nullptr && *staging != '\0'
                      ? fs::path(staging)
                      : fs::path(storage::LocalCacheDir()) / "staging" / spec_hash_;
  // ZeRO-1 ranks of one job on one node stage apart.
  if (options_.zero) root /= absl::StrCat("rank-", comm_->rank());
  return root.string();
}

absl::Status Checkpointer::Start(const StartFrom& from) {
  const std::string& dir = spec_.checkpoint().dir();
  if (!dir.empty()) LOOM_RETURN_IF_ERROR(OpenStore());
  if (!dir.empty() && comm_->rank() == 0) {
    LOOM_ASSIGN_OR_RETURN(int removed, store_->CleanIncomplete());
    if (removed > 0) {
      reporter_->Log(
          absl::StrCat("checkpoint: removed ", removed, " incomplete checkpoint(s) in ", dir));
    }
    if (store_->remote()) DropStagedBefore(std::numeric_limits<int64_t>::max());
  }
  if (!from.resume.empty() && !from.init_from.empty()) {
    return absl::InvalidArgumentError("--resume and --init-from are exclusive");
  }
  if (!from.resume.empty() && !from.resume_if_any.empty()) {
    return absl::InvalidArgumentError("--resume and --resume-if-any are exclusive");
  }
  if (!from.resume_if_any.empty()) return RestoreNewestIntact(from.resume_if_any, from.init_from);
  if (!from.resume.empty()) LOOM_RETURN_IF_ERROR(Restore(from.resume, false));
  if (!from.init_from.empty()) LOOM_RETURN_IF_ERROR(Restore(from.init_from, true));
  return absl::OkStatus();
}

void Checkpointer::ReportStart(const StartFrom& from) {
  for (const Note& k : skipped_) {
    v1::TrainerEvent e;
    e.mutable_checkpoint_skipped()->set_step(k.step);
    e.mutable_checkpoint_skipped()->set_dir(k.dir);
    e.mutable_checkpoint_skipped()->set_reason(k.reason);
    reporter_->Event(e);
  }
  if (from.resume_if_any.empty()) return;
  v1::TrainerEvent e;
  e.mutable_resumed()->set_step(resumed_.step);
  e.mutable_resumed()->set_dir(resumed_.dir);
  reporter_->Event(e);
}

absl::Status Checkpointer::Restore(const std::string& where, bool weights_only) {
  const auto start = Clock::now();
  std::vector<absl::Status> skipped;
  absl::StatusOr<storage::LoadedCheckpoint> loaded = storage::LoadCheckpointAt(where, &skipped);
  for (const absl::Status& s : skipped) {
    reporter_->Log(absl::StrCat("checkpoint: skipping a damaged checkpoint: ", s.message()));
  }
  if (!loaded.ok()) {
    return absl::Status(
        loaded.status().code(),
        absl::StrCat(weights_only ? "--init-from" : "--resume", ": ", loaded.status().message()));
  }
  return Apply(*loaded, weights_only, start);
}

// --resume-if-any: the newest checkpoint under `root` that verifies and restores; each newer
// one that does not is skipped and reported (events "checkpoint_skipped") so the control plane
// marks it. None at all: a fresh start (or --init-from).
absl::Status Checkpointer::RestoreNewestIntact(const std::string& root,
                                               const std::string& init_from) {
  std::unique_ptr<storage::CheckpointStore> other;
  storage::CheckpointStore* store = store_.get();
  if (store == nullptr || store->root() != root) {
    LOOM_ASSIGN_OR_RETURN(other, storage::OpenCheckpointStore(root));
    store = other.get();
  }
  LOOM_ASSIGN_OR_RETURN(std::vector<storage::CheckpointRef> refs, store->List());
  for (auto it = refs.rbegin(); it != refs.rend(); ++it) {
    const auto start = Clock::now();
    absl::StatusOr<storage::LoadedCheckpoint> loaded = store->Load(it->dir);
    absl::Status s = loaded.ok() ? Apply(*loaded, false, start) : loaded.status();
    if (s.ok()) {
      resumed_ = {it->step, it->dir, ""};
      return absl::OkStatus();
    }
    if (absl::IsInvalidArgument(s)) return s;  // the spec does not fit its own checkpoints
    // The store failing (unreachable, credentials) is no reason to pass over a checkpoint.
    if (absl::IsUnavailable(s) || absl::IsPermissionDenied(s)) return s;
    reporter_->Log(absl::StrCat("checkpoint: skipping ", it->dir, ": ", s.message()));
    skipped_.push_back({it->step, it->dir, std::string(s.message())});
  }
  resumed_ = {0, "", ""};
  if (!init_from.empty()) return Restore(init_from, true);
  return absl::OkStatus();
}

absl::Status Checkpointer::Apply(const storage::LoadedCheckpoint& loaded, bool weights_only,
                                 Clock::time_point start) {
  const char* what = weights_only ? "--init-from" : "--resume";
  const storage::Manifest& m = loaded.manifest;
  LOOM_ASSIGN_OR_RETURN(SplitTensors tensors, ReadTensors(loaded));
  if (!weights_only) {
    auto it = m.state.find("model_hash");
    if (it == m.state.end() || it->second != model_hash_) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": ", loaded.dir, " holds a different model (hash ",
                       it == m.state.end() ? "none" : it->second, ", this spec ", model_hash_,
                       "); use --init-from to start a new run from its weights"));
    }
  }
  if (absl::Status s = LoadIntoModule(*state_.model, tensors.model); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", loaded.dir, ": model: ", s.message()));
  }
  if (weights_only) {
    state_.progress->parent = loaded.dir;
    reporter_->Log(absl::StrCat("init-from: weights of ", loaded.dir, " (step ", m.step,
                                "); fresh optimizer"));
  } else {
    auto rng = tensors.all.find(kTorchRng);
    LOOM_RETURN_IF_ERROR(ApplyTrainingState(
        loaded, tensors.optim, rng == tensors.all.end() ? nullptr : &rng->second, what));
  }
  reporter_->registry().Observe("loom_train_checkpoint_load_seconds",
                                std::chrono::duration<double>(Clock::now() - start).count(),
                                reporter_->labels());
  return absl::OkStatus();
}

// --resume: everything beyond the weights (optimizer, data cursor, early stopping, loss scale,
// counters, LibTorch's generator).
absl::Status Checkpointer::ApplyTrainingState(const storage::LoadedCheckpoint& loaded,
                                              std::map<std::string, torch::Tensor>& optim_tensors,
                                              const torch::Tensor* torch_rng, const char* what) {
  const storage::Manifest& m = loaded.manifest;
  auto get = [&](const std::string& key) -> absl::StatusOr<std::string> {
    auto it = m.state.find(key);
    if (it == m.state.end())
      return absl::DataLossError(absl::StrCat(what, ": manifest lacks state '", key, "'"));
    return it->second;
  };
  LOOM_ASSIGN_OR_RETURN(std::string optim_step, get("optim.step"));
  LOOM_ASSIGN_OR_RETURN(std::string data_rng, get("data.rng"));
  LOOM_ASSIGN_OR_RETURN(std::string nan_run, get("nan.consecutive"));
  TrainProgress& p = *state_.progress;
  int64_t optim_step_value = 0;
  if (!absl::SimpleAtoi(optim_step, &optim_step_value) ||
      !absl::SimpleAtoi(nan_run, &p.consecutive_nan)) {
    return absl::DataLossError(
        absl::StrCat(what, ": malformed optimizer step or NaN counter in the manifest"));
  }
  for (auto& [name, t] : optim_tensors) t = t.to(options_.device);
  LOOM_RETURN_IF_ERROR(state_.optimizer->LoadState(optim_tensors, optim_step_value));
  if (state_.data != nullptr) LOOM_RETURN_IF_ERROR(state_.data->Restore(data_rng));
  if (state_.early_stop != nullptr) {
    LOOM_ASSIGN_OR_RETURN(std::string early, get("split.early_stop"));
    LOOM_RETURN_IF_ERROR(state_.early_stop->Restore(early));
  }
  if (state_.loss_scaler != nullptr) {
    // A checkpoint written without loss scaling resumes at the configured initial scale.
    auto it = m.state.find("loss_scale");
    if (it != m.state.end()) LOOM_RETURN_IF_ERROR(state_.loss_scaler->Restore(it->second));
  }
  if (torch_rng == nullptr)
    return absl::DataLossError(absl::StrCat(what, ": shard lacks ", kTorchRng));
  at::Generator generator = at::detail::getDefaultCPUGenerator();  // a handle to the global one
  generator.set_state(*torch_rng);
  p.step = m.step;
  p.tokens_seen = m.tokens_seen;
  p.parent = m.parent;
  reporter_->Log(
      absl::StrCat("resume: ", loaded.dir, " at step ", p.step, " (", p.tokens_seen, " tokens)"));
  return absl::OkStatus();
}

bool Checkpointer::Due(int64_t step) const {
  return enabled() && spec_.checkpoint().interval() > 0 &&
         step % spec_.checkpoint().interval() == 0;
}

bool Checkpointer::DueByTime() const {
  const int64_t seconds = spec_.checkpoint().interval_seconds();
  return enabled() && seconds > 0 &&
         std::chrono::steady_clock::now() - last_save_time_ >= std::chrono::seconds(seconds);
}

absl::Status Checkpointer::Save() {
  // Data-parallel state is replicated: rank 0 writes it, the others wait.
  if (comm_->rank() == 0 || options_.zero) {
    LOOM_ASSIGN_OR_RETURN(last_checkpoint_, Write());
  }
  LOOM_RETURN_IF_ERROR(comm_->Barrier());
  last_saved_ = state_.progress->step;
  last_save_time_ = std::chrono::steady_clock::now();
  if (comm_->rank() == 0) {
    reporter_->Log(absl::StrCat("checkpoint: step ", last_saved_,
                                uploader_ ? " staged, uploading to " : " committed to ",
                                last_checkpoint_));
  }
  return absl::OkStatus();
}

storage::Manifest Checkpointer::ManifestNow() const {
  const TrainProgress& p = *state_.progress;
  storage::Manifest manifest;
  manifest.tokens_seen = p.tokens_seen;
  manifest.spec_hash = spec_hash_;
  manifest.parent = p.parent;
  manifest.kind = spec_.kind();
  manifest.state = {{"optim.step", std::to_string(state_.optimizer->step())},
                    {"data.rng", state_.data ? state_.data->State() : ""},
                    {"nan.consecutive", std::to_string(p.consecutive_nan)},
                    {"model_hash", model_hash_},
                    {"zero_stage", options_.zero ? "1" : "0"},
                    {"spec", MessageToJsonText(spec_)}};
  if (state_.early_stop != nullptr) manifest.state["split.early_stop"] = state_.early_stop->State();
  if (state_.loss_scaler != nullptr) manifest.state["loss_scale"] = state_.loss_scaler->State();
  return manifest;
}

// This rank's shard; with ZeRO-1 every rank writes its shard into one temporary directory that
// rank 0 creates and commits, otherwise rank 0 alone writes the (replicated) state. Returns the
// committed directory on rank 0, "" on the others.
absl::StatusOr<std::string> Checkpointer::Write() {
  const auto start = Clock::now();
  const int64_t step = state_.progress->step;
  NamedTensors tensors;
  const int rank = comm_->rank(), world = options_.zero ? comm_->world_size() : 1;
  if (rank == 0) {
    for (auto& [name, t] : ModuleTensors(*state_.model))
      tensors.emplace_back(kModelPrefix + name, t);
    tensors.emplace_back(kTorchRng, at::detail::getDefaultCPUGenerator().get_state());
  }
  for (auto& [name, t] : state_.optimizer->StateTensors())
    tensors.emplace_back(kOptimPrefix + name, t);
  LOOM_ASSIGN_OR_RETURN(WritableTensors writable, ToWritable(tensors));
  // Per attempt: a fenced attempt's half-written directory never mixes with the next one's.
  const char* attempt = std::getenv("LOOM_ATTEMPT");
  const std::string token =
      absl::StrCat("run", spec_hash_, attempt ? "-a" : "", attempt ? attempt : "");
  if (options_.zero && uploader_ != nullptr) return WriteShardRemote(step, writable, token, start);
  if (options_.zero && rank != 0) LOOM_RETURN_IF_ERROR(comm_->Barrier());  // directory created
  LOOM_ASSIGN_OR_RETURN(
      storage::CheckpointWriter writer,
      storage::CheckpointWriter::Begin(uploader_ ? StagingRoot() : spec_.checkpoint().dir(), step,
                                       world, token, rank == 0));
  if (options_.zero && rank == 0) LOOM_RETURN_IF_ERROR(comm_->Barrier());
  if (absl::Status s = writer.WriteShard(rank, writable.items, {{"format", "pt"}}); !s.ok()) {
    if (rank == 0) writer.Abort();
    return s;
  }
  if (options_.zero) {
    LOOM_RETURN_IF_ERROR(comm_->Barrier());  // every shard is on disk
    if (rank != 0) return std::string();
    for (int r = 1; r < world; ++r) LOOM_RETURN_IF_ERROR(writer.AdoptShard(r));
  }
  if (options_.before_commit) options_.before_commit(step);
  RequireLease("before a checkpoint commit");
  auto dir = writer.Commit(ManifestNow());
  if (!dir.ok()) {
    writer.Abort();
    return dir.status();
  }
  uint64_t bytes = 0;
  for (const auto& item : writable.items) bytes += item.size_bytes;
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (uploader_ != nullptr) return Stage(step, *dir, seconds, bytes);
  if (options_.apply_retention) {
    LOOM_RETURN_IF_ERROR(storage::ApplyRetention(
        spec_.checkpoint().dir(), spec_.checkpoint().keep_last(), spec_.checkpoint().keep_every()));
  }
  reporter_->Checkpoint(step, *dir, seconds, bytes);
  return *dir;
}

// ZeRO-1 on an object store, where no directory is shared: each rank commits its shard as a
// one-shard local checkpoint in its own staging directory and uploads it; the ranks exchange
// their shards' sizes and CRC-32Cs, and rank 0 commits the manifest once every shard is in the
// store (CheckpointStore::CommitManifest). Returns the step's URL on rank 0, "" elsewhere.
absl::StatusOr<std::string> Checkpointer::WriteShardRemote(int64_t step,
                                                           const WritableTensors& writable,
                                                           const std::string& token,
                                                           Clock::time_point start) {
  const int rank = comm_->rank(), world = comm_->world_size();
  // A rerun of a step stops existing before any rank's shard of it changes (the exchange
  // below orders every upload after this).
  if (rank == 0) LOOM_RETURN_IF_ERROR(store_->Uncommit(step));
  LOOM_ASSIGN_OR_RETURN(storage::CheckpointWriter writer,
                        storage::CheckpointWriter::Begin(StagingRoot(), step, 1, token));
  if (absl::Status s = writer.WriteShard(0, writable.items, {{"format", "pt"}}); !s.ok()) {
    writer.Abort();
    return s;
  }
  auto dir = writer.Commit(ManifestNow());
  if (!dir.ok()) {
    writer.Abort();
    return dir.status();
  }
  LOOM_ASSIGN_OR_RETURN(storage::ShardInfo mine, writer.shard(0));
  mine.rank = rank;
  mine.file = storage::ShardFileName(rank, world);
  LOOM_ASSIGN_OR_RETURN(std::vector<storage::ShardInfo> all, ExchangeShards(mine));
  std::optional<storage::Manifest> commit;
  if (rank == 0) {
    commit = ManifestNow();
    commit->step = step;
    commit->world_size = world;
    commit->shards = all;
    commit->created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                  std::chrono::system_clock::now().time_since_epoch())
                                  .count();
  }
  uint64_t bytes = 0;
  for (const auto& item : writable.items) bytes += item.size_bytes;
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double waited = uploader_->SubmitShard(step, *dir, mine, std::move(commit), bytes);
  LOOM_RETURN_IF_ERROR(Poll());
  staged_[step] = {seconds, waited};
  DropStagedBefore(step);
  return rank == 0 ? store_->root() + "/" + storage::CheckpointDirName(step) : std::string();
}

// Every rank's shard size and CRC-32C, from every rank (one broadcast each, as float64: exact
// for both).
absl::StatusOr<std::vector<storage::ShardInfo>> Checkpointer::ExchangeShards(
    const storage::ShardInfo& mine) {
  std::vector<storage::ShardInfo> all;
  for (int r = 0; r < comm_->world_size(); ++r) {
    torch::Tensor t = torch::zeros({2}, torch::dtype(torch::kFloat64).device(options_.device));
    if (r == comm_->rank()) {
      uint32_t crc = 0;
      if (!absl::SimpleHexAtoi(mine.crc32c, &crc)) return absl::InternalError("shard checksum");
      t = torch::tensor({static_cast<double>(mine.bytes), static_cast<double>(crc)},
                        torch::dtype(torch::kFloat64))
              .to(options_.device);
    }
    LOOM_RETURN_IF_ERROR(comm_->Broadcast({t}, r));
    const torch::Tensor cpu = t.cpu();
    storage::ShardInfo info;
    info.rank = r;
    info.file = storage::ShardFileName(r, comm_->world_size());
    info.bytes = static_cast<uint64_t>(cpu[0].item<double>());
    info.crc32c = absl::StrFormat("%08x", static_cast<uint32_t>(cpu[1].item<double>()));
    all.push_back(info);
  }
  return all;
}

// A step committed to the staging directory goes to the uploader; the previous upload is
// finished by then, so every older staged step can go.
absl::StatusOr<std::string> Checkpointer::Stage(int64_t step, const std::string& local_dir,
                                                double seconds, uint64_t bytes) {
  const double waited = uploader_->Submit(step, local_dir, bytes);
  LOOM_RETURN_IF_ERROR(Poll());
  staged_[step] = {seconds, waited};
  DropStagedBefore(step);
  return store_->root() + "/" + storage::CheckpointDirName(step);
}

void Checkpointer::DropStagedBefore(int64_t step) {
  auto staged = storage::ListCheckpoints(StagingRoot());
  if (!staged.ok()) return;
  for (const storage::CheckpointRef& ref : *staged) {
    if (ref.step < step) (void)storage::DeleteCheckpoint(ref.dir);
  }
  (void)storage::CleanIncomplete(StagingRoot());
}

absl::Status Checkpointer::Poll() {
  if (uploader_ == nullptr) return absl::OkStatus();
  for (const std::string& note : uploader_->TakeNotes()) reporter_->Log(note);
  for (const storage::CheckpointUploader::Finished& f : uploader_->TakeFinished()) {
    const Staged staged = staged_[f.step];
    staged_.erase(f.step);
    if (!f.status.ok()) {
      return absl::Status(f.status.code(), absl::StrCat("checkpoint upload of step ", f.step, ": ",
                                                        f.status.message()));
    }
    if (comm_->rank() != 0) continue;  // ZeRO-1: rank 0 reports the committed step
    const StepReporter::UploadTimes times{f.seconds, staged.wait_seconds,
                                          f.retries + f.request_retries};
    reporter_->Checkpoint(f.step, f.where, staged.write_seconds, f.bytes, &times);
    reporter_->Log(
        absl::StrFormat("checkpoint: step %d uploaded to %s (%.2f s; %d retried "
                        "request(s), %d retried upload(s))",
                        f.step, f.where, f.seconds, f.request_retries, f.retries));
  }
  return absl::OkStatus();
}

absl::Status Checkpointer::Flush() {
  if (uploader_ == nullptr) return absl::OkStatus();
  uploader_->Wait();
  return Poll();
}

}  // namespace loom::trainer
