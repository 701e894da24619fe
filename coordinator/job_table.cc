#include "coordinator/job_table.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "coordinator/credentials.h"
#include "coordinator/ids.h"

namespace loom::coordinator {

namespace {

// Its metric families, each series at 0 from the first scrape, so increase() sees the first
// failure (a series born at 1 has none).
void DeclareMetrics(metrics::Registry& r) {
  r.DeclareCounter("loom_coordinator_jobs_ended_total",
                   "Jobs that reached a terminal state (succeeded, failed, cancelled)");
  for (JobState s : {JobState::kSucceeded, JobState::kFailed, JobState::kCancelled}) {
    r.Increment("loom_coordinator_jobs_ended_total", 0, {{"state", std::string(JobStateName(s))}});
  }
  r.DeclareCounter("loom_coordinator_store_errors_total", "Failed RocksDB writes");
  r.Increment("loom_coordinator_store_errors_total", 0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobTable>> JobTable::Open(const std::string& state_dir,
                                                         std::shared_ptr<Clock> clock,
                                                         metrics::Registry& registry) {
  std::unique_ptr<JobTable> t(new JobTable(std::move(clock), registry));
  DeclareMetrics(registry);
  LOOM_ASSIGN_OR_RETURN(t->store_, StateStore::Open(state_dir));
  LOOM_RETURN_IF_ERROR(t->Load());
  LOOM_RETURN_IF_ERROR(t->DigestClearCredentials());
  LOOM_RETURN_IF_ERROR(t->MigrateCheckpointIds());
  return t;
}

absl::Status JobTable::Load() {
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
  webhooks_ = std::move(state.webhooks);
  next_webhook_ = state.next_webhook;
  next_event_ = state.next_event;
  return absl::OkStatus();
}

// Credentials stored in clear by an older coordinator: their digests replace them.
absl::Status JobTable::DigestClearCredentials() {
  StateStore::Batch upgrade;
  for (auto& [worker, stored] : credentials_) {
    if (absl::StartsWith(stored, kCredentialDigestPrefix)) continue;
    stored = CredentialDigest(stored);
    upgrade.PutCredential(worker, stored);
  }
  if (!upgrade.empty()) LOOM_RETURN_IF_ERROR(store_->Commit(upgrade, true));
  for (const auto& [worker, digest] : credentials_) credential_owner_[digest] = worker;
  return absl::OkStatus();
}

// State written before checkpoint ids were "<job>.<step>": catalogue keys, ids and parents,
// jobs' checkpoint lists and init_from are rewritten once, in one synced commit.
absl::Status JobTable::MigrateCheckpointIds() {
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

void JobTable::Save(Txn& txn, const v1::Job& job) {
  if (txn.jobs.count(job.id())) return;
  auto it = jobs_.find(job.id());
  txn.jobs[job.id()] = it == jobs_.end() ? std::nullopt : std::optional<v1::Job>(it->second);
  if (!txn.event_counts.count(job.id())) txn.event_counts[job.id()] = event_counts_[job.id()];
}

void JobTable::Save(Txn& txn, const std::string& worker_id) {
  if (txn.workers.count(worker_id)) return;
  auto it = workers_.find(worker_id);
  txn.workers[worker_id] =
      it == workers_.end() ? std::nullopt : std::optional<v1::Worker>(it->second);
}

void JobTable::SaveCheckpoint(Txn& txn, const std::string& id) {
  if (txn.checkpoints.count(id)) return;
  auto it = checkpoints_.find(id);
  txn.checkpoints[id] =
      it == checkpoints_.end() ? std::nullopt : std::optional<v1::CheckpointEntry>(it->second);
}

void JobTable::SaveCredential(Txn& txn, const std::string& worker_id) {
  if (txn.credentials.count(worker_id)) return;
  auto it = credentials_.find(worker_id);
  txn.credentials[worker_id] =
      it == credentials_.end() ? std::nullopt : std::optional<std::string>(it->second);
}

absl::Status JobTable::Commit(Txn& txn, bool sync) {
  // A job log or series append that found the disk full fails the change like a full store:
  // nothing of it is recorded, so the agent sends it all again.
  absl::Status s = txn.no_space           ? StorageFullError("a job log append")
                   : txn.progress.empty() ? absl::OkStatus()
                                          : store_->Commit(txn.progress, false);
  if (s.ok() && !txn.batch.empty()) s = store_->Commit(txn.batch, sync);
  if (IsStorageFull(s)) storage_full_ = true;
  if (s.ok() && !(txn.progress.empty() && txn.batch.empty())) storage_full_ = false;
  if (s.ok()) {
    for (auto& effect : txn.on_commit) effect();
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

void JobTable::Rollback(Txn& txn) {
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
  txn.on_commit.clear();
}

void JobTable::AddEvent(Txn& txn, v1::Job& job, std::optional<JobState> state,
                        const std::string& reason) {
  Save(txn, job);
  v1::JobEvent e;
  e.set_seq(event_counts_[job.id()]++);
  e.set_time_ms(clock_->NowMs());
  if (state) e.set_state(std::string(JobStateName(*state)));
  e.set_reason(reason);
  e.set_attempt(job.attempt());
  txn.batch.PutEvent(job.id(), e);
}

void JobTable::SetState(Txn& txn, v1::Job& job, JobState state, const std::string& reason) {
  Save(txn, job);
  SetJobState(job, state);
  job.set_reason(reason);
  if (state != JobState::kRunning) job.clear_serve();  // a serve job answers only while running
  job.set_update_time_ms(clock_->NowMs());
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
  if (IsTerminal(state) && on_terminal_) on_terminal_(txn, job);
  if (on_state_) on_state_(txn, job, state);
}

std::string JobTable::NextJobId(int64_t i) const {
  return absl::StrFormat("job-%06d", next_job_ + i);
}

std::string JobTable::NextSweepId() const { return absl::StrFormat("sweep-%06d", next_sweep_); }

void JobTable::TakeJobIds(Txn& txn, int64_t n) {
  txn.batch.PutNextJob(next_job_ + n);
  txn.on_commit.push_back([this, n] { next_job_ += n; });
}

void JobTable::TakeSweepId(Txn& txn) {
  txn.batch.PutNextSweep(next_sweep_ + 1);
  txn.on_commit.push_back([this] { ++next_sweep_; });
}

std::string JobTable::RequestId(const std::string& key) const {
  auto it = request_ids_.find(key);
  return it == request_ids_.end() ? "" : it->second;
}

void JobTable::PutRequestId(Txn& txn, const std::string& key, const std::string& id) {
  txn.batch.PutRequestId(key, id);
  txn.on_commit.push_back([this, key, id] { request_ids_[key] = id; });
}

void JobTable::PutSweep(Txn& txn, const v1::Sweep& sweep) {
  txn.batch.PutSweep(sweep);
  txn.on_commit.push_back([this, sweep] { sweeps_[sweep.id()] = sweep; });
}

void JobTable::PutQuota(Txn& txn, const v1::Quota& quota) {
  txn.batch.PutQuota(quota);
  v1::Quota stored = quota;
  stored.clear_used();
  txn.on_commit.push_back(
      [this, stored] { quotas_[absl::StrCat(stored.kind(), "/", stored.name())] = stored; });
}

void JobTable::DeleteQuota(Txn& txn, const std::string& kind, const std::string& name) {
  txn.batch.DeleteQuota(kind, name);
  txn.on_commit.push_back([this, key = absl::StrCat(kind, "/", name)] { quotas_.erase(key); });
}

std::string JobTable::NextWebhookId() const { return absl::StrFormat("wh-%06d", next_webhook_); }

void JobTable::PutWebhook(Txn& txn, const v1::Webhook& webhook) {
  if (webhook.id() == NextWebhookId()) {
    txn.batch.PutNextWebhook(next_webhook_ + 1);
    txn.on_commit.push_back([this] { ++next_webhook_; });
  }
  txn.batch.PutWebhook(webhook);
  txn.on_commit.push_back([this, webhook] { webhooks_[webhook.id()] = webhook; });
}

void JobTable::DeleteWebhook(Txn& txn, const std::string& id) {
  txn.batch.DeleteWebhook(id);
  txn.on_commit.push_back([this, id] { webhooks_.erase(id); });
}

int64_t JobTable::TakeEventSeq(Txn& txn) {
  const int64_t seq = next_event_++;
  txn.batch.PutNextEvent(next_event_);
  return seq;
}

void JobTable::PutDelivery(Txn& txn, const v1::WebhookDelivery& delivery) {
  txn.batch.PutDelivery(delivery);
}

std::string JobTable::WorkerOfDigest(const std::string& digest) const {
  auto it = credential_owner_.find(digest);
  return it == credential_owner_.end() ? "" : it->second;
}

std::string JobTable::DigestOf(const std::string& worker_id) const {
  auto it = credentials_.find(worker_id);
  return it == credentials_.end() ? "" : it->second;
}

void JobTable::SetCredential(Txn& txn, const std::string& worker_id, const std::string& digest) {
  RevokeCredential(txn, worker_id);
  SaveCredential(txn, worker_id);
  credentials_[worker_id] = digest;
  credential_owner_[digest] = worker_id;
  txn.batch.PutCredential(worker_id, digest);
}

void JobTable::RevokeCredential(Txn& txn, const std::string& worker_id) {
  auto it = credentials_.find(worker_id);
  if (it == credentials_.end()) return;
  SaveCredential(txn, worker_id);
  credential_owner_.erase(it->second);
  credentials_.erase(it);
  txn.batch.DeleteCredential(worker_id);
}

}  // namespace loom::coordinator
