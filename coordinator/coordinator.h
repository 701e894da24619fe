// The coordinator's state machine: jobs, workers, the checkpoint catalogue and scheduling.
// Everything the REST layer does goes through here; every state transition is written to
// RocksDB (synced) before the call returns. One mutex: the work per call is small and the
// control plane handles tens of workers, not thousands.
#ifndef LOOM_COORDINATOR_COORDINATOR_H_
#define LOOM_COORDINATOR_COORDINATOR_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/clock.h"
#include "coordinator/ids.h"
#include "coordinator/job_table.h"
#include "coordinator/log_syncer.h"
#include "coordinator/paging.h"
#include "coordinator/records.h"
#include "coordinator/retention.h"
#include "coordinator/scheduler.h"
#include "coordinator/state_store.h"
#include "coordinator/states.h"
#include "coordinator/webhooks.h"
#include "loom/exit_codes.h"
#include "loom/v1/control.pb.h"
#include "metrics/prometheus.h"

namespace loom::coordinator {

struct SweepCell;

struct CoordinatorOptions {
  std::string data_dir;      // RocksDB (state/) and job logs (logs/)
  std::string storage_root;  // checkpoints and datasets; client paths must stay inside it
  // Where job checkpoints go instead of <storage_root>/jobs: "s3://bucket/prefix" (an object
  // store; credentials and endpoint from the environment, storage/checkpoint_store.h).
  std::string checkpoint_store;
  int heartbeat_interval_ms = 1000;
  int lost_after_ms = 10000;  // a worker silent this long is lost and its jobs rescheduled
  // How long an agent's ranks keep running without reaching the coordinator: the coordinator
  // outage that costs no work, and the least time before a lost worker's jobs run elsewhere
  // (docs/control-plane.md, "Leases: a trade-off").
  int lease_ms = 90000;
  // Fencing: a lost worker's jobs are placed again only once its ranks' lease has certainly
  // run out (last heartbeat + lease_ms), and this much later still (a rank slow to die).
  int term_grace_ms = 5000;
  // When at least this many alive workers are all silent at once (none heard for half of
  // lost_after_ms), the silence is taken for the coordinator's own partition: none is marked
  // lost until the newest heartbeat is lease_ms old (their ranks run on meanwhile), as the
  // Kubernetes node controller stops evicting in a full disruption. 0 = never hold.
  int all_silent_min_workers = 2;
  int max_infra_restarts = 20;  // attempts a job may lose to lost or restarted workers
  // A job whose spec leaves checkpoint.interval_seconds 0 checkpoints this often: a lost worker
  // then costs at most this much of its work.
  int64_t checkpoint_interval_seconds = 600;
  int64_t max_body_bytes = 1 << 20;                // told to agents: heartbeats must fit
  int64_t max_job_log_bytes = int64_t{256} << 20;  // the first this many bytes of a job's log
  SchedulerOptions scheduler;
  double fair_share_half_life_s = 86400;  // decay of the usage fair share counts (UsageLedger)
  WebhookOptions webhooks;                // retries of webhook deliveries (webhooks.h)
  // Every time the coordinator reads (heartbeat silence, fencing, queue ages, event times).
  std::shared_ptr<Clock> clock = std::make_shared<SystemClock>();
};

class Coordinator {
 public:
  static absl::StatusOr<std::unique_ptr<Coordinator>> Open(const CoordinatorOptions& options);
  ~Coordinator();

  // Starts the background loop (lost workers, scheduling); Stop() joins it.
  void Start();
  void Stop();

  absl::StatusOr<v1::SubmitJobResponse> Submit(const v1::SubmitJobRequest& request,
                                               const std::string& user);
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const std::string& state, int page_size,
                                                const std::string& page_token);
  // Every filter that is non-empty must match; `newest_first` pages from the highest id down.
  struct JobFilter {
    std::string state, user, kind, sweep;
    std::string labels;  // "k=v,k2=v2": every label must be on the job
    bool newest_first = false;
  };
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const JobFilter& filter, int page_size,
                                                const std::string& page_token);
  absl::StatusOr<v1::Job> GetJob(const std::string& id);
  // A kind: serve job's server, where the proxy sends a request (coordinator_serve.cc).
  struct ServeTarget {
    std::string job_id, owner;
    int attempt = 0;
    std::string host;
    int port = 0;
    std::string token;  // the server's own bearer token, made by its agent: never shown
  };
  // NotFound (no such job), PermissionDenied (`scope` non-empty and not the owner: --private-jobs),
  // FailedPrecondition (not a serve job, or ended) or Unavailable (not answering yet), each with
  // a message a client can show.
  absl::StatusOr<ServeTarget> ServeTargetOf(const std::string& id, const std::string& scope);
  // Owner or admin only (PermissionDenied otherwise).
  absl::StatusOr<v1::Job> Cancel(const std::string& id, const Caller& caller);
  // Priority and retention after submission; owner-or-admin, each change an event.
  absl::StatusOr<v1::Job> UpdateJob(const std::string& id, const v1::JobUpdate& update,
                                    const Caller& caller);
  // Lists are paged (paging.h): page_size in 1..500, page_token from the previous page.
  // `owner` non-empty: only the checkpoints of that user's jobs (--private-jobs).
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const std::string& job_id,
                                                              int page_size = kMaxPageSize,
                                                              const std::string& page_token = "",
                                                              const std::string& owner = "");

  // Sweeps (docs/sweeps.md): every (cell, seed) becomes an ordinary job, all in one commit.
  absl::StatusOr<v1::CreateSweepResponse> CreateSweep(const v1::SweepSpec& spec,
                                                      const std::string& user);
  absl::StatusOr<v1::Sweep> GetSweep(const std::string& id);
  // `owner` non-empty: only that user's sweeps (--private-jobs); `labels` "k=v,...": only
  // sweeps with those labels.
  absl::StatusOr<v1::ListSweepsResponse> ListSweeps(int page_size = kMaxPageSize,
                                                    const std::string& page_token = "",
                                                    const std::string& owner = "",
                                                    const std::string& labels = "");
  // Cancels every job of the sweep that has not ended.
  absl::StatusOr<v1::Sweep> CancelSweep(const std::string& id, const Caller& caller);
  // The sweep's report; each set field of the query replaces the sweep's own (400 naming it if
  // unknown). A baseline is a cell of this sweep, or SWEEP_ID/CELL: another sweep's cell, added
  // to the report and paired with this sweep's cells by seed.
  struct ReportQuery {
    std::string metric, select, baseline;
    std::vector<std::string> merge;  // sweeps whose cells join this one's namesakes as more seeds
    std::optional<int64_t> length;
    std::optional<double> threshold;
  };
  absl::StatusOr<v1::SweepReport> ReportSweep(const std::string& id, const ReportQuery& query = {});
  // The sweep's curves (sweep_curves.h) over the same jobs as its report: the query's metric,
  // baseline and merge as ReportSweep reads them (select, length and threshold do not apply).
  absl::StatusOr<v1::SweepCurves> SweepCurves(const std::string& id, const ReportQuery& query = {});
  // Quotas (scheduler.h): listed with what they count now; set and deleted by admins only.
  absl::StatusOr<v1::ListQuotasResponse> ListQuotas();
  absl::StatusOr<v1::Quota> SetQuota(const v1::Quota& quota, const Caller& caller);
  absl::Status DeleteQuota(const std::string& kind, const std::string& name, const Caller& caller);
  // Webhooks (webhooks.h), admins only: the answer to AddWebhook is the only one with the secret.
  absl::StatusOr<v1::Webhook> AddWebhook(v1::Webhook webhook, const Caller& caller);
  absl::StatusOr<v1::ListWebhooksResponse> ListWebhooks(const Caller& caller);
  absl::Status DeleteWebhook(const std::string& id, const Caller& caller);
  WebhookSender& webhook_sender() { return *webhooks_; }  // tests: DeliverDue()
  absl::StatusOr<v1::ListWorkersResponse> ListWorkers(int page_size = kMaxPageSize,
                                                      const std::string& page_token = "");

  absl::StatusOr<v1::RegisterWorkerResponse> Register(const v1::RegisterWorkerRequest& request);
  // The worker a heartbeat credential is bound to; Unauthenticated when unknown or revoked.
  absl::StatusOr<std::string> WorkerForCredential(const std::string& credential);
  // `worker` is the id the request's credential is bound to.
  // Heartbeat without waiting on the caller's thread: done runs at once when the heartbeat
  // changed no state (or failed), else on the log syncer's thread once its change is on disk
  // (group commit). Heartbeat() is the same, waited for.
  void HeartbeatThen(const v1::HeartbeatRequest& request, const std::string& worker,
                     std::function<void(absl::StatusOr<v1::HeartbeatResponse>)> done);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request,
                                                  const std::string& worker);

  // Log bytes [offset, offset + max) of a job (its attempts' logs in order). `done` is true when
  // the job is terminal and no more bytes will come.
  struct LogChunk {
    std::string data;
    int64_t next_offset = 0;
    bool done = false;
  };
  absl::StatusOr<LogChunk> ReadLog(const std::string& id, int64_t offset, int64_t max);

  // The job's training curves (rank 0's steps, one series per attempt, each thinned to at most
  // max_points) and its evaluations: what the console draws.
  absl::StatusOr<v1::JobMetricsResponse> JobMetrics(const std::string& id, int max_points);
  static constexpr int kMaxStepsPerReport = 10000;
  static constexpr uintmax_t kMaxSeriesBytes = uintmax_t{256} << 20;  // per job

  metrics::Registry& registry() { return registry_; }
  std::string RenderMetrics();

  // One pass of the background loop: workers silent for lost_after_ms are declared lost, then
  // queued jobs are placed. Tests call it after moving a ManualClock on.
  void Tick();

 private:
  using Txn = JobTable::Txn;
  enum class Failure { kJob, kInfra, kBadInput };
  struct PlannedJob;     // one (cell, seed) of a sweep, validated before anything is stored
  struct ReportedSweep;  // a sweep as its report and curves read it
  // Attempts ("<job>", attempt) a worker reported as not finished -> its ranks running them.
  using RunningAttempts = std::map<std::pair<std::string, int>, int>;

  explicit Coordinator(const CoordinatorOptions& options)
      : options_(options), usage_(options.fair_share_half_life_s) {}
  int64_t NowMs() const { return options_.clock->NowMs(); }
  int64_t SteadyMs() const { return options_.clock->SteadyMs(); }
  // When the worker was last heard, on the steady clock (0: never since this process started).
  int64_t HeardAt(const std::string& worker) const;
  void Load();
  absl::Status OpenWebhooks();
  absl::StatusOr<v1::JobSpec> ResolveSubmission(const v1::SubmitJobRequest& request);
  // The job or sweep, mutex_ held: InvalidArgument for a malformed id, NotFound when unknown.
  absl::StatusOr<v1::Job*> FindJobLocked(const std::string& id);
  absl::StatusOr<const v1::Sweep*> FindSweepLocked(const std::string& id) const;
  absl::StatusOr<std::vector<PlannedJob>> PlanSweepJobs(const v1::SweepSpec& spec,
                                                        const std::vector<SweepCell>& cells);

  // All below: mutex_ held.
  absl::StatusOr<std::string> InitFromPathLocked(const v1::SubmitJobRequest& request) const;
  absl::StatusOr<v1::Job> AddJobLocked(Txn& txn, const v1::SubmitJobRequest& request,
                                       v1::JobSpec spec, const std::string& user,
                                       const std::string& id);
  absl::StatusOr<v1::CreateSweepResponse> RepeatedSweepLocked(const std::string& key,
                                                              const v1::SweepSpec& spec);
  absl::Status AddSweepJobsLocked(Txn& txn, v1::Sweep& sweep,
                                  const std::vector<PlannedJob>& planned, const std::string& user);
  v1::Sweep SweepWithStates(const v1::Sweep& sweep) const;
  // A report's baseline into `sweep` (its spec.baseline) and, for another sweep's cell, that
  // cell and its jobs (renamed SWEEP_ID/CELL) into `sweep` and `jobs`; returns that sweep's id.
  absl::StatusOr<std::string> AddReportBaselineLocked(const std::string& baseline, v1::Sweep& sweep,
                                                      std::map<std::string, v1::Job>& jobs) const;
  // The jobs of each merged sweep's cells into `sweep`'s namesake cells and `jobs`; returns the
  // warnings (cells that differ besides the seed, cells with no namesake). A seed counts once.
  absl::StatusOr<std::vector<std::string>> AddReportMergeLocked(
      const std::vector<std::string>& merge, v1::Sweep& sweep,
      std::map<std::string, v1::Job>& jobs) const;
  // The sweep and its jobs under the query: merged sweeps and another sweep's baseline joined.
  absl::StatusOr<ReportedSweep> ReportedSweepOf(const std::string& id, const ReportQuery& query);
  // Webhooks: the state hook, and one event's deliveries into the change's outbox.
  void NotifyStateLocked(Txn& txn, const v1::Job& job, JobState state);
  void AddDeliveriesLocked(Txn& txn, v1::WebhookDelivery event);
  void FailAttempt(Txn& txn, v1::Job& job, const std::string& reason, Failure kind,
                   int64_t not_before_ms = 0);
  // Fails every active attempt with ranks on the worker that it has not finished.
  void FailAttemptsOn(Txn& txn, const std::string& worker_id, const std::string& reason,
                      int64_t not_before_ms = 0);
  void MarkWorkerLost(Txn& txn, v1::Worker& worker, const std::string& reason);
  void ForgiveOwnOutage();
  void ResumeStoreIfFull();
  Quotas QuotasLocked() const;
  Quotas QuotaLimitsLocked() const;
  void CountQuotaUsage(const v1::Job& job, Quotas& q) const;
  struct PassInputs {
    Quotas quotas;
    FairShare share;
    std::vector<RunningJob> running;
  };
  PassInputs PassInputsLocked(int64_t now);
  RunningJob RunningJobOf(const v1::Job& job, int64_t now) const;
  void AdvanceUsageLocked(int64_t now, const std::map<std::string, int>& held);
  void RebuildUsageLocked();
  int SweepOrder(const v1::Job& job) const;
  void RequestPreemption(Txn& txn, v1::Job& victim, const std::string& for_job);
  void RequeuePreempted(Txn& txn, v1::Job& job, const std::string& how);
  std::string Requeue(v1::Job& job, int64_t not_before_ms);
  void MarkSilentWorkersLost(Txn& txn);
  bool AllWorkersSilent(int64_t now);
  bool AppendCapped(Txn& txn, const std::string& job_id, const std::string& path,
                    absl::string_view part);
  // A heartbeat under the lock; *written: the log sequence its state changes need on disk
  // before the answer goes out (0: none).
  absl::StatusOr<v1::HeartbeatResponse> HeartbeatLocked(const v1::HeartbeatRequest& request,
                                                        const std::string& worker,
                                                        uint64_t* written);
  void IndexPlacementsLocked();
  absl::StatusOr<std::string> RegisteringIdLocked(Txn& txn, const v1::RegisterWorkerRequest& r);
  int UsedSlots(const std::string& worker_id) const;
  bool OldAttemptRunning(const v1::Job& job) const;
  void ScheduleLocked(Txn& txn);
  std::vector<QueuedJob> QueueLocked(std::map<std::string, std::string>& held) const;
  bool AwaitingReportsAfterRestart() const;
  std::vector<FreeWorker> FreeWorkersLocked() const;
  void StartAttemptLocked(Txn& txn, const GangPlacement& placement, int64_t now);
  const v1::CheckpointEntry* NewestIntactCheckpoint(const v1::Job& job) const;
  // One report of a heartbeat: logs and steps recorded, the attempt's job brought up to date,
  // the agent told to stop or forget it; what still runs is added to `running`.
  void ReconcileReportLocked(Txn& txn, const std::string& worker, const v1::AttemptReport& r,
                             v1::HeartbeatResponse& response, RunningAttempts& running);
  // The attempts placed on the worker that it does not run yet, as assignments.
  void AssignLocked(const std::string& worker, const v1::HeartbeatRequest& request,
                    v1::HeartbeatResponse& response) const;
  // Records the part of a resendable chunk not received yet under `key` (a log offset):
  // `write(first new item)` stores it; the offset moves on when it returns true.
  void RecordNewPart(Txn& txn, const std::string& key, int64_t offset, int64_t count,
                     const std::function<bool(int64_t)>& write);
  void AppendLog(Txn& txn, const v1::AttemptReport& report, const std::string& worker_id);
  void AppendSteps(Txn& txn, const v1::AttemptReport& report, const std::string& worker_id);
  std::string CheckpointDir(const v1::Job& job) const { return job.spec().checkpoint().dir(); }
  absl::Status ValidateReport(const v1::AttemptReport& r, const std::string& worker_id) const;
  void ApplyReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r, const std::string& wid);
  void ApplyProgress(Txn& txn, v1::Job& job, const v1::AttemptReport& r, const std::string& wid);
  void ApplyServeReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r, const std::string& wid);
  void RecordEvals(Txn& txn, v1::Job& job, const v1::AttemptReport& r);
  void ApplyFinishedShare(Txn& txn, v1::Job& job, const v1::AttemptReport& r,
                          const std::string& wid);
  void CatalogueCheckpoint(Txn& txn, v1::Job& job, int64_t step, const std::string& path);
  void ApplyResumeReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r);
  // <storage root>/jobs/<id>/checkpoints, or on an object store
  // <store>/jobs/<id>-<submit ms>/checkpoints (nothing there to set aside: an id used before, in
  // an earlier coordinator state, never meets its old steps).
  std::string CheckpointDirFor(const std::string& id, int64_t now) const;
  bool RemoteCheckpoints() const { return !options_.checkpoint_store.empty(); }

  CoordinatorOptions options_;
  metrics::Registry registry_{"coordinator"};
  std::unique_ptr<JobTable> table_;          // after registry_: gone before it
  std::unique_ptr<Retention> retention_;     // after table_: gone (its thread joined) before it
  std::unique_ptr<LogSyncer> log_syncer_;    // after table_ and registry_: gone before them
  std::unique_ptr<WebhookSender> webhooks_;  // after table_ and registry_: gone before them

  std::mutex mutex_;  // guards table_, retention_'s decisions and everything below
  // kind: serve jobs' servers as their agents last reported them (kept in memory only: the
  // tokens are never stored; the next heartbeat brings them back after a restart).
  std::map<std::string, ServeTarget> serve_targets_;
  // Fair share's decayed usage: rebuilt from the jobs' attempt histories at load, advanced by
  // each pass with what the users held since the one before.
  UsageLedger usage_;
  std::map<std::string, int> last_held_;
  std::map<std::string, std::string> waiting_reason_;  // not persisted: recomputed each pass
  // Per worker: attempts its last heartbeat reported as still running -> ranks running there.
  std::map<std::string, RunningAttempts> reported_running_;
  // After a restart nothing is placed until every live worker has reported what it runs (or
  // been declared lost), so an old attempt still running is known before a new one starts.
  std::set<std::string> heard_since_start_;

  std::condition_variable wake_;
  bool stop_ = false;
  std::thread loop_;
  // When the background loop last ran (steady clock): a longer gap is the coordinator's own
  // outage, not its workers' silence (ForgiveOwnOutage).
  std::chrono::steady_clock::time_point last_tick_{};
  bool holding_loss_detection_ = false;  // AllWorkersSilent held at the last tick
  int64_t last_resume_try_ms_ = 0;       // steady; the tick thread only
  int64_t last_resume_report_ms_ = 0;    // steady: when a failed resume was last logged
  int64_t hold_ended_ms_ = 0;            // steady: when a worker was heard after such a hold
  // Liveness and fencing on the steady clock (clock.h): an NTP step moves neither. The wall-clock
  // twins (Worker.last_heartbeat_ms, Job.not_before_ms) are what is shown and stored.
  std::map<std::string, int64_t> heard_steady_;  // worker id -> last heartbeat
  std::map<std::string, int64_t> fence_steady_;  // job id -> not placed again before this
  std::map<std::string, std::vector<std::string>> placed_on_;  // IndexPlacementsLocked
};

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_COORDINATOR_H_
