// Jobs: submission, listing, cancellation and updates, their logs and curves, and the end of an
// attempt (failed, preempted, requeued).

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_logs.h"
#include "coordinator/paging.h"
#include "coordinator/records.h"
#include "coordinator/submit_validation.h"
#include "storage/checkpoint_store.h"

namespace fs = std::filesystem;

namespace loom::coordinator {

absl::StatusOr<v1::JobSpec> Coordinator::ResolveSubmission(const v1::SubmitJobRequest& request) {
  LOOM_RETURN_IF_ERROR(CheckSubmitRequest(request));
  std::string model_checkpoint_dir;
  if (TakesModelFromCheckpoint(request)) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = table_->checkpoints().find(request.init_from());
    if (it != table_->checkpoints().end()) model_checkpoint_dir = it->second.path();
  }
  return ResolveSubmittedSpec(request, model_checkpoint_dir);
}

namespace {

// A directory left by an earlier coordinator state under this id must not be resumed from: it
// moves to <storage root>/stale/<id>-<now>.
absl::Status SetAsideStaleDirectory(const std::string& storage_root, const std::string& id,
                                    int64_t now) {
  const fs::path job_dir = fs::path(storage_root) / "jobs" / id;
  std::error_code ec;
  if (fs::exists(job_dir, ec)) {
    fs::create_directories(fs::path(storage_root) / "stale", ec);
    fs::rename(job_dir, fs::path(storage_root) / "stale" / absl::StrCat(id, "-", now), ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("cannot move the stale directory ", job_dir.string(), ": ", ec.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// Where the request's init_from checkpoint is ("" without one), after the catalogue check:
// retention holds the same lock, so an accepted job's starting checkpoint is pinned from here on.
absl::StatusOr<std::string> Coordinator::InitFromPathLocked(
    const v1::SubmitJobRequest& request) const {
  if (request.init_from().empty()) return std::string();
  auto it = table_->checkpoints().find(request.init_from());
  if (it == table_->checkpoints().end()) {
    return FieldError("init_from",
                      absl::StrCat("no checkpoint '", request.init_from().substr(0, 100),
                                   "' in the catalogue (GET /v1/checkpoints)"));
  }
  const std::string& init_path = it->second.path();
  std::error_code ec;
  // (A step on an object store is not looked up under the lock: the catalogue says it exists.)
  if (it->second.deleted() || (!storage::IsRemoteLocation(init_path) &&
                               !fs::exists(fs::path(init_path) / "manifest.json", ec))) {
    return FieldError("init_from",
                      absl::StrCat("checkpoint '", request.init_from(), "' is no longer on disk (",
                                   init_path, "); pick an available one"));
  }
  if (!it->second.damaged().empty()) {
    return FieldError("init_from", absl::StrCat("checkpoint '", request.init_from(),
                                                "' is damaged: ", it->second.damaged()));
  }
  return init_path;
}

// Under the lock: the init_from check, the id, paths and the stored job.
absl::StatusOr<v1::Job> Coordinator::AddJobLocked(Txn& txn, const v1::SubmitJobRequest& request,
                                                  v1::JobSpec spec, const std::string& user,
                                                  const std::string& id) {
  LOOM_ASSIGN_OR_RETURN(const std::string init_path, InitFromPathLocked(request));
  LOOM_RETURN_IF_ERROR(ResolveJobPaths(spec, options_.storage_root, id));
  spec.mutable_checkpoint()->set_dir(CheckpointDirFor(id, NowMs()));
  ApplyCheckpointIntervalDefault(spec, options_.checkpoint_interval_seconds);
  // Clients name the model a serve job serves by its checkpoint's id unless the spec names it.
  if (spec.kind() == "serve" && spec.serve().model_name().empty())
    spec.mutable_serve()->set_model_name(request.init_from());
  v1::Job job;
  job.set_id(id);
  job.set_name(spec.name().empty() ? id : spec.name());
  *job.mutable_request() = request;
  *job.mutable_spec() = spec;
  job.set_world_size(WorldSizeOf(request));
  job.set_priority(request.priority());
  job.set_max_restarts(MaxRestartsOf(request));
  job.set_init_from_path(init_path);
  job.set_submitted_by(user);
  const int64_t now = NowMs();
  job.set_submit_time_ms(now);
  job.set_queued_since_ms(now);
  job.mutable_progress()->set_total_steps(spec.steps());
  LOOM_RETURN_IF_ERROR(CheckPrintable(job));
  if (!RemoteCheckpoints()) {
    LOOM_RETURN_IF_ERROR(SetAsideStaleDirectory(options_.storage_root, id, now));
  }
  table_->SetState(txn, job, JobState::kQueued, absl::StrCat("submitted by ", user));
  table_->jobs()[id] = job;
  return job;
}

absl::StatusOr<v1::SubmitJobResponse> Coordinator::Submit(const v1::SubmitJobRequest& raw,
                                                          const std::string& user) {
  v1::SubmitJobRequest request = raw;  // with init_from in the canonical id form
  if (!request.init_from().empty()) {
    LOOM_ASSIGN_OR_RETURN(*request.mutable_init_from(),
                          CanonicalCheckpointId(request.init_from(), "init_from"));
  }
  LOOM_ASSIGN_OR_RETURN(v1::JobSpec spec, ResolveSubmission(request));
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string key = IdempotencyKey("", user, request.request_id());
  if (!request.request_id().empty()) {
    if (const std::string earlier = table_->RequestId(key); !earlier.empty()) {
      auto job = table_->jobs().find(earlier);
      LOOM_RETURN_IF_ERROR(
          CheckRetry(job == table_->jobs().end() ? nullptr : &job->second.request(), request,
                     earlier, "request"));
      v1::SubmitJobResponse r;
      r.set_id(earlier);
      r.set_created(false);
      return r;
    }
  }
  const std::string id = table_->NextJobId();
  Txn txn;
  LOOM_RETURN_IF_ERROR(AddJobLocked(txn, request, spec, user, id).status());
  table_->TakeJobIds(txn, 1);
  if (!request.request_id().empty()) table_->PutRequestId(txn, key, id);
  LOOM_RETURN_IF_ERROR(table_->Commit(txn));
  registry_.Increment("loom_coordinator_jobs_submitted_total");
  wake_.notify_all();
  v1::SubmitJobResponse r;
  r.set_id(id);
  r.set_created(true);
  return r;
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const std::string& state, int page_size,
                                                           const std::string& page_token) {
  JobFilter filter;
  filter.state = state;
  return ListJobs(filter, page_size, page_token);
}

absl::StatusOr<v1::ListJobsResponse> Coordinator::ListJobs(const JobFilter& f, int page_size,
                                                           const std::string& page_token) {
  const std::optional<JobState> state = ParseJobState(f.state);  // nullopt: any state
  if (!f.state.empty() && !state) {
    return FieldError("state", absl::StrCat("unknown state '", f.state.substr(0, 40), "'; one of ",
                                            absl::StrJoin(JobStateNames(), ", ")));
  }
  for (const auto& [name, value] : {std::pair<const char*, const std::string&>{"user", f.user},
                                    {"kind", f.kind},
                                    {"sweep", f.sweep}}) {
    if (value.size() > 128) return FieldError(name, "at most 128 characters");
  }
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  // The old token format carries the state alone; the other filters extend it.
  LOOM_ASSIGN_OR_RETURN(const auto labels, ParseLabelSelector(f.labels));
  std::string key = f.state;
  if (!f.user.empty() || !f.kind.empty() || !f.sweep.empty() || f.newest_first ||
      !f.labels.empty()) {
    key = absl::StrJoin(
        {f.state, f.user, f.kind, f.sweep, std::string(f.newest_first ? "desc" : ""), f.labels},
        "\x1e");
  }
  LOOM_ASSIGN_OR_RETURN(const std::string after, DecodePageToken(page_token, "jobs", key));
  std::lock_guard<std::mutex> lock(mutex_);
  auto matches = [&](const v1::Job& j) {
    return (!state || JobStateOf(j) == state) && (f.user.empty() || j.submitted_by() == f.user) &&
           (f.kind.empty() || (j.spec().kind().empty() ? "pretrain" : j.spec().kind()) == f.kind) &&
           (f.sweep.empty() || j.sweep_id() == f.sweep) && HasLabels(j.request().labels(), labels);
  };
  v1::ListJobsResponse out;
  auto add = [&](const v1::Job& job) {
    if (!matches(job)) return true;
    if (out.jobs_size() == page_size) {
      out.set_next_page_token(EncodePageToken("jobs", key, out.jobs(page_size - 1).id()));
      return false;
    }
    v1::Job* j = out.add_jobs();
    *j = job;
    auto w = waiting_reason_.find(job.id());
    if (JobStateOf(*j) == JobState::kQueued && w != waiting_reason_.end()) {
      j->set_reason(w->second);
    }
    return true;
  };
  if (f.newest_first) {
    auto end = after.empty() ? table_->jobs().end() : table_->jobs().lower_bound(after);
    for (auto it = std::make_reverse_iterator(end); it != table_->jobs().rend(); ++it) {
      if (!add(it->second)) break;
    }
  } else {
    for (auto it = table_->jobs().upper_bound(after); it != table_->jobs().end(); ++it) {
      if (!add(it->second)) break;
    }
  }
  return out;
}

absl::StatusOr<v1::Job*> Coordinator::FindJobLocked(const std::string& id) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  auto it = table_->jobs().find(id);
  if (it == table_->jobs().end())
    return absl::NotFoundError(absl::StrCat("job '", id, "' not found"));
  return &it->second;
}

absl::StatusOr<v1::Job> Coordinator::GetJob(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  LOOM_ASSIGN_OR_RETURN(const v1::Job* found, FindJobLocked(id));
  v1::Job job = *found;
  auto w = waiting_reason_.find(id);
  if (JobStateOf(job) == JobState::kQueued && w != waiting_reason_.end()) job.set_reason(w->second);
  LOOM_ASSIGN_OR_RETURN(std::vector<v1::JobEvent> events, table_->store().Events(id));
  for (auto& e : events) *job.add_events() = std::move(e);
  return job;
}

absl::StatusOr<v1::Job> Coordinator::Cancel(const std::string& id, const Caller& caller) {
  std::lock_guard<std::mutex> lock(mutex_);
  LOOM_ASSIGN_OR_RETURN(v1::Job * found, FindJobLocked(id));
  v1::Job& job = *found;
  LOOM_RETURN_IF_ERROR(MayChange(caller, "job", id, job.submitted_by()));
  const std::string& user = caller.user;
  if (IsTerminal(job)) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " is already ", job.state()));
  }
  // The attempt's ranks get SIGTERM through their agents' next heartbeat; their slots stay
  // counted until the agents report them gone.
  Txn txn;
  table_->Save(txn, job);
  job.set_cancel_requested(true);
  table_->SetState(txn, job, JobState::kCancelled, absl::StrCat("cancelled by ", user));
  LOOM_RETURN_IF_ERROR(table_->Commit(txn));
  wake_.notify_all();
  return table_->jobs()[id];
}

namespace {

absl::Status CheckJobUpdate(const v1::JobUpdate& u) {
  if (!u.has_priority() && !u.has_keep_last() && !u.has_keep_every())
    return FieldError("priority", "give priority, keep_last or keep_every");
  if (u.has_priority() && (u.priority() < -1000 || u.priority() > 1000))
    return FieldError("priority", "must be in -1000..1000");
  if (u.has_keep_last() && (u.keep_last() < 1 || u.keep_last() > 1000000))
    return FieldError("keep_last", "must be in 1..1000000");
  if (u.has_keep_every() && (u.keep_every() < 0 || u.keep_every() > (int64_t{1} << 40)))
    return FieldError("keep_every", "must be in 0..2^40");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::Job> Coordinator::UpdateJob(const std::string& id, const v1::JobUpdate& u,
                                               const Caller& caller) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  LOOM_RETURN_IF_ERROR(CheckJobUpdate(u));
  std::lock_guard<std::mutex> lock(mutex_);
  LOOM_ASSIGN_OR_RETURN(v1::Job * found, FindJobLocked(id));
  v1::Job& job = *found;
  LOOM_RETURN_IF_ERROR(MayChange(caller, "job", id, job.submitted_by()));
  if (u.has_priority() && IsTerminal(job)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is already ", job.state(), ": its priority no longer matters"));
  }
  Txn txn;
  table_->Save(txn, job);
  std::vector<std::string> changed;
  if (u.has_priority() && u.priority() != job.priority()) {
    changed.push_back(absl::StrCat("priority ", job.priority(), " -> ", u.priority()));
    job.set_priority(u.priority());
  }
  v1::CheckpointConfig* cfg = job.mutable_spec()->mutable_checkpoint();
  if (u.has_keep_last() && u.keep_last() != cfg->keep_last()) {
    changed.push_back(absl::StrCat("keep_last ", cfg->keep_last(), " -> ", u.keep_last()));
    cfg->set_keep_last(u.keep_last());
  }
  if (u.has_keep_every() && u.keep_every() != cfg->keep_every()) {
    changed.push_back(absl::StrCat("keep_every ", cfg->keep_every(), " -> ", u.keep_every()));
    cfg->set_keep_every(u.keep_every());
  }
  if (changed.empty()) return job;
  txn.batch.PutJob(job);
  table_->AddEvent(txn, job, std::nullopt,
                   absl::StrCat(absl::StrJoin(changed, ", "), " by ", caller.user));
  if (u.has_keep_last() || u.has_keep_every()) retention_->Apply(txn, id);
  LOOM_RETURN_IF_ERROR(table_->Commit(txn));
  wake_.notify_all();  // a raised priority may place it, or let it preempt
  return table_->jobs()[id];
}

// Readies a job whose attempt ended for its next one (the caller sets it queued): placement
// cleared, fenced until not_before_ms (0: none). It keeps its original queue time, so aging and
// reservations count from the submission. Returns where it will resume from, in words.
std::string Coordinator::Requeue(v1::Job& job, int64_t not_before_ms) {
  std::string from = "the start";
  if (const v1::CheckpointEntry* newest = NewestIntactCheckpoint(job)) {
    from = absl::StrCat("step ", newest->step());
  }
  job.clear_placement();
  job.set_master_port(0);
  job.clear_finished_workers();
  job.set_not_before_ms(not_before_ms);
  // A preemption asked of an attempt that ended otherwise (its worker lost) is void: the next
  // attempt must not be stopped for it.
  job.set_preempt_requested(false);
  fence_steady_[job.id()] = not_before_ms > 0 ? SteadyMs() + (not_before_ms - NowMs()) : 0;
  return from;
}

// A preempted attempt ended (its ranks checkpointed and exited 76, or whatever they did once
// asked to stop): queued again with its place kept, no restart counted.
void Coordinator::RequeuePreempted(Txn& txn, v1::Job& job, const std::string& how) {
  table_->Save(txn, job);
  v1::AttemptRecord* record = job.history_size() > 0 ? &*job.mutable_history()->rbegin() : nullptr;
  if (record != nullptr) {
    record->set_end_reason(absl::StrCat("preempted for ", job.preempted_for(), ": ", how));
    record->set_end_time_ms(NowMs());
    record->set_preempted(true);
  }
  job.set_preemptions(job.preemptions() + 1);
  const std::string from = Requeue(job, 0);
  table_->SetState(txn, job, JobState::kQueued,
                   absl::StrCat("preempted for ", job.preempted_for(), "; requeued from ", from,
                                " with its place in the queue kept (no restart counted)"));
  registry_.Increment("loom_coordinator_preemptions_total");
}

void Coordinator::FailAttempt(Txn& txn, v1::Job& job, const std::string& reason, Failure kind,
                              int64_t not_before_ms) {
  table_->Save(txn, job);
  if (job.history_size() > 0) {
    job.mutable_history()->rbegin()->set_end_reason(reason);
    job.mutable_history()->rbegin()->set_end_time_ms(NowMs());
  }
  if (kind == Failure::kBadInput) {
    table_->SetState(txn, job, JobState::kFailed,
                     absl::StrCat(reason,
                                  " (bad input: the trainer refused the spec or its data; "
                                  "not restarted)"));
    return;
  }
  const bool infra = kind == Failure::kInfra;
  const bool left = infra ? job.infra_restarts() < options_.max_infra_restarts
                          : job.restarts() < job.max_restarts();
  if (!left) {
    table_->SetState(txn, job, JobState::kFailed,
                     infra ? absl::StrCat(reason, " (", options_.max_infra_restarts,
                                          " attempts lost to infrastructure)")
                     : job.max_restarts() > 0
                         ? absl::StrCat(reason, " (no restarts left of ", job.max_restarts(), ")")
                         : reason);
    return;
  }
  if (infra) {
    job.set_infra_restarts(job.infra_restarts() + 1);
  } else {
    job.set_restarts(job.restarts() + 1);
  }
  table_->SetState(txn, job, JobState::kRetrying, reason);
  const std::string from = Requeue(job, not_before_ms);
  table_->SetState(
      txn, job, JobState::kQueued,
      infra ? absl::StrCat("requeued from ", from, " (infrastructure failure ",
                           job.infra_restarts(), " of ", options_.max_infra_restarts,
                           "; does not count against max_restarts)")
            : absl::StrCat("restart ", job.restarts(), " of ", job.max_restarts(), " from ", from));
  registry_.Increment("loom_coordinator_job_restarts_total");
}

absl::StatusOr<Coordinator::LogChunk> Coordinator::ReadLog(const std::string& id, int64_t offset,
                                                           int64_t max) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  if (offset < 0) return FieldError("offset", "must be >= 0");
  bool terminal = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    LOOM_ASSIGN_OR_RETURN(const v1::Job* job, FindJobLocked(id));
    terminal = IsTerminal(*job);
  }
  FileBytes read = ReadFileBytes(JobLogPath(options_.data_dir, id), offset, max);
  LogChunk chunk;
  chunk.data = std::move(read.data);
  chunk.next_offset = offset + static_cast<int64_t>(chunk.data.size());
  chunk.done = terminal && chunk.next_offset >= read.size;
  return chunk;
}

absl::StatusOr<v1::JobMetricsResponse> Coordinator::JobMetrics(const std::string& id,
                                                               int max_points) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("job id: malformed");
  if (max_points < 10 || max_points > 100000) {
    return FieldError("max_points", "must be in 10..100000");
  }
  v1::JobMetricsResponse out;
  out.set_job_id(id);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    LOOM_ASSIGN_OR_RETURN(const v1::Job* job, FindJobLocked(id));
    *out.mutable_evals() = job->evals();
  }
  for (v1::AttemptSeries& s : ReadStepSeries(JobSeriesPath(options_.data_dir, id), max_points)) {
    *out.add_series() = std::move(s);
  }
  return out;
}

}  // namespace loom::coordinator
