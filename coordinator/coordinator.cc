#include "coordinator/coordinator.h"

#include <google/protobuf/util/message_differencer.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "coordinator/job_logs.h"
#include "coordinator/submit_validation.h"
#include "coordinator/sweep.h"
#include "storage/checkpoint.h"
#include "storage/checkpoint_store.h"

namespace fs = std::filesystem;

namespace loom::coordinator {
namespace {

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

// The coordinator's metric families, each series that must exist from the first scrape at 0.
void DeclareMetrics(metrics::Registry& r) {
  r.DeclareGauge("loom_coordinator_jobs", "Jobs by state");
  r.DeclareGauge("loom_coordinator_workers", "Workers by state");
  r.DeclareGauge("loom_coordinator_slots",
                 "Slots on live workers, used and free (their sum is the capacity)");
  r.DeclareCounter("loom_coordinator_jobs_submitted_total", "Jobs accepted by POST /v1/jobs");
  r.DeclareCounter("loom_coordinator_job_restarts_total", "Failed attempts requeued");
  r.DeclareCounter("loom_coordinator_preemptions_total",
                   "Attempts stopped for a higher-priority job and requeued");
  r.DeclareCounter("loom_coordinator_jobs_ended_total",
                   "Jobs that reached a terminal state (succeeded, failed, cancelled)");
  // At 0 from the start, so increase() sees the first failure (a series born at 1 has none).
  for (JobState s : {JobState::kSucceeded, JobState::kFailed, JobState::kCancelled}) {
    r.Increment("loom_coordinator_jobs_ended_total", 0, {{"state", std::string(JobStateName(s))}});
  }
  r.DeclareCounter("loom_coordinator_workers_lost_total", "Workers marked lost");
  r.DeclareCounter("loom_coordinator_outages_forgiven_total",
                   "Pauses of the coordinator itself not counted against its workers' silence");
  r.DeclareGauge("loom_coordinator_loss_detection_held",
                 "1 while every alive worker is silent at once (a partition of the coordinator): "
                 "none is marked lost until the lease lapses");
  r.Set("loom_coordinator_loss_detection_held", 0);
  r.DeclareGauge("loom_coordinator_storage_full",
                 "1 while the data directory's filesystem is full: heartbeats and leases go on, "
                 "nothing is stored (submissions get 507) until there is room again");
  r.Set("loom_coordinator_storage_full", 0);
  r.DeclareCounter("loom_coordinator_http_requests_total", "HTTP requests by route and status");
  r.DeclareCounter("loom_coordinator_store_errors_total", "Failed RocksDB writes");
  r.DeclareCounter("loom_coordinator_log_syncs_total",
                   "fsyncs of the RocksDB log that heartbeats' state changes waited for (each "
                   "covers every heartbeat written before it: a group commit)");
  // Label-less counters start at 0, so rate() and increase() see them from the first scrape.
  for (const char* c :
       {"loom_coordinator_jobs_submitted_total", "loom_coordinator_job_restarts_total",
        "loom_coordinator_workers_lost_total", "loom_coordinator_store_errors_total",
        "loom_coordinator_log_syncs_total"}) {
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
}

// The job's `project` label, what project quotas count ("" = none).
std::string ProjectOf(const v1::Job& job) {
  auto it = job.request().labels().find("project");
  return it == job.request().labels().end() ? "" : it->second;
}

// Every label of the selector, with its value.
bool HasLabels(const google::protobuf::Map<std::string, std::string>& labels,
               const std::map<std::string, std::string>& want) {
  for (const auto& [k, v] : want) {
    auto it = labels.find(k);
    if (it == labels.end() || it->second != v) return false;
  }
  return true;
}

// Owners change their own jobs and sweeps; admins anyone's. A record without an owner (stored
// before owners were kept) is an admin's to change.
absl::Status MayChange(const Caller& caller, absl::string_view what, const std::string& id,
                       const std::string& owner) {
  if (caller.admin || (!owner.empty() && owner == caller.user)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(what, " ", id, " belongs to ",
                                                  owner.empty() ? "nobody on record" : owner,
                                                  ": only its owner or an admin may change it"));
}

}  // namespace

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
  if (!c->options_.clock) c->options_.clock = std::make_shared<SystemClock>();
  std::error_code ec;
  c->options_.storage_root = fs::weakly_canonical(fs::absolute(options.storage_root), ec).string();
  fs::create_directories(c->options_.storage_root, ec);
  fs::create_directories(fs::path(options.data_dir) / "logs", ec);
  if (!ec) fs::create_directories(fs::path(options.data_dir) / "series", ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot create '", options.data_dir, "': ", ec.message()));
  }
  // RocksDB's files take the umask's mode (0644 under 022); its directory is the owner's alone,
  // whatever the umask, so no other local user reads the state (credential digests included).
  const fs::path state = fs::path(options.data_dir) / "state";
  fs::create_directories(state, ec);
  if (!ec) fs::permissions(state, fs::perms::owner_all, fs::perm_options::replace, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot create '", state.string(), "' (mode 0700): ", ec.message()));
  }
  LOOM_ASSIGN_OR_RETURN(c->store_, StateStore::Open(state.string()));
  LOOM_RETURN_IF_ERROR(c->Load());
  LOOM_RETURN_IF_ERROR(c->MigrateCheckpointIds());
  DeclareMetrics(c->registry_);
  c->log_syncer_ = std::make_unique<LogSyncer>(*c->store_, c->registry_);
  return c;
}

Coordinator::~Coordinator() { Stop(); }

namespace {

constexpr char kDigestPrefix[] = "sha256:";

// What is stored of a worker credential: its SHA-256, so the state directory (and a copy of it)
// holds no usable credential. Credentials are 256 random bits: no salt or slow hash needed.
std::string CredentialDigest(const std::string& credential) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(credential.data()), credential.size(), digest);
  std::string out = kDigestPrefix;
  for (unsigned char b : digest) out += absl::StrFormat("%02x", b);
  return out;
}

bool SameDigest(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

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
  quotas_ = std::move(state.quotas);
  // Written before slots became optional: a stored quota with neither slots nor a weight was
  // one of 0 slots (proto3 does not write zeros).
  for (auto& [key, quota] : quotas_) {
    if (!quota.has_slots() && quota.weight() == 0) quota.set_slots(0);
  }
  next_sweep_ = state.next_sweep;
  // Credentials stored in clear by an older coordinator: their digests replace them.
  StateStore::Batch upgrade;
  for (auto& [worker, stored] : credentials_) {
    if (absl::StartsWith(stored, kDigestPrefix)) continue;
    stored = CredentialDigest(stored);
    upgrade.PutCredential(worker, stored);
  }
  if (!upgrade.empty()) LOOM_RETURN_IF_ERROR(store_->Commit(upgrade, true));
  for (const auto& [worker, digest] : credentials_) credential_owner_[digest] = worker;
  // Restarted: every known worker gets a fresh grace period to heartbeat again.
  const int64_t now = NowMs();
  const int64_t steady = SteadyMs();
  for (auto& [id, w] : workers_) {
    w.set_last_heartbeat_ms(now);
    heard_steady_[id] = steady;
  }
  // A fence carried over a restart: what was left of it (never more than a lease and a grace,
  // whatever the wall clock did while the coordinator was down).
  const int64_t longest = int64_t{options_.lease_ms} + options_.term_grace_ms;
  for (const auto& [id, job] : jobs_) {
    if (job.not_before_ms() > now) {
      fence_steady_[id] = steady + std::min(job.not_before_ms() - now, longest);
    }
  }
  IndexPlacementsLocked();
  RebuildUsageLocked();
  // Retention decided before a crash but not carried out yet.
  for (const auto& [id, c] : checkpoints_) {
    std::error_code ec;
    // (On an object store a step whose deletion a crash interrupted waits for its job's next
    // sweep: a HEAD per deleted checkpoint at every start would grow without bound.)
    if (c.deleted() && fs::exists(c.path(), ec)) pending_deletes_.push_back({c.path()});
  }
  return absl::OkStatus();
}

// Fair share's usage from every attempt's start and end (a running one's so far): the same
// value the passes had advanced to, whatever the restart cost.
void Coordinator::RebuildUsageLocked() {
  const int64_t now = NowMs();
  usage_.Advance(now, {});
  last_held_.clear();
  for (const auto& [id, job] : jobs_) {
    const bool active = IsActive(job);
    for (int i = 0; i < job.history_size(); ++i) {
      const v1::AttemptRecord& a = job.history(i);
      const bool current = active && i == job.history_size() - 1;
      const int64_t end = current ? now : a.end_time_ms();
      if (end > 0) usage_.AddInterval(job.submitted_by(), job.world_size(), a.start_time_ms(), end);
    }
    if (active) last_held_[job.submitted_by()] += job.world_size();
  }
}

void Coordinator::Start() {
  remote_remover_ = std::thread([this] { RemoveRemotely(); });
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
  {
    std::lock_guard<std::mutex> lock(remote_mu_);
    remote_stop_ = true;  // what is still queued is swept with its job's next retention
  }
  remote_cv_.notify_all();
  if (remote_remover_.joinable()) remote_remover_.join();
}

void Coordinator::RemoveRemotely() {
  for (;;) {
    std::vector<Removal> batch;
    {
      std::unique_lock<std::mutex> lock(remote_mu_);
      remote_cv_.wait(lock, [this] { return remote_stop_ || !remote_removals_.empty(); });
      if (remote_stop_) return;
      batch.swap(remote_removals_);
    }
    DeleteDirectories(std::move(batch));
  }
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

absl::Status Coordinator::Commit(Txn& txn, bool sync) {
  // A job log or series append that found the disk full fails the change like a full store:
  // nothing of it is recorded, so the agent sends it all again.
  absl::Status s = txn.no_space           ? StorageFullError("a job log append")
                   : txn.progress.empty() ? absl::OkStatus()
                                          : store_->Commit(txn.progress, false);
  if (s.ok() && !txn.batch.empty()) s = store_->Commit(txn.batch, sync);
  if (IsStorageFull(s)) disk_full_ = true;
  if (s.ok() && !(txn.progress.empty() && txn.batch.empty())) disk_full_ = false;
  if (s.ok()) {
    pending_deletes_.insert(pending_deletes_.end(), txn.deletes.begin(), txn.deletes.end());
    for (JobState state : txn.ended) {
      registry_.Increment("loom_coordinator_jobs_ended_total", 1,
                          {{"state", std::string(JobStateName(state))}});
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

void Coordinator::AddEvent(Txn& txn, v1::Job& job, std::optional<JobState> state,
                           const std::string& reason) {
  Save(txn, job);
  v1::JobEvent e;
  e.set_seq(event_counts_[job.id()]++);
  e.set_time_ms(NowMs());
  if (state) e.set_state(std::string(JobStateName(*state)));
  e.set_reason(reason);
  e.set_attempt(job.attempt());
  txn.batch.PutEvent(job.id(), e);
}

void Coordinator::SetState(Txn& txn, v1::Job& job, JobState state, const std::string& reason) {
  Save(txn, job);
  SetJobState(job, state);
  job.set_reason(reason);
  job.set_update_time_ms(NowMs());
  if (IsTerminal(state)) {
    txn.ended.push_back(state);
    job.set_end_time_ms(job.update_time_ms());
    job.clear_placement();
    if (job.history_size() > 0 && job.history().rbegin()->end_reason().empty()) {
      job.mutable_history()->rbegin()->set_end_reason(
          absl::StrCat(JobStateName(state), ": ", reason));
      job.mutable_history()->rbegin()->set_end_time_ms(job.update_time_ms());
    }
  }
  AddEvent(txn, job, state, reason);
  txn.batch.PutJob(job);
  // A finished child no longer pins its parent's checkpoint.
  if (IsTerminal(state) && !job.request().init_from().empty()) {
    ApplyRetention(txn, ParentJob(job.request().init_from()));
  }
}

absl::StatusOr<v1::JobSpec> Coordinator::ResolveSubmission(const v1::SubmitJobRequest& request) {
  LOOM_RETURN_IF_ERROR(CheckSubmitRequest(request));
  std::string model_checkpoint_dir;
  if (TakesModelFromCheckpoint(request)) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = checkpoints_.find(request.init_from());
    if (it != checkpoints_.end()) model_checkpoint_dir = it->second.path();
  }
  return ResolveSubmittedSpec(request, model_checkpoint_dir);
}

namespace {

// A directory left by an earlier coordinator state under this id must not be resumed from: it
// moves to <storage root>/stale/<id>-<now>.
absl::Status SetAsideStaleDirectory(const std::string& storage_root, const std::string& id,
                                    int64_t now) {
  const fs::path job_dir = fs::path(storage_root) / "jobs" / id;
  std::error_code ec;
  if (fs::exists(job_dir, ec)) {
    fs::create_directories(fs::path(storage_root) / "stale", ec);
    fs::rename(job_dir, fs::path(storage_root) / "stale" / absl::StrCat(id, "-", now), ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot move the stale directory ", job_dir.string(), ": ", ec.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// Where the request's init_from checkpoint is ("" without one), after the catalogue check:
// retention holds the same lock, so an accepted job's starting checkpoint is pinned from here on.
absl::StatusOr<std::string> Coordinator::InitFromPathLocked(
    const v1::SubmitJobRequest& request) const {
  if (request.init_from().empty()) return std::string();
  auto it = checkpoints_.find(request.init_from());
  if (it == checkpoints_.end()) {
    return FieldError("init_from",
                      absl::StrCat("no checkpoint '", request.init_from().substr(0, 100),
                                   "' in the catalogue (GET /v1/checkpoints)"));
  }
  const std::string& init_path = it->second.path();
  std::error_code ec;
  // (A step on an object store is not looked up under the lock: the catalogue says it exists.)
  if (it->second.deleted() || (!storage::IsRemoteLocation(init_path) &&
                               !fs::exists(fs::path(init_path) / "manifest.json", ec))) {
    return FieldError("init_from",
                      absl::StrCat("checkpoint '", request.init_from(), "' is no longer on disk (",
                                   init_path, "); pick an available one"));
  }
  if (!it->second.damaged().empty()) {
    return FieldError("init_from", absl::StrCat("checkpoint '", request.init_from(),
                                                "' is damaged: ", it->second.damaged()));
  }
  return init_path;
}

// Under the lock: the init_from check, the id, paths and the stored job.
absl::StatusOr<v1::Job> Coordinator::AddJobLocked(Txn& txn, const v1::SubmitJobRequest& request,
                                                  v1::JobSpec spec, const std::string& user,
                                                  const std::string& id) {
  LOOM_ASSIGN_OR_RETURN(const std::string init_path, InitFromPathLocked(request));
  LOOM_RETURN_IF_ERROR(ResolveJobPaths(spec, options_.storage_root, id));
  spec.mutable_checkpoint()->set_dir(CheckpointDirFor(id, NowMs()));
  ApplyCheckpointIntervalDefault(spec, options_.checkpoint_interval_seconds);
  v1::Job job;
  job.set_id(id);
  job.set_name(spec.name().empty() ? id : spec.name());
  *job.mutable_request() = request;
  *job.mutable_spec() = spec;
  job.set_world_size(WorldSizeOf(request));
  job.set_priority(request.priority());
  job.set_max_restarts(MaxRestartsOf(request));
  job.set_init_from_path(init_path);
  job.set_submitted_by(user);
  const int64_t now = NowMs();
  job.set_submit_time_ms(now);
  job.set_queued_since_ms(now);
  job.mutable_progress()->set_total_steps(spec.steps());
  LOOM_RETURN_IF_ERROR(CheckPrintable(job));
  if (!RemoteCheckpoints()) {
    LOOM_RETURN_IF_ERROR(SetAsideStaleDirectory(options_.storage_root, id, now));
  }
  SetState(txn, job, JobState::kQueued, absl::StrCat("submitted by ", user));
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

struct Coordinator::PlannedJob {
  const SweepCell* cell;
  uint64_t seed;
  v1::SubmitJobRequest request;
  v1::JobSpec spec;
};

namespace {

// A refusal of one job of a sweep, naming its cell and seed.
absl::Status InCell(const absl::Status& s, const std::string& cell, uint64_t seed) {
  return absl::Status(s.code(), absl::StrCat("cell '", cell, "' seed ", seed, ": ", s.message()));
}

}  // namespace

// Every job validated before any is stored: a sweep is accepted whole or not at all.
absl::StatusOr<std::vector<Coordinator::PlannedJob>> Coordinator::PlanSweepJobs(
    const v1::SweepSpec& spec, const std::vector<SweepCell>& cells) {
  std::vector<PlannedJob> planned;
  for (const SweepCell& cell : cells) {
    for (uint64_t seed : spec.seeds()) {
      PlannedJob p{&cell, seed, spec.base(), {}};
      LOOM_ASSIGN_OR_RETURN(*p.request.mutable_spec(), ApplyCell(spec.base().spec(), cell, seed));
      for (const auto& [k, v] : spec.labels()) (*p.request.mutable_labels())[k] = v;
      auto resolved = ResolveSubmission(p.request);
      if (!resolved.ok()) return InCell(resolved.status(), cell.name, seed);
      p.spec = *std::move(resolved);
      planned.push_back(std::move(p));
    }
  }
  return planned;
}

// A retry of a sweep already created under the same idempotency key.
absl::StatusOr<v1::CreateSweepResponse> Coordinator::RepeatedSweepLocked(
    const std::string& key, const v1::SweepSpec& spec) {
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

// The planned jobs stored under the next job ids, tagged with the sweep and listed in it; on a
// refusal nothing stays changed.
absl::Status Coordinator::AddSweepJobsLocked(Txn& txn, v1::Sweep& sweep,
                                             const std::vector<PlannedJob>& planned,
                                             const std::string& user) {
  for (size_t i = 0; i < planned.size(); ++i) {
    const std::string id = absl::StrFormat("job-%06d", next_job_ + static_cast<int64_t>(i));
    auto job = AddJobLocked(txn, planned[i].request, planned[i].spec, user, id);
    if (!job.ok()) {
      Rollback(txn);
      return InCell(job.status(), planned[i].cell->name, planned[i].seed);
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
  return absl::OkStatus();
}

absl::StatusOr<v1::CreateSweepResponse> Coordinator::CreateSweep(const v1::SweepSpec& raw,
                                                                 const std::string& user) {
  v1::SweepSpec spec = raw;
  if (!spec.base().init_from().empty()) {
    LOOM_ASSIGN_OR_RETURN(*spec.mutable_base()->mutable_init_from(),
                          CanonicalCheckpointId(spec.base().init_from(), "base.init_from"));
  }
  LOOM_RETURN_IF_ERROR(CheckSweepRequest(spec));
  LOOM_ASSIGN_OR_RETURN(std::vector<SweepCell> cells, ExpandSweep(spec));
  LOOM_ASSIGN_OR_RETURN(std::vector<PlannedJob> planned, PlanSweepJobs(spec, cells));
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string key = IdempotencyKey("sweep:", user, spec.request_id());
  if (!spec.request_id().empty() && request_ids_.count(key)) return RepeatedSweepLocked(key, spec);
  v1::Sweep sweep;
  sweep.set_id(absl::StrFormat("sweep-%06d", next_sweep_));
  sweep.set_name(spec.name().empty() ? sweep.id() : spec.name());
  *sweep.mutable_spec() = spec;
  for (const SweepCell& c : cells) sweep.add_cells(c.name);
  sweep.set_submitted_by(user);
  sweep.set_submit_time_ms(NowMs());
  Txn txn;
  LOOM_RETURN_IF_ERROR(AddSweepJobsLocked(txn, sweep, planned, user));
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
    const std::string name =
        it == jobs_.end() ? std::string(JobStateName(JobState::kQueued)) : it->second.state();
    (*out.mutable_job_states())[name]++;
    const std::optional<JobState> state = ParseJobState(name);
    ended += state && IsTerminal(*state) ? 1 : 0;
    cancelled += state == JobState::kCancelled ? 1 : 0;
  }
  const SweepState state = ended < sweep.jobs_size() ? SweepState::kRunning
                           : cancelled > 0           ? SweepState::kCancelled
                                                     : SweepState::kFinished;
  out.set_state(std::string(SweepStateName(state)));
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
                                                               const std::string& page_token,
                                                               const std::string& owner,
                                                               const std::string& label_selector) {
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  LOOM_ASSIGN_OR_RETURN(const auto labels, ParseLabelSelector(label_selector));
  const std::string filter =
      owner.empty() && label_selector.empty() ? "" : absl::StrCat(owner, "\x1e", label_selector);
  LOOM_ASSIGN_OR_RETURN(const std::string after, DecodePageToken(page_token, "sweeps", filter));
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListSweepsResponse out;
  for (auto it = sweeps_.upper_bound(after); it != sweeps_.end(); ++it) {
    const v1::Sweep& sweep = it->second;
    if (!owner.empty() && sweep.submitted_by() != owner) continue;
    if (!HasLabels(sweep.spec().labels(), labels)) continue;
    if (out.sweeps_size() == page_size) {
      out.set_next_page_token(EncodePageToken("sweeps", filter, out.sweeps(page_size - 1).id()));
      break;
    }
    v1::Sweep* s = out.add_sweeps();
    *s = SweepWithStates(sweep);
    s->clear_jobs();  // the list stays small; GET /v1/sweeps/{id} has them
  }
  return out;
}

absl::StatusOr<v1::Sweep> Coordinator::CancelSweep(const std::string& id, const Caller& caller) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("sweep id: malformed");
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = sweeps_.find(id);
  if (it == sweeps_.end()) return absl::NotFoundError(absl::StrCat("sweep '", id, "' not found"));
  LOOM_RETURN_IF_ERROR(MayChange(caller, "sweep", id, it->second.submitted_by()));
  const std::string& user = caller.user;
  Txn txn;
  for (const v1::SweepJob& sj : it->second.jobs()) {
    auto job = jobs_.find(sj.job_id());
    if (job == jobs_.end() || IsTerminal(job->second)) continue;
    Save(txn, job->second);
    job->second.set_cancel_requested(true);
    SetState(txn, job->second, JobState::kCancelled,
             absl::StrCat("sweep ", id, " cancelled by ", user));
  }
  LOOM_RETURN_IF_ERROR(Commit(txn));
  wake_.notify_all();
  return SweepWithStates(it->second);
}

absl::StatusOr<std::string> Coordinator::AddReportBaselineLocked(
    const std::string& baseline, v1::Sweep& sweep, std::map<std::string, v1::Job>& jobs) const {
  auto cells_text = [](const v1::Sweep& s) { return absl::StrJoin(s.cells(), "; "); };
  if (baseline.size() > 256) return FieldError("baseline", "longer than 256 characters");
  const size_t slash = baseline.find('/');
  const std::string other_id = slash == std::string::npos ? sweep.id() : baseline.substr(0, slash);
  const std::string cell = slash == std::string::npos ? baseline : baseline.substr(slash + 1);
  if (other_id == sweep.id()) {
    if (!Contains(sweep.cells(), cell)) {
      return FieldError("baseline", absl::StrCat("no cell named '", cell.substr(0, 200),
                                                 "' (cells: ", cells_text(sweep), ")"));
    }
    sweep.mutable_spec()->set_baseline(cell);
    return std::string();
  }
  auto it = IsValidId(other_id) ? sweeps_.find(other_id) : sweeps_.end();
  if (it == sweeps_.end()) {
    return FieldError("baseline", absl::StrCat("no sweep '", other_id.substr(0, 100),
                                               "' (expected a cell, or SWEEP_ID/CELL)"));
  }
  const v1::Sweep& other = it->second;
  if (!Contains(other.cells(), cell)) {
    return FieldError("baseline",
                      absl::StrCat(other_id, " has no cell named '", cell.substr(0, 200),
                                   "' (cells: ", cells_text(other), ")"));
  }
  if (Contains(sweep.cells(), baseline)) {
    return FieldError("baseline", absl::StrCat("'", baseline, "' is also a cell of ", sweep.id()));
  }
  sweep.add_cells(baseline);
  for (const v1::SweepJob& sj : other.jobs()) {
    if (sj.cell() != cell) continue;
    v1::SweepJob* added = sweep.add_jobs();
    *added = sj;
    added->set_cell(baseline);
    auto job = jobs_.find(sj.job_id());
    if (job != jobs_.end()) jobs[sj.job_id()] = job->second;
  }
  sweep.mutable_spec()->set_baseline(baseline);
  return other_id;
}

namespace {

// What a merged report knows of each of its cells: the seeds it has so far and its first job.
struct MergedCells {
  std::map<std::string, std::set<uint64_t>> seeds;
  std::map<std::string, v1::Job> first;
};

// `other`'s jobs of the cells `sweep` has too, into `sweep` and `jobs` (from `all`); a warning per
// cell whose jobs differ besides the seed, and one naming the cells `sweep` does not have.
absl::Status MergeSweep(const v1::Sweep& other, const std::map<std::string, v1::Job>& all,
                        MergedCells& cells, v1::Sweep& sweep, std::map<std::string, v1::Job>& jobs,
                        std::vector<std::string>& warnings) {
  std::vector<std::string> unmatched;
  for (const std::string& cell : other.cells()) {
    if (!Contains(sweep.cells(), cell)) unmatched.push_back(absl::StrCat("'", cell, "'"));
  }
  if (unmatched.size() == static_cast<size_t>(other.cells_size())) {
    return FieldError("merge",
                      absl::StrCat(other.id(), " has no cell named like one of ", sweep.id(),
                                   "'s (its cells: ", absl::StrJoin(other.cells(), "; "), ")"));
  }
  std::set<std::string> compared;
  for (const v1::SweepJob& sj : other.jobs()) {
    if (!Contains(sweep.cells(), sj.cell())) continue;
    if (!cells.seeds[sj.cell()].insert(sj.seed()).second) {
      return FieldError("merge",
                        absl::StrCat(other.id(), "'s cell '", sj.cell(), "' has seed ", sj.seed(),
                                     ", which the cell has already: a seed counts once"));
    }
    *sweep.add_jobs() = sj;
    auto job = all.find(sj.job_id());
    if (job == all.end()) continue;
    jobs[sj.job_id()] = job->second;
    auto own = cells.first.find(sj.cell());
    if (own == cells.first.end() || !compared.insert(sj.cell()).second) continue;
    const std::vector<std::string> differ = SpecDifferencesBesidesSeed(job->second, own->second);
    if (differ.empty()) continue;
    warnings.push_back(absl::StrCat("cell '", sj.cell(), "' of ", other.id(), " differs from ",
                                    sweep.id(),
                                    "'s besides the seed: ", absl::StrJoin(differ, ", ")));
  }
  if (!unmatched.empty()) {
    warnings.push_back(absl::StrCat(other.id(), "'s cells ", absl::StrJoin(unmatched, ", "),
                                    " have no namesake in ", sweep.id(), ": not merged"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> Coordinator::AddReportMergeLocked(
    const std::vector<std::string>& merge, v1::Sweep& sweep,
    std::map<std::string, v1::Job>& jobs) const {
  constexpr size_t kMaxMerged = 16;
  if (merge.size() > kMaxMerged) {
    return FieldError("merge", absl::StrCat("at most ", kMaxMerged, " sweeps"));
  }
  MergedCells cells;
  for (const v1::SweepJob& sj : sweep.jobs()) {
    cells.seeds[sj.cell()].insert(sj.seed());
    auto it = jobs.find(sj.job_id());
    if (it != jobs.end()) cells.first.emplace(sj.cell(), it->second);
  }
  std::vector<std::string> warnings;
  std::set<std::string> listed;
  for (const std::string& id : merge) {
    if (id == sweep.id()) return FieldError("merge", absl::StrCat(id, " is the reported sweep"));
    if (!listed.insert(id).second) return FieldError("merge", absl::StrCat(id, " is listed twice"));
    auto it = IsValidId(id) ? sweeps_.find(id) : sweeps_.end();
    if (it == sweeps_.end()) {
      return FieldError("merge", absl::StrCat("no sweep '", id.substr(0, 100), "'"));
    }
    LOOM_RETURN_IF_ERROR(MergeSweep(it->second, jobs_, cells, sweep, jobs, warnings));
  }
  return warnings;
}

namespace {

// The first stored pair of jobs with one seed, of `cell` and of `baseline` (nulls if none).
std::pair<const v1::Job*, const v1::Job*> PairedJobs(const v1::Sweep& sweep,
                                                     const std::map<std::string, v1::Job>& jobs,
                                                     const std::string& cell,
                                                     const std::string& baseline) {
  std::map<uint64_t, const v1::Job*> base;
  for (const v1::SweepJob& sj : sweep.jobs()) {
    auto it = jobs.find(sj.job_id());
    if (sj.cell() == baseline && it != jobs.end()) base[sj.seed()] = &it->second;
  }
  for (const v1::SweepJob& sj : sweep.jobs()) {
    auto it = jobs.find(sj.job_id());
    auto b = base.find(sj.seed());
    if (sj.cell() == cell && it != jobs.end() && b != base.end()) return {&it->second, b->second};
  }
  return {nullptr, nullptr};
}

// A baseline from another sweep: marks its cell, and warns of each cell whose jobs' specs differ
// from the baseline's at one seed in more than the model (the pairing then compares more).
void AddBaselineWarnings(const v1::Sweep& sweep, const std::map<std::string, v1::Job>& jobs,
                         const std::string& baseline_sweep, v1::SweepReport& report) {
  const std::string& baseline = sweep.spec().baseline();
  for (v1::CellStats& cell : *report.mutable_cells()) {
    if (cell.cell() == baseline) {
      cell.set_sweep_id(baseline_sweep);
      continue;
    }
    const auto [job, base] = PairedJobs(sweep, jobs, cell.cell(), baseline);
    if (job == nullptr) continue;
    const std::vector<std::string> differ = SpecDifferencesBesidesModel(*job, *base);
    if (differ.empty()) continue;
    report.add_warnings(
        absl::StrCat("cell '", cell.cell(), "' and the baseline '", baseline,
                     "' differ in more than the model: ", absl::StrJoin(differ, ", ")));
  }
}

}  // namespace

absl::StatusOr<v1::SweepReport> Coordinator::ReportSweep(const std::string& id,
                                                         const ReportQuery& query) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("sweep id: malformed");
  // The names now; the combination (a reach threshold fits the metric) once the sweep's own
  // fields fill in what the query leaves out.
  LOOM_RETURN_IF_ERROR(
      CheckMetricAndSelect(query.metric, query.select == "reach" ? "" : query.select, 0));
  v1::Sweep sweep;
  std::map<std::string, v1::Job> jobs;
  std::string baseline_sweep;  // set when the baseline is another sweep's cell
  std::vector<std::string> merge_warnings;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sweeps_.find(id);
    if (it == sweeps_.end()) return absl::NotFoundError(absl::StrCat("sweep '", id, "' not found"));
    sweep = it->second;
    for (const v1::SweepJob& sj : sweep.jobs()) {
      auto job = jobs_.find(sj.job_id());
      if (job != jobs_.end()) jobs[sj.job_id()] = job->second;
    }
    if (!query.merge.empty()) {
      LOOM_ASSIGN_OR_RETURN(merge_warnings, AddReportMergeLocked(query.merge, sweep, jobs));
    }
    if (!query.baseline.empty()) {
      LOOM_ASSIGN_OR_RETURN(baseline_sweep, AddReportBaselineLocked(query.baseline, sweep, jobs));
    }
  }
  // A report of another metric or selection than the sweep's own: the same jobs, read again.
  if (!query.metric.empty()) sweep.mutable_spec()->set_metric(query.metric);
  if (!query.select.empty()) sweep.mutable_spec()->set_select(query.select);
  if (query.length.has_value()) sweep.mutable_spec()->set_length(*query.length);
  if (query.threshold.has_value()) sweep.mutable_spec()->set_threshold(*query.threshold);
  const v1::SweepSpec& spec = sweep.spec();  // the overrides combined with the sweep's own
  LOOM_RETURN_IF_ERROR(
      CheckMetricAndSelect(spec.metric(), spec.select(), spec.length(), spec.threshold()));
  v1::SweepReport report = BuildSweepReport(sweep, jobs);  // the bootstrap runs without the lock
  if (!baseline_sweep.empty()) AddBaselineWarnings(sweep, jobs, baseline_sweep, report);
  for (const std::string& id : query.merge) report.add_merged_sweeps(id);
  for (const std::string& w : merge_warnings) report.add_warnings(w);
  return report;
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const std::string& state, int page_size,
                                                           const std::string& page_token) {
  JobFilter filter;
  filter.state = state;
  return ListJobs(filter, page_size, page_token);
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const JobFilter& f, int page_size,
                                                           const std::string& page_token) {
  const std::optional<JobState> state = ParseJobState(f.state);  // nullopt: any state
  if (!f.state.empty() && !state) {
    return FieldError("state", absl::StrCat("unknown state '", f.state.substr(0, 40), "'; one of ",
                                            absl::StrJoin(JobStateNames(), ", ")));
  }
  for (const auto& [name, value] : {std::pair<const char*, const std::string&>{"user", f.user},
                                    {"kind", f.kind},
                                    {"sweep", f.sweep}}) {
    if (value.size() > 128) return FieldError(name, "at most 128 characters");
  }
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  // The old token format carries the state alone; the other filters extend it.
  LOOM_ASSIGN_OR_RETURN(const auto labels, ParseLabelSelector(f.labels));
  std::string key = f.state;
  if (!f.user.empty() || !f.kind.empty() || !f.sweep.empty() || f.newest_first ||
      !f.labels.empty()) {
    key = absl::StrJoin(
        {f.state, f.user, f.kind, f.sweep, std::string(f.newest_first ? "desc" : ""), f.labels},
        "\x1e");
  }
  LOOM_ASSIGN_OR_RETURN(const std::string after, DecodePageToken(page_token, "jobs", key));
  std::lock_guard<std::mutex> lock(mutex_);
  auto matches = [&](const v1::Job& j) {
    return (!state || JobStateOf(j) == state) && (f.user.empty() || j.submitted_by() == f.user) &&
           (f.kind.empty() || (j.spec().kind().empty() ? "pretrain" : j.spec().kind()) == f.kind) &&
           (f.sweep.empty() || j.sweep_id() == f.sweep) && HasLabels(j.request().labels(), labels);
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
    if (JobStateOf(*j) == JobState::kQueued && w != waiting_reason_.end()) {
      j->set_reason(w->second);
    }
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
  if (JobStateOf(job) == JobState::kQueued && w != waiting_reason_.end()) job.set_reason(w->second);
  LOOM_ASSIGN_OR_RETURN(std::vector<v1::JobEvent> events, store_->Events(id));
  for (auto& e : events) *job.add_events() = std::move(e);
  return job;
}

absl::StatusOr<v1::Job> Coordinator::Cancel(const std::string& id, const Caller& caller) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  v1::Job& job = it->second;
  LOOM_RETURN_IF_ERROR(MayChange(caller, "job", id, job.submitted_by()));
  const std::string& user = caller.user;
  if (IsTerminal(job)) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is already ", job.state()));
  }
  // The attempt's ranks get SIGTERM through their agents' next heartbeat; their slots stay
  // counted until the agents report them gone.
  Txn txn;
  Save(txn, job);
  job.set_cancel_requested(true);
  SetState(txn, job, JobState::kCancelled, absl::StrCat("cancelled by ", user));
  LOOM_RETURN_IF_ERROR(Commit(txn));
  wake_.notify_all();
  return jobs_[id];
}

namespace {

absl::Status CheckJobUpdate(const v1::JobUpdate& u) {
  if (!u.has_priority() && !u.has_keep_last() && !u.has_keep_every())
    return FieldError("priority", "give priority, keep_last or keep_every");
  if (u.has_priority() && (u.priority() < -1000 || u.priority() > 1000))
    return FieldError("priority", "must be in -1000..1000");
  if (u.has_keep_last() && (u.keep_last() < 1 || u.keep_last() > 1000000))
    return FieldError("keep_last", "must be in 1..1000000");
  if (u.has_keep_every() && (u.keep_every() < 0 || u.keep_every() > (int64_t{1} << 40)))
    return FieldError("keep_every", "must be in 0..2^40");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::Job> Coordinator::UpdateJob(const std::string& id, const v1::JobUpdate& u,
                                               const Caller& caller) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  LOOM_RETURN_IF_ERROR(CheckJobUpdate(u));
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  v1::Job& job = it->second;
  LOOM_RETURN_IF_ERROR(MayChange(caller, "job", id, job.submitted_by()));
  if (u.has_priority() && IsTerminal(job)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is already ", job.state(), ": its priority no longer matters"));
  }
  Txn txn;
  Save(txn, job);
  std::vector<std::string> changed;
  if (u.has_priority() && u.priority() != job.priority()) {
    changed.push_back(absl::StrCat("priority ", job.priority(), " -> ", u.priority()));
    job.set_priority(u.priority());
  }
  v1::CheckpointConfig* cfg = job.mutable_spec()->mutable_checkpoint();
  if (u.has_keep_last() && u.keep_last() != cfg->keep_last()) {
    changed.push_back(absl::StrCat("keep_last ", cfg->keep_last(), " -> ", u.keep_last()));
    cfg->set_keep_last(u.keep_last());
  }
  if (u.has_keep_every() && u.keep_every() != cfg->keep_every()) {
    changed.push_back(absl::StrCat("keep_every ", cfg->keep_every(), " -> ", u.keep_every()));
    cfg->set_keep_every(u.keep_every());
  }
  if (changed.empty()) return job;
  txn.batch.PutJob(job);
  AddEvent(txn, job, std::nullopt, absl::StrCat(absl::StrJoin(changed, ", "), " by ", caller.user));
  if (u.has_keep_last() || u.has_keep_every()) ApplyRetention(txn, id);
  LOOM_RETURN_IF_ERROR(Commit(txn));
  wake_.notify_all();  // a raised priority may place it, or let it preempt
  return jobs_[id];
}

std::vector<std::string> Coordinator::PinnedBy(const std::string& checkpoint_id) const {
  std::vector<std::string> out;
  for (const auto& [id, job] : jobs_) {
    if (!IsTerminal(job) && job.request().init_from() == checkpoint_id) out.push_back(id);
  }
  return out;
}

absl::StatusOr<v1::ListCheckpointsResponse> Coordinator::ListCheckpoints(
    const std::string& job_id, int page_size, const std::string& page_token,
    const std::string& owner) {
  if (!job_id.empty() && !IsValidId(job_id)) return FieldError("job", "malformed job id");
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  const std::string filter = absl::StrCat(job_id, "|", owner);
  LOOM_ASSIGN_OR_RETURN(const std::string after,
                        DecodePageToken(page_token, "checkpoints", filter));
  // Ordered by job, then step: the key "<job>/<step, zero-padded>" sorts that way.
  auto key = [](const v1::CheckpointEntry& c) {
    return absl::StrFormat("%s/%020d", c.job_id(), c.step());
  };
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListCheckpointsResponse out;
  std::map<std::string, const v1::CheckpointEntry*> list;
  auto owned = [&](const v1::CheckpointEntry& c) {
    if (owner.empty()) return true;
    auto job = jobs_.find(c.job_id());
    return job != jobs_.end() && job->second.submitted_by() == owner;
  };
  for (const auto& [id, c] : checkpoints_) {
    if ((job_id.empty() || c.job_id() == job_id) && key(c) > after && owned(c))
      list.emplace(key(c), &c);
  }
  for (const auto& [k, c] : list) {
    if (out.checkpoints_size() == page_size) {
      out.set_next_page_token(
          EncodePageToken("checkpoints", filter, key(out.checkpoints(page_size - 1))));
      break;
    }
    v1::CheckpointEntry* e = out.add_checkpoints();
    *e = *c;
    std::error_code ec;
    // On an object store the catalogue's word (a HEAD per entry would make a page wait on the
    // network): not deleted, not found damaged.
    e->set_available(!c->deleted() &&
                     (storage::IsRemoteLocation(c->path())
                          ? c->damaged().empty()
                          : fs::exists(fs::path(c->path()) / "manifest.json", ec)));
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
  // Looked up by digest: the map's comparisons can time only the digest, which tells nothing
  // about the credential.
  const std::string digest = CredentialDigest(credential);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = credential_owner_.find(digest);
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

absl::Status CheckRegisterRequest(const v1::RegisterWorkerRequest& request) {
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
  return CheckGpus(request);
}

}  // namespace

// The id the registering worker gets: a fresh one, its own again, or a new worker's chosen one.
// An agent that registers its known id again restarted: the attempts it ran failed.
absl::StatusOr<std::string> Coordinator::RegisteringIdLocked(
    Txn& txn, const v1::RegisterWorkerRequest& request) {
  std::string id = request.worker_id();
  auto existing = workers_.find(id);
  if (id.empty()) {
    std::random_device rd;
    do {
      id = absl::StrFormat("w-%08x", rd());
    } while (workers_.count(id));
    return id;
  }
  if (existing == workers_.end()) return id;
  // A live worker's id is taken over only by the holder of its credential (its own agent
  // after a restart); a lost worker's credential is already revoked.
  auto cred = credentials_.find(id);
  if (IsAlive(existing->second) && cred != credentials_.end() &&
      !SameDigest(CredentialDigest(request.credential()), cred->second)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker id '", id, "' belongs to a live worker; re-registering it needs its credential"));
  }
  // An agent that restarted lost its ranks (they die with it): their attempts failed.
  FailAttemptsOn(txn, id, absl::StrCat("worker ", id, " restarted"));
  reported_running_[id].clear();
  return id;
}

// A fresh heartbeat credential for the worker; the one it had stops working.
std::string Coordinator::IssueCredential(Txn& txn, const std::string& worker_id) {
  RevokeCredential(txn, worker_id);
  const std::string credential = RandomToken();
  const std::string digest = CredentialDigest(credential);
  SaveCredential(txn, worker_id);
  credentials_[worker_id] = digest;
  credential_owner_[digest] = worker_id;
  txn.batch.PutCredential(worker_id, digest);
  return credential;  // the only copy in clear: the agent's
}

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::Register(
    const v1::RegisterWorkerRequest& request) {
  LOOM_RETURN_IF_ERROR(CheckRegisterRequest(request));
  std::lock_guard<std::mutex> lock(mutex_);
  Txn txn;
  LOOM_ASSIGN_OR_RETURN(const std::string id, RegisteringIdLocked(txn, request));
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
  SetWorkerState(w, WorkerState::kAlive);
  w.set_last_heartbeat_ms(now);
  heard_steady_[id] = SteadyMs();
  txn.batch.PutWorker(w);
  const std::string credential = IssueCredential(txn, id);
  LOOM_RETURN_IF_ERROR(Commit(txn));
  heard_since_start_.insert(id);
  wake_.notify_all();
  v1::RegisterWorkerResponse r;
  r.set_worker_id(id);
  r.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  r.set_credential(credential);
  r.set_lease_ms(options_.lease_ms);
  r.set_max_body_bytes(options_.max_body_bytes);
  return r;
}

// Readies a job whose attempt ended for its next one (the caller sets it queued): placement
// cleared, fenced until not_before_ms (0: none). It keeps its original queue time, so aging and
// reservations count from the submission. Returns where it will resume from, in words.
std::string Coordinator::Requeue(v1::Job& job, int64_t not_before_ms) {
  std::string from = "the start";
  if (const v1::CheckpointEntry* newest = NewestIntactCheckpoint(job)) {
    from = absl::StrCat("step ", newest->step());
  }
  job.clear_placement();
  job.set_master_port(0);
  job.clear_finished_workers();
  job.set_not_before_ms(not_before_ms);
  // A preemption asked of an attempt that ended otherwise (its worker lost) is void: the next
  // attempt must not be stopped for it.
  job.set_preempt_requested(false);
  fence_steady_[job.id()] = not_before_ms > 0 ? SteadyMs() + (not_before_ms - NowMs()) : 0;
  return from;
}

// A preempted attempt ended (its ranks checkpointed and exited 76, or whatever they did once
// asked to stop): queued again with its place kept, no restart counted.
void Coordinator::RequeuePreempted(Txn& txn, v1::Job& job, const std::string& how) {
  Save(txn, job);
  v1::AttemptRecord* record = job.history_size() > 0 ? &*job.mutable_history()->rbegin() : nullptr;
  if (record != nullptr) {
    record->set_end_reason(absl::StrCat("preempted for ", job.preempted_for(), ": ", how));
    record->set_end_time_ms(NowMs());
    record->set_preempted(true);
  }
  job.set_preemptions(job.preemptions() + 1);
  const std::string from = Requeue(job, 0);
  SetState(txn, job, JobState::kQueued,
           absl::StrCat("preempted for ", job.preempted_for(), "; requeued from ", from,
                        " with its place in the queue kept (no restart counted)"));
  registry_.Increment("loom_coordinator_preemptions_total");
}

void Coordinator::FailAttempt(Txn& txn, v1::Job& job, const std::string& reason, Failure kind,
                              int64_t not_before_ms) {
  Save(txn, job);
  if (job.history_size() > 0) {
    job.mutable_history()->rbegin()->set_end_reason(reason);
    job.mutable_history()->rbegin()->set_end_time_ms(NowMs());
  }
  if (kind == Failure::kBadInput) {
    SetState(txn, job, JobState::kFailed,
             absl::StrCat(reason,
                          " (bad input: the trainer refused the spec or its data; "
                          "not restarted)"));
    return;
  }
  const bool infra = kind == Failure::kInfra;
  const bool left = infra ? job.infra_restarts() < options_.max_infra_restarts
                          : job.restarts() < job.max_restarts();
  if (!left) {
    SetState(txn, job, JobState::kFailed,
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
  SetState(txn, job, JobState::kRetrying, reason);
  const std::string from = Requeue(job, not_before_ms);
  SetState(
      txn, job, JobState::kQueued,
      infra ? absl::StrCat("requeued from ", from, " (infrastructure failure ",
                           job.infra_restarts(), " of ", options_.max_infra_restarts,
                           "; does not count against max_restarts)")
            : absl::StrCat("restart ", job.restarts(), " of ", job.max_restarts(), " from ", from));
  registry_.Increment("loom_coordinator_job_restarts_total");
}

void Coordinator::FailAttemptsOn(Txn& txn, const std::string& worker_id, const std::string& reason,
                                 int64_t not_before_ms) {
  for (auto& [id, job] : jobs_) {
    if (IsActive(job) && PlacementOf(job, worker_id) != nullptr &&
        !Contains(job.finished_workers(), worker_id)) {
      FailAttempt(txn, job, reason, Failure::kInfra, not_before_ms);
    }
  }
}

void Coordinator::MarkWorkerLost(Txn& txn, v1::Worker& worker, const std::string& reason) {
  Save(txn, worker.id());
  SetWorkerState(worker, WorkerState::kLost);
  txn.batch.PutWorker(worker);
  registry_.Increment("loom_coordinator_workers_lost_total");
  reported_running_[worker.id()].clear();
  RevokeCredential(txn, worker.id());
  // Its ranks stop themselves when their lease runs out, at the latest lease_ms after the last
  // heartbeat that reached here; the termination grace covers a rank that was slow to die.
  // On the steady clock; the jobs carry it as wall-clock time (not_before_ms) for people.
  const int64_t steady = SteadyMs();
  const int64_t lapsed = HeardAt(worker.id()) + options_.lease_ms;
  const int64_t fence = std::max(steady, lapsed) + options_.term_grace_ms;
  FailAttemptsOn(txn, worker.id(), absl::StrCat("worker ", worker.id(), " ", reason),
                 NowMs() + (fence - steady));
}

int Coordinator::UsedSlots(const std::string& worker_id) const {
  int used = 0;
  std::set<std::pair<std::string, int>> counted;
  for (const auto& [id, job] : jobs_) {
    if (!IsActive(job) || Contains(job.finished_workers(), worker_id)) continue;
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

void Coordinator::RecordNewPart(Txn& txn, const std::string& key, int64_t offset, int64_t count,
                                const std::function<bool(int64_t)>& write) {
  int64_t& received = log_offsets_[key];
  const std::optional<int64_t> first = NewPartStart(received, offset, count);
  if (!first || !write(*first)) return;  // nothing new, or not recorded: the agent resends it
  received = offset + count;
  txn.progress.PutLogOffset(key, received);
}

// One log per job, in arrival order; each agent sends whole lines of its attempt's log by byte
// offset, and the offsets received per (attempt, worker) drop resent chunks after a lost reply.
void Coordinator::AppendLog(Txn& txn, const v1::AttemptReport& report,
                            const std::string& worker_id) {
  if (report.log().empty() || report.attempt() < 1 || report.log_offset() < 0) return;
  const std::string key = absl::StrCat(report.job_id(), "/", report.attempt(), "/", worker_id);
  const std::string path = JobLogPath(options_.data_dir, report.job_id());
  RecordNewPart(txn, key, report.log_offset(), static_cast<int64_t>(report.log().size()),
                [&](int64_t first) {
                  return AppendCapped(txn, report.job_id(), path,
                                      absl::string_view(report.log()).substr(first));
                });
}

// A bound per job, as for the step series: the first max_job_log_bytes are kept; the chunk that
// crosses the bound is cut there and followed by a line that says so (and a job event); later
// ones are acknowledged and dropped. A broken or hostile agent cannot fill the disk.
bool Coordinator::AppendCapped(Txn& txn, const std::string& job_id, const std::string& path,
                               absl::string_view part) {
  const uintmax_t cap = static_cast<uintmax_t>(options_.max_job_log_bytes);
  std::error_code ec;
  const uintmax_t have = fs::exists(path, ec) ? fs::file_size(path, ec) : 0;
  if (ec || have >= cap) return !ec;
  if (have + part.size() <= cap) return AppendToFile(path, part, &txn.no_space);
  const std::string note = absl::StrCat("this job's log reached ", cap,
                                        " bytes (--max-job-log-bytes): later lines are dropped");
  // Cut at a character boundary: the log stays valid UTF-8 (no continuation byte left alone).
  size_t cut = static_cast<size_t>(cap - have);
  while (cut > 0 && cut < part.size() && (static_cast<unsigned char>(part[cut]) & 0xC0) == 0x80)
    --cut;
  if (!AppendToFile(path, absl::StrCat(part.substr(0, cut), "\n[coordinator] ", note, "\n"),
                    &txn.no_space)) {
    return false;
  }
  if (auto it = jobs_.find(job_id); it != jobs_.end()) {
    AddEvent(txn, it->second, std::nullopt, note);
  }
  return true;
}

// Rank 0's step points by their index in the attempt's sequence: the points received per
// (attempt, worker) drop resent ones after a lost reply, as AppendLog does for bytes.
void Coordinator::AppendSteps(Txn& txn, const v1::AttemptReport& report,
                              const std::string& worker_id) {
  if (report.steps().empty() || report.attempt() < 1) return;
  const std::string key =
      absl::StrCat("steps:", report.job_id(), "/", report.attempt(), "/", worker_id);
  const std::string path = JobSeriesPath(options_.data_dir, report.job_id());
  RecordNewPart(txn, key, report.steps_offset(), report.steps_size(), [&](int64_t first) {
    // A bound per job, as a disk quota: a broken or hostile agent cannot fill the coordinator's
    // disk (a million steps take ~60 MB); beyond it the points are acknowledged and dropped.
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (!ec && size > kMaxSeriesBytes) return true;
    return AppendToFile(path, StepLines(report, first), &txn.no_space);
  });
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
  // A worker names the step; where it is follows from the job (retention deletes what the
  // catalogue holds: a report naming another job's directory must not get it deleted).
  const std::string& root = job.spec().checkpoint().dir();
  const std::string name = storage::CheckpointDirName(step);
  if (step < 0 || (path != root + "/" + name && path != (fs::path(root) / name).string())) {
    AddEvent(txn, job, std::nullopt,
             absl::StrCat("a report named checkpoint ", path.substr(0, 200), " for step ", step,
                          ", not under the job's ", root, ": ignored"));
    txn.batch.PutJob(job);
    return;
  }
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
  AddEvent(txn, job, std::nullopt, absl::StrCat("checkpoint at step ", step, ": ", path));
  txn.batch.PutJob(job);
}

// What the attempt's trainer restored from: skipped (damaged) checkpoints are marked in the
// catalogue, newer catalogued ones that vanished from disk too, so no later attempt picks them.
void Coordinator::ApplyResumeReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r) {
  auto mark = [&](int64_t step, const std::string& why) {
    const std::string cid = CheckpointId(job.id(), step);
    auto it = checkpoints_.find(cid);
    if (it != checkpoints_.end() && !it->second.damaged().empty()) return;
    AddEvent(txn, job, std::nullopt, absl::StrCat("checkpoint at step ", step, " skipped: ", why));
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
    if (it == checkpoints_.end() || it->second.step() <= step || it->second.deleted() ||
        !it->second.damaged().empty()) {
      continue;
    }
    // In an object store nothing is looked up under the lock: the trainer listed the store and
    // took its newest step that verified, so a newer catalogued one it did not report skipped
    // was not there.
    if (storage::IsRemoteLocation(it->second.path()) ||
        !fs::exists(fs::path(it->second.path()) / "manifest.json", ec)) {
      mark(it->second.step(), absl::StrCat("missing: ", it->second.path(), " is gone"));
    }
  }
  if (!r.resumed().path().empty()) CatalogueCheckpoint(txn, job, step, r.resumed().path());
  AddEvent(txn, job, std::nullopt,
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
    const std::string jobs_root = RemoteCheckpoints()
                                      ? options_.checkpoint_store + "/jobs/"
                                      : (fs::path(options_.storage_root) / "jobs").string() + "/";
    if (!absl::StartsWith(e.path(), jobs_root)) continue;  // never delete outside jobs/
    SaveCheckpoint(txn, cid);
    e.set_deleted(true);
    txn.batch.PutCheckpoint(e);
    txn.deletes.push_back({e.path()});
  }
  // Steps a fenced attempt committed but never reported, older than what is kept: garbage.
  if (intact.empty()) return;
  const int64_t oldest_kept = intact[first_kept]->step();
  if (RemoteCheckpoints()) {
    Removal sweep{cfg.dir(), oldest_kept, cfg.keep_every(), {}};
    for (const std::string& cid : jit->second.checkpoints()) {
      auto it = checkpoints_.find(cid);
      if (it != checkpoints_.end() && !it->second.deleted())
        sweep.catalogued.insert(it->second.step());
    }
    txn.deletes.push_back(std::move(sweep));
    return;
  }
  auto on_disk = storage::ListCheckpoints(cfg.dir());
  if (!on_disk.ok()) return;
  for (const storage::CheckpointRef& ref : *on_disk) {
    if (ref.step < oldest_kept && !checkpoints_.count(CheckpointId(job_id, ref.step)) &&
        (cfg.keep_every() == 0 || ref.step % cfg.keep_every() != 0)) {
      txn.deletes.push_back({ref.dir});
    }
  }
}

std::string Coordinator::CheckpointDirFor(const std::string& id, int64_t now) const {
  if (!RemoteCheckpoints()) {
    return (fs::path(options_.storage_root) / "jobs" / id / "checkpoints").string();
  }
  return absl::StrCat(options_.checkpoint_store, "/jobs/", id, "-", now, "/checkpoints");
}

void Coordinator::DeleteDirectories(std::vector<Removal> removals) {
  for (const Removal& r : removals) {
    if (r.sweep_before < 0) {
      if (absl::Status s = storage::DeleteCheckpoint(r.dir); !s.ok()) {
        std::cerr << "coordinator: retention: " << s.message() << "\n";
      }
      continue;
    }
    auto store = storage::OpenCheckpointStore(r.dir);
    auto refs = store.ok() ? (*store)->List() : store.status();
    if (!refs.ok()) {
      std::cerr << "coordinator: retention: " << refs.status().message() << "\n";
      continue;
    }
    for (const storage::CheckpointRef& ref : *refs) {
      if (ref.step >= r.sweep_before || r.catalogued.count(ref.step) ||
          (r.keep_every > 0 && ref.step % r.keep_every == 0)) {
        continue;
      }
      if (absl::Status s = (*store)->Delete(ref.dir); !s.ok()) {
        std::cerr << "coordinator: retention: " << s.message() << "\n";
      }
    }
  }
}

namespace {

int RanksRunning(const v1::AttemptReport& r) {
  int running = 0;
  for (const auto& rank : r.ranks()) running += rank.running() ? 1 : 0;
  return running;
}

// The failed ranks of a report, the likely cause first: a rank killed by a signal makes its
// peers exit with a communication error right after. `text` is empty when none failed.
struct RankFailures {
  std::string text;
  bool bad_input = false;  // a rank refused the spec or its data
  bool infra = false;      // a rank's lease ran out, or it was stopped
};

RankFailures FailedRanks(const v1::AttemptReport& r, const std::string& wid) {
  RankFailures out;
  std::vector<std::string> killed, exited;
  for (const auto& rank : r.ranks()) {
    if (rank.running() || rank.exit_code() == 0) continue;
    out.bad_input |= rank.exit_code() == kExitBadInput;
    out.infra |= rank.exit_code() == kExitLeaseExpired || rank.exit_code() == kExitStopped;
    (rank.exit_code() > 128 ? killed : exited)
        .push_back(
            absl::StrCat("rank ", rank.rank(), " on ", wid, ": ", rank.detail().substr(0, 200)));
  }
  killed.insert(killed.end(), exited.begin(), exited.end());
  out.text = absl::StrJoin(killed, "; ");
  return out;
}

}  // namespace

// The rendezvous port rank 0's worker picked, and the trainer's newest progress.
void Coordinator::ApplyProgress(Txn& txn, v1::Job& job, const v1::AttemptReport& r,
                                const std::string& wid) {
  if (r.master_port() > 0 && job.master_port() == 0 && HostsRankZero(job, wid)) {
    job.set_master_port(r.master_port());
    txn.batch.PutJob(job);
  }
  if (r.progress().update_time_ms() > job.progress().update_time_ms()) {
    *job.mutable_progress() = r.progress();
    job.mutable_progress()->set_total_steps(job.spec().steps());
    txn.progress.PutJob(job);
  }
}

// Evaluations not recorded yet for this attempt (a resent report repeats them).
void Coordinator::RecordEvals(Txn& txn, v1::Job& job, const v1::AttemptReport& r) {
  for (const auto& ev : r.evals()) {
    bool seen = false;
    for (const auto& have : job.evals()) {
      seen |= have.step() == ev.step() && have.attempt() == r.attempt() &&
              have.kind() == ev.kind() && have.length() == ev.length();
    }
    if (!seen) {
      *job.add_evals() = ev;
      job.mutable_evals()->rbegin()->set_attempt(r.attempt());
      txn.batch.PutJob(job);
    }
  }
}

// Success of a worker's share: every rank placed on it reported, exited 0. The job succeeds
// when every worker's share has.
void Coordinator::ApplyFinishedShare(Txn& txn, v1::Job& job, const v1::AttemptReport& r,
                                     const std::string& wid) {
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
        txn, job, JobState::kSucceeded,
        absl::StrCat("all ", job.world_size(), " ranks exited 0 at step ", job.progress().step()));
  }
}

void Coordinator::ApplyReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r,
                              const std::string& wid) {
  Save(txn, job);
  ApplyProgress(txn, job, r, wid);
  ApplyResumeReport(txn, job, r);
  const size_t before = job.checkpoints_size();
  for (const auto& c : r.checkpoints()) CatalogueCheckpoint(txn, job, c.step(), c.path());
  if (static_cast<size_t>(job.checkpoints_size()) != before) ApplyRetention(txn, job.id());
  RecordEvals(txn, job, r);
  const RankFailures failed = FailedRanks(r, wid);
  if (!failed.text.empty() && job.preempt_requested()) {
    RequeuePreempted(txn, job, failed.text);
    return;
  }
  if (!failed.text.empty()) {
    FailAttempt(txn, job, failed.text,
                failed.bad_input ? Failure::kBadInput
                : failed.infra   ? Failure::kInfra
                                 : Failure::kJob);
    return;
  }
  if (RanksRunning(r) > 0 && JobStateOf(job) == JobState::kScheduled) {
    if (job.start_time_ms() == 0) job.set_start_time_ms(NowMs());
    SetState(txn, job, JobState::kRunning, absl::StrCat("ranks started on ", wid));
  }
  ApplyFinishedShare(txn, job, r, wid);
}

namespace {

v1::AttemptRef* AddAttemptRef(google::protobuf::RepeatedPtrField<v1::AttemptRef>* list,
                              const v1::AttemptReport& r) {
  v1::AttemptRef* ref = list->Add();
  ref->set_job_id(r.job_id());
  ref->set_attempt(r.attempt());
  return ref;
}

// What a worker placed in `p` is told to start.
v1::Assignment AssignmentOf(const std::string& id, const v1::Job& job, const v1::Placement& p,
                            const CoordinatorOptions& options) {
  v1::Assignment a;
  a.set_job_id(id);
  a.set_attempt(job.attempt());
  *a.mutable_ranks() = p.ranks();
  a.set_world_size(job.world_size());
  a.set_master_addr(job.master_addr());
  a.set_master_port(job.master_port());
  *a.mutable_spec() = job.spec();
  // Jobs stored before the time interval existed get it here.
  ApplyCheckpointIntervalDefault(*a.mutable_spec(), options.checkpoint_interval_seconds);
  a.set_resume_from(job.spec().checkpoint().dir());
  a.set_init_from(job.init_from_path());
  a.set_storage_root(options.storage_root);
  return a;
}

}  // namespace

void Coordinator::ReconcileReportLocked(Txn& txn, const std::string& worker,
                                        const v1::AttemptReport& r, v1::HeartbeatResponse& response,
                                        RunningAttempts& running) {
  auto jit = jobs_.find(r.job_id());
  if (jit != jobs_.end()) {
    AppendLog(txn, r, worker);
    AppendSteps(txn, r, worker);
  }
  const bool current = jit != jobs_.end() && IsActive(jit->second) &&
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
      jit != jobs_.end() && IsActive(jit->second) && r.attempt() == jit->second.attempt();
  // A preempted attempt is stopped like a cancelled one: SIGTERM, checkpoint, exit 76.
  const bool stop = !live || jit->second.preempt_requested();
  if (stop && !r.finished()) AddAttemptRef(response.mutable_cancels(), r);
  if (r.finished()) {
    AddAttemptRef(response.mutable_forget(), r);
  } else {
    running[{r.job_id(), r.attempt()}] = std::max(1, RanksRunning(r));
  }
}

void Coordinator::AssignLocked(const std::string& worker, const v1::HeartbeatRequest& request,
                               v1::HeartbeatResponse& response) const {
  auto placed = placed_on_.find(worker);
  if (placed == placed_on_.end()) return;
  std::set<std::pair<std::string, int>> reported;
  for (const v1::AttemptReport& r : request.attempts()) reported.insert({r.job_id(), r.attempt()});
  for (const std::string& id : placed->second) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) continue;
    const v1::Job& job = it->second;
    if (!IsActive(job) || Contains(job.finished_workers(), worker)) continue;
    const v1::Placement* p = PlacementOf(job, worker);
    if (p == nullptr) continue;
    if (reported.count({id, job.attempt()})) continue;  // already running there
    // Other workers wait for the port rank 0's worker picks (0 tells rank 0's worker to pick).
    if (job.master_port() == 0 && !HostsRankZero(job, worker)) continue;
    *response.add_assignments() = AssignmentOf(id, job, *p, options_);
  }
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& request,
                                                             const std::string& worker) {
  std::promise<absl::StatusOr<v1::HeartbeatResponse>> answered;
  HeartbeatThen(request, worker, [&answered](absl::StatusOr<v1::HeartbeatResponse> r) {
    answered.set_value(std::move(r));
  });
  return answered.get_future().get();
}

void Coordinator::HeartbeatThen(const v1::HeartbeatRequest& request, const std::string& worker,
                                std::function<void(absl::StatusOr<v1::HeartbeatResponse>)> done) {
  if (request.worker_id() != worker) {
    return done(absl::PermissionDeniedError(absl::StrCat("this credential belongs to worker ",
                                                         worker, ", not '",
                                                         request.worker_id().substr(0, 64), "'")));
  }
  if (request.attempts_size() > 4096) return done(FieldError("attempts", "too many"));
  uint64_t written = 0;
  absl::StatusOr<v1::HeartbeatResponse> response;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    response = HeartbeatLocked(request, worker, &written);
  }
  if (!response.ok() || written == 0) return done(std::move(response));
  // Group commit: the state this heartbeat changed is in RocksDB's log (and in effect) already;
  // its answer waits until the log is on disk, and heartbeats that arrive meanwhile share that
  // fsync. A failed fsync fails the call: the agent sends the report again.
  log_syncer_->After(written, [this, response = *std::move(response),
                               done = std::move(done)](absl::Status synced) mutable {
    if (!synced.ok()) {
      registry_.Increment("loom_coordinator_store_errors_total");
      return done(
          absl::UnavailableError(absl::StrCat("not on disk, send again: ", synced.message())));
    }
    done(std::move(response));
  });
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::HeartbeatLocked(
    const v1::HeartbeatRequest& request, const std::string& worker, uint64_t* written) {
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
  heard_steady_[worker] = SteadyMs();
  heard_since_start_.insert(worker);
  v1::HeartbeatResponse response;
  RunningAttempts running;
  for (const v1::AttemptReport& r : request.attempts()) {
    ReconcileReportLocked(txn, worker, r, response, running);
  }
  AssignLocked(worker, request, response);
  if (!IsAlive(w)) {
    SetWorkerState(w, WorkerState::kAlive);
    txn.batch.PutWorker(w);
  } else {
    txn.progress.PutWorker(w);
  }
  const bool changes_state = !txn.batch.empty();
  const absl::Status s = Commit(txn, /*sync=*/false);
  if (IsStorageFull(s)) {
    // A full disk: the heartbeat still counts (liveness is in memory, the agent renews its
    // ranks' lease on this answer), but nothing it reported is recorded. The agent keeps every
    // report, log chunk and step and sends them again; no attempt is forgotten.
    response.clear_forget();
    response.set_not_recorded(true);
  } else if (!s.ok()) {
    return s;
  } else if (changes_state) {
    *written = store_->LastSequence();
  }
  reported_running_[worker] = std::move(running);
  return response;
}

// The queued jobs the scheduler may place now; those held back (fenced after a lost worker, or
// waiting for an old attempt's ranks to stop) go to `held` with the reason.
std::vector<QueuedJob> Coordinator::QueueLocked(std::map<std::string, std::string>& held) const {
  std::vector<QueuedJob> queue;
  const int64_t steady = SteadyMs();
  for (const auto& [id, job] : jobs_) {
    if (JobStateOf(job) != JobState::kQueued) continue;
    if (auto fence = fence_steady_.find(id);
        fence != fence_steady_.end() && fence->second > steady) {
      held[id] = absl::StrFormat(
          "fenced: the previous attempt's worker was lost; placing again in %.1f s (lost-after "
          "+ termination grace)",
          static_cast<double>(fence->second - steady) / 1000.0);
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
    q.user = job.submitted_by();
    q.project = ProjectOf(job);
    q.queued_since_ms = job.queued_since_ms();
    q.sweep = job.sweep_id();
    q.sweep_order = SweepOrder(job);
    q.preempting = job.preempting();
    queue.push_back(std::move(q));
  }
  return queue;
}

// A sweep job's seed-major position: seed index × cells + cell index (0 for other jobs).
int Coordinator::SweepOrder(const v1::Job& job) const {
  auto sweep = sweeps_.find(job.sweep_id());
  if (job.sweep_id().empty() || sweep == sweeps_.end()) return 0;
  const auto& cells = sweep->second.cells();
  const auto& seeds = sweep->second.spec().seeds();
  const auto cell = std::find(cells.begin(), cells.end(), job.sweep_cell());
  const auto seed = std::find(seeds.begin(), seeds.end(), job.sweep_seed());
  return static_cast<int>((seed - seeds.begin()) * cells.size() + (cell - cells.begin()));
}

// After a restart: nothing is placed until every live worker has said what it runs.
bool Coordinator::AwaitingReportsAfterRestart() const {
  for (const auto& [id, w] : workers_) {
    if (IsAlive(w) && !heard_since_start_.count(id)) return true;
  }
  return false;
}

std::vector<FreeWorker> Coordinator::FreeWorkersLocked() const {
  std::vector<FreeWorker> free;
  const int64_t steady = SteadyMs();
  for (const auto& [id, w] : workers_) {
    // A silent worker is not placed on even while loss detection holds (AllWorkersSilent).
    if (!IsAlive(w) || steady - HeardAt(id) > options_.lost_after_ms) continue;
    FreeWorker f;
    f.id = id;
    f.labels.insert(w.labels().begin(), w.labels().end());
    f.slots = w.slots();
    f.free_slots = std::max(0, w.slots() - UsedSlots(id));
    free.push_back(std::move(f));
  }
  return free;
}

const v1::CheckpointEntry* Coordinator::NewestIntactCheckpoint(const v1::Job& job) const {
  const v1::CheckpointEntry* newest = nullptr;
  for (const std::string& cid : job.checkpoints()) {
    auto c = checkpoints_.find(cid);
    if (c != checkpoints_.end() && !c->second.deleted() && c->second.damaged().empty() &&
        (newest == nullptr || c->second.step() > newest->step())) {
      newest = &c->second;
    }
  }
  return newest;
}

// The job's next attempt on the gang's workers, resuming from its newest intact checkpoint.
// Worker -> the active jobs placed on it, in id order: what a heartbeat's assignments are drawn
// from, instead of every job ever submitted (a scan of all of them per heartbeat made 512
// agents' heartbeats quadratic). Placements are made only by the scheduling pass and read at
// load, so it is rebuilt after both; placements cleared in between leave entries that
// AssignLocked skips.
void Coordinator::IndexPlacementsLocked() {
  placed_on_.clear();
  for (const auto& [id, job] : jobs_) {
    if (!IsActive(job)) continue;
    for (const v1::Placement& p : job.placement()) placed_on_[p.worker_id()].push_back(id);
  }
}

void Coordinator::StartAttemptLocked(Txn& txn, const GangPlacement& g, int64_t now) {
  v1::Job& job = jobs_[g.job_id];
  Save(txn, job);
  job.set_attempt(job.attempt() + 1);
  job.set_preempting(false);  // placed: it no longer goes first
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
  if (const v1::CheckpointEntry* newest = NewestIntactCheckpoint(job)) {
    job.set_resume_from(newest->path());
    from =
        absl::StrCat("; resuming from step ", newest->step(), " (or the newest intact checkpoint)");
  }
  registry_.Observe("loom_coordinator_scheduling_delay_seconds",
                    static_cast<double>(now - job.queued_since_ms()) / 1000.0);
  SetState(txn, job, JobState::kScheduled,
           absl::StrCat("attempt ", job.attempt(), " on ", absl::StrJoin(where, ", "), from));
}

void Coordinator::ScheduleLocked(Txn& txn) {
  const int64_t now = NowMs();
  std::map<std::string, std::string> held;  // queued jobs that wait for their last attempt
  std::vector<QueuedJob> queue = QueueLocked(held);
  if (AwaitingReportsAfterRestart()) {
    for (const auto& q : queue) held[q.id] = "waiting for every worker to report after a restart";
    queue.clear();
  }
  // Every pass, queue or not: fair share's usage accrues while nothing waits too.
  const PassInputs in = PassInputsLocked(now);
  if (queue.empty()) {
    waiting_reason_ = std::move(held);
    return;
  }
  const ScheduleResult result = Schedule(queue, FreeWorkersLocked(), options_.scheduler, now,
                                         in.quotas, in.share, in.running);
  waiting_reason_ = Explain(result, queue);
  waiting_reason_.insert(held.begin(), held.end());
  for (const GangPlacement& g : result.placed) StartAttemptLocked(txn, g, now);
  for (const Preemption& p : result.preempt) RequestPreemption(txn, jobs_[p.victim], p.for_job);
}

// Asks the victim's ranks to stop (SIGTERM on their agents' next heartbeat; they checkpoint and
// exit 76). Its slots stay counted until they are gone; then it is requeued (RequeuePreempted).
void Coordinator::RequestPreemption(Txn& txn, v1::Job& victim, const std::string& for_job) {
  Save(txn, victim);
  victim.set_preempt_requested(true);
  victim.set_preempted_for(for_job);
  txn.batch.PutJob(victim);
  v1::Job& preemptor = jobs_[for_job];
  if (!preemptor.preempting()) {
    Save(txn, preemptor);
    preemptor.set_preempting(true);
    txn.batch.PutJob(preemptor);
  }
  AddEvent(txn, victim, std::nullopt,
           absl::StrCat("preempting for ", for_job, " (priority ", jobs_[for_job].priority(), " > ",
                        victim.priority(), "): stopping its ranks to checkpoint and requeue"));
}

// The fair-share ledger brought to `now` with what each user held since the last pass.
void Coordinator::AdvanceUsageLocked(int64_t now, const std::map<std::string, int>& held) {
  usage_.Advance(now, last_held_);
  last_held_ = held;
}

// One scan of the jobs for what a pass needs besides the queue and the free slots: quotas with
// their usage, sweeps' max_concurrent, fair share, and the running jobs preemption may stop.
Coordinator::PassInputs Coordinator::PassInputsLocked(int64_t now) {
  PassInputs in;
  in.quotas = QuotaLimitsLocked();
  for (const auto& [key, quota] : quotas_) {
    if (quota.kind() == "user" && quota.weight() > 0)
      in.share.weight[quota.name()] = quota.weight();
  }
  for (const auto& [id, job] : jobs_) {
    const std::optional<JobState> state = JobStateOf(job);
    if (state != JobState::kScheduled && state != JobState::kRunning) continue;
    CountQuotaUsage(job, in.quotas);
    in.share.held[job.submitted_by()] += job.world_size();
    if (!job.sweep_id().empty()) in.quotas.sweep_active[job.sweep_id()] += 1;
    if (state == JobState::kRunning) in.running.push_back(RunningJobOf(job, now));
  }
  for (const auto& [id, sweep] : sweeps_) {
    if (sweep.spec().max_concurrent() > 0)
      in.quotas.sweep_limit[id] = sweep.spec().max_concurrent();
  }
  AdvanceUsageLocked(now, in.share.held);
  in.share.average = usage_.averages();
  return in;
}

// A running job as preemption sees it: the work it would lose is the time since its newest
// checkpoint (or its attempt's start); an attempt that follows a preemption is protected for
// min_run_ms, so no job is stopped over and over.
RunningJob Coordinator::RunningJobOf(const v1::Job& job, int64_t now) const {
  RunningJob r;
  r.id = job.id();
  r.priority = job.priority();
  for (const v1::Placement& p : job.placement())
    r.slots.emplace_back(p.worker_id(), p.ranks_size());
  int64_t since = job.history_size() > 0 ? job.history().rbegin()->start_time_ms() : now;
  if (const v1::CheckpointEntry* c = NewestIntactCheckpoint(job))
    since = std::max(since, c->time_ms());
  r.checkpoint_age_ms = std::max<int64_t>(0, now - since);
  const int n = job.history_size();
  if (n >= 2 && job.history(n - 2).preempted())
    r.protected_until_ms = job.history(n - 1).start_time_ms() + options_.scheduler.min_run_ms;
  r.stopping = job.preempt_requested();
  return r;
}

// The quotas with what they count now: the slots of every scheduled or running job. A quota
// without slots (a fair-share weight alone) limits nothing.
Quotas Coordinator::QuotasLocked() const {
  Quotas q = QuotaLimitsLocked();
  if (quotas_.empty()) return q;
  for (const auto& [id, job] : jobs_) {
    const std::optional<JobState> state = JobStateOf(job);
    if (state == JobState::kScheduled || state == JobState::kRunning) CountQuotaUsage(job, q);
  }
  return q;
}

Quotas Coordinator::QuotaLimitsLocked() const {
  Quotas q;
  for (const auto& [key, quota] : quotas_) {
    if (!quota.has_slots()) continue;
    (quota.kind() == "user" ? q.user_limit : q.project_limit)[quota.name()] = quota.slots();
  }
  return q;
}

// A scheduled or running job's slots, counted against its owner's and its project's quota.
void Coordinator::CountQuotaUsage(const v1::Job& job, Quotas& q) const {
  q.user_used[job.submitted_by()] += job.world_size();
  if (const std::string project = ProjectOf(job); !project.empty())
    q.project_used[project] += job.world_size();
}

absl::StatusOr<v1::ListQuotasResponse> Coordinator::ListQuotas() {
  std::lock_guard<std::mutex> lock(mutex_);
  const Quotas live = QuotasLocked();
  v1::ListQuotasResponse out;
  for (const auto& [key, quota] : quotas_) {
    v1::Quota* q = out.add_quotas();
    *q = quota;
    const auto& used = quota.kind() == "user" ? live.user_used : live.project_used;
    q->set_used(used.count(quota.name()) ? used.at(quota.name()) : 0);
  }
  return out;
}

absl::StatusOr<v1::Quota> Coordinator::SetQuota(const v1::Quota& quota, const Caller& caller) {
  if (!caller.admin) return absl::PermissionDeniedError("quotas are set by admins");
  if (quota.kind() != "user" && quota.kind() != "project")
    return FieldError("kind", "user or project");
  if (!IsToken(quota.name(), 63) || quota.name().find_first_of("/:") != std::string::npos)
    return FieldError("name", "1..63 characters of [A-Za-z0-9._-]");
  if (quota.has_slots() && (quota.slots() < 0 || quota.slots() > 1000000))
    return FieldError("slots", "0..1000000");
  if (!(quota.weight() >= 0 && quota.weight() <= 1e6))  // NaN fails too
    return FieldError("weight", "a number in (0, 1000000]");
  if (quota.weight() > 0 && quota.kind() != "user")
    return FieldError("weight", "fair share is between users: set it on a user");
  if (!quota.has_slots() && quota.weight() == 0)
    return FieldError("slots", "give slots, a weight, or both");
  StateStore::Batch batch;
  batch.PutQuota(quota);
  std::lock_guard<std::mutex> lock(mutex_);
  LOOM_RETURN_IF_ERROR(store_->Commit(batch, true));
  v1::Quota& stored = quotas_[absl::StrCat(quota.kind(), "/", quota.name())];
  stored = quota;
  stored.clear_used();
  wake_.notify_all();  // a raised quota may let a waiting job run
  return stored;
}

absl::Status Coordinator::DeleteQuota(const std::string& kind, const std::string& name,
                                      const Caller& caller) {
  if (!caller.admin) return absl::PermissionDeniedError("quotas are set by admins");
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = quotas_.find(absl::StrCat(kind, "/", name));
  if (it == quotas_.end())
    return absl::NotFoundError(absl::StrCat("no quota for ", kind, " '", name.substr(0, 64), "'"));
  StateStore::Batch batch;
  batch.DeleteQuota(kind, name);
  LOOM_RETURN_IF_ERROR(store_->Commit(batch, true));
  quotas_.erase(it);
  wake_.notify_all();
  return absl::OkStatus();
}

int64_t Coordinator::HeardAt(const std::string& worker) const {
  auto it = heard_steady_.find(worker);
  return it == heard_steady_.end() ? 0 : it->second;
}

void Coordinator::MarkSilentWorkersLost(Txn& txn) {
  const int64_t steady = SteadyMs();
  if (AllWorkersSilent(steady)) return;
  for (auto& [id, w] : workers_) {
    const int64_t silent_since = std::max(HeardAt(id), hold_ended_ms_);
    if (IsAlive(w) && steady - silent_since > options_.lost_after_ms) {
      MarkWorkerLost(txn, w,
                     absl::StrCat("lost: no heartbeat for ", (steady - HeardAt(id)) / 1000, " s"));
    }
  }
}

// Every alive worker silent at once, and still within the lease of the newest heartbeat: more
// likely this coordinator's link is cut than every node gone at once. Marking them lost would
// fail every running attempt although their ranks train on; once the lease has lapsed they have
// stopped either way, and loss detection resumes (the fence is the same: last heartbeat + lease).
// `now` is the steady clock.
bool Coordinator::AllWorkersSilent(int64_t now) {
  int alive = 0;
  int64_t newest = 0;
  for (const auto& [id, w] : workers_) {
    if (!IsAlive(w)) continue;
    ++alive;
    newest = std::max(newest, HeardAt(id));
  }
  const bool hold = options_.all_silent_min_workers > 0 &&
                    alive >= options_.all_silent_min_workers &&
                    now - newest > options_.lost_after_ms / 2 && now - newest <= options_.lease_ms;
  if (hold && !holding_loss_detection_) {
    std::cerr << "coordinator: all " << alive << " alive workers silent for "
              << (now - newest) / 1000 << " s: holding loss detection (a partition of this "
              << "coordinator?) until the lease lapses\n";
  }
  if (!hold && holding_loss_detection_ && now - newest <= options_.lease_ms) {
    // Someone was heard: the link is back, and the others' beats follow within a probe or two.
    // They get lost_after_ms from now (their fence still counts from their last heartbeat).
    hold_ended_ms_ = now;
  }
  holding_loss_detection_ = hold;
  registry_.Set("loom_coordinator_loss_detection_held", hold ? 1 : 0);
  return hold;
}

// A coordinator that could not run (SIGSTOP, a VM pause, a swap storm) heard nobody meanwhile:
// that silence is its own, so alive workers get it back before loss detection. Measured on the
// steady clock, which keeps counting through a pause (and is not the injected wall clock).
void Coordinator::ForgiveOwnOutage() {
  const auto now = std::chrono::steady_clock::now();
  const auto last = last_tick_;
  last_tick_ = now;
  if (last == std::chrono::steady_clock::time_point{}) return;
  const int64_t gap = std::chrono::duration_cast<std::chrono::milliseconds>(now - last).count();
  if (gap <= std::max(2000, 2 * options_.heartbeat_interval_ms)) return;
  const int64_t wall = NowMs(), steady = SteadyMs();
  for (auto& [id, w] : workers_) {
    if (!IsAlive(w)) continue;
    w.set_last_heartbeat_ms(std::min(wall, w.last_heartbeat_ms() + gap));
    heard_steady_[id] = std::min(steady, HeardAt(id) + gap);
  }
  registry_.Increment("loom_coordinator_outages_forgiven_total");
}

// A full data directory: try to resume the store, at most once a second.
void Coordinator::ResumeStoreIfFull() {
  if (!store_->Full() || SteadyMs() - last_resume_try_ms_ < 1000) return;
  last_resume_try_ms_ = SteadyMs();
  const absl::Status resumed = store_->Resume();
  if (resumed.ok()) {
    std::cerr << "coordinator: the data directory has room again; state writes resumed\n";
  } else if (last_resume_try_ms_ - last_resume_report_ms_ >= 60000 || last_resume_report_ms_ == 0) {
    last_resume_report_ms_ = last_resume_try_ms_;
    std::cerr << "coordinator: " << resumed.message() << "\n";
  }
}

void Coordinator::Tick() {
  ResumeStoreIfFull();
  std::vector<Removal> deletes;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Txn txn;
    ForgiveOwnOutage();
    MarkSilentWorkersLost(txn);
    ScheduleLocked(txn);
    (void)Commit(txn);  // on failure memory is restored; the next tick tries again
    registry_.Set("loom_coordinator_storage_full", disk_full_ || store_->Full() ? 1 : 0);
    IndexPlacementsLocked();
    deletes.swap(pending_deletes_);
  }
  // A heartbeat's retention decision may still wait for its group commit: no directory goes
  // before the decision to delete it is on disk.
  if (!deletes.empty() && !store_->SyncLogThrough(store_->LastSequence()).ok()) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_deletes_.insert(pending_deletes_.end(), deletes.begin(), deletes.end());
    return;
  }
  std::vector<Removal> remote;
  for (auto it = deletes.begin(); it != deletes.end();) {
    if (storage::IsRemoteLocation(it->dir)) {
      remote.push_back(std::move(*it));
      it = deletes.erase(it);
    } else {
      ++it;
    }
  }
  if (!remote.empty()) {
    std::lock_guard<std::mutex> lock(remote_mu_);
    remote_removals_.insert(remote_removals_.end(), std::make_move_iterator(remote.begin()),
                            std::make_move_iterator(remote.end()));
    remote_cv_.notify_all();
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
    terminal = IsTerminal(it->second);
  }
  FileBytes read = ReadFileBytes(JobLogPath(options_.data_dir, id), offset, max);
  LogChunk chunk;
  chunk.data = std::move(read.data);
  chunk.next_offset = offset + static_cast<int64_t>(chunk.data.size());
  chunk.done = terminal && chunk.next_offset >= read.size;
  return chunk;
}

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
  for (v1::AttemptSeries& s : ReadStepSeries(JobSeriesPath(options_.data_dir, id), max_points)) {
    *out.add_series() = std::move(s);
  }
  return out;
}

std::string Coordinator::RenderMetrics() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, int> by_state;
    for (absl::string_view s : JobStateNames()) by_state[std::string(s)] = 0;
    for (const auto& [id, j] : jobs_) by_state[j.state()]++;
    for (const auto& [s, n] : by_state) registry_.Set("loom_coordinator_jobs", n, {{"state", s}});
    registry_.Set("loom_coordinator_queue_depth",
                  by_state[std::string(JobStateName(JobState::kQueued))]);
    const int64_t now = NowMs();
    for (const char* f : {"loom_coordinator_job_step", "loom_coordinator_job_progress_age_seconds",
                          "loom_coordinator_job_checkpoint_age_seconds"}) {
      registry_.Clear(f);
    }
    for (const auto& [id, j] : jobs_) {
      if (!IsActive(j)) continue;
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
      if (IsAlive(w)) {
        ++alive;
        total += w.slots();
        used += UsedSlots(id);
      } else {
        ++lost;
      }
    }
    registry_.Set("loom_coordinator_workers", alive,
                  {{"state", std::string(WorkerStateName(WorkerState::kAlive))}});
    registry_.Set("loom_coordinator_workers", lost,
                  {{"state", std::string(WorkerStateName(WorkerState::kLost))}});
    registry_.Set("loom_coordinator_slots", used, {{"state", "used"}});
    registry_.Set("loom_coordinator_slots", total - used, {{"state", "free"}});
  }
  return registry_.Render();
}

}  // namespace loom::coordinator
