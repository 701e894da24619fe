// Heartbeats: the agents' reports (logs, steps, progress, checkpoints, exits) validated and
// applied, and the assignments sent back.
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <functional>
#include <future>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/host_port.h"
#include "base/status_macros.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_logs.h"
#include "coordinator/records.h"
#include "coordinator/submit_validation.h"
#include "storage/checkpoint.h"

namespace fs = std::filesystem;

namespace loom::coordinator {

namespace {

bool HostsRankZero(const v1::Job& job, const std::string& worker_id) {
  for (const auto& p : job.placement()) {
    for (int r : p.ranks()) {
      if (r == 0) return p.worker_id() == worker_id;
    }
  }
  return false;
}

const v1::AttemptRecord* HistoryOf(const v1::Job& job, int attempt) {
  for (const auto& h : job.history()) {
    if (h.attempt() == attempt) return &h;
  }
  return nullptr;
}

}  // namespace

void Coordinator::RecordNewPart(Txn& txn, const std::string& key, int64_t offset, int64_t count,
                                const std::function<bool(int64_t)>& write) {
  int64_t& received = table_->log_offsets()[key];
  const std::optional<int64_t> first = NewPartStart(received, offset, count);
  if (!first || !write(*first)) return;  // nothing new, or not recorded: the agent resends it
  received = offset + count;
  txn.progress.PutLogOffset(key, received);
}

// One log per job, in arrival order; each agent sends whole lines of its attempt's log by byte
// offset, and the offsets received per (attempt, worker) drop resent chunks after a lost reply.
void Coordinator::AppendLog(Txn& txn, const v1::AttemptReport& report,
                            const std::string& worker_id) {
  if (report.log().empty() || report.attempt() < 1 || report.log_offset() < 0) return;
  const std::string key = absl::StrCat(report.job_id(), "/", report.attempt(), "/", worker_id);
  const std::string path = JobLogPath(options_.data_dir, report.job_id());
  RecordNewPart(txn, key, report.log_offset(), static_cast<int64_t>(report.log().size()),
                [&](int64_t first) {
                  return AppendCapped(txn, report.job_id(), path,
                                      absl::string_view(report.log()).substr(first));
                });
}

// A bound per job, as for the step series: the first max_job_log_bytes are kept; the chunk that
// crosses the bound is cut there and followed by a line that says so (and a job event); later
// ones are acknowledged and dropped. A broken or hostile agent cannot fill the disk.
bool Coordinator::AppendCapped(Txn& txn, const std::string& job_id, const std::string& path,
                               absl::string_view part) {
  const uintmax_t cap = static_cast<uintmax_t>(options_.max_job_log_bytes);
  std::error_code ec;
  const uintmax_t have = fs::exists(path, ec) ? fs::file_size(path, ec) : 0;
  if (ec || have >= cap) return !ec;
  if (have + part.size() <= cap) return AppendToFile(path, part, &txn.no_space);
  const std::string note = absl::StrCat("this job's log reached ", cap,
                                        " bytes (--max-job-log-bytes): later lines are dropped");
  // Cut at a character boundary: the log stays valid UTF-8 (no continuation byte left alone).
  size_t cut = static_cast<size_t>(cap - have);
  while (cut > 0 && cut < part.size() && (static_cast<unsigned char>(part[cut]) & 0xC0) == 0x80)
    --cut;
  if (!AppendToFile(path, absl::StrCat(part.substr(0, cut), "\n[coordinator] ", note, "\n"),
                    &txn.no_space)) {
    return false;
  }
  if (auto it = table_->jobs().find(job_id); it != table_->jobs().end()) {
    table_->AddEvent(txn, it->second, std::nullopt, note);
  }
  return true;
}

// Rank 0's step points by their index in the attempt's sequence: the points received per
// (attempt, worker) drop resent ones after a lost reply, as AppendLog does for bytes.
void Coordinator::AppendSteps(Txn& txn, const v1::AttemptReport& report,
                              const std::string& worker_id) {
  if (report.steps().empty() || report.attempt() < 1) return;
  const std::string key =
      absl::StrCat("steps:", report.job_id(), "/", report.attempt(), "/", worker_id);
  const std::string path = JobSeriesPath(options_.data_dir, report.job_id());
  RecordNewPart(txn, key, report.steps_offset(), report.steps_size(), [&](int64_t first) {
    // A bound per job, as a disk quota: a broken or hostile agent cannot fill the coordinator's
    // disk (a million steps take ~90 MB); beyond it the points are acknowledged and dropped.
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    if (!ec && size > kMaxSeriesBytes) return true;
    return AppendToFile(path, StepLines(report, first), &txn.no_space);
  });
}

namespace {

// The step points of a report: bounded in number, offset and values.
absl::Status CheckReportedSteps(const v1::AttemptReport& r) {
  if (r.steps_size() > Coordinator::kMaxStepsPerReport || r.steps_offset() < 0 ||
      r.steps_offset() > (int64_t{1} << 40)) {
    return FieldError("attempts.steps", absl::StrCat("at most ", Coordinator::kMaxStepsPerReport,
                                                     " points per report, from an offset >= 0"));
  }
  for (const auto& p : r.steps()) {
    if (p.step() < 0 || p.step() > (int64_t{1} << 40) || p.time_ms() < 0) {
      return FieldError("attempts.steps",
                        absl::StrCat("step ", p.step(), " or time ", p.time_ms(), " out of range"));
    }
  }
  return absl::OkStatus();
}

// Every checkpoint a report names (written, skipped, resumed from) is the step's directory in
// the job's own checkpoint directory `dir`.
absl::Status CheckReportedCheckpoints(const v1::AttemptReport& r, const std::string& dir) {
  auto check_path = [&](int64_t step, const std::string& path, const char* field) {
    const std::string want = (fs::path(dir) / storage::CheckpointDirName(step)).string();
    if (step < 0 || path != want) {
      return FieldError(field, absl::StrCat("checkpoint path '", path.substr(0, 200),
                                            "' is not the job's checkpoint directory for step ",
                                            step, " (", want, ")"));
    }
    return absl::OkStatus();
  };
  for (const auto& c : r.checkpoints()) {
    LOOM_RETURN_IF_ERROR(check_path(c.step(), c.path(), "attempts.checkpoints"));
  }
  for (const auto& s : r.skipped()) {
    LOOM_RETURN_IF_ERROR(check_path(s.step(), s.path(), "attempts.skipped"));
  }
  if (r.resumed().restored() && !r.resumed().path().empty()) {
    LOOM_RETURN_IF_ERROR(check_path(r.resumed().step(), r.resumed().path(), "attempts.resumed"));
  }
  return absl::OkStatus();
}

}  // namespace

// A report is refused whole (nothing applied) when it names an attempt the worker was not given
// or a checkpoint outside the job's own directory: a forged or broken agent changes nothing.
absl::Status Coordinator::ValidateReport(const v1::AttemptReport& r,
                                         const std::string& worker_id) const {
  if (!IsValidId(r.job_id())) return FieldError("attempts.job_id", "malformed");
  auto jit = table_->jobs().find(r.job_id());
  if (jit == table_->jobs().end())
    return absl::OkStatus();  // unknown job: the agent is told to stop it
  const v1::Job& job = jit->second;
  if (r.attempt() < 1 || r.attempt() > job.attempt()) {
    return FieldError("attempts.attempt",
                      absl::StrCat("job ", job.id(), " has no attempt ", r.attempt()));
  }
  const v1::AttemptRecord* h = HistoryOf(job, r.attempt());
  const bool placed = h != nullptr
                          ? std::find(h->worker_ids().begin(), h->worker_ids().end(), worker_id) !=
                                h->worker_ids().end()
                          : r.attempt() == job.attempt() && PlacementOf(job, worker_id) != nullptr;
  if (!placed) {
    return absl::PermissionDeniedError(absl::StrCat("attempt ", r.attempt(), " of job ", job.id(),
                                                    " was not placed on worker ", worker_id));
  }
  LOOM_RETURN_IF_ERROR(CheckReportedSteps(r));
  LOOM_RETURN_IF_ERROR(CheckReportedCheckpoints(r, CheckpointDir(job)));
  if (const v1::Placement* p = PlacementOf(job, worker_id);
      p != nullptr && r.attempt() == job.attempt()) {
    for (const auto& rank : r.ranks()) {
      if (std::find(p->ranks().begin(), p->ranks().end(), rank.rank()) == p->ranks().end()) {
        return FieldError("attempts.ranks", absl::StrCat("rank ", rank.rank(), " of job ", job.id(),
                                                         " is not placed on ", worker_id));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

int RanksRunning(const v1::AttemptReport& r) {
  int running = 0;
  for (const auto& rank : r.ranks()) running += rank.running() ? 1 : 0;
  return running;
}

// The failed ranks of a report, the likely cause first: a rank killed by a signal makes its
// peers exit with a communication error right after. `text` is empty when none failed.
struct RankFailures {
  std::string text;
  bool bad_input = false;  // a rank refused the spec or its data
  bool infra = false;      // a rank's lease ran out, or it was stopped
};

RankFailures FailedRanks(const v1::AttemptReport& r, const std::string& wid) {
  RankFailures out;
  std::vector<std::string> killed, exited;
  for (const auto& rank : r.ranks()) {
    if (rank.running() || rank.exit_code() == 0) continue;
    out.bad_input |= rank.exit_code() == kExitBadInput;
    out.infra |= rank.exit_code() == kExitLeaseExpired || rank.exit_code() == kExitStopped;
    (rank.exit_code() > 128 ? killed : exited)
        .push_back(
            absl::StrCat("rank ", rank.rank(), " on ", wid, ": ", rank.detail().substr(0, 200)));
  }
  killed.insert(killed.end(), exited.begin(), exited.end());
  out.text = absl::StrJoin(killed, "; ");
  return out;
}

}  // namespace

// The rendezvous port rank 0's worker picked, and the trainer's newest progress.
void Coordinator::ApplyProgress(Txn& txn, v1::Job& job, const v1::AttemptReport& r,
                                const std::string& wid) {
  if (r.master_port() > 0 && job.master_port() == 0 && HostsRankZero(job, wid)) {
    job.set_master_port(r.master_port());
    txn.batch.PutJob(job);
  }
  if (r.progress().update_time_ms() > job.progress().update_time_ms()) {
    *job.mutable_progress() = r.progress();
    job.mutable_progress()->set_total_steps(job.spec().steps());
    txn.progress.PutJob(job);
  }
}

// Evaluations not recorded yet for this attempt (a resent report repeats them).
void Coordinator::RecordEvals(Txn& txn, v1::Job& job, const v1::AttemptReport& r) {
  for (const auto& ev : r.evals()) {
    bool seen = false;
    for (const auto& have : job.evals()) {
      seen |= have.step() == ev.step() && have.attempt() == r.attempt() &&
              have.kind() == ev.kind() && have.length() == ev.length();
    }
    if (!seen) {
      *job.add_evals() = ev;
      job.mutable_evals()->rbegin()->set_attempt(r.attempt());
      txn.batch.PutJob(job);
    }
  }
}

// Success of a worker's share: every rank placed on it reported, exited 0. The job succeeds
// when every worker's share has.
void Coordinator::ApplyFinishedShare(Txn& txn, v1::Job& job, const v1::AttemptReport& r,
                                     const std::string& wid) {
  const v1::Placement* p = PlacementOf(job, wid);
  if (!r.finished() || p == nullptr || Contains(job.finished_workers(), wid)) return;
  int exited_ok = 0;
  for (int placed : p->ranks()) {
    for (const auto& rank : r.ranks()) {
      exited_ok += rank.rank() == placed && !rank.running() && rank.exit_code() == 0 ? 1 : 0;
    }
  }
  if (exited_ok != p->ranks_size()) return;
  job.add_finished_workers(wid);
  txn.batch.PutJob(job);
  bool all = true;
  for (const auto& pl : job.placement()) all &= Contains(job.finished_workers(), pl.worker_id());
  if (all) {
    table_->SetState(
        txn, job, JobState::kSucceeded,
        absl::StrCat("all ", job.world_size(), " ranks exited 0 at step ", job.progress().step()));
  }
}

namespace {

// What the coordinator will put in an Authorization header: no byte that could end it.
bool IsBearerToken(const std::string& t) {
  if (t.size() < 16 || t.size() > 256) return false;
  for (char c : t) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && !absl::StrContains("-._~+/=", c))
      return false;
  }
  return true;
}

// A server the proxy can be pointed at: listening, with a token fit for a header. (A report
// that is not is ignored: a hostile worker gets nothing from it.)
bool Reachable(const v1::ServeReport& s) {
  return s.port() >= 1 && s.port() <= 65535 && IsBearerToken(s.token());
}

}  // namespace

void Coordinator::ApplyReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r,
                              const std::string& wid) {
  table_->Save(txn, job);
  ApplyProgress(txn, job, r, wid);
  ApplyResumeReport(txn, job, r);
  const size_t before = job.checkpoints_size();
  for (const auto& c : r.checkpoints()) CatalogueCheckpoint(txn, job, c.step(), c.path());
  if (static_cast<size_t>(job.checkpoints_size()) != before) retention_->Apply(txn, job.id());
  RecordEvals(txn, job, r);
  const RankFailures failed = FailedRanks(r, wid);
  if (!failed.text.empty() && job.preempt_requested()) {
    RequeuePreempted(txn, job, failed.text);
    return;
  }
  if (!failed.text.empty()) {
    FailAttempt(txn, job, failed.text,
                failed.bad_input ? Failure::kBadInput
                : failed.infra   ? Failure::kInfra
                                 : Failure::kJob);
    return;
  }
  // A serve job runs once its server answers: until then clients could only be refused.
  const bool serve = job.spec().kind() == "serve";
  if (RanksRunning(r) > 0 && JobStateOf(job) == JobState::kScheduled &&
      (!serve || (r.serve().ready() && Reachable(r.serve()) && r.attempt() == job.attempt()))) {
    if (job.start_time_ms() == 0) job.set_start_time_ms(NowMs());
    table_->SetState(txn, job, JobState::kRunning,
                     serve ? absl::StrCat("loom-serve answering on ", wid)
                           : absl::StrCat("ranks started on ", wid));
  }
  ApplyServeReport(txn, job, r, wid);
  ApplyFinishedShare(txn, job, r, wid);
}

// Where rank 0's agent says the server listens and whether it answers; the token stays in memory.
void Coordinator::ApplyServeReport(Txn& txn, v1::Job& job, const v1::AttemptReport& r,
                                   const std::string& wid) {
  const std::optional<JobState> state = JobStateOf(job);
  if (job.spec().kind() != "serve" || r.attempt() != job.attempt() || !HostsRankZero(job, wid) ||
      (state != JobState::kScheduled && state != JobState::kRunning))
    return;
  const v1::ServeReport& s = r.serve();
  if (!Reachable(s)) return;
  serve_targets_[job.id()] = ServeTarget{job.id(),          job.submitted_by(), job.attempt(),
                                         job.master_addr(), s.port(),           s.token()};
  v1::ServeEndpoint e;
  e.set_base_path(absl::StrCat("/v1/jobs/", job.id(), "/serve/v1"));
  e.set_address(JoinHostPort(job.master_addr(), s.port()));
  e.set_ready(s.ready());
  e.set_model(job.spec().serve().model_name());
  e.set_attempt(job.attempt());
  if (e.SerializeAsString() == job.serve().SerializeAsString()) return;
  table_->Save(txn, job);
  *job.mutable_serve() = std::move(e);
  txn.batch.PutJob(job);
}

namespace {

v1::AttemptRef* AddAttemptRef(google::protobuf::RepeatedPtrField<v1::AttemptRef>* list,
                              const v1::AttemptReport& r) {
  v1::AttemptRef* ref = list->Add();
  ref->set_job_id(r.job_id());
  ref->set_attempt(r.attempt());
  return ref;
}

// What a worker placed in `p` is told to start.
v1::Assignment AssignmentOf(const std::string& id, const v1::Job& job, const v1::Placement& p,
                            const CoordinatorOptions& options) {
  v1::Assignment a;
  a.set_job_id(id);
  a.set_attempt(job.attempt());
  *a.mutable_ranks() = p.ranks();
  a.set_world_size(job.world_size());
  a.set_master_addr(job.master_addr());
  a.set_master_port(job.master_port());
  *a.mutable_spec() = job.spec();
  // Jobs stored before the time interval existed get it here.
  ApplyCheckpointIntervalDefault(*a.mutable_spec(), options.checkpoint_interval_seconds);
  a.set_resume_from(job.spec().checkpoint().dir());
  a.set_init_from(job.init_from_path());
  a.set_storage_root(options.storage_root);
  return a;
}

}  // namespace

void Coordinator::ReconcileReportLocked(Txn& txn, const std::string& worker,
                                        const v1::AttemptReport& r, v1::HeartbeatResponse& response,
                                        RunningAttempts& running) {
  auto jit = table_->jobs().find(r.job_id());
  if (jit != table_->jobs().end()) {
    AppendLog(txn, r, worker);
    AppendSteps(txn, r, worker);
  }
  const bool current = jit != table_->jobs().end() && IsActive(jit->second) &&
                       r.attempt() == jit->second.attempt() &&
                       PlacementOf(jit->second, worker) != nullptr;
  if (current) {
    ApplyReport(txn, jit->second, r, worker);
  } else if (jit != table_->jobs().end() && HistoryOf(jit->second, r.attempt()) != nullptr &&
             !r.skipped().empty()) {
    ApplyResumeReport(txn, jit->second, r);  // what an old attempt found is still true
  }
  // Reports of unknown jobs and of old attempts: stop what still runs, forget what ended.
  const bool live =
      jit != table_->jobs().end() && IsActive(jit->second) && r.attempt() == jit->second.attempt();
  // A preempted attempt is stopped like a cancelled one: SIGTERM, checkpoint, exit 76.
  const bool stop = !live || jit->second.preempt_requested();
  if (stop && !r.finished()) AddAttemptRef(response.mutable_cancels(), r);
  if (r.finished()) {
    AddAttemptRef(response.mutable_forget(), r);
  } else {
    running[{r.job_id(), r.attempt()}] = std::max(1, RanksRunning(r));
  }
}

void Coordinator::AssignLocked(const std::string& worker, const v1::HeartbeatRequest& request,
                               v1::HeartbeatResponse& response) const {
  auto placed = placed_on_.find(worker);
  if (placed == placed_on_.end()) return;
  std::set<std::pair<std::string, int>> reported;
  for (const v1::AttemptReport& r : request.attempts()) reported.insert({r.job_id(), r.attempt()});
  for (const std::string& id : placed->second) {
    auto it = table_->jobs().find(id);
    if (it == table_->jobs().end()) continue;
    const v1::Job& job = it->second;
    if (!IsActive(job) || Contains(job.finished_workers(), worker)) continue;
    const v1::Placement* p = PlacementOf(job, worker);
    if (p == nullptr) continue;
    if (reported.count({id, job.attempt()})) continue;  // already running there
    // Other workers wait for the port rank 0's worker picks (0 tells rank 0's worker to pick).
    if (job.master_port() == 0 && !HostsRankZero(job, worker)) continue;
    *response.add_assignments() = AssignmentOf(id, job, *p, options_);
  }
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& request,
                                                             const std::string& worker) {
  std::promise<absl::StatusOr<v1::HeartbeatResponse>> answered;
  HeartbeatThen(request, worker, [&answered](absl::StatusOr<v1::HeartbeatResponse> r) {
    answered.set_value(std::move(r));
  });
  return answered.get_future().get();
}

void Coordinator::HeartbeatThen(const v1::HeartbeatRequest& request, const std::string& worker,
                                std::function<void(absl::StatusOr<v1::HeartbeatResponse>)> done) {
  if (request.worker_id() != worker) {
    return done(absl::PermissionDeniedError(absl::StrCat("this credential belongs to worker ",
                                                         worker, ", not '",
                                                         request.worker_id().substr(0, 64), "'")));
  }
  if (request.attempts_size() > 4096) return done(FieldError("attempts", "too many"));
  uint64_t written = 0;
  absl::StatusOr<v1::HeartbeatResponse> response;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    response = HeartbeatLocked(request, worker, &written);
  }
  // An attempt that ended freed its slots: schedule now, not at the next tick, so the agent's
  // prompt follow-up heartbeat finds what waited for them (a sweep of short jobs).
  if (response.ok() && response->forget_size() > 0) wake_.notify_all();
  if (!response.ok() || written == 0) return done(std::move(response));
  // Group commit: the state this heartbeat changed is in RocksDB's log (and in effect) already;
  // its answer waits until the log is on disk, and heartbeats that arrive meanwhile share that
  // fsync. A failed fsync fails the call: the agent sends the report again.
  log_syncer_->After(written, [this, response = *std::move(response),
                               done = std::move(done)](absl::Status synced) mutable {
    if (!synced.ok()) {
      registry_.Increment("loom_coordinator_store_errors_total");
      return done(
          absl::UnavailableError(absl::StrCat("not on disk, send again: ", synced.message())));
    }
    done(std::move(response));
  });
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::HeartbeatLocked(
    const v1::HeartbeatRequest& request, const std::string& worker, uint64_t* written) {
  auto wit = table_->workers().find(worker);
  if (wit == table_->workers().end()) {
    return absl::NotFoundError(absl::StrCat("worker '", worker, "' is not registered"));
  }
  for (const v1::AttemptReport& r : request.attempts()) {
    LOOM_RETURN_IF_ERROR(ValidateReport(r, worker));
  }
  Txn txn;
  v1::Worker& w = wit->second;
  table_->Save(txn, worker);
  w.set_last_heartbeat_ms(NowMs());
  heard_steady_[worker] = SteadyMs();
  heard_since_start_.insert(worker);
  v1::HeartbeatResponse response;
  RunningAttempts running;
  for (const v1::AttemptReport& r : request.attempts()) {
    ReconcileReportLocked(txn, worker, r, response, running);
  }
  AssignLocked(worker, request, response);
  if (!IsAlive(w)) {
    SetWorkerState(w, WorkerState::kAlive);
    txn.batch.PutWorker(w);
  } else {
    txn.progress.PutWorker(w);
  }
  const bool changes_state = !txn.batch.empty();
  const absl::Status s = table_->Commit(txn, /*sync=*/false);
  if (IsStorageFull(s)) {
    // A full disk: the heartbeat still counts (liveness is in memory, the agent renews its
    // ranks' lease on this answer), but nothing it reported is recorded. The agent keeps every
    // report, log chunk and step and sends them again; no attempt is forgotten.
    response.clear_forget();
    response.set_not_recorded(true);
  } else if (!s.ok()) {
    return s;
  } else if (changes_state) {
    *written = table_->store().LastSequence();
  }
  reported_running_[worker] = std::move(running);
  return response;
}

}  // namespace loom::coordinator
