// Scheduling passes: the queue, free slots, quotas, fair share and preemption, and starting the
// attempts placed.
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "coordinator/coordinator.h"
#include "coordinator/submit_validation.h"

namespace loom::coordinator {

namespace {

std::string RankText(const std::vector<int>& ranks) {
  if (ranks.empty()) return "";
  if (ranks.size() == 1) return absl::StrCat("rank ", ranks[0]);
  return absl::StrCat("ranks ", ranks.front(), "-", ranks.back());
}

// The job's `project` label, what project quotas count ("" = none).
std::string ProjectOf(const v1::Job& job) {
  auto it = job.request().labels().find("project");
  return it == job.request().labels().end() ? "" : it->second;
}

}  // namespace

// Fair share's usage from every attempt's start and end (a running one's so far): the same
// value the passes had advanced to, whatever the restart cost.
void Coordinator::RebuildUsageLocked() {
  const int64_t now = NowMs();
  usage_.Advance(now, {});
  last_held_.clear();
  for (const auto& [id, job] : table_->jobs()) {
    const bool active = IsActive(job);
    for (int i = 0; i < job.history_size(); ++i) {
      const v1::AttemptRecord& a = job.history(i);
      const bool current = active && i == job.history_size() - 1;
      const int64_t end = current ? now : a.end_time_ms();
      if (end > 0) usage_.AddInterval(job.submitted_by(), job.world_size(), a.start_time_ms(), end);
    }
    if (active) last_held_[job.submitted_by()] += job.world_size();
  }
}

// Some live worker still reports ranks of an earlier attempt of this job.
bool Coordinator::OldAttemptRunning(const v1::Job& job) const {
  for (const auto& [worker, attempts] : reported_running_) {
    for (const auto& [key, ranks] : attempts) {
      if (key.first == job.id() && key.second <= job.attempt() && ranks > 0) return true;
    }
  }
  return false;
}

// The queued jobs the scheduler may place now; those held back (fenced after a lost worker, or
// waiting for an old attempt's ranks to stop) go to `held` with the reason.
std::vector<QueuedJob> Coordinator::QueueLocked(std::map<std::string, std::string>& held) const {
  std::vector<QueuedJob> queue;
  const int64_t steady = SteadyMs();
  for (const auto& [id, job] : table_->jobs()) {
    if (JobStateOf(job) != JobState::kQueued) continue;
    if (auto fence = fence_steady_.find(id);
        fence != fence_steady_.end() && fence->second > steady) {
      held[id] = absl::StrFormat(
          "fenced: the previous attempt's worker was lost; placing again in %.1f s (lost-after "
          "+ termination grace)",
          static_cast<double>(fence->second - steady) / 1000.0);
      continue;
    }
    if (OldAttemptRunning(job)) {
      held[id] = absl::StrCat("waiting for attempt ", job.attempt(), "'s ranks to stop");
      continue;
    }
    QueuedJob q;
    q.id = id;
    q.world_size = job.world_size();
    q.priority = job.priority();
    q.pool.insert(job.request().pool().begin(), job.request().pool().end());
    q.user = job.submitted_by();
    q.project = ProjectOf(job);
    q.queued_since_ms = job.queued_since_ms();
    q.sweep = job.sweep_id();
    q.sweep_order = SweepOrder(job);
    q.preempting = job.preempting();
    queue.push_back(std::move(q));
  }
  return queue;
}

// A sweep job's seed-major position: seed index × cells + cell index (0 for other jobs).
int Coordinator::SweepOrder(const v1::Job& job) const {
  auto sweep = table_->sweeps().find(job.sweep_id());
  if (job.sweep_id().empty() || sweep == table_->sweeps().end()) return 0;
  const auto& cells = sweep->second.cells();
  const auto& seeds = sweep->second.spec().seeds();
  const auto cell = std::find(cells.begin(), cells.end(), job.sweep_cell());
  const auto seed = std::find(seeds.begin(), seeds.end(), job.sweep_seed());
  return static_cast<int>((seed - seeds.begin()) * cells.size() + (cell - cells.begin()));
}

// After a restart: nothing is placed until every live worker has said what it runs.
bool Coordinator::AwaitingReportsAfterRestart() const {
  for (const auto& [id, w] : table_->workers()) {
    if (IsAlive(w) && !heard_since_start_.count(id)) return true;
  }
  return false;
}

std::vector<FreeWorker> Coordinator::FreeWorkersLocked() const {
  std::vector<FreeWorker> free;
  const int64_t steady = SteadyMs();
  for (const auto& [id, w] : table_->workers()) {
    // A silent worker is not placed on even while loss detection holds (AllWorkersSilent).
    if (!IsAlive(w) || steady - HeardAt(id) > options_.lost_after_ms) continue;
    FreeWorker f;
    f.id = id;
    f.labels.insert(w.labels().begin(), w.labels().end());
    f.slots = w.slots();
    f.free_slots = std::max(0, w.slots() - UsedSlots(id));
    free.push_back(std::move(f));
  }
  return free;
}

// The job's next attempt on the gang's workers, resuming from its newest intact checkpoint.
// Worker -> the active jobs placed on it, in id order: what a heartbeat's assignments are drawn
// from, instead of every job ever submitted (a scan of all of them per heartbeat made 512
// agents' heartbeats quadratic). Placements are made only by the scheduling pass and read at
// load, so it is rebuilt after both; placements cleared in between leave entries that
// AssignLocked skips.
void Coordinator::IndexPlacementsLocked() {
  placed_on_.clear();
  for (const auto& [id, job] : table_->jobs()) {
    if (!IsActive(job)) continue;
    for (const v1::Placement& p : job.placement()) placed_on_[p.worker_id()].push_back(id);
  }
}

void Coordinator::StartAttemptLocked(Txn& txn, const GangPlacement& g, int64_t now) {
  v1::Job& job = table_->jobs()[g.job_id];
  table_->Save(txn, job);
  job.set_attempt(job.attempt() + 1);
  job.set_preempting(false);  // placed: it no longer goes first
  job.clear_placement();
  job.clear_finished_workers();
  v1::AttemptRecord* record = job.add_history();
  record->set_attempt(job.attempt());
  record->set_start_time_ms(now);
  std::vector<std::string> where;
  for (const auto& [wid, ranks] : g.workers) {
    v1::Placement* p = job.add_placement();
    p->set_worker_id(wid);
    for (int r : ranks) p->add_ranks(r);
    record->add_worker_ids(wid);
    where.push_back(absl::StrCat(wid, " (", RankText(ranks), ")"));
  }
  job.set_master_addr(table_->workers()[g.workers.front().first].address());
  job.set_master_port(0);
  job.clear_serve();
  job.clear_resume_from();
  std::string from;
  if (const v1::CheckpointEntry* newest = NewestIntactCheckpoint(job)) {
    job.set_resume_from(newest->path());
    from =
        absl::StrCat("; resuming from step ", newest->step(), " (or the newest intact checkpoint)");
  }
  registry_.Observe("loom_coordinator_scheduling_delay_seconds",
                    static_cast<double>(now - job.queued_since_ms()) / 1000.0);
  table_->SetState(
      txn, job, JobState::kScheduled,
      absl::StrCat("attempt ", job.attempt(), " on ", absl::StrJoin(where, ", "), from));
}

void Coordinator::ScheduleLocked(Txn& txn) {
  const int64_t now = NowMs();
  std::map<std::string, std::string> held;  // queued jobs that wait for their last attempt
  std::vector<QueuedJob> queue = QueueLocked(held);
  if (AwaitingReportsAfterRestart()) {
    for (const auto& q : queue) held[q.id] = "waiting for every worker to report after a restart";
    queue.clear();
  }
  // Every pass, queue or not: fair share's usage accrues while nothing waits too.
  const PassInputs in = PassInputsLocked(now);
  if (queue.empty()) {
    waiting_reason_ = std::move(held);
    return;
  }
  const ScheduleResult result = Schedule(queue, FreeWorkersLocked(), options_.scheduler, now,
                                         in.quotas, in.share, in.running);
  waiting_reason_ = Explain(result, queue);
  waiting_reason_.insert(held.begin(), held.end());
  for (const GangPlacement& g : result.placed) StartAttemptLocked(txn, g, now);
  for (const Preemption& p : result.preempt)
    RequestPreemption(txn, table_->jobs()[p.victim], p.for_job);
}

// Asks the victim's ranks to stop (SIGTERM on their agents' next heartbeat; they checkpoint and
// exit 76). Its slots stay counted until they are gone; then it is requeued (RequeuePreempted).
void Coordinator::RequestPreemption(Txn& txn, v1::Job& victim, const std::string& for_job) {
  table_->Save(txn, victim);
  victim.set_preempt_requested(true);
  victim.set_preempted_for(for_job);
  txn.batch.PutJob(victim);
  v1::Job& preemptor = table_->jobs()[for_job];
  if (!preemptor.preempting()) {
    table_->Save(txn, preemptor);
    preemptor.set_preempting(true);
    txn.batch.PutJob(preemptor);
  }
  table_->AddEvent(
      txn, victim, std::nullopt,
      absl::StrCat("preempting for ", for_job, " (priority ", table_->jobs()[for_job].priority(),
                   " > ", victim.priority(), "): stopping its ranks to checkpoint and requeue"));
}

// The fair-share ledger brought to `now` with what each user held since the last pass.
void Coordinator::AdvanceUsageLocked(int64_t now, const std::map<std::string, int>& held) {
  usage_.Advance(now, last_held_);
  last_held_ = held;
}

// One scan of the jobs for what a pass needs besides the queue and the free slots: quotas with
// their usage, sweeps' max_concurrent, fair share, and the running jobs preemption may stop.
Coordinator::PassInputs Coordinator::PassInputsLocked(int64_t now) {
  PassInputs in;
  in.quotas = QuotaLimitsLocked();
  for (const auto& [key, quota] : table_->quotas()) {
    if (quota.kind() == "user" && quota.weight() > 0)
      in.share.weight[quota.name()] = quota.weight();
  }
  for (const auto& [id, job] : table_->jobs()) {
    const std::optional<JobState> state = JobStateOf(job);
    if (state != JobState::kScheduled && state != JobState::kRunning) continue;
    CountQuotaUsage(job, in.quotas);
    in.share.held[job.submitted_by()] += job.world_size();
    if (!job.sweep_id().empty()) in.quotas.sweep_active[job.sweep_id()] += 1;
    if (state == JobState::kRunning) in.running.push_back(RunningJobOf(job, now));
  }
  for (const auto& [id, sweep] : table_->sweeps()) {
    if (sweep.spec().max_concurrent() > 0)
      in.quotas.sweep_limit[id] = sweep.spec().max_concurrent();
  }
  AdvanceUsageLocked(now, in.share.held);
  in.share.average = usage_.averages();
  return in;
}

// A running job as preemption sees it: the work it would lose is the time since its newest
// checkpoint (or its attempt's start); an attempt that follows a preemption is protected for
// min_run_ms, so no job is stopped over and over.
RunningJob Coordinator::RunningJobOf(const v1::Job& job, int64_t now) const {
  RunningJob r;
  r.id = job.id();
  r.priority = job.priority();
  for (const v1::Placement& p : job.placement())
    r.slots.emplace_back(p.worker_id(), p.ranks_size());
  int64_t since = job.history_size() > 0 ? job.history().rbegin()->start_time_ms() : now;
  if (const v1::CheckpointEntry* c = NewestIntactCheckpoint(job))
    since = std::max(since, c->time_ms());
  r.checkpoint_age_ms = std::max<int64_t>(0, now - since);
  const int n = job.history_size();
  if (n >= 2 && job.history(n - 2).preempted())
    r.protected_until_ms = job.history(n - 1).start_time_ms() + options_.scheduler.min_run_ms;
  r.stopping = job.preempt_requested();
  return r;
}

// The quotas with what they count now: the slots of every scheduled or running job. A quota
// without slots (a fair-share weight alone) limits nothing.
Quotas Coordinator::QuotasLocked() const {
  Quotas q = QuotaLimitsLocked();
  if (table_->quotas().empty()) return q;
  for (const auto& [id, job] : table_->jobs()) {
    const std::optional<JobState> state = JobStateOf(job);
    if (state == JobState::kScheduled || state == JobState::kRunning) CountQuotaUsage(job, q);
  }
  return q;
}

Quotas Coordinator::QuotaLimitsLocked() const {
  Quotas q;
  for (const auto& [key, quota] : table_->quotas()) {
    if (!quota.has_slots()) continue;
    (quota.kind() == "user" ? q.user_limit : q.project_limit)[quota.name()] = quota.slots();
  }
  return q;
}

// A scheduled or running job's slots, counted against its owner's and its project's quota.
void Coordinator::CountQuotaUsage(const v1::Job& job, Quotas& q) const {
  q.user_used[job.submitted_by()] += job.world_size();
  if (const std::string project = ProjectOf(job); !project.empty())
    q.project_used[project] += job.world_size();
}

absl::StatusOr<v1::ListQuotasResponse> Coordinator::ListQuotas() {
  std::lock_guard<std::mutex> lock(mutex_);
  const Quotas live = QuotasLocked();
  v1::ListQuotasResponse out;
  for (const auto& [key, quota] : table_->quotas()) {
    v1::Quota* q = out.add_quotas();
    *q = quota;
    const auto& used = quota.kind() == "user" ? live.user_used : live.project_used;
    q->set_used(used.count(quota.name()) ? used.at(quota.name()) : 0);
  }
  return out;
}

absl::StatusOr<v1::Quota> Coordinator::SetQuota(const v1::Quota& quota, const Caller& caller) {
  if (!caller.admin) return absl::PermissionDeniedError("quotas are set by admins");
  if (quota.kind() != "user" && quota.kind() != "project")
    return FieldError("kind", "user or project");
  if (!IsToken(quota.name(), 63) || quota.name().find_first_of("/:") != std::string::npos)
    return FieldError("name", "1..63 characters of [A-Za-z0-9._-]");
  if (quota.has_slots() && (quota.slots() < 0 || quota.slots() > 1000000))
    return FieldError("slots", "0..1000000");
  if (!(quota.weight() >= 0 && quota.weight() <= 1e6))  // NaN fails too
    return FieldError("weight", "a number in (0, 1000000]");
  if (quota.weight() > 0 && quota.kind() != "user")
    return FieldError("weight", "fair share is between users: set it on a user");
  if (!quota.has_slots() && quota.weight() == 0)
    return FieldError("slots", "give slots, a weight, or both");
  std::lock_guard<std::mutex> lock(mutex_);
  Txn txn;
  table_->PutQuota(txn, quota);
  LOOM_RETURN_IF_ERROR(table_->Commit(txn));
  wake_.notify_all();  // a raised quota may let a waiting job run
  return table_->quotas().at(absl::StrCat(quota.kind(), "/", quota.name()));
}

absl::Status Coordinator::DeleteQuota(const std::string& kind, const std::string& name,
                                      const Caller& caller) {
  if (!caller.admin) return absl::PermissionDeniedError("quotas are set by admins");
  std::lock_guard<std::mutex> lock(mutex_);
  if (!table_->quotas().count(absl::StrCat(kind, "/", name)))
    return absl::NotFoundError(absl::StrCat("no quota for ", kind, " '", name.substr(0, 64), "'"));
  Txn txn;
  table_->DeleteQuota(txn, kind, name);
  LOOM_RETURN_IF_ERROR(table_->Commit(txn));
  wake_.notify_all();
  return absl::OkStatus();
}

}  // namespace loom::coordinator
