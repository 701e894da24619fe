#include "coordinator.h"

#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "checkpoint.h"
#include "loom/spec.h"
#include "loom/status_macros.h"
#include "sweep.h"

namespace fs = std::filesystem;

namespace loom::coordinator {
namespace {

constexpr const char* kStates[] = {"queued",    "scheduled", "running",  "retrying",
                                   "succeeded", "failed",    "cancelled"};

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool IsActive(const std::string& state) { return state == "scheduled" || state == "running"; }

// Labels, pool selectors and idempotency keys: short printable tokens.
bool IsToken(const std::string& s, size_t max_len) {
  if (s.empty() || s.size() > max_len) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == '/' || c == ':')) {
      return false;
    }
  }
  return true;
}

absl::Status FieldError(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

// Idempotency keys are scoped per user: the same request_id from two users names two requests,
// and one user's key never reveals or returns another's job.
std::string IdempotencyKey(absl::string_view kind, const std::string& user,
                           const std::string& request_id) {
  return absl::StrCat(kind, user, "\x1f", request_id);
}

std::string RankText(const std::vector<int>& ranks) {
  if (ranks.empty()) return "";
  if (ranks.size() == 1) return absl::StrCat("rank ", ranks[0]);
  return absl::StrCat("ranks ", ranks.front(), "-", ranks.back());
}

bool HostsRankZero(const v1::Job& job, const std::string& worker_id) {
  for (const auto& p : job.placement()) {
    for (int r : p.ranks()) {
      if (r == 0) return p.worker_id() == worker_id;
    }
  }
  return false;
}

const v1::Placement* PlacementOf(const v1::Job& job, const std::string& worker_id) {
  for (const auto& p : job.placement()) {
    if (p.worker_id() == worker_id) return &p;
  }
  return nullptr;
}

bool Contains(const google::protobuf::RepeatedPtrField<std::string>& list, const std::string& s) {
  return std::find(list.begin(), list.end(), s) != list.end();
}

}  // namespace

bool IsTerminal(const std::string& state) {
  return state == "succeeded" || state == "failed" || state == "cancelled";
}

bool IsValidId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!(std::islower(static_cast<unsigned char>(c)) ||
          std::isdigit(static_cast<unsigned char>(c)) || c == '-')) {
      return false;
    }
  }
  return true;
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Open(const CoordinatorOptions& options) {
  if (options.data_dir.empty()) return absl::InvalidArgumentError("--data-dir is required");
  if (options.storage_root.empty()) return absl::InvalidArgumentError("--storage-root is required");
  std::unique_ptr<Coordinator> c(new Coordinator(options));
  std::error_code ec;
  c->options_.storage_root = fs::weakly_canonical(fs::absolute(options.storage_root), ec).string();
  fs::create_directories(c->options_.storage_root, ec);
  fs::create_directories(fs::path(options.data_dir) / "logs", ec);
  if (!ec) fs::create_directories(fs::path(options.data_dir) / "series", ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot create '", options.data_dir, "': ", ec.message()));
  }
  LOOM_ASSIGN_OR_RETURN(c->store_,
                        StateStore::Open((fs::path(options.data_dir) / "state").string()));
  LOOM_RETURN_IF_ERROR(c->Load());
  LOOM_RETURN_IF_ERROR(c->MigrateCheckpointIds());
  auto& r = c->registry_;
  r.DeclareGauge("loom_coordinator_jobs", "Jobs by state");
  r.DeclareGauge("loom_coordinator_workers", "Workers by state");
  r.DeclareGauge("loom_coordinator_slots",
                 "Slots on live workers, used and free (their sum is the capacity)");
  r.DeclareCounter("loom_coordinator_jobs_submitted_total", "Jobs accepted by POST /v1/jobs");
  r.DeclareCounter("loom_coordinator_job_restarts_total", "Failed attempts requeued");
  r.DeclareCounter("loom_coordinator_jobs_ended_total",
                   "Jobs that reached a terminal state (succeeded, failed, cancelled)");
  // At 0 from the start, so increase() sees the first failure (a series born at 1 has none).
  for (const char* s : {"succeeded", "failed", "cancelled"}) {
    r.Increment("loom_coordinator_jobs_ended_total", 0, {{"state", s}});
  }
  r.DeclareCounter("loom_coordinator_workers_lost_total", "Workers marked lost");
  r.DeclareCounter("loom_coordinator_http_requests_total", "HTTP requests by route and status");
  r.DeclareCounter("loom_coordinator_store_errors_total", "Failed RocksDB writes");
  // Label-less counters start at 0, so rate() and increase() see them from the first scrape.
  for (const char* c :
       {"loom_coordinator_jobs_submitted_total", "loom_coordinator_job_restarts_total",
        "loom_coordinator_workers_lost_total", "loom_coordinator_store_errors_total"}) {
    r.Increment(c, 0);
  }
  r.DeclareGauge("loom_coordinator_queue_depth", "Jobs waiting in the queue");
  r.DeclareHistogram("loom_coordinator_http_request_duration_seconds",
                     "REST request latency by route (logs streams excluded)",
                     {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5});
  r.DeclareHistogram("loom_coordinator_scheduling_delay_seconds",
                     "Time a job waited in the queue before a placement",
                     {0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 7200});
  // Per active job (scheduled or running) only: cardinality = jobs running now.
  r.DeclareGauge("loom_coordinator_job_step", "Last reported optimizer step of an active job");
  r.DeclareGauge("loom_coordinator_job_progress_age_seconds",
                 "Seconds since an active job last reported progress (or started)");
  r.DeclareGauge("loom_coordinator_job_checkpoint_age_seconds",
                 "Seconds since an active job's newest checkpoint (or its start)");
  return c;
}

Coordinator::~Coordinator() { Stop(); }

namespace {

// 32 random bytes from the kernel as 64 hex digits: a worker's heartbeat credential.
std::string RandomToken() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[32] = {};
  in.read(reinterpret_cast<char*>(bytes), sizeof(bytes));
  if (!in) {  // no /dev/urandom: std::random_device is the kernel's generator on Linux too
    std::random_device rd;
    for (auto& b : bytes) b = static_cast<unsigned char>(rd());
  }
  std::string out;
  for (unsigned char b : bytes) absl::StrAppendFormat(&out, "%02x", b);
  return out;
}

const v1::AttemptRecord* HistoryOf(const v1::Job& job, int attempt) {
  for (const auto& h : job.history()) {
    if (h.attempt() == attempt) return &h;
  }
  return nullptr;
}

std::string ParentJob(const std::string& checkpoint_id) {
  return checkpoint_id.substr(0, checkpoint_id.find_first_of("./"));
}

}  // namespace

std::string CheckpointId(const std::string& job_id, int64_t step) {
  return absl::StrCat(job_id, ".", step);
}

absl::StatusOr<std::string> CanonicalCheckpointId(const std::string& id, const std::string& field) {
  const size_t sep = id.find_first_of("./");
  int64_t step = -1;
  if (sep == std::string::npos || !IsValidId(id.substr(0, sep)) ||
      id.find_first_of("./", sep + 1) != std::string::npos ||
      !absl::SimpleAtoi(id.substr(sep + 1), &step) || step < 0 ||
      id.substr(sep + 1) != std::to_string(step)) {
    return FieldError(field, absl::StrCat("'", id.substr(0, 100),
                                          "' is not a checkpoint id (<job id>.<step>, e.g. "
                                          "job-000001.150)"));
  }
  return CheckpointId(id.substr(0, sep), step);
}

// State written before checkpoint ids were "<job>.<step>": catalogue keys, ids and parents,
// jobs' checkpoint lists and init_from are rewritten once, in one synced commit.
absl::Status Coordinator::MigrateCheckpointIds() {
  auto canonical = [](const std::string& id) {
    auto c = CanonicalCheckpointId(id, "checkpoint id");
    return c.ok() ? *c : id;
  };
  StateStore::Batch batch;
  std::map<std::string, v1::CheckpointEntry> migrated;
  for (auto& [id, entry] : checkpoints_) {
    v1::CheckpointEntry e = entry;
    e.set_id(canonical(id));
    if (!e.parent().empty()) e.set_parent(canonical(e.parent()));
    if (e.id() != id) batch.DeleteCheckpoint(id);
    if (e.id() != id || e.parent() != entry.parent()) batch.PutCheckpoint(e);
    migrated[e.id()] = std::move(e);
  }
  checkpoints_ = std::move(migrated);
  for (auto& [id, job] : jobs_) {
    const std::string before = job.SerializeAsString();
    for (auto& c : *job.mutable_checkpoints()) c = canonical(c);
    if (!job.request().init_from().empty()) {
      job.mutable_request()->set_init_from(canonical(job.request().init_from()));
    }
    if (job.SerializeAsString() != before) batch.PutJob(job);
  }
  return batch.empty() ? absl::OkStatus() : store_->Commit(batch, true);
}

absl::Status Coordinator::Load() {
  LOOM_ASSIGN_OR_RETURN(LoadedState state, store_->Load());
  jobs_ = std::move(state.jobs);
  event_counts_ = std::move(state.event_counts);
  workers_ = std::move(state.workers);
  checkpoints_ = std::move(state.checkpoints);
  request_ids_ = std::move(state.request_ids);
  next_job_ = state.next_job;
  log_offsets_ = std::move(state.log_offsets);
  credentials_ = std::move(state.credentials);
  sweeps_ = std::move(state.sweeps);
  next_sweep_ = state.next_sweep;
  for (const auto& [worker, token] : credentials_) credential_owner_[token] = worker;
  // Restarted: every known worker gets a fresh grace period to heartbeat again.
  const int64_t now = NowMs();
  for (auto& [id, w] : workers_) w.set_last_heartbeat_ms(now);
  // Retention decided before a crash but not carried out yet.
  for (const auto& [id, c] : checkpoints_) {
    std::error_code ec;
    if (c.deleted() && fs::exists(c.path(), ec)) pending_deletes_.push_back(c.path());
  }
  return absl::OkStatus();
}

void Coordinator::Start() {
  loop_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock,
                     std::chrono::milliseconds(std::max(50, options_.heartbeat_interval_ms / 4)));
      if (stop_) break;
      lock.unlock();
      Tick();
      lock.lock();
    }
  });
}

void Coordinator::Stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (loop_.joinable()) loop_.join();
}

void Coordinator::Save(Txn& txn, const v1::Job& job) {
  if (txn.jobs.count(job.id())) return;
  auto it = jobs_.find(job.id());
  txn.jobs[job.id()] = it == jobs_.end() ? std::nullopt : std::optional<v1::Job>(it->second);
  if (!txn.event_counts.count(job.id())) txn.event_counts[job.id()] = event_counts_[job.id()];
}

void Coordinator::Save(Txn& txn, const std::string& worker_id) {
  if (txn.workers.count(worker_id)) return;
  auto it = workers_.find(worker_id);
  txn.workers[worker_id] =
      it == workers_.end() ? std::nullopt : std::optional<v1::Worker>(it->second);
}

void Coordinator::SaveCheckpoint(Txn& txn, const std::string& id) {
  if (txn.checkpoints.count(id)) return;
  auto it = checkpoints_.find(id);
  txn.checkpoints[id] =
      it == checkpoints_.end() ? std::nullopt : std::optional<v1::CheckpointEntry>(it->second);
}

void Coordinator::SaveCredential(Txn& txn, const std::string& worker_id) {
  if (txn.credentials.count(worker_id)) return;
  auto it = credentials_.find(worker_id);
  txn.credentials[worker_id] =
      it == credentials_.end() ? std::nullopt : std::optional<std::string>(it->second);
}

absl::Status Coordinator::Commit(Txn& txn) {
  absl::Status s = txn.progress.empty() ? absl::OkStatus() : store_->Commit(txn.progress, false);
  if (s.ok() && !txn.batch.empty()) s = store_->Commit(txn.batch, true);
  if (s.ok()) {
    pending_deletes_.insert(pending_deletes_.end(), txn.deletes.begin(), txn.deletes.end());
    for (const auto& state : txn.ended) {
      registry_.Increment("loom_coordinator_jobs_ended_total", 1, {{"state", state}});
    }
    return s;
  }
  // Not on disk, so not in effect: put back everything the change touched.
  registry_.Increment("loom_coordinator_store_errors_total");
  Rollback(txn);
  return s;
}

void Coordinator::Rollback(Txn& txn) {
  auto restore = [](auto& live, auto& saved) {
    for (auto& [id, before] : saved) {
      if (before) {
        live[id] = *before;
      } else {
        live.erase(id);
      }
    }
  };
  restore(jobs_, txn.jobs);
  restore(workers_, txn.workers);
  restore(checkpoints_, txn.checkpoints);
  for (auto& [worker, before] : txn.credentials) {
    auto now = credentials_.find(worker);
    if (now != credentials_.end()) credential_owner_.erase(now->second);
    if (before) {
      credentials_[worker] = *before;
      credential_owner_[*before] = worker;
    } else {
      credentials_.erase(worker);
    }
  }
  for (auto& [id, n] : txn.event_counts) event_counts_[id] = n;
}

void Coordinator::AddEvent(Txn& txn, v1::Job& job, const std::string& state,
                           const std::string& reason) {
  Save(txn, job);
  v1::JobEvent e;
  e.set_seq(event_counts_[job.id()]++);
  e.set_time_ms(NowMs());
  e.set_state(state);
  e.set_reason(reason);
  e.set_attempt(job.attempt());
  txn.batch.PutEvent(job.id(), e);
}

void Coordinator::SetState(Txn& txn, v1::Job& job, const std::string& state,
                           const std::string& reason) {
  Save(txn, job);
  job.set_state(state);
  job.set_reason(reason);
  job.set_update_time_ms(NowMs());
  if (IsTerminal(state)) {
    txn.ended.push_back(state);
    job.set_end_time_ms(job.update_time_ms());
    job.clear_placement();
    if (job.history_size() > 0 && job.history().rbegin()->end_reason().empty()) {
      job.mutable_history()->rbegin()->set_end_reason(absl::StrCat(state, ": ", reason));
    }
  }
  AddEvent(txn, job, state, reason);
  txn.batch.PutJob(job);
  // A finished child no longer pins its parent's checkpoint.
  if (IsTerminal(state) && !job.request().init_from().empty()) {
    ApplyRetention(txn, ParentJob(job.request().init_from()));
  }
}

absl::StatusOr<std::string> Coordinator::InsideRoot(const std::string& field,
                                                    const std::string& value) const {
  const fs::path root(options_.storage_root);
  if (value.find('\0') != std::string::npos) return FieldError(field, "contains a NUL byte");
  fs::path p(value);
  for (const auto& part : p) {
    if (part == "..") return FieldError(field, absl::StrCat("'", value, "' must not contain '..'"));
  }
  const fs::path full = p.is_absolute() ? p.lexically_normal() : (root / p).lexically_normal();
  // Symlinks resolved: a link inside the root may point anywhere.
  std::error_code ec;
  const fs::path real = fs::weakly_canonical(full, ec);
  const std::string r = root.string();
  for (const std::string& f : {full.string(), ec ? full.string() : real.string()}) {
    if (!(f == r || absl::StartsWith(f, r + "/"))) {
      return FieldError(field, absl::StrCat("'", value, "' is outside the storage root ", r,
                                            f == full.string() ? "" : " (through a symlink)"));
    }
  }
  return full.string();
}

// The coordinator owns where things go: a job's checkpoints live in its own directory, every
// client path stays inside the storage root (symlinks resolved).
absl::Status Coordinator::ResolvePaths(v1::JobSpec& spec, const std::string& job_id) const {
  if (!spec.checkpoint().dir().empty()) {
    return FieldError("spec.checkpoint.dir",
                      "is chosen by the coordinator (<storage root>/jobs/<id>/checkpoints); "
                      "leave it empty");
  }
  spec.mutable_checkpoint()->set_dir(
      (fs::path(options_.storage_root) / "jobs" / job_id / "checkpoints").string());
  if (!spec.data().path().empty()) {
    LOOM_ASSIGN_OR_RETURN(std::string path, InsideRoot("spec.data.path", spec.data().path()));
    spec.mutable_data()->set_path(path);
  }
  if (!spec.data().tokenizer_path().empty()) {
    LOOM_ASSIGN_OR_RETURN(std::string path,
                          InsideRoot("spec.data.tokenizer_path", spec.data().tokenizer_path()));
    spec.mutable_data()->set_tokenizer_path(path);
  }
  if (!spec.reasoning_eval().path().empty()) {
    LOOM_ASSIGN_OR_RETURN(std::string path,
                          InsideRoot("spec.reasoning_eval.path", spec.reasoning_eval().path()));
    spec.mutable_reasoning_eval()->set_path(path);
  }
  if (!spec.metrics().jsonl().empty()) {
    return FieldError("spec.metrics.jsonl",
                      "is set by the worker agent for service jobs; leave it empty");
  }
  if (spec.metrics().port() > 0) {
    return FieldError(
        "spec.metrics.port",
        "a fixed port would collide between ranks; use -1 (any free port) or 0 (off)");
  }
  return absl::OkStatus();
}

// A stored job must print and parse back: agents and every GET depend on it.
static absl::Status CheckPrintable(const v1::Job& job) {
  google::protobuf::util::JsonPrintOptions print;
  print.preserve_proto_field_names = true;
  print.always_print_primitive_fields = true;
  std::string json;
  auto s = google::protobuf::util::MessageToJsonString(job, &json, print);
  v1::Job back;
  if (s.ok()) s = google::protobuf::util::JsonStringToMessage(json, &back);
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec: cannot be stored (it would not print as JSON: ", s.ToString(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::JobSpec> Coordinator::ResolveSubmission(const v1::SubmitJobRequest& request) {
  if (!request.has_spec()) return FieldError("spec", "is required");
  const int world_size = request.world_size() == 0 ? 1 : request.world_size();
  if (world_size < 1 || world_size > 1024) return FieldError("world_size", "must be in 1..1024");
  if (request.priority() < -1000 || request.priority() > 1000) {
    return FieldError("priority", "must be in -1000..1000");
  }
  const int max_restarts = request.has_max_restarts() ? request.max_restarts() : 3;
  if (max_restarts < 0 || max_restarts > 100)
    return FieldError("max_restarts", "must be in 0..100");
  if (request.pool_size() > 16) return FieldError("pool", "at most 16 labels");
  for (const auto& [k, v] : request.pool()) {
    if (!IsToken(k, 63))
      return FieldError("pool", absl::StrCat("bad label name '", k.substr(0, 80), "'"));
    if (!IsToken(v, 63)) return FieldError(absl::StrCat("pool.", k), "bad label value");
  }
  if (!request.request_id().empty() && !IsToken(request.request_id(), 128)) {
    return FieldError("request_id", "1..128 characters of [A-Za-z0-9._:/-]");
  }
  if (!request.spec().checkpoint().dir().empty()) {
    return FieldError("spec.checkpoint.dir",
                      "is chosen by the coordinator (<storage root>/jobs/<id>/checkpoints); "
                      "leave it empty");
  }
  // Checkpoints are what restarts resume from: the job's own directory (its id is not known
  // yet; ResolvePaths fills it in).
  v1::JobSpec unresolved = request.spec();
  unresolved.mutable_checkpoint()->set_dir("jobs/pending/checkpoints");
  if (unresolved.kind() == "eval" && !unresolved.has_model() && !request.init_from().empty()) {
    // An eval job that leaves the model out takes it from its checkpoint's recorded spec.
    std::string path;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = checkpoints_.find(request.init_from());
      if (it != checkpoints_.end()) path = it->second.path();
    }
    if (!path.empty()) {
      std::ifstream in(fs::path(path) / "manifest.json");
      std::stringstream text;
      text << in.rdbuf();
      if (in) {
        if (absl::Status s = FillModelFromManifest(&unresolved, text.str(), "init_from manifest");
            !s.ok()) {
          return absl::InvalidArgumentError(absl::StrCat("spec.", s.message()));
        }
      }
    }
  }
  auto resolved = ResolveJobSpec(unresolved);
  if (!resolved.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec.", resolved.status().message()));
  }
  v1::JobSpec spec = *std::move(resolved);
  spec.mutable_checkpoint()->clear_dir();
  return spec;
}

// Under the lock: the catalogue check of init_from (retention holds the same lock, so an
// accepted job's starting checkpoint is pinned from here on), the id, paths and the stored job.
absl::StatusOr<v1::Job> Coordinator::AddJobLocked(Txn& txn, const v1::SubmitJobRequest& request,
                                                  v1::JobSpec spec, const std::string& user,
                                                  const std::string& id) {
  std::string init_path;
  if (!request.init_from().empty()) {
    auto it = checkpoints_.find(request.init_from());
    if (it == checkpoints_.end()) {
      return FieldError("init_from",
                        absl::StrCat("no checkpoint '", request.init_from().substr(0, 100),
                                     "' in the catalogue (GET /v1/checkpoints)"));
    }
    init_path = it->second.path();
    std::error_code ec;
    if (it->second.deleted() || !fs::exists(fs::path(init_path) / "manifest.json", ec)) {
      return FieldError(
          "init_from", absl::StrCat("checkpoint '", request.init_from(), "' is no longer on disk (",
                                    init_path, "); pick an available one"));
    }
    if (!it->second.damaged().empty()) {
      return FieldError("init_from", absl::StrCat("checkpoint '", request.init_from(),
                                                  "' is damaged: ", it->second.damaged()));
    }
  }
  LOOM_RETURN_IF_ERROR(ResolvePaths(spec, id));
  v1::Job job;
  job.set_id(id);
  job.set_name(spec.name().empty() ? id : spec.name());
  *job.mutable_request() = request;
  *job.mutable_spec() = spec;
  job.set_world_size(request.world_size() == 0 ? 1 : request.world_size());
  job.set_priority(request.priority());
  job.set_max_restarts(request.has_max_restarts() ? request.max_restarts() : 3);
  job.set_init_from_path(init_path);
  job.set_submitted_by(user);
  const int64_t now = NowMs();
  job.set_submit_time_ms(now);
  job.set_queued_since_ms(now);
  job.mutable_progress()->set_total_steps(spec.steps());
  LOOM_RETURN_IF_ERROR(CheckPrintable(job));
  // A directory left by an earlier coordinator state under this id must not be resumed from.
  const fs::path job_dir = fs::path(options_.storage_root) / "jobs" / id;
  std::error_code ec;
  if (fs::exists(job_dir, ec)) {
    fs::create_directories(fs::path(options_.storage_root) / "stale", ec);
    fs::rename(job_dir, fs::path(options_.storage_root) / "stale" / absl::StrCat(id, "-", now), ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot move the stale directory ", job_dir.string(), ": ", ec.message()));
    }
  }
  SetState(txn, job, "queued", absl::StrCat("submitted by ", user));
  jobs_[id] = job;
  return job;
}

absl::StatusOr<v1::SubmitJobResponse> Coordinator::Submit(const v1::SubmitJobRequest& raw,
                                                          const std::string& user) {
  v1::SubmitJobRequest request = raw;  // with init_from in the canonical id form
  if (!request.init_from().empty()) {
    LOOM_ASSIGN_OR_RETURN(*request.mutable_init_from(),
                          CanonicalCheckpointId(request.init_from(), "init_from"));
  }
  LOOM_ASSIGN_OR_RETURN(v1::JobSpec spec, ResolveSubmission(request));
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string key = IdempotencyKey("", user, request.request_id());
  if (!request.request_id().empty()) {
    auto it = request_ids_.find(key);
    if (it != request_ids_.end()) {
      auto job = jobs_.find(it->second);
      if (job != jobs_.end() &&
          !google::protobuf::util::MessageDifferencer::Equals(job->second.request(), request)) {
        return absl::AlreadyExistsError(
            absl::StrCat("request_id: already used for ", it->second,
                         " with a different request (a retry must repeat the request exactly)"));
      }
      v1::SubmitJobResponse r;
      r.set_id(it->second);
      r.set_created(false);
      return r;
    }
  }
  const std::string id = absl::StrFormat("job-%06d", next_job_);
  Txn txn;
  LOOM_RETURN_IF_ERROR(AddJobLocked(txn, request, spec, user, id).status());
  txn.batch.PutNextJob(next_job_ + 1);
  if (!request.request_id().empty()) txn.batch.PutRequestId(key, id);
  LOOM_RETURN_IF_ERROR(Commit(txn));
  ++next_job_;
  if (!request.request_id().empty()) request_ids_[key] = id;
  registry_.Increment("loom_coordinator_jobs_submitted_total");
  wake_.notify_all();
  v1::SubmitJobResponse r;
  r.set_id(id);
  r.set_created(true);
  return r;
}

absl::StatusOr<v1::CreateSweepResponse> Coordinator::CreateSweep(const v1::SweepSpec& raw,
                                                                 const std::string& user) {
  v1::SweepSpec spec = raw;
  if (!spec.base().init_from().empty()) {
    LOOM_ASSIGN_OR_RETURN(*spec.mutable_base()->mutable_init_from(),
                          CanonicalCheckpointId(spec.base().init_from(), "base.init_from"));
  }
  if (spec.name().size() > 128) return FieldError("name", "at most 128 characters");
  if (!spec.request_id().empty() && !IsToken(spec.request_id(), 128)) {
    return FieldError("request_id", "1..128 characters of [A-Za-z0-9._:/-]");
  }
  if (!spec.base().request_id().empty()) {
    return FieldError("base.request_id", "set request_id on the sweep, not its base job");
  }
  LOOM_ASSIGN_OR_RETURN(std::vector<SweepCell> cells, ExpandSweep(spec));
  // Every job validated before any is stored: a sweep is accepted whole or not at all.
  struct Planned {
    const SweepCell* cell;
    uint64_t seed;
    v1::SubmitJobRequest request;
    v1::JobSpec spec;
  };
  std::vector<Planned> planned;
  for (const SweepCell& cell : cells) {
    for (uint64_t seed : spec.seeds()) {
      Planned p{&cell, seed, spec.base(), {}};
      LOOM_ASSIGN_OR_RETURN(*p.request.mutable_spec(), ApplyCell(spec.base().spec(), cell, seed));
      auto resolved = ResolveSubmission(p.request);
      if (!resolved.ok()) {
        return absl::Status(
            resolved.status().code(),
            absl::StrCat("cell '", cell.name, "' seed ", seed, ": ", resolved.status().message()));
      }
      p.spec = *std::move(resolved);
      planned.push_back(std::move(p));
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string key = IdempotencyKey("sweep:", user, spec.request_id());
  if (!spec.request_id().empty() && request_ids_.count(key)) {
    auto sweep = sweeps_.find(request_ids_[key]);
    if (sweep != sweeps_.end() &&
        !google::protobuf::util::MessageDifferencer::Equals(sweep->second.spec(), spec)) {
      return absl::AlreadyExistsError(
          absl::StrCat("request_id: already used for ", request_ids_[key],
                       " with a different sweep (a retry must repeat the request exactly)"));
    }
    v1::CreateSweepResponse r;
    r.set_id(request_ids_[key]);
    r.set_created(false);
    r.set_jobs(sweeps_[request_ids_[key]].jobs_size());
    return r;
  }
  v1::Sweep sweep;
  sweep.set_id(absl::StrFormat("sweep-%06d", next_sweep_));
  sweep.set_name(spec.name().empty() ? sweep.id() : spec.name());
  *sweep.mutable_spec() = spec;
  for (const SweepCell& c : cells) sweep.add_cells(c.name);
  sweep.set_submitted_by(user);
  sweep.set_submit_time_ms(NowMs());
  Txn txn;
  for (size_t i = 0; i < planned.size(); ++i) {
    const std::string id = absl::StrFormat("job-%06d", next_job_ + static_cast<int64_t>(i));
    auto job = AddJobLocked(txn, planned[i].request, planned[i].spec, user, id);
    if (!job.ok()) {
      Rollback(txn);
      return absl::Status(job.status().code(),
                          absl::StrCat("cell '", planned[i].cell->name, "' seed ", planned[i].seed,
                                       ": ", job.status().message()));
    }
    v1::Job& stored = jobs_[id];
    stored.set_sweep_id(sweep.id());
    stored.set_sweep_cell(planned[i].cell->name);
    stored.set_sweep_seed(planned[i].seed);
    txn.batch.PutJob(stored);
    v1::SweepJob* sj = sweep.add_jobs();
    sj->set_cell(planned[i].cell->name);
    sj->set_seed(planned[i].seed);
    sj->set_job_id(id);
  }
  txn.batch.PutSweep(sweep);
  txn.batch.PutNextSweep(next_sweep_ + 1);
  txn.batch.PutNextJob(next_job_ + static_cast<int64_t>(planned.size()));
  if (!spec.request_id().empty()) txn.batch.PutRequestId(key, sweep.id());
  LOOM_RETURN_IF_ERROR(Commit(txn));
  next_job_ += static_cast<int64_t>(planned.size());
  ++next_sweep_;
  sweeps_[sweep.id()] = sweep;
  if (!spec.request_id().empty()) request_ids_[key] = sweep.id();
  registry_.Increment("loom_coordinator_jobs_submitted_total", static_cast<double>(planned.size()));
  wake_.notify_all();
  v1::CreateSweepResponse r;
  r.set_id(sweep.id());
  r.set_created(true);
  r.set_jobs(sweep.jobs_size());
  return r;
}

// A sweep with its state and per-state job counts, derived from its jobs.
v1::Sweep Coordinator::SweepWithStates(const v1::Sweep& sweep) const {
  v1::Sweep out = sweep;
  int ended = 0, cancelled = 0;
  for (const v1::SweepJob& sj : sweep.jobs()) {
    auto it = jobs_.find(sj.job_id());
    const std::string state = it == jobs_.end() ? "queued" : it->second.state();
    (*out.mutable_job_states())[state]++;
    ended += IsTerminal(state) ? 1 : 0;
    cancelled += state == "cancelled" ? 1 : 0;
  }
  out.set_state(ended < sweep.jobs_size() ? "running" : cancelled > 0 ? "cancelled" : "finished");
  return out;
}

absl::StatusOr<v1::Sweep> Coordinator::GetSweep(const std::string& id) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("sweep id: malformed");
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sweeps_.find(id);
  if (it == sweeps_.end()) return absl::NotFoundError(absl::StrCat("sweep '", id, "' not found"));
  return SweepWithStates(it->second);
}

absl::StatusOr<v1::ListSweepsResponse> Coordinator::ListSweeps(int page_size,
                                                               const std::string& page_token) {
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  LOOM_ASSIGN_OR_RETURN(const std::string after, DecodePageToken(page_token, "sweeps", ""));
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListSweepsResponse out;
  for (auto it = sweeps_.upper_bound(after); it != sweeps_.end(); ++it) {
    const v1::Sweep& sweep = it->second;
    if (out.sweeps_size() == page_size) {
      out.set_next_page_token(EncodePageToken("sweeps", "", out.sweeps(page_size - 1).id()));
      break;
    }
    v1::Sweep* s = out.add_sweeps();
    *s = SweepWithStates(sweep);
    s->clear_jobs();  // the list stays small; GET /v1/sweeps/{id} has them
  }
  return out;
}

absl::StatusOr<v1::Sweep> Coordinator::CancelSweep(const std::string& id, const std::string& user) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("sweep id: malformed");
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sweeps_.find(id);
  if (it == sweeps_.end()) return absl::NotFoundError(absl::StrCat("sweep '", id, "' not found"));
  Txn txn;
  for (const v1::SweepJob& sj : it->second.jobs()) {
    auto job = jobs_.find(sj.job_id());
    if (job == jobs_.end() || IsTerminal(job->second.state())) continue;
    Save(txn, job->second);
    job->second.set_cancel_requested(true);
    SetState(txn, job->second, "cancelled", absl::StrCat("sweep ", id, " cancelled by ", user));
  }
  LOOM_RETURN_IF_ERROR(Commit(txn));
  wake_.notify_all();
  return SweepWithStates(it->second);
}

absl::StatusOr<v1::SweepReport> Coordinator::ReportSweep(const std::string& id,
                                                         const std::string& metric,
                                                         const std::string& select) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("sweep id: malformed");
  LOOM_RETURN_IF_ERROR(CheckMetricAndSelect(metric, select));
  v1::Sweep sweep;
  std::map<std::string, v1::Job> jobs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sweeps_.find(id);
    if (it == sweeps_.end()) return absl::NotFoundError(absl::StrCat("sweep '", id, "' not found"));
    sweep = it->second;
    for (const v1::SweepJob& sj : sweep.jobs()) {
      auto job = jobs_.find(sj.job_id());
      if (job != jobs_.end()) jobs[sj.job_id()] = job->second;
    }
  }
  // A report of another metric or selection than the sweep's own: the same jobs, read again.
  if (!metric.empty()) sweep.mutable_spec()->set_metric(metric);
  if (!select.empty()) sweep.mutable_spec()->set_select(select);
  return BuildSweepReport(sweep, jobs);  // the bootstrap runs without the lock
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const std::string& state, int page_size,
                                                           const std::string& page_token) {
  JobFilter filter;
  filter.state = state;
  return ListJobs(filter, page_size, page_token);
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const JobFilter& f, int page_size,
                                                           const std::string& page_token) {
  if (!f.state.empty() &&
      std::find(std::begin(kStates), std::end(kStates), f.state) == std::end(kStates)) {
    return FieldError("state", absl::StrCat("unknown state '", f.state.substr(0, 40), "'; one of ",
                                            absl::StrJoin(kStates, ", ")));
  }
  for (const auto& [name, value] : {std::pair<const char*, const std::string&>{"user", f.user},
                                    {"kind", f.kind},
                                    {"sweep", f.sweep}}) {
    if (value.size() > 128) return FieldError(name, "at most 128 characters");
  }
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  // The old token format carries the state alone; the other filters extend it.
  std::string key = f.state;
  if (!f.user.empty() || !f.kind.empty() || !f.sweep.empty() || f.newest_first) {
    key = absl::StrJoin(
        {f.state, f.user, f.kind, f.sweep, std::string(f.newest_first ? "desc" : "")}, "\x1e");
  }
  LOOM_ASSIGN_OR_RETURN(const std::string after, DecodePageToken(page_token, "jobs", key));
  std::lock_guard<std::mutex> lock(mutex_);
  auto matches = [&](const v1::Job& j) {
    return (f.state.empty() || j.state() == f.state) &&
           (f.user.empty() || j.submitted_by() == f.user) &&
           (f.kind.empty() || (j.spec().kind().empty() ? "pretrain" : j.spec().kind()) == f.kind) &&
           (f.sweep.empty() || j.sweep_id() == f.sweep);
  };
  v1::ListJobsResponse out;
  auto add = [&](const v1::Job& job) {
    if (!matches(job)) return true;
    if (out.jobs_size() == page_size) {
      out.set_next_page_token(EncodePageToken("jobs", key, out.jobs(page_size - 1).id()));
      return false;
    }
    v1::Job* j = out.add_jobs();
    *j = job;
    auto w = waiting_reason_.find(job.id());
    if (j->state() == "queued" && w != waiting_reason_.end()) j->set_reason(w->second);
    return true;
  };
  if (f.newest_first) {
    auto end = after.empty() ? jobs_.end() : jobs_.lower_bound(after);
    for (auto it = std::make_reverse_iterator(end); it != jobs_.rend(); ++it) {
      if (!add(it->second)) break;
    }
  } else {
    for (auto it = jobs_.upper_bound(after); it != jobs_.end(); ++it) {
      if (!add(it->second)) break;
    }
  }
  return out;
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const std::string& id) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  v1::Job job = it->second;
  auto w = waiting_reason_.find(id);
  if (job.state() == "queued" && w != waiting_reason_.end()) job.set_reason(w->second);
  LOOM_ASSIGN_OR_RETURN(std::vector<v1::JobEvent> events, store_->Events(id));
  for (auto& e : events) *job.add_events() = std::move(e);
  return job;
}

absl::StatusOr<v1::Job> Coordinator::Cancel(const std::string& id, const std::string& user) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  v1::Job& job = it->second;
  if (IsTerminal(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is already ", job.state()));
  }
  // The attempt's ranks get SIGTERM through their agents' next heartbeat; their slots stay
  // counted until the agents report them gone.
  Txn txn;
  Save(txn, job);
  job.set_cancel_requested(true);
  SetState(txn, job, "cancelled", absl::StrCat("cancelled by ", user));
  LOOM_RETURN_IF_ERROR(Commit(txn));
  wake_.notify_all();
  return jobs_[id];
}

std::vector<std::string> Coordinator::PinnedBy(const std::string& checkpoint_id) const {
  std::vector<std::string> out;
  for (const auto& [id, job] : jobs_) {
    if (!IsTerminal(job.state()) && job.request().init_from() == checkpoint_id) out.push_back(id);
  }
  return out;
}

absl::StatusOr<v1::ListCheckpointsResponse> Coordinator::ListCheckpoints(
    const std::string& job_id, int page_size, const std::string& page_token) {
  if (!job_id.empty() && !IsValidId(job_id)) return FieldError("job", "malformed job id");
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  LOOM_ASSIGN_OR_RETURN(const std::string after,
                        DecodePageToken(page_token, "checkpoints", job_id));
  // Ordered by job, then step: the key "<job>/<step, zero-padded>" sorts that way.
  auto key = [](const v1::CheckpointEntry& c) {
    return absl::StrFormat("%s/%020d", c.job_id(), c.step());
  };
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListCheckpointsResponse out;
  std::map<std::string, const v1::CheckpointEntry*> list;
  for (const auto& [id, c] : checkpoints_) {
    if ((job_id.empty() || c.job_id() == job_id) && key(c) > after) list.emplace(key(c), &c);
  }
  for (const auto& [k, c] : list) {
    if (out.checkpoints_size() == page_size) {
      out.set_next_page_token(
          EncodePageToken("checkpoints", job_id, key(out.checkpoints(page_size - 1))));
      break;
    }
    v1::CheckpointEntry* e = out.add_checkpoints();
    *e = *c;
    std::error_code ec;
    e->set_available(!c->deleted() && fs::exists(fs::path(c->path()) / "manifest.json", ec));
    for (const std::string& j : PinnedBy(c->id())) e->add_pinned_by(j);
  }
  return out;
}

absl::StatusOr<v1::ListWorkersResponse> Coordinator::ListWorkers(int page_size,
                                                                 const std::string& page_token) {
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  LOOM_ASSIGN_OR_RETURN(const std::string after, DecodePageToken(page_token, "workers", ""));
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListWorkersResponse out;
  for (auto it = workers_.upper_bound(after); it != workers_.end(); ++it) {
    const auto& [id, w] = *it;
    if (out.workers_size() == page_size) {
      out.set_next_page_token(EncodePageToken("workers", "", out.workers(page_size - 1).id()));
      break;
    }
    v1::Worker* o = out.add_workers();
    *o = w;
    o->set_used_slots(UsedSlots(id));
  }
  return out;
}

absl::StatusOr<std::string> Coordinator::WorkerForCredential(const std::string& credential) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = credential_owner_.find(credential);
  if (it == credential_owner_.end()) {
    return absl::UnauthenticatedError(
        "invalid or revoked worker credential: register again with the enrolment token");
  }
  return it->second;
}

void Coordinator::RevokeCredential(Txn& txn, const std::string& worker_id) {
  auto it = credentials_.find(worker_id);
  if (it == credentials_.end()) return;
  SaveCredential(txn, worker_id);
  credential_owner_.erase(it->second);
  credentials_.erase(it);
  txn.batch.DeleteCredential(worker_id);
}

namespace {

bool Printable(const std::string& s, size_t max) {
  if (s.size() > max) return false;
  for (unsigned char c : s)
    if (c < 0x20 || c > 0x7e) return false;
  return true;
}

// A worker's GPU inventory: one rank per GPU, so never more slots than GPUs.
absl::Status CheckGpus(const v1::RegisterWorkerRequest& request) {
  if (request.gpus_size() > 256) return FieldError("gpus", "at most 256 GPUs");
  std::set<int32_t> seen;
  for (int i = 0; i < request.gpus_size(); ++i) {
    const v1::Gpu& g = request.gpus(i);
    const std::string field = absl::StrCat("gpus[", i, "]");
    if (g.index() < 0 || g.index() > 1023 || !seen.insert(g.index()).second) {
      return FieldError(field + ".index", "must be distinct, in 0..1023");
    }
    if (!Printable(g.uuid(), 96)) return FieldError(field + ".uuid", "at most 96 printable ASCII");
    if (!Printable(g.model(), 128))
      return FieldError(field + ".model", "at most 128 printable ASCII");
    if (g.memory_bytes() < 0) return FieldError(field + ".memory_bytes", "must be >= 0");
  }
  if (request.gpus_size() > 0 && request.slots() > request.gpus_size()) {
    return FieldError("slots", absl::StrCat("exceeds the worker's ", request.gpus_size(),
                                            " GPUs (one GPU per rank)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::Register(
    const v1::RegisterWorkerRequest& request) {
  if (request.slots() < 1 || request.slots() > 4096)
    return FieldError("slots", "must be in 1..4096");
  if (request.address().empty() || request.address().size() > 255) {
    return FieldError("address", "is required (host name or IP ranks are reachable at)");
  }
  if (request.name().size() > 128) return FieldError("name", "at most 128 characters");
  if (request.labels_size() > 32) return FieldError("labels", "at most 32 labels");
  for (const auto& [k, v] : request.labels()) {
    if (!IsToken(k, 63) || !IsToken(v, 63)) return FieldError("labels", "bad label");
  }
  if (!request.worker_id().empty() && !IsValidId(request.worker_id())) {
    return FieldError("worker_id", "malformed");
  }
  LOOM_RETURN_IF_ERROR(CheckGpus(request));
  std::lock_guard<std::mutex> lock(mutex_);
  Txn txn;
  std::string id = request.worker_id();
  auto existing = workers_.find(id);
  if (id.empty() || existing == workers_.end()) {
    if (id.empty()) {
      std::random_device rd;
      do {
        id = absl::StrFormat("w-%08x", rd());
      } while (workers_.count(id));
    }
  } else {
    // A live worker's id is taken over only by the holder of its credential (its own agent
    // after a restart); a lost worker's credential is already revoked.
    auto cred = credentials_.find(id);
    if (existing->second.state() == "alive" && cred != credentials_.end() &&
        request.credential() != cred->second) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker id '", id, "' belongs to a live worker; re-registering it needs its credential"));
    }
    // An agent that restarted lost its ranks (they die with it): their attempts failed.
    for (auto& [job_id, job] : jobs_) {
      if (IsActive(job.state()) && PlacementOf(job, id) != nullptr &&
          !Contains(job.finished_workers(), id)) {
        FailAttempt(txn, job, absl::StrCat("worker ", id, " restarted"), Failure::kInfra);
      }
    }
    reported_running_[id].clear();
  }
  Save(txn, id);
  v1::Worker& w = workers_[id];
  const int64_t now = NowMs();
  if (w.register_time_ms() == 0) w.set_register_time_ms(now);
  w.set_id(id);
  w.set_name(request.name().empty() ? id : request.name());
  w.set_address(request.address());
  w.set_slots(request.slots());
  *w.mutable_labels() = request.labels();
  *w.mutable_gpus() = request.gpus();
  w.set_state("alive");
  w.set_last_heartbeat_ms(now);
  txn.batch.PutWorker(w);
  RevokeCredential(txn, id);
  const std::string credential = RandomToken();
  SaveCredential(txn, id);
  credentials_[id] = credential;
  credential_owner_[credential] = id;
  txn.batch.PutCredential(id, credential);
  LOOM_RETURN_IF_ERROR(Commit(txn));
  heard_since_start_.insert(id);
  wake_.notify_all();
  v1::RegisterWorkerResponse r;
  r.set_worker_id(id);
  r.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  r.set_credential(credential);
  r.set_lease_ms(options_.lost_after_ms / 2);
  r.set_max_body_bytes(options_.max_body_bytes);
  return r;
}

void Coordinator::FailAttempt(Txn& txn, v1::Job& job, const std::string& reason, Failure kind,
                              int64_t not_before_ms) {
  Save(txn, job);
  if (job.history_size() > 0) job.mutable_history()->rbegin()->set_end_reason(reason);
  if (kind == Failure::kBadInput) {
    SetState(txn, job, "failed",
             absl::StrCat(reason,
                          " (bad input: the trainer refused the spec or its data; "
                          "not restarted)"));
    return;
  }
  const bool infra = kind == Failure::kInfra;
  const bool left = infra ? job.infra_restarts() < options_.max_infra_restarts
                          : job.restarts() < job.max_restarts();
  if (!left) {
    SetState(txn, job, "failed",
             infra ? absl::StrCat(reason, " (", options_.max_infra_restarts,
                                  " attempts lost to infrastructure)")
             : job.max_restarts() > 0
                 ? absl::StrCat(reason, " (no restarts left of ", job.max_restarts(), ")")
                 : reason);
    return;
  }
  if (infra) {
    job.set_infra_restarts(job.infra_restarts() + 1);
  } else {
    job.set_restarts(job.restarts() + 1);
  }
  SetState(txn, job, "retrying", reason);
  std::string from = "the start";
  for (auto it = job.checkpoints().rbegin(); it != job.checkpoints().rend(); ++it) {
    auto c = checkpoints_.find(*it);
    if (c != checkpoints_.end() && !c->second.deleted() && c->second.damaged().empty()) {
      from = absl::StrCat("step ", c->second.step());
      break;
    }
  }
  job.clear_placement();
  job.set_master_port(0);
  job.clear_finished_workers();
  job.set_not_before_ms(not_before_ms);
  // The job keeps its original queue time: aging and reservations count from the submission.
  SetState(
      txn, job, "queued",
      infra ? absl::StrCat("requeued from ", from, " (infrastructure failure ",
                           job.infra_restarts(), " of ", options_.max_infra_restarts,
                           "; does not count against max_restarts)")
            : absl::StrCat("restart ", job.restarts(), " of ", job.max_restarts(), " from ", from));
  registry_.Increment("loom_coordinator_job_restarts_total");
}

void Coordinator::MarkWorkerLost(Txn& txn, v1::Worker& worker, const std::string& reason) {
  Save(txn, worker.id());
  worker.set_state("lost");
  txn.batch.PutWorker(worker);
  registry_.Increment("loom_coordinator_workers_lost_total");
  reported_running_[worker.id()].clear();
  RevokeCredential(txn, worker.id());
  // Its ranks stopped themselves when their lease ran out (lost-after / 2 after the last
  // heartbeat); the termination grace covers a rank that was slow to die.
  const int64_t fence = NowMs() + options_.term_grace_ms;
  for (auto& [id, job] : jobs_) {
    if (IsActive(job.state()) && PlacementOf(job, worker.id()) != nullptr &&
        !Contains(job.finished_workers(), worker.id())) {
      FailAttempt(txn, job, absl::StrCat("worker ", worker.id(), " ", reason), Failure::kInfra,
                  fence);
    }
  }
}

int Coordinator::UsedSlots(const std::string& worker_id) const {
  int used = 0;
  std::set<std::pair<std::string, int>> counted;
  for (const auto& [id, job] : jobs_) {
    if (!IsActive(job.state()) || Contains(job.finished_workers(), worker_id)) continue;
    if (const v1::Placement* p = PlacementOf(job, worker_id)) {
      used += p->ranks_size();
      counted.insert({id, job.attempt()});
    }
  }
  auto r = reported_running_.find(worker_id);
  if (r != reported_running_.end()) {
    for (const auto& [attempt, ranks] : r->second) {
      if (!counted.count(attempt)) used += ranks;  // stopping ranks of an old attempt
    }
  }
  return used;
}

// Some live worker still reports ranks of an earlier attempt of this job.
bool Coordinator::OldAttemptRunning(const v1::Job& job) const {
  for (const auto& [worker, attempts] : reported_running_) {
    for (const auto& [key, ranks] : attempts) {
      if (key.first == job.id() && key.second <= job.attempt() && ranks > 0) return true;
    }
  }
  return false;
}

std::string Coordinator::LogPath(const std::string& job_id) const {
  return (fs::path(options_.data_dir) / "logs" / (job_id + ".log")).string();
}

// One log per job, in arrival order; each agent sends whole lines of its attempt's log by byte
// offset, and the offsets received per (attempt, worker) drop resent chunks after a lost reply.
void Coordinator::AppendLog(Txn& txn, const v1::AttemptReport& report,
                            const std::string& worker_id) {
  if (report.log().empty() || report.attempt() < 1 || report.log_offset() < 0) return;
  const std::string key = absl::StrCat(report.job_id(), "/", report.attempt(), "/", worker_id);
  int64_t& have = log_offsets_[key];
  const int64_t end = report.log_offset() + static_cast<int64_t>(report.log().size());
  if (end <= have) return;
  const int64_t skip = std::max<int64_t>(0, have - report.log_offset());
  std::ofstream out(LogPath(report.job_id()), std::ios::app | std::ios::binary);
  out.write(report.log().data() + skip, static_cast<std::streamsize>(report.log().size() - skip));
  out.flush();
  if (!out) return;  // not recorded: the agent resends it
  have = end;
  txn.progress.PutLogOffset(key, end);
}

std::string Coordinator::SeriesPath(const std::string& job_id) const {
  return (fs::path(options_.data_dir) / "series" / (job_id + ".tsv")).string();
}

// Rank 0's step points, one line each ("attempt step loss lr tokens/s grad_norm time_ms"), by
// their index in the attempt's sequence: the points received per (attempt, worker) drop resent
// ones after a lost reply, as AppendLog does for bytes.
void Coordinator::AppendSteps(Txn& txn, const v1::AttemptReport& report,
                              const std::string& worker_id) {
  if (report.steps().empty() || report.attempt() < 1) return;
  const std::string key =
      absl::StrCat("steps:", report.job_id(), "/", report.attempt(), "/", worker_id);
  int64_t& have = log_offsets_[key];
  const int64_t end = report.steps_offset() + report.steps_size();
  if (end <= have) return;
  // A bound per job, as a disk quota: a broken or hostile agent cannot fill the coordinator's disk
  // (a million steps take ~60 MB); beyond it the points are acknowledged and dropped.
  std::error_code ec;
  const auto size = fs::file_size(SeriesPath(report.job_id()), ec);
  if (!ec && size > kMaxSeriesBytes) {
    have = end;
    txn.progress.PutLogOffset(key, end);
    return;
  }
  std::string lines;
  for (int64_t i = std::max<int64_t>(0, have - report.steps_offset()); i < report.steps_size();
       ++i) {
    const v1::StepPoint& p = report.steps(static_cast<int>(i));
    absl::StrAppendFormat(&lines, "%d\t%d\t%.10g\t%.10g\t%.10g\t%.10g\t%d\n", report.attempt(),
                          p.step(), p.loss(), p.learning_rate(), p.tokens_per_second(),
                          p.grad_norm(), p.time_ms());
  }
  std::ofstream out(SeriesPath(report.job_id()), std::ios::app | std::ios::binary);
  out << lines;
  out.flush();
  if (!out) return;  // not recorded: the agent resends them
  have = end;
  txn.progress.PutLogOffset(key, end);
}

// A report is refused whole (nothing applied) when it names an attempt the worker was not given
// or a checkpoint outside the job's own directory: a forged or broken agent changes nothing.
absl::Status Coordinator::ValidateReport(const v1::AttemptReport& r,
                                         const std::string& worker_id) const {
  if (!IsValidId(r.job_id())) return FieldError("attempts.job_id", "malformed");
  auto jit = jobs_.find(r.job_id());
  if (jit == jobs_.end()) return absl::OkStatus();  // unknown job: the agent is told to stop it
  const v1::Job& job = jit->second;
  if (r.attempt() < 1 || r.attempt() > job.attempt()) {
    return FieldError("attempts.attempt",
                      absl::StrCat("job ", job.id(), " has no attempt ", r.attempt()));
  }
  const v1::AttemptRecord* h = HistoryOf(job, r.attempt());
  const bool placed = h != nullptr
                          ? std::find(h->worker_ids().begin(), h->worker_ids().end(), worker_id) !=
                                h->worker_ids().end()
                          : r.attempt() == job.attempt() && PlacementOf(job, worker_id) != nullptr;
  if (!placed) {
    return absl::PermissionDeniedError(absl::StrCat("attempt ", r.attempt(), " of job ", job.id(),
                                                    " was not placed on worker ", worker_id));
  }
  auto check_path = [&](int64_t step, const std::string& path, const char* field) {
    const std::string want =
        (fs::path(CheckpointDir(job)) / storage::CheckpointDirName(step)).string();
    if (step < 0 || path != want) {
      return FieldError(field, absl::StrCat("checkpoint path '", path.substr(0, 200),
                                            "' is not the job's checkpoint directory for step ",
                                            step, " (", want, ")"));
    }
    return absl::OkStatus();
  };
  if (r.steps_size() > kMaxStepsPerReport || r.steps_offset() < 0 ||
      r.steps_offset() > (int64_t{1} << 40)) {
    return FieldError("attempts.steps", absl::StrCat("at most ", kMaxStepsPerReport,
                                                     " points per report, from an offset >= 0"));
  }
  for (const auto& p : r.steps()) {
    if (p.step() < 0 || p.step() > (int64_t{1} << 40) || p.time_ms() < 0) {
      return FieldError("attempts.steps",
                        absl::StrCat("step ", p.step(), " or time ", p.time_ms(), " out of range"));
    }
  }
  for (const auto& c : r.checkpoints()) {
    LOOM_RETURN_IF_ERROR(check_path(c.step(), c.path(), "attempts.checkpoints"));
  }
  for (const auto& s : r.skipped()) {
    LOOM_RETURN_IF_ERROR(check_path(s.step(), s.path(), "attempts.skipped"));
  }
  if (r.resumed().restored() && !r.resumed().path().empty()) {
    LOOM_RETURN_IF_ERROR(check_path(r.resumed().step(), r.resumed().path(), "attempts.resumed"));
  }
  if (const v1::Placement* p = PlacementOf(job, worker_id);
      p != nullptr && r.attempt() == job.attempt()) {
    for (const auto& rank : r.ranks()) {
      if (std::find(p->ranks().begin(), p->ranks().end(), rank.rank()) == p->ranks().end()) {
        return FieldError("attempts.ranks", absl::StrCat("rank ", rank.rank(), " of job ", job.id(),
                                                         " is not placed on ", worker_id));
      }
    }
  }
  return absl::OkStatus();
}

void Coordinator::CatalogueCheckpoint(Txn& txn, v1::Job& job, int64_t step,
                                      const std::string& path) {
  const std::string cid = CheckpointId(job.id(), step);
  if (checkpoints_.count(cid)) return;
  Save(txn, job);
  SaveCheckpoint(txn, cid);
  v1::CheckpointEntry e;
  e.set_id(cid);
  e.set_job_id(job.id());
  e.set_job_name(job.name());
  e.set_kind(job.spec().kind());
  e.set_step(step);
  e.set_path(path);
  e.set_parent(job.request().init_from());
  e.set_time_ms(NowMs());
  e.set_world_size(job.world_size());
  checkpoints_[cid] = e;
  txn.batch.PutCheckpoint(e);
  // Oldest first by step: a checkpoint catalogued late (found at resume) goes in its place.
  job.add_checkpoints(cid);
  std::sort(job.mutable_checkpoints()->begin(), job.mutable_checkpoints()->end(),
            [this](const std::string& a, const std::string& b) {
              return checkpoints_[a].step() < checkpoints_[b].step();
            });
  AddEvent(txn, job, "", absl::StrCat("checkpoint at step ", step, ": ", path));
  txn.batch.PutJob(job);
}

// What the attempt's trainer restored from: skipped (damaged) checkpoints are marked in the
// catalogue, newer catalogued ones that vanished from disk too, so no later attempt picks them.
void Coordinator::ApplyResumeReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r) {
  auto mark = [&](int64_t step, const std::string& why) {
    const std::string cid = CheckpointId(job.id(), step);
    auto it = checkpoints_.find(cid);
    if (it != checkpoints_.end() && !it->second.damaged().empty()) return;
    AddEvent(txn, job, "", absl::StrCat("checkpoint at step ", step, " skipped: ", why));
    if (it == checkpoints_.end()) return;
    SaveCheckpoint(txn, cid);
    it->second.set_damaged(why);
    txn.batch.PutCheckpoint(it->second);
  };
  for (const auto& s : r.skipped()) mark(s.step(), s.reason().substr(0, 1000));
  if (!r.resumed().restored()) return;
  // Once per attempt: the record remembers that the resume was reported.
  v1::AttemptRecord* rec = nullptr;
  for (auto& hh : *job.mutable_history()) {
    if (hh.attempt() == r.attempt()) rec = &hh;
  }
  if (rec == nullptr || !rec->resumed_from().empty()) return;
  Save(txn, job);
  const int64_t step = r.resumed().path().empty() ? 0 : r.resumed().step();
  rec->set_resumed_from(r.resumed().path().empty() ? "start" : r.resumed().path());
  for (const std::string& cid : job.checkpoints()) {
    auto it = checkpoints_.find(cid);
    std::error_code ec;
    if (it != checkpoints_.end() && it->second.step() > step && !it->second.deleted() &&
        it->second.damaged().empty() &&
        !fs::exists(fs::path(it->second.path()) / "manifest.json", ec)) {
      mark(it->second.step(), absl::StrCat("missing: ", it->second.path(), " is gone"));
    }
  }
  if (!r.resumed().path().empty()) CatalogueCheckpoint(txn, job, step, r.resumed().path());
  AddEvent(txn, job, "",
           r.resumed().path().empty() ? std::string("resumed from the start")
                                      : absl::StrCat("resumed from step ", step));
  txn.batch.PutJob(job);
}

// The job's spec.checkpoint.keep_last newest intact checkpoints and every keep_every-th stay;
// so does any checkpoint a non-terminal job starts from (init_from). The rest are marked
// deleted now (no new job can pin them) and removed from disk after the commit.
void Coordinator::ApplyRetention(Txn& txn, const std::string& job_id) {
  auto jit = jobs_.find(job_id);
  if (jit == jobs_.end()) return;
  const v1::CheckpointConfig& cfg = jit->second.spec().checkpoint();
  const int keep_last = cfg.keep_last() > 0 ? cfg.keep_last() : 3;
  std::vector<v1::CheckpointEntry*> intact;
  for (const std::string& cid : jit->second.checkpoints()) {
    auto it = checkpoints_.find(cid);
    if (it != checkpoints_.end() && !it->second.deleted() && it->second.damaged().empty()) {
      intact.push_back(&it->second);
    }
  }
  std::sort(intact.begin(), intact.end(),
            [](const auto* a, const auto* b) { return a->step() < b->step(); });
  std::set<std::string> keep;
  const size_t first_kept =
      intact.size() > static_cast<size_t>(keep_last) ? intact.size() - keep_last : 0;
  for (size_t i = first_kept; i < intact.size(); ++i) keep.insert(intact[i]->id());
  for (const std::string& cid : jit->second.checkpoints()) {
    auto it = checkpoints_.find(cid);
    if (it == checkpoints_.end() || it->second.deleted() || keep.count(cid)) continue;
    v1::CheckpointEntry& e = it->second;
    if (cfg.keep_every() > 0 && e.step() % cfg.keep_every() == 0) continue;
    if (!PinnedBy(cid).empty()) continue;
    const std::string jobs_root = (fs::path(options_.storage_root) / "jobs").string() + "/";
    if (!absl::StartsWith(e.path(), jobs_root)) continue;  // never delete outside jobs/
    SaveCheckpoint(txn, cid);
    e.set_deleted(true);
    txn.batch.PutCheckpoint(e);
    txn.deletes.push_back(e.path());
  }
  // Steps a fenced attempt committed but never reported, older than what is kept: garbage.
  if (intact.empty()) return;
  const int64_t oldest_kept = intact[first_kept]->step();
  auto on_disk = storage::ListCheckpoints(cfg.dir());
  if (!on_disk.ok()) return;
  for (const storage::CheckpointRef& ref : *on_disk) {
    if (ref.step < oldest_kept && !checkpoints_.count(CheckpointId(job_id, ref.step)) &&
        (cfg.keep_every() == 0 || ref.step % cfg.keep_every() != 0)) {
      txn.deletes.push_back(ref.dir);
    }
  }
}

void Coordinator::DeleteDirectories(std::vector<std::string> dirs) {
  for (const std::string& d : dirs) {
    std::error_code ec;
    fs::remove_all(d, ec);
  }
}

void Coordinator::ApplyReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r,
                              const std::string& wid) {
  Save(txn, job);
  if (r.master_port() > 0 && job.master_port() == 0 && HostsRankZero(job, wid)) {
    job.set_master_port(r.master_port());
    txn.batch.PutJob(job);
  }
  if (r.progress().update_time_ms() > job.progress().update_time_ms()) {
    *job.mutable_progress() = r.progress();
    job.mutable_progress()->set_total_steps(job.spec().steps());
    txn.progress.PutJob(job);
  }
  ApplyResumeReport(txn, job, r);
  const size_t before = job.checkpoints_size();
  for (const auto& c : r.checkpoints()) CatalogueCheckpoint(txn, job, c.step(), c.path());
  if (static_cast<size_t>(job.checkpoints_size()) != before) ApplyRetention(txn, job.id());
  for (const auto& ev : r.evals()) {
    bool seen = false;
    for (const auto& have : job.evals()) {
      seen |= have.step() == ev.step() && have.attempt() == r.attempt() && have.kind() == ev.kind();
    }
    if (!seen) {
      *job.add_evals() = ev;
      job.mutable_evals()->rbegin()->set_attempt(r.attempt());
      txn.batch.PutJob(job);
    }
  }
  // Every failed rank, the likely cause first: a rank killed by a signal makes its peers exit
  // with a communication error right after.
  std::vector<std::string> killed, exited;
  bool bad_input = false, infra = false;
  for (const auto& rank : r.ranks()) {
    if (rank.running() || rank.exit_code() == 0) continue;
    bad_input |= rank.exit_code() == kExitBadInput;
    infra |= rank.exit_code() == kExitLeaseExpired || rank.exit_code() == kExitStopped;
    (rank.exit_code() > 128 ? killed : exited)
        .push_back(
            absl::StrCat("rank ", rank.rank(), " on ", wid, ": ", rank.detail().substr(0, 200)));
  }
  killed.insert(killed.end(), exited.begin(), exited.end());
  if (!killed.empty()) {
    const std::string failure = absl::StrJoin(killed, "; ");
    FailAttempt(txn, job, failure,
                bad_input ? Failure::kBadInput
                : infra   ? Failure::kInfra
                          : Failure::kJob);
    return;
  }
  int ranks_running = 0;
  for (const auto& rank : r.ranks()) ranks_running += rank.running() ? 1 : 0;
  if (ranks_running > 0 && job.state() == "scheduled") {
    if (job.start_time_ms() == 0) job.set_start_time_ms(NowMs());
    SetState(txn, job, "running", absl::StrCat("ranks started on ", wid));
  }
  // Success of a worker's share: every rank placed on it reported, exited 0.
  const v1::Placement* p = PlacementOf(job, wid);
  if (!r.finished() || p == nullptr || Contains(job.finished_workers(), wid)) return;
  int exited_ok = 0;
  for (int placed : p->ranks()) {
    for (const auto& rank : r.ranks()) {
      exited_ok += rank.rank() == placed && !rank.running() && rank.exit_code() == 0 ? 1 : 0;
    }
  }
  if (exited_ok != p->ranks_size()) return;
  job.add_finished_workers(wid);
  txn.batch.PutJob(job);
  bool all = true;
  for (const auto& pl : job.placement()) all &= Contains(job.finished_workers(), pl.worker_id());
  if (all) {
    SetState(
        txn, job, "succeeded",
        absl::StrCat("all ", job.world_size(), " ranks exited 0 at step ", job.progress().step()));
  }
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& request,
                                                             const std::string& worker) {
  if (request.worker_id() != worker) {
    return absl::PermissionDeniedError(absl::StrCat("this credential belongs to worker ", worker,
                                                    ", not '", request.worker_id().substr(0, 64),
                                                    "'"));
  }
  if (request.attempts_size() > 4096) return FieldError("attempts", "too many");
  std::lock_guard<std::mutex> lock(mutex_);
  auto wit = workers_.find(worker);
  if (wit == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("worker '", worker, "' is not registered"));
  }
  for (const v1::AttemptReport& r : request.attempts()) {
    LOOM_RETURN_IF_ERROR(ValidateReport(r, worker));
  }
  Txn txn;
  v1::Worker& w = wit->second;
  Save(txn, worker);
  w.set_last_heartbeat_ms(NowMs());
  heard_since_start_.insert(worker);
  v1::HeartbeatResponse response;
  std::map<std::pair<std::string, int>, int> running;
  std::set<std::pair<std::string, int>> reported;
  for (const v1::AttemptReport& r : request.attempts()) {
    reported.insert({r.job_id(), r.attempt()});
    auto jit = jobs_.find(r.job_id());
    if (jit != jobs_.end()) {
      AppendLog(txn, r, worker);
      AppendSteps(txn, r, worker);
    }
    int ranks_running = 0;
    for (const auto& rank : r.ranks()) ranks_running += rank.running() ? 1 : 0;
    const bool current = jit != jobs_.end() && IsActive(jit->second.state()) &&
                         r.attempt() == jit->second.attempt() &&
                         PlacementOf(jit->second, worker) != nullptr;
    if (current) {
      ApplyReport(txn, jit->second, r, worker);
    } else if (jit != jobs_.end() && HistoryOf(jit->second, r.attempt()) != nullptr &&
               !r.skipped().empty()) {
      ApplyResumeReport(txn, jit->second, r);  // what an old attempt found is still true
    }
    // Reports of unknown jobs and of old attempts: stop what still runs, forget what ended.
    const bool live =
        jit != jobs_.end() && IsActive(jit->second.state()) && r.attempt() == jit->second.attempt();
    if (!live && !r.finished()) {
      v1::AttemptRef* c = response.add_cancels();
      c->set_job_id(r.job_id());
      c->set_attempt(r.attempt());
    }
    if (r.finished()) {
      v1::AttemptRef* f = response.add_forget();
      f->set_job_id(r.job_id());
      f->set_attempt(r.attempt());
    } else {
      running[{r.job_id(), r.attempt()}] = std::max(1, ranks_running);
    }
  }
  for (const auto& [id, job] : jobs_) {
    if (!IsActive(job.state()) || Contains(job.finished_workers(), worker)) continue;
    const v1::Placement* p = PlacementOf(job, worker);
    if (p == nullptr) continue;
    if (reported.count({id, job.attempt()})) continue;  // already running there
    // Other workers wait for the port rank 0's worker picks (0 tells rank 0's worker to pick).
    if (job.master_port() == 0 && !HostsRankZero(job, worker)) continue;
    v1::Assignment* a = response.add_assignments();
    a->set_job_id(id);
    a->set_attempt(job.attempt());
    *a->mutable_ranks() = p->ranks();
    a->set_world_size(job.world_size());
    a->set_master_addr(job.master_addr());
    a->set_master_port(job.master_port());
    *a->mutable_spec() = job.spec();
    a->set_resume_from(CheckpointDir(job));
    a->set_init_from(job.init_from_path());
  }
  if (w.state() != "alive") {
    w.set_state("alive");
    txn.batch.PutWorker(w);
  } else {
    txn.progress.PutWorker(w);
  }
  LOOM_RETURN_IF_ERROR(Commit(txn));
  reported_running_[worker] = std::move(running);
  return response;
}

void Coordinator::ScheduleLocked(Txn& txn) {
  const int64_t now = NowMs();
  std::vector<QueuedJob> queue;
  std::map<std::string, std::string> held;  // queued jobs that wait for their last attempt
  for (const auto& [id, job] : jobs_) {
    if (job.state() != "queued") continue;
    if (job.not_before_ms() > now) {
      held[id] = absl::StrFormat(
          "fenced: the previous attempt's worker was lost; placing again in %.1f s (lost-after "
          "+ termination grace)",
          static_cast<double>(job.not_before_ms() - now) / 1000.0);
      continue;
    }
    if (OldAttemptRunning(job)) {
      held[id] = absl::StrCat("waiting for attempt ", job.attempt(), "'s ranks to stop");
      continue;
    }
    QueuedJob q;
    q.id = id;
    q.world_size = job.world_size();
    q.priority = job.priority();
    q.pool.insert(job.request().pool().begin(), job.request().pool().end());
    q.queued_since_ms = job.queued_since_ms();
    queue.push_back(std::move(q));
  }
  // After a restart: nothing is placed until every live worker has said what it runs.
  for (const auto& [id, w] : workers_) {
    if (w.state() == "alive" && !heard_since_start_.count(id)) {
      for (const auto& q : queue) held[q.id] = "waiting for every worker to report after a restart";
      queue.clear();
      break;
    }
  }
  if (queue.empty()) {
    waiting_reason_ = std::move(held);
    return;
  }
  std::vector<FreeWorker> free;
  for (const auto& [id, w] : workers_) {
    if (w.state() != "alive") continue;
    FreeWorker f;
    f.id = id;
    f.labels.insert(w.labels().begin(), w.labels().end());
    f.slots = w.slots();
    f.free_slots = std::max(0, w.slots() - UsedSlots(id));
    free.push_back(std::move(f));
  }
  ScheduleResult result = Schedule(std::move(queue), std::move(free), options_.scheduler, now);
  waiting_reason_ = std::move(result.waiting);
  waiting_reason_.insert(held.begin(), held.end());
  for (const GangPlacement& g : result.placed) {
    v1::Job& job = jobs_[g.job_id];
    Save(txn, job);
    job.set_attempt(job.attempt() + 1);
    job.clear_placement();
    job.clear_finished_workers();
    v1::AttemptRecord* record = job.add_history();
    record->set_attempt(job.attempt());
    record->set_start_time_ms(now);
    std::vector<std::string> where;
    for (const auto& [wid, ranks] : g.workers) {
      v1::Placement* p = job.add_placement();
      p->set_worker_id(wid);
      for (int r : ranks) p->add_ranks(r);
      record->add_worker_ids(wid);
      where.push_back(absl::StrCat(wid, " (", RankText(ranks), ")"));
    }
    job.set_master_addr(workers_[g.workers.front().first].address());
    job.set_master_port(0);
    job.clear_resume_from();
    std::string from;
    const v1::CheckpointEntry* newest = nullptr;
    for (const std::string& cid : job.checkpoints()) {
      auto c = checkpoints_.find(cid);
      if (c != checkpoints_.end() && !c->second.deleted() && c->second.damaged().empty() &&
          (newest == nullptr || c->second.step() > newest->step())) {
        newest = &c->second;
      }
    }
    if (newest != nullptr) {
      job.set_resume_from(newest->path());
      from = absl::StrCat("; resuming from step ", newest->step(),
                          " (or the newest intact checkpoint)");
    }
    registry_.Observe("loom_coordinator_scheduling_delay_seconds",
                      static_cast<double>(now - job.queued_since_ms()) / 1000.0);
    SetState(txn, job, "scheduled",
             absl::StrCat("attempt ", job.attempt(), " on ", absl::StrJoin(where, ", "), from));
  }
}

void Coordinator::Tick() {
  std::vector<std::string> deletes;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t now = NowMs();
    Txn txn;
    for (auto& [id, w] : workers_) {
      if (w.state() == "alive" && now - w.last_heartbeat_ms() > options_.lost_after_ms) {
        MarkWorkerLost(
            txn, w,
            absl::StrCat("lost: no heartbeat for ", (now - w.last_heartbeat_ms()) / 1000, " s"));
      }
    }
    ScheduleLocked(txn);
    (void)Commit(txn);  // on failure memory is restored; the next tick tries again
    deletes.swap(pending_deletes_);
  }
  DeleteDirectories(std::move(deletes));  // retention, without holding the lock
}

absl::StatusOr<Coordinator::LogChunk> Coordinator::ReadLog(const std::string& id, int64_t offset,
                                                           int64_t max) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  if (offset < 0) return FieldError("offset", "must be >= 0");
  bool terminal = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
    terminal = IsTerminal(it->second.state());
  }
  LogChunk chunk;
  const std::string path = LogPath(id);
  std::error_code ec;
  const int64_t size = fs::exists(path, ec) ? static_cast<int64_t>(fs::file_size(path, ec)) : 0;
  if (offset < size) {
    const int64_t want = std::min<int64_t>(size - offset, max);
    std::ifstream in(path, std::ios::binary);
    in.seekg(offset);
    chunk.data.resize(static_cast<size_t>(want));
    in.read(chunk.data.data(), want);
    chunk.data.resize(static_cast<size_t>(in.gcount()));
  }
  chunk.next_offset = offset + static_cast<int64_t>(chunk.data.size());
  chunk.done = terminal && chunk.next_offset >= size;
  return chunk;
}

namespace {

// One line of a series file; false for a torn or foreign line.
bool ParseStepLine(absl::string_view line, int* attempt, v1::StepPoint* p) {
  std::vector<absl::string_view> f = absl::StrSplit(line, '\t');
  int64_t step, time_ms;
  double loss, lr, tps, grad;
  if (f.size() != 7 || !absl::SimpleAtoi(f[0], attempt) || !absl::SimpleAtoi(f[1], &step) ||
      !absl::SimpleAtod(f[2], &loss) || !absl::SimpleAtod(f[3], &lr) ||
      !absl::SimpleAtod(f[4], &tps) || !absl::SimpleAtod(f[5], &grad) ||
      !absl::SimpleAtoi(f[6], &time_ms)) {
    return false;
  }
  p->set_step(step);
  p->set_loss(loss);
  p->set_learning_rate(lr);
  p->set_tokens_per_second(tps);
  p->set_grad_norm(grad);
  p->set_time_ms(time_ms);
  return true;
}

// At most max_points per series: every k-th point and always the last one.
void Thin(v1::AttemptSeries& series, int max_points) {
  const int n = series.points_size();
  series.set_total_points(n);
  if (n <= max_points) return;
  const int k = (n + max_points - 1) / max_points;
  google::protobuf::RepeatedPtrField<v1::StepPoint> kept;
  for (int i = 0; i < n; ++i) {
    if (i % k == 0 || i == n - 1) *kept.Add() = series.points(i);
  }
  series.mutable_points()->Swap(&kept);
}

}  // namespace

absl::StatusOr<v1::JobMetricsResponse> Coordinator::JobMetrics(const std::string& id,
                                                               int max_points) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  if (max_points < 10 || max_points > 100000) {
    return FieldError("max_points", "must be in 10..100000");
  }
  v1::JobMetricsResponse out;
  out.set_job_id(id);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
    *out.mutable_evals() = it->second.evals();
  }
  std::ifstream in(SeriesPath(id), std::ios::binary);
  std::map<int, v1::AttemptSeries> by_attempt;
  std::string line;
  while (std::getline(in, line)) {
    int attempt;
    v1::StepPoint p;
    if (!ParseStepLine(line, &attempt, &p)) continue;
    v1::AttemptSeries& s = by_attempt[attempt];
    s.set_attempt(attempt);
    *s.add_points() = std::move(p);
  }
  for (auto& [attempt, s] : by_attempt) {
    Thin(s, max_points);
    *out.add_series() = std::move(s);
  }
  return out;
}

std::string Coordinator::RenderMetrics() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, int> by_state;
    for (const char* s : kStates) by_state[s] = 0;
    for (const auto& [id, j] : jobs_) by_state[j.state()]++;
    for (const auto& [s, n] : by_state) registry_.Set("loom_coordinator_jobs", n, {{"state", s}});
    registry_.Set("loom_coordinator_queue_depth", by_state["queued"]);
    const int64_t now = NowMs();
    for (const char* f : {"loom_coordinator_job_step", "loom_coordinator_job_progress_age_seconds",
                          "loom_coordinator_job_checkpoint_age_seconds"}) {
      registry_.Clear(f);
    }
    for (const auto& [id, j] : jobs_) {
      if (!IsActive(j.state())) continue;
      const metrics::Labels l = {{metrics::kJobLabel, id}};
      const int64_t started = std::max(j.update_time_ms(), j.start_time_ms());
      int64_t last_ckpt = 0;
      for (const auto& cid : j.checkpoints()) {
        auto c = checkpoints_.find(cid);
        if (c != checkpoints_.end()) last_ckpt = std::max(last_ckpt, c->second.time_ms());
      }
      registry_.Set("loom_coordinator_job_step", static_cast<double>(j.progress().step()), l);
      registry_.Set(
          "loom_coordinator_job_progress_age_seconds",
          static_cast<double>(now - std::max(j.progress().update_time_ms(), started)) / 1000.0, l);
      registry_.Set("loom_coordinator_job_checkpoint_age_seconds",
                    static_cast<double>(now - std::max(last_ckpt, started)) / 1000.0, l);
    }
    int alive = 0, lost = 0, total = 0, used = 0;
    for (const auto& [id, w] : workers_) {
      if (w.state() == "alive") {
        ++alive;
        total += w.slots();
        used += UsedSlots(id);
      } else {
        ++lost;
      }
    }
    registry_.Set("loom_coordinator_workers", alive, {{"state", "alive"}});
    registry_.Set("loom_coordinator_workers", lost, {{"state", "lost"}});
    registry_.Set("loom_coordinator_slots", used, {{"state", "used"}});
    registry_.Set("loom_coordinator_slots", total - used, {{"state", "free"}});
  }
  return registry_.Render();
}

}  // namespace loom::coordinator
