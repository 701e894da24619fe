#include "coordinator/retention.h"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <utility>

#include "absl/strings/match.h"
#include "coordinator/ids.h"
#include "storage/checkpoint.h"
#include "storage/checkpoint_store.h"

namespace fs = std::filesystem;

namespace loom::coordinator {

Retention::Retention(JobTable& table, const std::string& storage_root,
                     const std::string& checkpoint_store)
    : table_(table),
      jobs_root_(checkpoint_store.empty() ? (fs::path(storage_root) / "jobs").string() + "/"
                                          : checkpoint_store + "/jobs/"),
      on_store_(!checkpoint_store.empty()) {}

Retention::~Retention() { Stop(); }

void Retention::Start() {
  remote_remover_ = std::thread([this] { RemoveRemotely(); });
}

void Retention::Stop() {
  {
    std::lock_guard<std::mutex> lock(remote_mu_);
    remote_stop_ = true;
  }
  remote_cv_.notify_all();
  if (remote_remover_.joinable()) remote_remover_.join();
}

std::vector<std::string> Retention::PinnedBy(const std::string& checkpoint_id) const {
  std::vector<std::string> out;
  for (const auto& [id, job] : table_.jobs()) {
    if (!IsTerminal(job) && job.request().init_from() == checkpoint_id) out.push_back(id);
  }
  return out;
}

void Retention::Recover() {
  for (const auto& [id, c] : table_.checkpoints()) {
    std::error_code ec;
    if (c.deleted() && fs::exists(c.path(), ec)) {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({c.path()});
    }
  }
}

void Retention::Remove(JobTable::Txn& txn, Removal removal) {
  txn.on_commit.push_back([this, r = std::move(removal)] {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(r);
  });
}

void Retention::Apply(JobTable::Txn& txn, const std::string& job_id) {
  auto jit = table_.jobs().find(job_id);
  if (jit == table_.jobs().end()) return;
  const v1::CheckpointConfig& cfg = jit->second.spec().checkpoint();
  const int keep_last = cfg.keep_last() > 0 ? cfg.keep_last() : 3;
  std::vector<v1::CheckpointEntry*> intact;
  for (const std::string& cid : jit->second.checkpoints()) {
    auto it = table_.checkpoints().find(cid);
    if (it != table_.checkpoints().end() && !it->second.deleted() && it->second.damaged().empty()) {
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
    auto it = table_.checkpoints().find(cid);
    if (it == table_.checkpoints().end() || it->second.deleted() || keep.count(cid)) continue;
    v1::CheckpointEntry& e = it->second;
    if (cfg.keep_every() > 0 && e.step() % cfg.keep_every() == 0) continue;
    if (!PinnedBy(cid).empty()) continue;
    if (!absl::StartsWith(e.path(), jobs_root_)) continue;  // never delete outside jobs/
    table_.SaveCheckpoint(txn, cid);
    e.set_deleted(true);
    txn.batch.PutCheckpoint(e);
    Remove(txn, {e.path()});
  }
  if (!intact.empty()) SweepUnreported(txn, jit->second, intact[first_kept]->step());
}

// Steps a fenced attempt committed but never reported, older than what is kept: garbage.
void Retention::SweepUnreported(JobTable::Txn& txn, const v1::Job& job, int64_t oldest_kept) {
  const v1::CheckpointConfig& cfg = job.spec().checkpoint();
  if (on_store_) {
    Removal sweep{cfg.dir(), oldest_kept, cfg.keep_every(), {}};
    for (const std::string& cid : job.checkpoints()) {
      auto it = table_.checkpoints().find(cid);
      if (it != table_.checkpoints().end() && !it->second.deleted())
        sweep.catalogued.insert(it->second.step());
    }
    Remove(txn, std::move(sweep));
    return;
  }
  auto on_disk = storage::ListCheckpoints(cfg.dir());
  if (!on_disk.ok()) return;
  for (const storage::CheckpointRef& ref : *on_disk) {
    if (ref.step < oldest_kept && !table_.checkpoints().count(CheckpointId(job.id(), ref.step)) &&
        (cfg.keep_every() == 0 || ref.step % cfg.keep_every() != 0)) {
      Remove(txn, {ref.dir});
    }
  }
}

void Retention::CarryOut() {
  std::vector<Removal> local;
  {
    std::lock_guard<std::mutex> lock(mu_);
    local.swap(pending_);
  }
  if (local.empty()) return;
  // No directory goes before the decision to delete it is on disk.
  if (!table_.store().SyncLogThrough(table_.store().LastSequence()).ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.insert(pending_.end(), local.begin(), local.end());
    return;
  }
  const auto remote = std::stable_partition(local.begin(), local.end(), [](const Removal& r) {
    return !storage::IsRemoteLocation(r.dir);
  });
  if (remote != local.end()) {
    std::lock_guard<std::mutex> lock(remote_mu_);
    remote_.insert(remote_.end(), std::make_move_iterator(remote),
                   std::make_move_iterator(local.end()));
    remote_cv_.notify_all();
  }
  local.erase(remote, local.end());
  Delete(local);
}

void Retention::RemoveRemotely() {
  for (;;) {
    std::vector<Removal> batch;
    {
      std::unique_lock<std::mutex> lock(remote_mu_);
      remote_cv_.wait(lock, [this] { return remote_stop_ || !remote_.empty(); });
      if (remote_stop_) return;
      batch.swap(remote_);
    }
    Delete(batch);
  }
}

void Retention::Delete(const std::vector<Removal>& removals) {
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

}  // namespace loom::coordinator
