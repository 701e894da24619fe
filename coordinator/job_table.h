// The coordinator's state core: every record it keeps (jobs and their events, workers and their
// credentials, the checkpoint catalogue, sweeps, quotas, idempotency keys, log offsets, the id
// counters), the transaction that changes them, and job state transitions.
//
// A change is a Txn: Save* records a record's prior value before the caller changes it, the
// batches collect the writes, Commit writes them (persisted, then in effect) and on failure puts
// every saved record back. Nothing here calls up into scheduling, retention or the API: what
// must follow a change is the caller's (Txn::on_commit) or a hook (on_terminal). Not
// thread-safe: the coordinator calls it under its one mutex.
#ifndef LOOM_COORDINATOR_JOB_TABLE_H_
#define LOOM_COORDINATOR_JOB_TABLE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/clock.h"
#include "coordinator/state_store.h"
#include "coordinator/states.h"
#include "loom/v1/control.pb.h"
#include "metrics/prometheus.h"

namespace loom::coordinator {

class JobTable {
 public:
  // One change of the state: the RocksDB batches and the prior values of everything it touched.
  struct Txn {
    StateStore::Batch batch;     // synced: state transitions
    StateStore::Batch progress;  // not synced: progress, log offsets
    std::map<std::string, std::optional<v1::Job>> jobs;
    std::map<std::string, std::optional<v1::Worker>> workers;
    std::map<std::string, std::optional<v1::CheckpointEntry>> checkpoints;
    std::map<std::string, std::optional<std::string>> credentials;
    std::map<std::string, int64_t> event_counts;
    std::vector<JobState> ended;  // terminal states reached, counted once committed
    // What takes effect only once the change is on disk (new ids, removals), in order.
    std::vector<std::function<void()>> on_commit;
    bool no_space = false;  // a job log or series append found the disk full
  };
  // Runs inside SetState when a job reaches a terminal state, in the same Txn.
  using TerminalHook = std::function<void(Txn&, const v1::Job&)>;
  // Runs at the end of every SetState (after on_terminal), in the same Txn: the webhooks'
  // outbox entries go into the change that causes them.
  using StateHook = std::function<void(Txn&, const v1::Job&, JobState)>;

  // Opens (or creates) the RocksDB state in `state_dir` and loads it, migrating what older
  // coordinators wrote (clear credentials, "<job>/<step>" checkpoint ids).
  static absl::StatusOr<std::unique_ptr<JobTable>> Open(const std::string& state_dir,
                                                        std::shared_ptr<Clock> clock,
                                                        metrics::Registry& registry);

  // The records, read and changed in place; a change is Saved into a Txn first.
  std::map<std::string, v1::Job>& jobs() { return jobs_; }
  const std::map<std::string, v1::Job>& jobs() const { return jobs_; }
  std::map<std::string, v1::Worker>& workers() { return workers_; }
  const std::map<std::string, v1::Worker>& workers() const { return workers_; }
  std::map<std::string, v1::CheckpointEntry>& checkpoints() { return checkpoints_; }
  const std::map<std::string, v1::CheckpointEntry>& checkpoints() const { return checkpoints_; }
  const std::map<std::string, v1::Sweep>& sweeps() const { return sweeps_; }
  const std::map<std::string, v1::Quota>& quotas() const { return quotas_; }
  const std::map<std::string, v1::Webhook>& webhooks() const { return webhooks_; }
  // "<job>/<attempt>/<worker>" -> log bytes (or step points) received; progress, not synced.
  std::map<std::string, int64_t>& log_offsets() { return log_offsets_; }
  StateStore& store() { return *store_; }

  void Save(Txn& txn, const v1::Job& job);
  void Save(Txn& txn, const std::string& worker_id);
  void SaveCheckpoint(Txn& txn, const std::string& id);

  // Writes both batches (the state batch fsynced unless !sync: the caller then waits for
  // StateStore::SyncLogThrough after releasing the lock), then runs txn.on_commit; on failure
  // restores memory and runs nothing.
  absl::Status Commit(Txn& txn, bool sync = true);
  void Rollback(Txn& txn);  // restores what the change touched, writes nothing
  // The last write found the data directory full (cleared by the next one that succeeds).
  bool storage_full() const { return storage_full_; }

  // An event of the job; `state` is the state entered, nullopt for an event that changes none.
  void AddEvent(Txn& txn, v1::Job& job, std::optional<JobState> state, const std::string& reason);
  void SetState(Txn& txn, v1::Job& job, JobState state, const std::string& reason);
  void set_on_terminal(TerminalHook hook) { on_terminal_ = std::move(hook); }
  void set_on_state(StateHook hook) { on_state_ = std::move(hook); }

  // Ids: the next `i`-th job id / sweep id not taken yet; Take* takes them with the change.
  std::string NextJobId(int64_t i = 0) const;
  std::string NextSweepId() const;
  void TakeJobIds(Txn& txn, int64_t n);
  void TakeSweepId(Txn& txn);
  // Idempotency keys -> job or sweep id ("" when unknown); PutRequestId keeps one with the change.
  std::string RequestId(const std::string& key) const;
  void PutRequestId(Txn& txn, const std::string& key, const std::string& id);
  void PutSweep(Txn& txn, const v1::Sweep& sweep);
  void PutQuota(Txn& txn, const v1::Quota& quota);
  void DeleteQuota(Txn& txn, const std::string& kind, const std::string& name);
  // Webhooks (webhooks.h): the next id, one stored or removed with the change.
  std::string NextWebhookId() const;
  void PutWebhook(Txn& txn, const v1::Webhook& webhook);  // takes the id when it is the next one
  void DeleteWebhook(Txn& txn, const std::string& id);
  // The outbox: a new event's sequence number (taken at once: a change rolled back leaves a
  // gap, never a reused event id) and a delivery stored with the change.
  int64_t TakeEventSeq(Txn& txn);
  void PutDelivery(Txn& txn, const v1::WebhookDelivery& delivery);

  // Heartbeat credentials, stored as digests (credentials.h): the worker a digest belongs to
  // ("" when none), a worker's digest ("" when none), a new one, or none.
  std::string WorkerOfDigest(const std::string& digest) const;
  std::string DigestOf(const std::string& worker_id) const;
  void SetCredential(Txn& txn, const std::string& worker_id, const std::string& digest);
  void RevokeCredential(Txn& txn, const std::string& worker_id);

 private:
  JobTable(std::shared_ptr<Clock> clock, metrics::Registry& registry)
      : clock_(std::move(clock)), registry_(registry) {}
  absl::Status Load();
  absl::Status DigestClearCredentials();
  absl::Status MigrateCheckpointIds();
  void SaveCredential(Txn& txn, const std::string& worker_id);

  std::shared_ptr<Clock> clock_;
  metrics::Registry& registry_;
  std::unique_ptr<StateStore> store_;
  TerminalHook on_terminal_;
  StateHook on_state_;
  bool storage_full_ = false;

  std::map<std::string, v1::Job> jobs_;
  std::map<std::string, int64_t> event_counts_;
  std::map<std::string, v1::Worker> workers_;
  std::map<std::string, v1::CheckpointEntry> checkpoints_;
  // IdempotencyKey(user, request_id) -> job id; "sweep:" + IdempotencyKey(...) -> sweep id.
  std::map<std::string, std::string> request_ids_;
  std::map<std::string, v1::Sweep> sweeps_;
  std::map<std::string, v1::Quota> quotas_;              // "<kind>/<name>" -> quota (used not kept)
  std::map<std::string, std::string> credentials_;       // worker id -> credential digest
  std::map<std::string, std::string> credential_owner_;  // credential digest -> worker id
  std::map<std::string, int64_t> log_offsets_;
  int64_t next_job_ = 1;
  int64_t next_sweep_ = 1;
  std::map<std::string, v1::Webhook> webhooks_;
  int64_t next_webhook_ = 1;
  int64_t next_event_ = 1;
};

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_JOB_TABLE_H_
