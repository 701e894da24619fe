#include "coordinator.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "loom/spec.h"
#include "loom/status_macros.h"

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
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot create '", options.data_dir, "': ", ec.message()));
  }
  LOOM_ASSIGN_OR_RETURN(c->store_,
                        StateStore::Open((fs::path(options.data_dir) / "state").string()));
  LOOM_RETURN_IF_ERROR(c->Load());
  auto& r = c->registry_;
  r.DeclareGauge("loom_coordinator_jobs", "Jobs by state");
  r.DeclareGauge("loom_coordinator_workers", "Workers by state");
  r.DeclareGauge("loom_coordinator_slots", "Slots on live workers (total) and in use (used)");
  r.DeclareCounter("loom_coordinator_jobs_submitted_total", "Jobs accepted by POST /v1/jobs");
  r.DeclareCounter("loom_coordinator_job_restarts_total", "Failed attempts requeued");
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

absl::Status Coordinator::Load() {
  LOOM_ASSIGN_OR_RETURN(LoadedState state, store_->Load());
  jobs_ = std::move(state.jobs);
  event_counts_ = std::move(state.event_counts);
  workers_ = std::move(state.workers);
  checkpoints_ = std::move(state.checkpoints);
  request_ids_ = std::move(state.request_ids);
  next_job_ = state.next_job;
  log_offsets_ = std::move(state.log_offsets);
  // Restarted: every known worker gets a fresh grace period to heartbeat again.
  const int64_t now = NowMs();
  for (auto& [id, w] : workers_) w.set_last_heartbeat_ms(now);
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

absl::Status Coordinator::CommitLocked(StateStore::Batch& batch, bool sync) {
  if (batch.empty()) return absl::OkStatus();
  return store_->Commit(batch, sync);
}

void Coordinator::AddEvent(v1::Job& job, const std::string& state, const std::string& reason,
                           StateStore::Batch& batch) {
  v1::JobEvent e;
  e.set_seq(event_counts_[job.id()]++);
  e.set_time_ms(NowMs());
  e.set_state(state);
  e.set_reason(reason);
  e.set_attempt(job.attempt());
  batch.PutEvent(job.id(), e);
}

void Coordinator::SetState(v1::Job& job, const std::string& state, const std::string& reason,
                           StateStore::Batch& batch) {
  job.set_state(state);
  job.set_reason(reason);
  job.set_update_time_ms(NowMs());
  if (IsTerminal(state)) {
    job.set_end_time_ms(job.update_time_ms());
    job.clear_placement();
  }
  AddEvent(job, state, reason, batch);
  batch.PutJob(job);
}

absl::Status Coordinator::ResolvePaths(v1::JobSpec& spec, const std::string& job_id) const {
  const fs::path root(options_.storage_root);
  // A client path: relative to the storage root, or absolute inside it; never escaping it.
  auto inside_root = [&](const std::string& field,
                         const std::string& value) -> absl::StatusOr<std::string> {
    if (value.find('\0') != std::string::npos) return FieldError(field, "contains a NUL byte");
    fs::path p(value);
    for (const auto& part : p) {
      if (part == "..")
        return FieldError(field, absl::StrCat("'", value, "' must not contain '..'"));
    }
    fs::path full = p.is_absolute() ? p.lexically_normal() : (root / p).lexically_normal();
    const std::string f = full.string(), r = root.string();
    if (!(f == r || absl::StartsWith(f, r + "/"))) {
      return FieldError(field, absl::StrCat("'", value, "' is outside the storage root ", r));
    }
    return f;
  };
  if (spec.checkpoint().dir().empty()) {
    spec.mutable_checkpoint()->set_dir((root / "jobs" / job_id / "checkpoints").string());
  } else {
    LOOM_ASSIGN_OR_RETURN(std::string dir,
                          inside_root("spec.checkpoint.dir", spec.checkpoint().dir()));
    spec.mutable_checkpoint()->set_dir(dir);
  }
  if (!spec.data().path().empty()) {
    LOOM_ASSIGN_OR_RETURN(std::string path, inside_root("spec.data.path", spec.data().path()));
    spec.mutable_data()->set_path(path);
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

absl::StatusOr<v1::SubmitJobResponse> Coordinator::Submit(const v1::SubmitJobRequest& request,
                                                          const std::string& user) {
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
  // Checkpoints are what restarts resume from: a job without a directory gets one under the
  // storage root (its id is not known yet; ResolvePaths fills it in).
  v1::JobSpec unresolved = request.spec();
  const bool default_dir = unresolved.checkpoint().dir().empty();
  if (default_dir) unresolved.mutable_checkpoint()->set_dir("jobs/pending/checkpoints");
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
  std::lock_guard<std::mutex> lock(mutex_);
  if (!request.request_id().empty()) {
    auto it = request_ids_.find(request.request_id());
    if (it != request_ids_.end()) {
      v1::SubmitJobResponse r;
      r.set_id(it->second);
      r.set_created(false);
      return r;
    }
  }
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
    if (!fs::exists(fs::path(init_path) / "manifest.json", ec)) {
      return FieldError(
          "init_from", absl::StrCat("checkpoint '", request.init_from(), "' is no longer on disk (",
                                    init_path, "); pick an available one"));
    }
  }
  const std::string id = absl::StrFormat("job-%06d", next_job_);
  if (default_dir) spec.mutable_checkpoint()->clear_dir();
  LOOM_RETURN_IF_ERROR(ResolvePaths(spec, id));
  v1::Job job;
  job.set_id(id);
  job.set_name(spec.name().empty() ? id : spec.name());
  *job.mutable_request() = request;
  *job.mutable_spec() = spec;
  job.set_world_size(world_size);
  job.set_priority(request.priority());
  job.set_max_restarts(max_restarts);
  job.set_init_from_path(init_path);
  job.set_submitted_by(user);
  const int64_t now = NowMs();
  job.set_submit_time_ms(now);
  job.set_queued_since_ms(now);
  job.mutable_progress()->set_total_steps(spec.steps());

  StateStore::Batch batch;
  SetState(job, "queued", absl::StrCat("submitted by ", user), batch);
  batch.PutNextJob(next_job_ + 1);
  if (!request.request_id().empty()) batch.PutRequestId(request.request_id(), id);
  LOOM_RETURN_IF_ERROR(CommitLocked(batch, true));
  ++next_job_;
  jobs_[id] = job;
  if (!request.request_id().empty()) request_ids_[request.request_id()] = id;
  registry_.Increment("loom_coordinator_jobs_submitted_total");
  wake_.notify_all();
  v1::SubmitJobResponse r;
  r.set_id(id);
  r.set_created(true);
  return r;
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const std::string& state, int page_size,
                                                           const std::string& page_token) {
  if (!state.empty() &&
      std::find(std::begin(kStates), std::end(kStates), state) == std::end(kStates)) {
    return FieldError("state", absl::StrCat("unknown state '", state.substr(0, 40), "'; one of ",
                                            absl::StrJoin(kStates, ", ")));
  }
  if (page_size < 1 || page_size > 500) return FieldError("page_size", "must be in 1..500");
  if (!page_token.empty() && !IsValidId(page_token)) return FieldError("page_token", "malformed");
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListJobsResponse out;
  for (auto it = jobs_.upper_bound(page_token); it != jobs_.end(); ++it) {
    if (!state.empty() && it->second.state() != state) continue;
    if (out.jobs_size() == page_size) {
      out.set_next_page_token(out.jobs(out.jobs_size() - 1).id());
      break;
    }
    v1::Job* j = out.add_jobs();
    *j = it->second;
    auto w = waiting_reason_.find(it->first);
    if (j->state() == "queued" && w != waiting_reason_.end()) j->set_reason(w->second);
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
  v1::Job job = it->second;
  if (IsTerminal(job.state())) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is already ", job.state()));
  }
  // The attempt's ranks get SIGTERM through their agents' next heartbeat; their slots stay
  // counted until the agents report them gone.
  job.set_cancel_requested(true);
  StateStore::Batch batch;
  SetState(job, "cancelled", absl::StrCat("cancelled by ", user), batch);
  LOOM_RETURN_IF_ERROR(CommitLocked(batch, true));
  it->second = job;
  wake_.notify_all();
  return job;
}

absl::StatusOr<v1::ListCheckpointsResponse> Coordinator::ListCheckpoints(
    const std::string& job_id) {
  if (!job_id.empty() && !IsValidId(job_id)) return FieldError("job", "malformed job id");
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListCheckpointsResponse out;
  std::vector<const v1::CheckpointEntry*> list;
  for (const auto& [id, c] : checkpoints_) {
    if (job_id.empty() || c.job_id() == job_id) list.push_back(&c);
  }
  std::sort(list.begin(), list.end(), [](const auto* a, const auto* b) {
    return a->job_id() != b->job_id() ? a->job_id() < b->job_id() : a->step() < b->step();
  });
  for (const auto* c : list) {
    v1::CheckpointEntry* e = out.add_checkpoints();
    *e = *c;
    std::error_code ec;
    e->set_available(fs::exists(fs::path(c->path()) / "manifest.json", ec));
  }
  return out;
}

v1::ListWorkersResponse Coordinator::ListWorkers() {
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListWorkersResponse out;
  for (const auto& [id, w] : workers_) {
    v1::Worker* o = out.add_workers();
    *o = w;
    o->set_used_slots(UsedSlots(id));
  }
  return out;
}

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
  std::lock_guard<std::mutex> lock(mutex_);
  StateStore::Batch batch;
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
    // An agent that restarted lost its ranks (they die with it): their attempts failed.
    for (auto& [job_id, job] : jobs_) {
      if (IsActive(job.state()) && PlacementOf(job, id) != nullptr &&
          !Contains(job.finished_workers(), id)) {
        FailAttempt(job, absl::StrCat("worker ", id, " restarted"), batch);
      }
    }
    reported_running_[id].clear();
  }
  v1::Worker& w = workers_[id];
  const int64_t now = NowMs();
  if (w.register_time_ms() == 0) w.set_register_time_ms(now);
  w.set_id(id);
  w.set_name(request.name().empty() ? id : request.name());
  w.set_address(request.address());
  w.set_slots(request.slots());
  *w.mutable_labels() = request.labels();
  w.set_state("alive");
  w.set_last_heartbeat_ms(now);
  batch.PutWorker(w);
  LOOM_RETURN_IF_ERROR(CommitLocked(batch, true));
  wake_.notify_all();
  v1::RegisterWorkerResponse r;
  r.set_worker_id(id);
  r.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  return r;
}

void Coordinator::FailAttempt(v1::Job& job, const std::string& reason, StateStore::Batch& batch) {
  if (job.restarts() < job.max_restarts()) {
    job.set_restarts(job.restarts() + 1);
    SetState(job, "retrying", reason, batch);
    std::string from = "the start";
    for (auto it = job.checkpoints().rbegin(); it != job.checkpoints().rend(); ++it) {
      auto c = checkpoints_.find(*it);
      if (c != checkpoints_.end()) {
        from = absl::StrCat("step ", c->second.step());
        break;
      }
    }
    job.clear_placement();
    job.set_master_port(0);
    job.clear_finished_workers();
    job.set_queued_since_ms(NowMs());
    SetState(job, "queued",
             absl::StrCat("restart ", job.restarts(), " of ", job.max_restarts(), " from ", from),
             batch);
    registry_.Increment("loom_coordinator_job_restarts_total");
  } else {
    SetState(job, "failed",
             job.max_restarts() > 0
                 ? absl::StrCat(reason, " (no restarts left of ", job.max_restarts(), ")")
                 : reason,
             batch);
  }
}

void Coordinator::MarkWorkerLost(v1::Worker& worker, const std::string& reason,
                                 StateStore::Batch& batch) {
  worker.set_state("lost");
  batch.PutWorker(worker);
  registry_.Increment("loom_coordinator_workers_lost_total");
  reported_running_[worker.id()].clear();
  for (auto& [id, job] : jobs_) {
    if (IsActive(job.state()) && PlacementOf(job, worker.id()) != nullptr &&
        !Contains(job.finished_workers(), worker.id())) {
      FailAttempt(job, absl::StrCat("worker ", worker.id(), " ", reason), batch);
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

std::string Coordinator::LogPath(const std::string& job_id) const {
  return (fs::path(options_.data_dir) / "logs" / (job_id + ".log")).string();
}

// One log per job, in arrival order; each agent sends whole lines of its attempt's log by byte
// offset, and the offsets received per (attempt, worker) drop resent chunks after a lost reply.
void Coordinator::AppendLog(const v1::AttemptReport& report, const std::string& worker_id,
                            StateStore::Batch& batch) {
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
  batch.PutLogOffset(key, end);
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& request) {
  if (!IsValidId(request.worker_id())) return FieldError("worker_id", "malformed");
  if (request.attempts_size() > 4096) return FieldError("attempts", "too many");
  std::lock_guard<std::mutex> lock(mutex_);
  auto wit = workers_.find(request.worker_id());
  if (wit == workers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("worker '", request.worker_id(), "' is not registered"));
  }
  v1::Worker& worker = wit->second;
  const std::string& wid = worker.id();
  StateStore::Batch batch, progress_batch;
  worker.set_last_heartbeat_ms(NowMs());
  if (worker.state() != "alive") {
    worker.set_state("alive");
    batch.PutWorker(worker);
  }
  v1::HeartbeatResponse response;
  auto& running = reported_running_[wid];
  running.clear();
  std::set<std::pair<std::string, int>> reported;
  for (const v1::AttemptReport& r : request.attempts()) reported.insert({r.job_id(), r.attempt()});
  for (const v1::AttemptReport& r : request.attempts()) {
    if (!IsValidId(r.job_id())) continue;
    auto jit = jobs_.find(r.job_id());
    if (jit != jobs_.end()) AppendLog(r, wid, progress_batch);
    int ranks_running = 0;
    for (const auto& rank : r.ranks()) ranks_running += rank.running() ? 1 : 0;
    // Reports of unknown jobs and of old attempts: stop what still runs, forget what ended.
    const bool current = jit != jobs_.end() && IsActive(jit->second.state()) &&
                         r.attempt() == jit->second.attempt() &&
                         PlacementOf(jit->second, wid) != nullptr;
    if (current) {
      v1::Job& job = jit->second;
      if (r.master_port() > 0 && job.master_port() == 0 && HostsRankZero(job, wid)) {
        job.set_master_port(r.master_port());
        batch.PutJob(job);
      }
      if (r.progress().update_time_ms() > job.progress().update_time_ms()) {
        *job.mutable_progress() = r.progress();
        job.mutable_progress()->set_total_steps(job.spec().steps());
        progress_batch.PutJob(job);
      }
      for (const auto& c : r.checkpoints()) {
        const std::string cid = absl::StrCat(job.id(), "/", c.step());
        if (checkpoints_.count(cid) || c.step() < 0) continue;
        v1::CheckpointEntry e;
        e.set_id(cid);
        e.set_job_id(job.id());
        e.set_job_name(job.name());
        e.set_kind(job.spec().kind());
        e.set_step(c.step());
        e.set_path(c.path());
        e.set_parent(job.request().init_from());
        e.set_time_ms(NowMs());
        e.set_world_size(job.world_size());
        checkpoints_[cid] = e;
        batch.PutCheckpoint(e);
        job.add_checkpoints(cid);
        AddEvent(job, "", absl::StrCat("checkpoint at step ", c.step(), ": ", c.path()), batch);
        batch.PutJob(job);
      }
      for (const auto& ev : r.evals()) {
        bool seen = false;
        for (const auto& have : job.evals()) {
          seen |=
              have.step() == ev.step() && have.attempt() == r.attempt() && have.kind() == ev.kind();
        }
        if (!seen) {
          *job.add_evals() = ev;
          job.mutable_evals()->rbegin()->set_attempt(r.attempt());
          batch.PutJob(job);
        }
      }
      // Every failed rank, the likely cause first: a rank killed by a signal makes its peers
      // exit with a communication error right after.
      std::vector<std::string> killed, exited;
      for (const auto& rank : r.ranks()) {
        if (rank.running() || rank.exit_code() == 0) continue;
        (rank.exit_code() > 128 ? killed : exited)
            .push_back(absl::StrCat("rank ", rank.rank(), " on ", wid, ": ", rank.detail()));
      }
      killed.insert(killed.end(), exited.begin(), exited.end());
      const std::string failure = absl::StrJoin(killed, "; ");
      if (!failure.empty()) {
        FailAttempt(job, failure, batch);
      } else {
        if (ranks_running > 0 && job.state() == "scheduled") {
          if (job.start_time_ms() == 0) job.set_start_time_ms(NowMs());
          SetState(job, "running", absl::StrCat("ranks started on ", wid), batch);
        }
        if (r.finished() && !Contains(job.finished_workers(), wid)) {
          job.add_finished_workers(wid);
          batch.PutJob(job);
          bool all = true;
          for (const auto& p : job.placement())
            all &= Contains(job.finished_workers(), p.worker_id());
          if (all) {
            SetState(job, "succeeded",
                     absl::StrCat("all ", job.world_size(), " ranks exited 0 at step ",
                                  job.progress().step()),
                     batch);
          }
        }
      }
    } else if (!r.finished()) {
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
    if (!IsActive(job.state()) || Contains(job.finished_workers(), wid)) continue;
    const v1::Placement* p = PlacementOf(job, wid);
    if (p == nullptr) continue;
    if (reported.count({id, job.attempt()})) continue;  // already running there
    // Other workers wait for the port rank 0's worker picks (0 tells rank 0's worker to pick).
    if (job.master_port() == 0 && !HostsRankZero(job, wid)) continue;
    v1::Assignment* a = response.add_assignments();
    a->set_job_id(id);
    a->set_attempt(job.attempt());
    *a->mutable_ranks() = p->ranks();
    a->set_world_size(job.world_size());
    a->set_master_addr(job.master_addr());
    a->set_master_port(job.master_port());
    *a->mutable_spec() = job.spec();
    a->set_resume_from(job.resume_from());
    if (job.resume_from().empty()) a->set_init_from(job.init_from_path());
  }
  // Progress first: both batches may hold the same job, and the synced one has its final state.
  LOOM_RETURN_IF_ERROR(CommitLocked(progress_batch, false));
  LOOM_RETURN_IF_ERROR(CommitLocked(batch, true));
  return response;
}

void Coordinator::ScheduleLocked(StateStore::Batch& batch) {
  const int64_t now = NowMs();
  std::vector<QueuedJob> queue;
  for (const auto& [id, job] : jobs_) {
    if (job.state() != "queued") continue;
    QueuedJob q;
    q.id = id;
    q.world_size = job.world_size();
    q.priority = job.priority();
    q.pool.insert(job.request().pool().begin(), job.request().pool().end());
    q.queued_since_ms = job.queued_since_ms();
    queue.push_back(std::move(q));
  }
  if (queue.empty()) {
    waiting_reason_.clear();
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
  for (const GangPlacement& g : result.placed) {
    v1::Job& job = jobs_[g.job_id];
    job.set_attempt(job.attempt() + 1);
    job.clear_placement();
    job.clear_finished_workers();
    std::vector<std::string> where;
    for (const auto& [wid, ranks] : g.workers) {
      v1::Placement* p = job.add_placement();
      p->set_worker_id(wid);
      for (int r : ranks) p->add_ranks(r);
      where.push_back(absl::StrCat(wid, " (", RankText(ranks), ")"));
    }
    job.set_master_addr(workers_[g.workers.front().first].address());
    job.set_master_port(0);
    job.clear_resume_from();
    std::string from;
    const v1::CheckpointEntry* newest = nullptr;
    for (const std::string& cid : job.checkpoints()) {
      auto c = checkpoints_.find(cid);
      if (c != checkpoints_.end() && (newest == nullptr || c->second.step() > newest->step())) {
        newest = &c->second;
      }
    }
    if (newest != nullptr) {
      job.set_resume_from(newest->path());
      from = absl::StrCat("; resuming from step ", newest->step());
    }
    registry_.Observe("loom_coordinator_scheduling_delay_seconds",
                      static_cast<double>(now - job.queued_since_ms()) / 1000.0);
    SetState(job, "scheduled",
             absl::StrCat("attempt ", job.attempt(), " on ", absl::StrJoin(where, ", "), from),
             batch);
  }
}

void Coordinator::Tick() {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t now = NowMs();
  StateStore::Batch batch;
  for (auto& [id, w] : workers_) {
    if (w.state() == "alive" && now - w.last_heartbeat_ms() > options_.lost_after_ms) {
      MarkWorkerLost(
          w, absl::StrCat("lost: no heartbeat for ", (now - w.last_heartbeat_ms()) / 1000, " s"),
          batch);
    }
  }
  ScheduleLocked(batch);
  if (auto s = CommitLocked(batch, true); !s.ok()) {
    // The in-memory state is ahead of the disk: the next successful write carries the jobs again.
    registry_.Increment("loom_coordinator_store_errors_total");
  }
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
      const metrics::Labels l = {{"job", id}};
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
    registry_.Set("loom_coordinator_slots", total, {{"kind", "total"}});
    registry_.Set("loom_coordinator_slots", used, {{"kind", "used"}});
    registry_.Set("loom_coordinator_slots", total - used, {{"kind", "free"}});
  }
  return registry_.Render();
}

}  // namespace loom::coordinator
