// The coordinator's state machine: jobs, workers, the checkpoint catalogue and scheduling.
// Everything the REST layer does goes through here; every state transition is written to
// RocksDB (synced) before the call returns. One mutex: the work per call is small and the
// control plane handles tens of workers, not thousands.
#ifndef LOOM_COORDINATOR_COORDINATOR_H_
#define LOOM_COORDINATOR_COORDINATOR_H_

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "loom/v1/control.pb.h"
#include "prometheus.h"
#include "scheduler.h"
#include "state_store.h"

namespace loom::coordinator {

struct CoordinatorOptions {
  std::string data_dir;      // RocksDB (state/) and job logs (logs/)
  std::string storage_root;  // checkpoints and datasets; client paths must stay inside it
  int heartbeat_interval_ms = 1000;
  int lost_after_ms = 10000;  // a worker silent this long is lost and its jobs rescheduled
  SchedulerOptions scheduler;
};

bool IsTerminal(const std::string& state);
bool IsValidId(const std::string& id);

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
  absl::StatusOr<v1::Job> GetJob(const std::string& id);
  absl::StatusOr<v1::Job> Cancel(const std::string& id, const std::string& user);
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const std::string& job_id);
  v1::ListWorkersResponse ListWorkers();

  absl::StatusOr<v1::RegisterWorkerResponse> Register(const v1::RegisterWorkerRequest& request);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);

  // Log bytes [offset, offset + max) of a job (its attempts' logs in order). `done` is true when
  // the job is terminal and no more bytes will come.
  struct LogChunk {
    std::string data;
    int64_t next_offset = 0;
    bool done = false;
  };
  absl::StatusOr<LogChunk> ReadLog(const std::string& id, int64_t offset, int64_t max);

  metrics::Registry& registry() { return registry_; }
  std::string RenderMetrics();

  // One scheduling pass (the background loop calls it; tests may too).
  void Tick();

 private:
  explicit Coordinator(const CoordinatorOptions& options) : options_(options) {}
  absl::Status Load();

  // All below: mutex_ held.
  void AddEvent(v1::Job& job, const std::string& state, const std::string& reason,
                StateStore::Batch& batch);
  void SetState(v1::Job& job, const std::string& state, const std::string& reason,
                StateStore::Batch& batch);
  void FailAttempt(v1::Job& job, const std::string& reason, StateStore::Batch& batch);
  void MarkWorkerLost(v1::Worker& worker, const std::string& reason, StateStore::Batch& batch);
  int UsedSlots(const std::string& worker_id) const;
  void ScheduleLocked(StateStore::Batch& batch);
  void AppendLog(const v1::AttemptReport& report, const std::string& worker_id,
                 StateStore::Batch& batch);
  std::string LogPath(const std::string& job_id) const;
  absl::Status ResolvePaths(v1::JobSpec& spec, const std::string& job_id) const;
  absl::Status CommitLocked(StateStore::Batch& batch, bool sync);

  CoordinatorOptions options_;
  std::unique_ptr<StateStore> store_;
  metrics::Registry registry_;

  std::mutex mutex_;
  std::map<std::string, v1::Job> jobs_;
  std::map<std::string, int64_t> event_counts_;
  std::map<std::string, v1::Worker> workers_;
  std::map<std::string, v1::CheckpointEntry> checkpoints_;
  std::map<std::string, std::string> request_ids_;
  int64_t next_job_ = 1;
  std::map<std::string, int64_t> log_offsets_;  // "<job>/<attempt>/<worker>" -> bytes received
  std::map<std::string, std::string> waiting_reason_;  // not persisted: recomputed each pass
  // Per worker: attempts its last heartbeat reported as still running -> ranks running there.
  std::map<std::string, std::map<std::pair<std::string, int>, int>> reported_running_;

  std::condition_variable wake_;
  bool stop_ = false;
  std::thread loop_;
};

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_COORDINATOR_H_
