// The checkpoint catalogue: where a job's checkpoints go, what attempts report and resume from,
// and what is listed (retention itself: retention.h).
#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

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
    for (const std::string& j : retention_->PinnedBy(c->id())) e->add_pinned_by(j);
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

std::string Coordinator::CheckpointDirFor(const std::string& id, int64_t now) const {
  if (!RemoteCheckpoints()) {
    return (fs::path(options_.storage_root) / "jobs" / id / "checkpoints").string();
  }
  return absl::StrCat(options_.checkpoint_store, "/jobs/", id, "-", now, "/checkpoints");
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

}  // namespace loom::coordinator
