// The coordinator's durable state in RocksDB (write-ahead log on): jobs, their events, workers,
// the checkpoint catalogue, idempotency keys and the job counter. Every state transition is one
// atomic WriteBatch written with sync, so a crash or kill -9 after a reply loses nothing.
//
// Keys: job/<id>, event/<job id>/<seq, 12 digits>, worker/<id>, ckpt/<id>, request/<key>,
// logoff/<job>/<attempt>/<worker>, cred/<worker id> (its heartbeat credential), sweep/<id>,
// quota/<kind>/<name>, webhook/<id>, outbox/<seq, 16 digits>/<webhook id> (deliveries not made
// yet: webhooks.h), meta/next_job, meta/next_sweep, meta/next_webhook, meta/next_event.
#ifndef LOOM_COORDINATOR_STATE_STORE_H_
#define LOOM_COORDINATOR_STATE_STORE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "loom/v1/control.pb.h"

namespace rocksdb {
class DB;
class Status;
class WriteBatch;
}  // namespace rocksdb

namespace loom::coordinator {

// A write refused because the data directory's filesystem is full: ResourceExhausted with this
// payload, which the REST API answers with 507 Insufficient Storage.
inline constexpr char kStorageFullPayload[] = "type.loom.dev/storage-full";
absl::Status StorageFullError(absl::string_view detail);
bool IsStorageFull(const absl::Status& s);

struct LoadedState {
  std::map<std::string, v1::Job> jobs;
  std::map<std::string, int64_t> event_counts;  // job id -> events stored
  std::map<std::string, v1::Worker> workers;
  std::map<std::string, v1::CheckpointEntry> checkpoints;
  std::map<std::string, std::string> request_ids;  // idempotency key -> job id
  int64_t next_job = 1;
  std::map<std::string, int64_t> log_offsets;  // "<job>/<attempt>/<worker>" -> log bytes received
  std::map<std::string, std::string> credentials;  // worker id -> heartbeat credential
  std::map<std::string, v1::Sweep> sweeps;
  std::map<std::string, v1::Quota> quotas;  // "<kind>/<name>" -> quota
  int64_t next_sweep = 1;
  std::map<std::string, v1::Webhook> webhooks;
  int64_t next_webhook = 1;
  int64_t next_event = 1;
};

class StateStore {
 public:
  class Batch {
   public:
    Batch();
    ~Batch();
    void PutJob(const v1::Job& job);
    void PutEvent(const std::string& job_id, const v1::JobEvent& event);
    void PutWorker(const v1::Worker& worker);
    void PutCheckpoint(const v1::CheckpointEntry& entry);
    void DeleteCheckpoint(const std::string& id);
    void PutRequestId(const std::string& key, const std::string& job_id);
    void PutNextJob(int64_t next);
    void PutLogOffset(const std::string& key, int64_t offset);
    void PutCredential(const std::string& worker_id, const std::string& token);
    void DeleteCredential(const std::string& worker_id);
    void PutSweep(const v1::Sweep& sweep);
    void PutNextSweep(int64_t next);
    void PutQuota(const v1::Quota& quota);
    void DeleteQuota(const std::string& kind, const std::string& name);
    void PutWebhook(const v1::Webhook& webhook);
    void DeleteWebhook(const std::string& id);
    void PutNextWebhook(int64_t next);
    void PutNextEvent(int64_t next);
    void PutDelivery(const v1::WebhookDelivery& delivery);
    void DeleteDelivery(const v1::WebhookDelivery& delivery);
    bool empty() const;

   private:
    friend class StateStore;
    std::unique_ptr<rocksdb::WriteBatch> batch_;
  };

  static absl::StatusOr<std::unique_ptr<StateStore>> Open(const std::string& dir);
  ~StateStore();

  absl::StatusOr<LoadedState> Load();
  absl::StatusOr<std::vector<v1::JobEvent>> Events(const std::string& job_id);
  // The outbox: deliveries not made yet, oldest event first (Load leaves them out).
  absl::StatusOr<std::vector<v1::WebhookDelivery>> Deliveries();
  // sync: fsync the WAL before returning (state transitions); progress updates skip it.
  absl::Status Commit(Batch& batch, bool sync);

  // Group commit: a writer that committed without sync under its own lock calls this after
  // releasing it, with LastSequence() taken after its write. Returns once the log is on disk
  // through that write: one caller fsyncs for everyone waiting (RocksDB's SyncWAL), the others
  // find their writes covered. *led: whether this caller ran the fsync.
  uint64_t LastSequence() const;
  absl::Status SyncLogThrough(uint64_t sequence, bool* led = nullptr);

  // After a write failed for lack of space RocksDB refuses every write (its background error)
  // until it has recovered, by itself once 4 MiB are free (Open) or through DB::Resume(), which
  // answers Busy while its own recovery is under way. Full(): such an error is outstanding.
  // Resume(): OK when writes work again (also when nothing was wrong).
  bool Full() const { return full_.load(); }
  absl::Status Resume();

 private:
  StateStore() = default;
  absl::Status Checked(const rocksdb::Status& s, const std::string& what);
  std::unique_ptr<rocksdb::DB> db_;
  std::atomic<bool> full_{false};
  std::mutex sync_mu_;
  std::condition_variable sync_done_;
  bool syncing_ = false;  // a caller is in SyncWAL
  uint64_t synced_ = 0;   // the log is on disk through this sequence number
};

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_STATE_STORE_H_
