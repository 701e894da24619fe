// The coordinator's facade: opening its state, the background loop, and its metrics.
#include "coordinator/coordinator.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace fs = std::filesystem;

namespace loom::coordinator {

namespace {

// The coordinator's metric families, each series that must exist from the first scrape at 0
// (the state core declares its own: JobTable::Open).
void DeclareMetrics(metrics::Registry& r) {
  r.DeclareGauge("loom_coordinator_jobs", "Jobs by state");
  r.DeclareGauge("loom_coordinator_workers", "Workers by state");
  r.DeclareGauge("loom_coordinator_slots",
                 "Slots on live workers, used and free (their sum is the capacity)");
  r.DeclareCounter("loom_coordinator_jobs_submitted_total", "Jobs accepted by POST /v1/jobs");
  r.DeclareCounter("loom_coordinator_job_restarts_total", "Failed attempts requeued");
  r.DeclareCounter("loom_coordinator_preemptions_total",
                   "Attempts stopped for a higher-priority job and requeued");
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
  r.DeclareCounter("loom_coordinator_log_syncs_total",
                   "fsyncs of the RocksDB log that heartbeats' state changes waited for (each "
                   "covers every heartbeat written before it: a group commit)");
  // Label-less counters start at 0, so rate() and increase() see them from the first scrape.
  for (const char* c :
       {"loom_coordinator_jobs_submitted_total", "loom_coordinator_job_restarts_total",
        "loom_coordinator_workers_lost_total", "loom_coordinator_log_syncs_total"}) {
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
  // Per job that failed in the last hour: an alert can name the job (LoomJobFailed).
  r.DeclareGauge("loom_coordinator_job_failed_timestamp_seconds",
                 "When a job failed (Unix seconds), for the jobs that failed in the last hour");
}

// The failure times of the jobs that failed in the last hour, labelled with their ids.
void SetRecentFailures(metrics::Registry& r, const std::map<std::string, v1::Job>& jobs,
                       int64_t now_ms) {
  r.Clear("loom_coordinator_job_failed_timestamp_seconds");
  for (const auto& [id, j] : jobs) {
    if (JobStateOf(j) != JobState::kFailed || now_ms - j.end_time_ms() > 3600000) continue;
    r.Set("loom_coordinator_job_failed_timestamp_seconds",
          static_cast<double>(j.end_time_ms()) / 1000.0, {{metrics::kJobLabel, id}});
  }
}

}  // namespace

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
  LOOM_ASSIGN_OR_RETURN(c->table_, JobTable::Open(state.string(), c->options_.clock, c->registry_));
  c->retention_ = std::make_unique<Retention>(*c->table_, c->options_.storage_root,
                                              c->options_.checkpoint_store);
  // A finished child no longer pins its parent's checkpoint.
  c->table_->set_on_terminal(
      [retention = c->retention_.get()](JobTable::Txn& txn, const v1::Job& job) {
        if (!job.request().init_from().empty()) {
          retention->Apply(txn, ParentJob(job.request().init_from()));
        }
      });
  LOOM_RETURN_IF_ERROR(c->OpenWebhooks());
  c->Load();
  DeclareMetrics(c->registry_);
  c->log_syncer_ = std::make_unique<LogSyncer>(c->table_->store(), c->registry_);
  return c;
}

Coordinator::~Coordinator() { Stop(); }

// What the coordinator keeps beside the table after a restart: liveness, fences, placements,
// fair share, and retention decided before a crash.
void Coordinator::Load() {
  // Restarted: every known worker gets a fresh grace period to heartbeat again.
  const int64_t now = NowMs();
  const int64_t steady = SteadyMs();
  for (auto& [id, w] : table_->workers()) {
    w.set_last_heartbeat_ms(now);
    heard_steady_[id] = steady;
  }
  // A fence carried over a restart: what was left of it (never more than a lease and a grace,
  // whatever the wall clock did while the coordinator was down).
  const int64_t longest = int64_t{options_.lease_ms} + options_.term_grace_ms;
  for (const auto& [id, job] : table_->jobs()) {
    if (job.not_before_ms() > now) {
      fence_steady_[id] = steady + std::min(job.not_before_ms() - now, longest);
    }
  }
  IndexPlacementsLocked();
  RebuildUsageLocked();
  retention_->Recover();  // decided before a crash, not carried out yet
}

// The outbox's sender (its deliveries not made before a restart go out again) and the hook that
// fills the outbox in each job state change's own commit.
absl::Status Coordinator::OpenWebhooks() {
  webhooks_ = std::make_unique<WebhookSender>(
      table_->store(), registry_, options_.clock, options_.webhooks,
      [this](const std::string& sweep_id) { return ReportSweep(sweep_id); });
  LOOM_RETURN_IF_ERROR(webhooks_->Load(table_->webhooks()));
  table_->set_on_state(
      [this](Txn& txn, const v1::Job& job, JobState state) { NotifyStateLocked(txn, job, state); });
  return absl::OkStatus();
}

void Coordinator::Start() {
  retention_->Start();
  webhooks_->Start();
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
  if (retention_) retention_->Stop();
  if (webhooks_) webhooks_->Stop();
}

// A full data directory: try to resume the store, at most once a second.
void Coordinator::ResumeStoreIfFull() {
  if (!table_->store().Full() || SteadyMs() - last_resume_try_ms_ < 1000) return;
  last_resume_try_ms_ = SteadyMs();
  const absl::Status resumed = table_->store().Resume();
  if (resumed.ok()) {
    std::cerr << "coordinator: the data directory has room again; state writes resumed\n";
  } else if (last_resume_try_ms_ - last_resume_report_ms_ >= 60000 || last_resume_report_ms_ == 0) {
    last_resume_report_ms_ = last_resume_try_ms_;
    std::cerr << "coordinator: " << resumed.message() << "\n";
  }
}

void Coordinator::Tick() {
  ResumeStoreIfFull();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Txn txn;
    ForgiveOwnOutage();
    MarkSilentWorkersLost(txn);
    ScheduleLocked(txn);
    (void)table_->Commit(txn);  // on failure memory is restored; the next tick tries again
    registry_.Set("loom_coordinator_storage_full",
                  table_->storage_full() || table_->store().Full() ? 1 : 0);
    IndexPlacementsLocked();
  }
  retention_->CarryOut();  // without the lock
}

std::string Coordinator::RenderMetrics() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::map<std::string, int> by_state;
    for (absl::string_view s : JobStateNames()) by_state[std::string(s)] = 0;
    for (const auto& [id, j] : table_->jobs()) by_state[j.state()]++;
    for (const auto& [s, n] : by_state) registry_.Set("loom_coordinator_jobs", n, {{"state", s}});
    registry_.Set("loom_coordinator_queue_depth",
                  by_state[std::string(JobStateName(JobState::kQueued))]);
    const int64_t now = NowMs();
    for (const char* f : {"loom_coordinator_job_step", "loom_coordinator_job_progress_age_seconds",
                          "loom_coordinator_job_checkpoint_age_seconds"}) {
      registry_.Clear(f);
    }
    for (const auto& [id, j] : table_->jobs()) {
      if (!IsActive(j)) continue;
      const metrics::Labels l = {{metrics::kJobLabel, id}};
      const int64_t started = std::max(j.update_time_ms(), j.start_time_ms());
      int64_t last_ckpt = 0;
      for (const auto& cid : j.checkpoints()) {
        auto c = table_->checkpoints().find(cid);
        if (c != table_->checkpoints().end()) last_ckpt = std::max(last_ckpt, c->second.time_ms());
      }
      registry_.Set("loom_coordinator_job_step", static_cast<double>(j.progress().step()), l);
      registry_.Set(
          "loom_coordinator_job_progress_age_seconds",
          static_cast<double>(now - std::max(j.progress().update_time_ms(), started)) / 1000.0, l);
      registry_.Set("loom_coordinator_job_checkpoint_age_seconds",
                    static_cast<double>(now - std::max(last_ckpt, started)) / 1000.0, l);
    }
    int alive = 0, lost = 0, total = 0, used = 0;
    for (const auto& [id, w] : table_->workers()) {
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
    SetRecentFailures(registry_, table_->jobs(), now);
  }
  return registry_.Render();
}

}  // namespace loom::coordinator
