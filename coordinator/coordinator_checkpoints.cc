// The checkpoint catalogue: what attempts report and resume from, and retention (decided under
// the lock, carried out after the commit without it).
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "coordinator/coordinator.h"
#include "coordinator/paging.h"
#include "coordinator/submit_validation.h"
#include "storage/checkpoint.h"
#include "storage/checkpoint_store.h"

namespace fs = std::filesystem;

namespace loom::coordinator {

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

std::vector<std::string> Coordinator::PinnedBy(const std::string& checkpoint_id) const {
  std::vector<std::string> out;
  for (const auto& [id, job] : table_->jobs()) {
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
    auto job = table_->jobs().find(c.job_id());
    return job != table_->jobs().end() && job->second.submitted_by() == owner;
  };
  for (const auto& [id, c] : table_->checkpoints()) {
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

void Coordinator::CatalogueCheckpoint(Txn& txn, v1::Job& job, int64_t step,
                                      const std::string& path) {
  const std::string cid = CheckpointId(job.id(), step);
  if (table_->checkpoints().count(cid)) return;
  // A worker names the step; where it is follows from the job (retention deletes what the
  // catalogue holds: a report naming another job's directory must not get it deleted).
  const std::string& root = job.spec().checkpoint().dir();
  const std::string name = storage::CheckpointDirName(step);
  if (step < 0 || (path != root + "/" + name && path != (fs::path(root) / name).string())) {
    table_->AddEvent(txn, job, std::nullopt,
                     absl::StrCat("a report named checkpoint ", path.substr(0, 200), " for step ",
                                  step, ", not under the job's ", root, ": ignored"));
    txn.batch.PutJob(job);
    return;
  }
  table_->Save(txn, job);
  table_->SaveCheckpoint(txn, cid);
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
  table_->checkpoints()[cid] = e;
  txn.batch.PutCheckpoint(e);
  // Oldest first by step: a checkpoint catalogued late (found at resume) goes in its place.
  job.add_checkpoints(cid);
  std::sort(job.mutable_checkpoints()->begin(), job.mutable_checkpoints()->end(),
            [this](const std::string& a, const std::string& b) {
              return table_->checkpoints()[a].step() < table_->checkpoints()[b].step();
            });
  table_->AddEvent(txn, job, std::nullopt, absl::StrCat("checkpoint at step ", step, ": ", path));
  txn.batch.PutJob(job);
}

// What the attempt's trainer restored from: skipped (damaged) checkpoints are marked in the
// catalogue, newer catalogued ones that vanished from disk too, so no later attempt picks them.
void Coordinator::ApplyResumeReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r) {
  auto mark = [&](int64_t step, const std::string& why) {
    const std::string cid = CheckpointId(job.id(), step);
    auto it = table_->checkpoints().find(cid);
    if (it != table_->checkpoints().end() && !it->second.damaged().empty()) return;
    table_->AddEvent(txn, job, std::nullopt,
                     absl::StrCat("checkpoint at step ", step, " skipped: ", why));
    if (it == table_->checkpoints().end()) return;
    table_->SaveCheckpoint(txn, cid);
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
  table_->Save(txn, job);
  const int64_t step = r.resumed().path().empty() ? 0 : r.resumed().step();
  rec->set_resumed_from(r.resumed().path().empty() ? "start" : r.resumed().path());
  for (const std::string& cid : job.checkpoints()) {
    auto it = table_->checkpoints().find(cid);
    std::error_code ec;
    if (it == table_->checkpoints().end() || it->second.step() <= step || it->second.deleted() ||
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
  table_->AddEvent(txn, job, std::nullopt,
                   r.resumed().path().empty() ? std::string("resumed from the start")
                                              : absl::StrCat("resumed from step ", step));
  txn.batch.PutJob(job);
}

// The job's spec.checkpoint.keep_last newest intact checkpoints and every keep_every-th stay;
// so does any checkpoint a non-terminal job starts from (init_from). The rest are marked
// deleted now (no new job can pin them) and removed from disk after the commit.
// Removed from disk once the retention decision is committed.
void Coordinator::Remove(Txn& txn, Removal removal) {
  txn.on_commit.push_back([this, r = std::move(removal)] { pending_deletes_.push_back(r); });
}

void Coordinator::ApplyRetention(Txn& txn, const std::string& job_id) {
  auto jit = table_->jobs().find(job_id);
  if (jit == table_->jobs().end()) return;
  const v1::CheckpointConfig& cfg = jit->second.spec().checkpoint();
  const int keep_last = cfg.keep_last() > 0 ? cfg.keep_last() : 3;
  std::vector<v1::CheckpointEntry*> intact;
  for (const std::string& cid : jit->second.checkpoints()) {
    auto it = table_->checkpoints().find(cid);
    if (it != table_->checkpoints().end() && !it->second.deleted() &&
        it->second.damaged().empty()) {
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
    auto it = table_->checkpoints().find(cid);
    if (it == table_->checkpoints().end() || it->second.deleted() || keep.count(cid)) continue;
    v1::CheckpointEntry& e = it->second;
    if (cfg.keep_every() > 0 && e.step() % cfg.keep_every() == 0) continue;
    if (!PinnedBy(cid).empty()) continue;
    const std::string jobs_root = RemoteCheckpoints()
                                      ? options_.checkpoint_store + "/jobs/"
                                      : (fs::path(options_.storage_root) / "jobs").string() + "/";
    if (!absl::StartsWith(e.path(), jobs_root)) continue;  // never delete outside jobs/
    table_->SaveCheckpoint(txn, cid);
    e.set_deleted(true);
    txn.batch.PutCheckpoint(e);
    Remove(txn, {e.path()});
  }
  // Steps a fenced attempt committed but never reported, older than what is kept: garbage.
  if (intact.empty()) return;
  const int64_t oldest_kept = intact[first_kept]->step();
  if (RemoteCheckpoints()) {
    Removal sweep{cfg.dir(), oldest_kept, cfg.keep_every(), {}};
    for (const std::string& cid : jit->second.checkpoints()) {
      auto it = table_->checkpoints().find(cid);
      if (it != table_->checkpoints().end() && !it->second.deleted())
        sweep.catalogued.insert(it->second.step());
    }
    Remove(txn, std::move(sweep));
    return;
  }
  auto on_disk = storage::ListCheckpoints(cfg.dir());
  if (!on_disk.ok()) return;
  for (const storage::CheckpointRef& ref : *on_disk) {
    if (ref.step < oldest_kept && !table_->checkpoints().count(CheckpointId(job_id, ref.step)) &&
        (cfg.keep_every() == 0 || ref.step % cfg.keep_every() != 0)) {
      Remove(txn, {ref.dir});
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

const v1::CheckpointEntry* Coordinator::NewestIntactCheckpoint(const v1::Job& job) const {
  const v1::CheckpointEntry* newest = nullptr;
  for (const std::string& cid : job.checkpoints()) {
    auto c = table_->checkpoints().find(cid);
    if (c != table_->checkpoints().end() && !c->second.deleted() && c->second.damaged().empty() &&
        (newest == nullptr || c->second.step() > newest->step())) {
      newest = &c->second;
    }
  }
  return newest;
}

// Retention's removals, once their decision is on disk, without the lock: local directories here,
// an object store's on the remote remover's thread.
void Coordinator::CarryOutRemovals(std::vector<Removal> deletes) {
  // A heartbeat's retention decision may still wait for its group commit: no directory goes
  // before the decision to delete it is on disk.
  if (!deletes.empty() && !table_->store().SyncLogThrough(table_->store().LastSequence()).ok()) {
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

}  // namespace loom::coordinator
