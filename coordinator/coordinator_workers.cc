// Workers: registration and credentials, listing, and loss (silence, restarts, the coordinator's
// own outages).
#include <algorithm>
#include <chrono>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "coordinator/coordinator.h"
#include "coordinator/credentials.h"
#include "coordinator/paging.h"
#include "coordinator/records.h"
#include "coordinator/submit_validation.h"

namespace loom::coordinator {

absl::StatusOr<v1::ListWorkersResponse> Coordinator::ListWorkers(int page_size,
                                                                 const std::string& page_token) {
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  LOOM_ASSIGN_OR_RETURN(const std::string after, DecodePageToken(page_token, "workers", ""));
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListWorkersResponse out;
  for (auto it = table_->workers().upper_bound(after); it != table_->workers().end(); ++it) {
    const auto& [id, w] = *it;
    if (out.workers_size() == page_size) {
      out.set_next_page_token(EncodePageToken("workers", "", out.workers(page_size - 1).id()));
      break;
    }
    v1::Worker* o = out.add_workers();
    *o = w;
    o->set_used_slots(UsedSlots(id));
  }
  return out;
}

absl::StatusOr<std::string> Coordinator::WorkerForCredential(const std::string& credential) {
  // Looked up by digest: the map's comparisons can time only the digest, which tells nothing
  // about the credential.
  const std::string digest = CredentialDigest(credential);
  std::lock_guard<std::mutex> lock(mutex_);
  std::string worker = table_->WorkerOfDigest(digest);
  if (worker.empty()) {
    return absl::UnauthenticatedError(
        "invalid or revoked worker credential: register again with the enrolment token");
  }
  return worker;
}

namespace {

bool Printable(const std::string& s, size_t max) {
  if (s.size() > max) return false;
  for (unsigned char c : s)
    if (c < 0x20 || c > 0x7e) return false;
  return true;
}

// A worker's GPU inventory: one rank per GPU, so never more slots than GPUs.
absl::Status CheckGpus(const v1::RegisterWorkerRequest& request) {
  if (request.gpus_size() > 256) return FieldError("gpus", "at most 256 GPUs");
  std::set<int32_t> seen;
  for (int i = 0; i < request.gpus_size(); ++i) {
    const v1::Gpu& g = request.gpus(i);
    const std::string field = absl::StrCat("gpus[", i, "]");
    if (g.index() < 0 || g.index() > 1023 || !seen.insert(g.index()).second) {
      return FieldError(field + ".index", "must be distinct, in 0..1023");
    }
    if (!Printable(g.uuid(), 96)) return FieldError(field + ".uuid", "at most 96 printable ASCII");
    if (!Printable(g.model(), 128))
      return FieldError(field + ".model", "at most 128 printable ASCII");
    if (g.memory_bytes() < 0) return FieldError(field + ".memory_bytes", "must be >= 0");
  }
  if (request.gpus_size() > 0 && request.slots() > request.gpus_size()) {
    return FieldError("slots", absl::StrCat("exceeds the worker's ", request.gpus_size(),
                                            " GPUs (one GPU per rank)"));
  }
  return absl::OkStatus();
}

absl::Status CheckRegisterRequest(const v1::RegisterWorkerRequest& request) {
  if (request.slots() < 1 || request.slots() > 4096)
    return FieldError("slots", "must be in 1..4096");
  if (request.address().empty() || request.address().size() > 255) {
    return FieldError("address", "is required (host name or IP ranks are reachable at)");
  }
  if (request.name().size() > 128) return FieldError("name", "at most 128 characters");
  if (request.labels_size() > 32) return FieldError("labels", "at most 32 labels");
  for (const auto& [k, v] : request.labels()) {
    if (!IsToken(k, 63) || !IsToken(v, 63)) return FieldError("labels", "bad label");
  }
  if (!request.worker_id().empty() && !IsValidId(request.worker_id())) {
    return FieldError("worker_id", "malformed");
  }
  return CheckGpus(request);
}

}  // namespace

// The id the registering worker gets: a fresh one, its own again, or a new worker's chosen one.
// An agent that registers its known id again restarted: the attempts it ran failed.
absl::StatusOr<std::string> Coordinator::RegisteringIdLocked(
    Txn& txn, const v1::RegisterWorkerRequest& request) {
  std::string id = request.worker_id();
  auto existing = table_->workers().find(id);
  if (id.empty()) {
    std::random_device rd;
    do {
      id = absl::StrFormat("w-%08x", rd());
    } while (table_->workers().count(id));
    return id;
  }
  if (existing == table_->workers().end()) return id;
  // A live worker's id is taken over only by the holder of its credential (its own agent
  // after a restart); a lost worker's credential is already revoked.
  const std::string digest = table_->DigestOf(id);
  if (IsAlive(existing->second) && !digest.empty() &&
      !SameDigest(CredentialDigest(request.credential()), digest)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker id '", id, "' belongs to a live worker; re-registering it needs its credential"));
  }
  // An agent that restarted lost its ranks (they die with it): their attempts failed.
  FailAttemptsOn(txn, id, absl::StrCat("worker ", id, " restarted"));
  reported_running_[id].clear();
  return id;
}

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::Register(
    const v1::RegisterWorkerRequest& request) {
  LOOM_RETURN_IF_ERROR(CheckRegisterRequest(request));
  // Drawn before anything changes: the only copy in clear is the agent's.
  LOOM_ASSIGN_OR_RETURN(const std::string credential, NewCredential());
  std::lock_guard<std::mutex> lock(mutex_);
  Txn txn;
  LOOM_ASSIGN_OR_RETURN(const std::string id, RegisteringIdLocked(txn, request));
  table_->Save(txn, id);
  v1::Worker& w = table_->workers()[id];
  const int64_t now = NowMs();
  if (w.register_time_ms() == 0) w.set_register_time_ms(now);
  w.set_id(id);
  w.set_name(request.name().empty() ? id : request.name());
  w.set_address(request.address());
  w.set_slots(request.slots());
  *w.mutable_labels() = request.labels();
  *w.mutable_gpus() = request.gpus();
  SetWorkerState(w, WorkerState::kAlive);
  w.set_last_heartbeat_ms(now);
  heard_steady_[id] = SteadyMs();
  txn.batch.PutWorker(w);
  table_->SetCredential(txn, id, CredentialDigest(credential));  // the old one stops working
  LOOM_RETURN_IF_ERROR(table_->Commit(txn));
  heard_since_start_.insert(id);
  wake_.notify_all();
  v1::RegisterWorkerResponse r;
  r.set_worker_id(id);
  r.set_heartbeat_interval_ms(options_.heartbeat_interval_ms);
  r.set_credential(credential);
  r.set_lease_ms(options_.lease_ms);
  r.set_max_body_bytes(options_.max_body_bytes);
  return r;
}

void Coordinator::FailAttemptsOn(Txn& txn, const std::string& worker_id, const std::string& reason,
                                 int64_t not_before_ms) {
  for (auto& [id, job] : table_->jobs()) {
    if (IsActive(job) && PlacementOf(job, worker_id) != nullptr &&
        !Contains(job.finished_workers(), worker_id)) {
      FailAttempt(txn, job, reason, Failure::kInfra, not_before_ms);
    }
  }
}

void Coordinator::MarkWorkerLost(Txn& txn, v1::Worker& worker, const std::string& reason) {
  table_->Save(txn, worker.id());
  SetWorkerState(worker, WorkerState::kLost);
  txn.batch.PutWorker(worker);
  registry_.Increment("loom_coordinator_workers_lost_total");
  reported_running_[worker.id()].clear();
  table_->RevokeCredential(txn, worker.id());
  // Its ranks stop themselves when their lease runs out, at the latest lease_ms after the last
  // heartbeat that reached here; the termination grace covers a rank that was slow to die.
  // On the steady clock; the jobs carry it as wall-clock time (not_before_ms) for people.
  const int64_t steady = SteadyMs();
  const int64_t lapsed = HeardAt(worker.id()) + options_.lease_ms;
  const int64_t fence = std::max(steady, lapsed) + options_.term_grace_ms;
  FailAttemptsOn(txn, worker.id(), absl::StrCat("worker ", worker.id(), " ", reason),
                 NowMs() + (fence - steady));
}

int Coordinator::UsedSlots(const std::string& worker_id) const {
  int used = 0;
  std::set<std::pair<std::string, int>> counted;
  for (const auto& [id, job] : table_->jobs()) {
    if (!IsActive(job) || Contains(job.finished_workers(), worker_id)) continue;
    if (const v1::Placement* p = PlacementOf(job, worker_id)) {
      used += p->ranks_size();
      counted.insert({id, job.attempt()});
    }
  }
  auto r = reported_running_.find(worker_id);
  if (r != reported_running_.end()) {
    for (const auto& [attempt, ranks] : r->second) {
      if (!counted.count(attempt)) used += ranks;  // stopping ranks of an old attempt
    }
  }
  return used;
}

int64_t Coordinator::HeardAt(const std::string& worker) const {
  auto it = heard_steady_.find(worker);
  return it == heard_steady_.end() ? 0 : it->second;
}

void Coordinator::MarkSilentWorkersLost(Txn& txn) {
  const int64_t steady = SteadyMs();
  if (AllWorkersSilent(steady)) return;
  for (auto& [id, w] : table_->workers()) {
    const int64_t silent_since = std::max(HeardAt(id), hold_ended_ms_);
    if (IsAlive(w) && steady - silent_since > options_.lost_after_ms) {
      MarkWorkerLost(txn, w,
                     absl::StrCat("lost: no heartbeat for ", (steady - HeardAt(id)) / 1000, " s"));
    }
  }
}

// Every alive worker silent at once, and still within the lease of the newest heartbeat: more
// likely this coordinator's link is cut than every node gone at once. Marking them lost would
// fail every running attempt although their ranks train on; once the lease has lapsed they have
// stopped either way, and loss detection resumes (the fence is the same: last heartbeat + lease).
// `now` is the steady clock.
bool Coordinator::AllWorkersSilent(int64_t now) {
  int alive = 0;
  int64_t newest = 0;
  for (const auto& [id, w] : table_->workers()) {
    if (!IsAlive(w)) continue;
    ++alive;
    newest = std::max(newest, HeardAt(id));
  }
  const bool hold = options_.all_silent_min_workers > 0 &&
                    alive >= options_.all_silent_min_workers &&
                    now - newest > options_.lost_after_ms / 2 && now - newest <= options_.lease_ms;
  if (hold && !holding_loss_detection_) {
    std::cerr << "coordinator: all " << alive << " alive workers silent for "
              << (now - newest) / 1000 << " s: holding loss detection (a partition of this "
              << "coordinator?) until the lease lapses\n";
  }
  if (!hold && holding_loss_detection_ && now - newest <= options_.lease_ms) {
    // Someone was heard: the link is back, and the others' beats follow within a probe or two.
    // They get lost_after_ms from now (their fence still counts from their last heartbeat).
    hold_ended_ms_ = now;
  }
  holding_loss_detection_ = hold;
  registry_.Set("loom_coordinator_loss_detection_held", hold ? 1 : 0);
  return hold;
}

// A coordinator that could not run (SIGSTOP, a VM pause, a swap storm) heard nobody meanwhile:
// that silence is its own, so alive workers get it back before loss detection. Measured on the
// steady clock, which keeps counting through a pause (and is not the injected wall clock).
void Coordinator::ForgiveOwnOutage() {
  const auto now = std::chrono::steady_clock::now();
  const auto last = last_tick_;
  last_tick_ = now;
  if (last == std::chrono::steady_clock::time_point{}) return;
  const int64_t gap = std::chrono::duration_cast<std::chrono::milliseconds>(now - last).count();
  if (gap <= std::max(2000, 2 * options_.heartbeat_interval_ms)) return;
  const int64_t wall = NowMs(), steady = SteadyMs();
  for (auto& [id, w] : table_->workers()) {
    if (!IsAlive(w)) continue;
    w.set_last_heartbeat_ms(std::min(wall, w.last_heartbeat_ms() + gap));
    heard_steady_[id] = std::min(steady, HeardAt(id) + gap);
  }
  registry_.Increment("loom_coordinator_outages_forgiven_total");
}

}  // namespace loom::coordinator
