#include "coordinator/state_store.h"

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include <algorithm>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace loom::coordinator {
namespace {

absl::Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("rocksdb ", what, ": ", s.ToString()));
}

std::string EventKey(const std::string& job_id, int64_t seq) {
  return absl::StrFormat("event/%s/%012d", job_id, seq);
}

std::string DeliveryKey(const v1::WebhookDelivery& d) {
  return absl::StrFormat("outbox/%016d/%s", d.seq(), d.webhook_id());
}

template <typename M>
absl::Status ParseValue(const rocksdb::Slice& key, const rocksdb::Slice& value, M* out) {
  if (!out->ParseFromArray(value.data(), static_cast<int>(value.size()))) {
    return absl::DataLossError(absl::StrCat("state store: cannot parse ", key.ToString()));
  }
  return absl::OkStatus();
}

bool NoSpace(const rocksdb::Status& s) {
  return s.IsNoSpace() || s.ToString().find("No space left on device") != std::string::npos;
}

}  // namespace

absl::Status StorageFullError(absl::string_view detail) {
  absl::Status full = absl::ResourceExhaustedError(
      absl::StrCat("the coordinator's data directory is full (", detail,
                   "): nothing was stored; the coordinator resumes by itself once there is room"));
  full.SetPayload(kStorageFullPayload, absl::Cord("507"));
  return full;
}

bool IsStorageFull(const absl::Status& s) { return s.GetPayload(kStorageFullPayload).has_value(); }

// A write's status; a full filesystem becomes ResourceExhausted (507 for users) and marks the
// store full until Resume() succeeds.
absl::Status StateStore::Checked(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) {
    full_.store(false);  // RocksDB recovered by itself: writes work again
    return absl::OkStatus();
  }
  if (!NoSpace(s) && !full_.load()) return FromRocks(s, what);
  full_.store(true);
  return StorageFullError(absl::StrCat("rocksdb ", what, ": ", s.ToString()));
}

absl::Status StateStore::Resume() {
  if (!full_.load()) return absl::OkStatus();
  const rocksdb::Status s = db_->Resume();
  if (!s.ok()) return Checked(s, "resume");
  full_.store(false);
  return absl::OkStatus();
}

StateStore::Batch::Batch() : batch_(std::make_unique<rocksdb::WriteBatch>()) {}
StateStore::Batch::~Batch() = default;

void StateStore::Batch::PutJob(const v1::Job& job) {
  v1::Job stored = job;
  stored.clear_events();  // events live under their own keys
  batch_->Put(absl::StrCat("job/", job.id()), stored.SerializeAsString());
}
void StateStore::Batch::PutEvent(const std::string& job_id, const v1::JobEvent& event) {
  batch_->Put(EventKey(job_id, event.seq()), event.SerializeAsString());
}
void StateStore::Batch::PutWorker(const v1::Worker& worker) {
  batch_->Put(absl::StrCat("worker/", worker.id()), worker.SerializeAsString());
}
void StateStore::Batch::PutCheckpoint(const v1::CheckpointEntry& entry) {
  batch_->Put(absl::StrCat("ckpt/", entry.id()), entry.SerializeAsString());
}
void StateStore::Batch::DeleteCheckpoint(const std::string& id) {
  batch_->Delete(absl::StrCat("ckpt/", id));
}
void StateStore::Batch::PutRequestId(const std::string& key, const std::string& job_id) {
  batch_->Put(absl::StrCat("request/", key), job_id);
}
void StateStore::Batch::PutNextJob(int64_t next) {
  batch_->Put("meta/next_job", std::to_string(next));
}
void StateStore::Batch::PutLogOffset(const std::string& key, int64_t offset) {
  batch_->Put(absl::StrCat("logoff/", key), std::to_string(offset));
}
void StateStore::Batch::PutCredential(const std::string& worker_id, const std::string& token) {
  batch_->Put(absl::StrCat("cred/", worker_id), token);
}
void StateStore::Batch::DeleteCredential(const std::string& worker_id) {
  batch_->Delete(absl::StrCat("cred/", worker_id));
}
void StateStore::Batch::PutSweep(const v1::Sweep& sweep) {
  batch_->Put(absl::StrCat("sweep/", sweep.id()), sweep.SerializeAsString());
}
void StateStore::Batch::PutNextSweep(int64_t next) {
  batch_->Put("meta/next_sweep", std::to_string(next));
}
void StateStore::Batch::PutQuota(const v1::Quota& quota) {
  v1::Quota stored = quota;
  stored.clear_used();
  batch_->Put(absl::StrCat("quota/", quota.kind(), "/", quota.name()), stored.SerializeAsString());
}
void StateStore::Batch::DeleteQuota(const std::string& kind, const std::string& name) {
  batch_->Delete(absl::StrCat("quota/", kind, "/", name));
}
void StateStore::Batch::PutWebhook(const v1::Webhook& webhook) {
  batch_->Put(absl::StrCat("webhook/", webhook.id()), webhook.SerializeAsString());
}
void StateStore::Batch::DeleteWebhook(const std::string& id) {
  batch_->Delete(absl::StrCat("webhook/", id));
}
void StateStore::Batch::PutNextWebhook(int64_t next) {
  batch_->Put("meta/next_webhook", std::to_string(next));
}
void StateStore::Batch::PutNextEvent(int64_t next) {
  batch_->Put("meta/next_event", std::to_string(next));
}
void StateStore::Batch::PutDelivery(const v1::WebhookDelivery& delivery) {
  batch_->Put(DeliveryKey(delivery), delivery.SerializeAsString());
}
void StateStore::Batch::DeleteDelivery(const v1::WebhookDelivery& delivery) {
  batch_->Delete(DeliveryKey(delivery));
}
bool StateStore::Batch::empty() const { return batch_->Count() == 0; }

absl::StatusOr<std::unique_ptr<StateStore>> StateStore::Open(const std::string& dir) {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.paranoid_checks = true;
  // After a full disk RocksDB recovers by itself (its SstFileManager polls every 5 s) once the
  // filesystem has a memtable's size free: 4 MiB instead of the default 64 (the state is small).
  options.write_buffer_size = 4 << 20;
  // No preallocated log space: a full disk shows at the next write (507, the storage_full gauge),
  // not megabytes later at an unforeseeable log roll or flush.
  options.allow_fallocate = false;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, dir, &db);
  if (!s.ok())
    return absl::UnavailableError(absl::StrCat("state store '", dir, "': ", s.ToString()));
  std::unique_ptr<StateStore> store(new StateStore());
  store->db_.reset(db);
  return store;
}

StateStore::~StateStore() = default;

absl::StatusOr<LoadedState> StateStore::Load() {
  LoadedState state;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string key = it->key().ToString();
    if (key.rfind("job/", 0) == 0) {
      v1::Job job;
      if (auto s = ParseValue(it->key(), it->value(), &job); !s.ok()) return s;
      state.jobs[job.id()] = std::move(job);
    } else if (key.rfind("event/", 0) == 0) {
      const size_t slash = key.rfind('/');
      state.event_counts[key.substr(6, slash - 6)]++;
    } else if (key.rfind("worker/", 0) == 0) {
      v1::Worker w;
      if (auto s = ParseValue(it->key(), it->value(), &w); !s.ok()) return s;
      state.workers[w.id()] = std::move(w);
    } else if (key.rfind("ckpt/", 0) == 0) {
      v1::CheckpointEntry c;
      if (auto s = ParseValue(it->key(), it->value(), &c); !s.ok()) return s;
      state.checkpoints[c.id()] = std::move(c);
    } else if (key.rfind("request/", 0) == 0) {
      state.request_ids[key.substr(8)] = it->value().ToString();
    } else if (key.rfind("logoff/", 0) == 0) {
      int64_t v = 0;
      if (absl::SimpleAtoi(it->value().ToString(), &v)) state.log_offsets[key.substr(7)] = v;
    } else if (key.rfind("cred/", 0) == 0) {
      state.credentials[key.substr(5)] = it->value().ToString();
    } else if (key.rfind("sweep/", 0) == 0) {
      v1::Sweep sw;
      if (auto s = ParseValue(it->key(), it->value(), &sw); !s.ok()) return s;
      state.sweeps[sw.id()] = std::move(sw);
    } else if (key.rfind("quota/", 0) == 0) {
      v1::Quota q;
      if (auto s = ParseValue(it->key(), it->value(), &q); !s.ok()) return s;
      state.quotas[absl::StrCat(q.kind(), "/", q.name())] = std::move(q);
    } else if (key.rfind("webhook/", 0) == 0) {
      v1::Webhook w;
      if (auto s = ParseValue(it->key(), it->value(), &w); !s.ok()) return s;
      state.webhooks[w.id()] = std::move(w);
    } else if (key == "meta/next_webhook" || key == "meta/next_event") {
      int64_t* next = key == "meta/next_event" ? &state.next_event : &state.next_webhook;
      if (!absl::SimpleAtoi(it->value().ToString(), next)) {
        return absl::DataLossError(absl::StrCat("state store: bad ", key));
      }
    } else if (key == "meta/next_sweep") {
      if (!absl::SimpleAtoi(it->value().ToString(), &state.next_sweep)) {
        return absl::DataLossError("state store: bad meta/next_sweep");
      }
    } else if (key == "meta/next_job") {
      if (!absl::SimpleAtoi(it->value().ToString(), &state.next_job)) {
        return absl::DataLossError("state store: bad meta/next_job");
      }
    }
  }
  if (auto s = FromRocks(it->status(), "scan"); !s.ok()) return s;
  return state;
}

absl::StatusOr<std::vector<v1::JobEvent>> StateStore::Events(const std::string& job_id) {
  std::vector<v1::JobEvent> events;
  const std::string prefix = absl::StrCat("event/", job_id, "/");
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    v1::JobEvent e;
    if (auto s = ParseValue(it->key(), it->value(), &e); !s.ok()) return s;
    events.push_back(std::move(e));
  }
  if (auto s = FromRocks(it->status(), "scan"); !s.ok()) return s;
  return events;
}

absl::StatusOr<std::vector<v1::WebhookDelivery>> StateStore::Deliveries() {
  std::vector<v1::WebhookDelivery> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("outbox/"); it->Valid() && it->key().starts_with("outbox/"); it->Next()) {
    v1::WebhookDelivery d;
    if (auto s = ParseValue(it->key(), it->value(), &d); !s.ok()) return s;
    out.push_back(std::move(d));
  }
  if (auto s = FromRocks(it->status(), "scan"); !s.ok()) return s;
  return out;
}

absl::Status StateStore::Commit(Batch& batch, bool sync) {
  rocksdb::WriteOptions options;
  options.sync = sync;
  return Checked(db_->Write(options, batch.batch_.get()), "write");
}

uint64_t StateStore::LastSequence() const { return db_->GetLatestSequenceNumber(); }

absl::Status StateStore::SyncLogThrough(uint64_t sequence, bool* led) {
  if (led != nullptr) *led = false;
  std::unique_lock<std::mutex> lock(sync_mu_);
  while (synced_ < sequence && syncing_) sync_done_.wait(lock);
  if (synced_ >= sequence) return absl::OkStatus();
  // Leader: everything written so far goes to disk with this one fsync. Writers that come
  // while it runs wait for the next one.
  syncing_ = true;
  const uint64_t through = db_->GetLatestSequenceNumber();
  lock.unlock();
  const rocksdb::Status s = db_->SyncWAL();
  lock.lock();
  syncing_ = false;
  if (s.ok()) synced_ = std::max(synced_, through);
  sync_done_.notify_all();
  if (led != nullptr) *led = true;
  return Checked(s, "sync");
}

}  // namespace loom::coordinator
