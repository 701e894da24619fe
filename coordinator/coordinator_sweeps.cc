// Sweeps: creation as ordinary jobs in one commit, listing, cancellation and reports.

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "coordinator/coordinator.h"
#include "coordinator/paging.h"
#include "coordinator/records.h"
#include "coordinator/submit_validation.h"
#include "coordinator/sweep.h"
#include "coordinator/sweep_curves.h"

namespace loom::coordinator {

struct Coordinator::PlannedJob {
  const SweepCell* cell;
  uint64_t seed;
  v1::SubmitJobRequest request;
  v1::JobSpec spec;
};

namespace {

// A refusal of one job of a sweep, naming its cell and seed.
absl::Status InCell(const absl::Status& s, const std::string& cell, uint64_t seed) {
  return absl::Status(s.code(), absl::StrCat("cell '", cell, "' seed ", seed, ": ", s.message()));
}

}  // namespace

// Every job validated before any is stored: a sweep is accepted whole or not at all.
absl::StatusOr<std::vector<Coordinator::PlannedJob>> Coordinator::PlanSweepJobs(
    const v1::SweepSpec& spec, const std::vector<SweepCell>& cells) {
  std::vector<PlannedJob> planned;
  for (const SweepCell& cell : cells) {
    for (uint64_t seed : spec.seeds()) {
      PlannedJob p{&cell, seed, spec.base(), {}};
      LOOM_ASSIGN_OR_RETURN(*p.request.mutable_spec(), ApplyCell(spec.base().spec(), cell, seed));
      for (const auto& [k, v] : spec.labels()) (*p.request.mutable_labels())[k] = v;
      auto resolved = ResolveSubmission(p.request);
      if (!resolved.ok()) return InCell(resolved.status(), cell.name, seed);
      p.spec = *std::move(resolved);
      planned.push_back(std::move(p));
    }
  }
  return planned;
}

// A retry of a sweep already created under the same idempotency key.
absl::StatusOr<v1::CreateSweepResponse> Coordinator::RepeatedSweepLocked(
    const std::string& key, const v1::SweepSpec& spec) {
  const std::string earlier = table_->RequestId(key);
  auto sweep = table_->sweeps().find(earlier);
  LOOM_RETURN_IF_ERROR(CheckRetry(sweep == table_->sweeps().end() ? nullptr : &sweep->second.spec(),
                                  spec, earlier, "sweep"));
  v1::CreateSweepResponse r;
  r.set_id(earlier);
  r.set_created(false);
  r.set_jobs(sweep == table_->sweeps().end() ? 0 : sweep->second.jobs_size());
  return r;
}

// The planned jobs stored under the next job ids, tagged with the sweep and listed in it; on a
// refusal nothing stays changed.
absl::Status Coordinator::AddSweepJobsLocked(Txn& txn, v1::Sweep& sweep,
                                             const std::vector<PlannedJob>& planned,
                                             const std::string& user) {
  for (size_t i = 0; i < planned.size(); ++i) {
    const std::string id = table_->NextJobId(static_cast<int64_t>(i));
    auto job = AddJobLocked(txn, planned[i].request, planned[i].spec, user, id);
    if (!job.ok()) {
      table_->Rollback(txn);
      return InCell(job.status(), planned[i].cell->name, planned[i].seed);
    }
    v1::Job& stored = table_->jobs()[id];
    stored.set_sweep_id(sweep.id());
    stored.set_sweep_cell(planned[i].cell->name);
    stored.set_sweep_seed(planned[i].seed);
    txn.batch.PutJob(stored);
    v1::SweepJob* sj = sweep.add_jobs();
    sj->set_cell(planned[i].cell->name);
    sj->set_seed(planned[i].seed);
    sj->set_job_id(id);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CreateSweepResponse> Coordinator::CreateSweep(const v1::SweepSpec& raw,
                                                                 const std::string& user) {
  v1::SweepSpec spec = raw;
  if (!spec.base().init_from().empty()) {
    LOOM_ASSIGN_OR_RETURN(*spec.mutable_base()->mutable_init_from(),
                          CanonicalCheckpointId(spec.base().init_from(), "base.init_from"));
  }
  LOOM_RETURN_IF_ERROR(CheckSweepRequest(spec));
  LOOM_ASSIGN_OR_RETURN(std::vector<SweepCell> cells, ExpandSweep(spec));
  LOOM_ASSIGN_OR_RETURN(std::vector<PlannedJob> planned, PlanSweepJobs(spec, cells));
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string key = IdempotencyKey("sweep:", user, spec.request_id());
  if (!spec.request_id().empty() && !table_->RequestId(key).empty())
    return RepeatedSweepLocked(key, spec);
  v1::Sweep sweep;
  sweep.set_id(table_->NextSweepId());
  sweep.set_name(spec.name().empty() ? sweep.id() : spec.name());
  *sweep.mutable_spec() = spec;
  for (const SweepCell& c : cells) sweep.add_cells(c.name);
  sweep.set_submitted_by(user);
  sweep.set_submit_time_ms(NowMs());
  Txn txn;
  LOOM_RETURN_IF_ERROR(AddSweepJobsLocked(txn, sweep, planned, user));
  table_->PutSweep(txn, sweep);
  table_->TakeSweepId(txn);
  table_->TakeJobIds(txn, static_cast<int64_t>(planned.size()));
  if (!spec.request_id().empty()) table_->PutRequestId(txn, key, sweep.id());
  LOOM_RETURN_IF_ERROR(table_->Commit(txn));
  registry_.Increment("loom_coordinator_jobs_submitted_total", static_cast<double>(planned.size()));
  wake_.notify_all();
  v1::CreateSweepResponse r;
  r.set_id(sweep.id());
  r.set_created(true);
  r.set_jobs(sweep.jobs_size());
  return r;
}

// A sweep with its state and per-state job counts, derived from its jobs.
v1::Sweep Coordinator::SweepWithStates(const v1::Sweep& sweep) const {
  v1::Sweep out = sweep;
  int ended = 0, cancelled = 0;
  for (const v1::SweepJob& sj : sweep.jobs()) {
    auto it = table_->jobs().find(sj.job_id());
    const std::string name = it == table_->jobs().end()
                                 ? std::string(JobStateName(JobState::kQueued))
                                 : it->second.state();
    (*out.mutable_job_states())[name]++;
    const std::optional<JobState> state = ParseJobState(name);
    ended += state && IsTerminal(*state) ? 1 : 0;
    cancelled += state == JobState::kCancelled ? 1 : 0;
  }
  const SweepState state = ended < sweep.jobs_size() ? SweepState::kRunning
                           : cancelled > 0           ? SweepState::kCancelled
                                                     : SweepState::kFinished;
  out.set_state(std::string(SweepStateName(state)));
  return out;
}

absl::StatusOr<const v1::Sweep*> Coordinator::FindSweepLocked(const std::string& id) const {
  if (!IsValidId(id)) return absl::InvalidArgumentError("sweep id: malformed");
  auto it = table_->sweeps().find(id);
  if (it == table_->sweeps().end())
    return absl::NotFoundError(absl::StrCat("sweep '", id, "' not found"));
  return &it->second;
}

absl::StatusOr<v1::Sweep> Coordinator::GetSweep(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  LOOM_ASSIGN_OR_RETURN(const v1::Sweep* sweep, FindSweepLocked(id));
  return SweepWithStates(*sweep);
}

absl::StatusOr<v1::ListSweepsResponse> Coordinator::ListSweeps(int page_size,
                                                               const std::string& page_token,
                                                               const std::string& owner,
                                                               const std::string& label_selector) {
  LOOM_RETURN_IF_ERROR(CheckPageSize(page_size));
  LOOM_ASSIGN_OR_RETURN(const auto labels, ParseLabelSelector(label_selector));
  const std::string filter =
      owner.empty() && label_selector.empty() ? "" : absl::StrCat(owner, "\x1e", label_selector);
  LOOM_ASSIGN_OR_RETURN(const std::string after, DecodePageToken(page_token, "sweeps", filter));
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListSweepsResponse out;
  for (auto it = table_->sweeps().upper_bound(after); it != table_->sweeps().end(); ++it) {
    const v1::Sweep& sweep = it->second;
    if (!owner.empty() && sweep.submitted_by() != owner) continue;
    if (!HasLabels(sweep.spec().labels(), labels)) continue;
    if (out.sweeps_size() == page_size) {
      out.set_next_page_token(EncodePageToken("sweeps", filter, out.sweeps(page_size - 1).id()));
      break;
    }
    v1::Sweep* s = out.add_sweeps();
    *s = SweepWithStates(sweep);
    s->clear_jobs();  // the list stays small; GET /v1/sweeps/{id} has them
  }
  return out;
}

absl::StatusOr<v1::Sweep> Coordinator::CancelSweep(const std::string& id, const Caller& caller) {
  std::lock_guard<std::mutex> lock(mutex_);
  LOOM_ASSIGN_OR_RETURN(const v1::Sweep* sweep, FindSweepLocked(id));
  LOOM_RETURN_IF_ERROR(MayChange(caller, "sweep", id, sweep->submitted_by()));
  const std::string& user = caller.user;
  Txn txn;
  for (const v1::SweepJob& sj : sweep->jobs()) {
    auto job = table_->jobs().find(sj.job_id());
    if (job == table_->jobs().end() || IsTerminal(job->second)) continue;
    table_->Save(txn, job->second);
    job->second.set_cancel_requested(true);
    table_->SetState(txn, job->second, JobState::kCancelled,
                     absl::StrCat("sweep ", id, " cancelled by ", user));
  }
  LOOM_RETURN_IF_ERROR(table_->Commit(txn));
  wake_.notify_all();
  return SweepWithStates(*sweep);
}

absl::StatusOr<std::string> Coordinator::AddReportBaselineLocked(
    const std::string& baseline, v1::Sweep& sweep, std::map<std::string, v1::Job>& jobs) const {
  auto cells_text = [](const v1::Sweep& s) { return absl::StrJoin(s.cells(), "; "); };
  if (baseline.size() > 256) return FieldError("baseline", "longer than 256 characters");
  const size_t slash = baseline.find('/');
  const std::string other_id = slash == std::string::npos ? sweep.id() : baseline.substr(0, slash);
  const std::string cell = slash == std::string::npos ? baseline : baseline.substr(slash + 1);
  if (other_id == sweep.id()) {
    if (!Contains(sweep.cells(), cell)) {
      return FieldError("baseline", absl::StrCat("no cell named '", cell.substr(0, 200),
                                                 "' (cells: ", cells_text(sweep), ")"));
    }
    sweep.mutable_spec()->set_baseline(cell);
    return std::string();
  }
  auto it = IsValidId(other_id) ? table_->sweeps().find(other_id) : table_->sweeps().end();
  if (it == table_->sweeps().end()) {
    return FieldError("baseline", absl::StrCat("no sweep '", other_id.substr(0, 100),
                                               "' (expected a cell, or SWEEP_ID/CELL)"));
  }
  const v1::Sweep& other = it->second;
  if (!Contains(other.cells(), cell)) {
    return FieldError("baseline",
                      absl::StrCat(other_id, " has no cell named '", cell.substr(0, 200),
                                   "' (cells: ", cells_text(other), ")"));
  }
  if (Contains(sweep.cells(), baseline)) {
    return FieldError("baseline", absl::StrCat("'", baseline, "' is also a cell of ", sweep.id()));
  }
  sweep.add_cells(baseline);
  for (const v1::SweepJob& sj : other.jobs()) {
    if (sj.cell() != cell) continue;
    v1::SweepJob* added = sweep.add_jobs();
    *added = sj;
    added->set_cell(baseline);
    auto job = table_->jobs().find(sj.job_id());
    if (job != table_->jobs().end()) jobs[sj.job_id()] = job->second;
  }
  sweep.mutable_spec()->set_baseline(baseline);
  return other_id;
}

namespace {

// What a merged report knows of each of its cells: the seeds it has so far and its first job.
struct MergedCells {
  std::map<std::string, std::set<uint64_t>> seeds;
  std::map<std::string, v1::Job> first;
};

// `other`'s jobs of the cells `sweep` has too, into `sweep` and `jobs` (from `all`); a warning per
// cell whose jobs differ besides the seed, and one naming the cells `sweep` does not have.
absl::Status MergeSweep(const v1::Sweep& other, const std::map<std::string, v1::Job>& all,
                        MergedCells& cells, v1::Sweep& sweep, std::map<std::string, v1::Job>& jobs,
                        std::vector<std::string>& warnings) {
  std::vector<std::string> unmatched;
  for (const std::string& cell : other.cells()) {
    if (!Contains(sweep.cells(), cell)) unmatched.push_back(absl::StrCat("'", cell, "'"));
  }
  if (unmatched.size() == static_cast<size_t>(other.cells_size())) {
    return FieldError("merge",
                      absl::StrCat(other.id(), " has no cell named like one of ", sweep.id(),
                                   "'s (its cells: ", absl::StrJoin(other.cells(), "; "), ")"));
  }
  std::set<std::string> compared;
  for (const v1::SweepJob& sj : other.jobs()) {
    if (!Contains(sweep.cells(), sj.cell())) continue;
    if (!cells.seeds[sj.cell()].insert(sj.seed()).second) {
      return FieldError("merge",
                        absl::StrCat(other.id(), "'s cell '", sj.cell(), "' has seed ", sj.seed(),
                                     ", which the cell has already: a seed counts once"));
    }
    *sweep.add_jobs() = sj;
    auto job = all.find(sj.job_id());
    if (job == all.end()) continue;
    jobs[sj.job_id()] = job->second;
    auto own = cells.first.find(sj.cell());
    if (own == cells.first.end() || !compared.insert(sj.cell()).second) continue;
    const std::vector<std::string> differ = SpecDifferencesBesidesSeed(job->second, own->second);
    if (differ.empty()) continue;
    warnings.push_back(absl::StrCat("cell '", sj.cell(), "' of ", other.id(), " differs from ",
                                    sweep.id(),
                                    "'s besides the seed: ", absl::StrJoin(differ, ", ")));
  }
  if (!unmatched.empty()) {
    warnings.push_back(absl::StrCat(other.id(), "'s cells ", absl::StrJoin(unmatched, ", "),
                                    " have no namesake in ", sweep.id(), ": not merged"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> Coordinator::AddReportMergeLocked(
    const std::vector<std::string>& merge, v1::Sweep& sweep,
    std::map<std::string, v1::Job>& jobs) const {
  constexpr size_t kMaxMerged = 16;
  if (merge.size() > kMaxMerged) {
    return FieldError("merge", absl::StrCat("at most ", kMaxMerged, " sweeps"));
  }
  MergedCells cells;
  for (const v1::SweepJob& sj : sweep.jobs()) {
    cells.seeds[sj.cell()].insert(sj.seed());
    auto it = jobs.find(sj.job_id());
    if (it != jobs.end()) cells.first.emplace(sj.cell(), it->second);
  }
  std::vector<std::string> warnings;
  std::set<std::string> listed;
  for (const std::string& id : merge) {
    if (id == sweep.id()) return FieldError("merge", absl::StrCat(id, " is the reported sweep"));
    if (!listed.insert(id).second) return FieldError("merge", absl::StrCat(id, " is listed twice"));
    auto it = IsValidId(id) ? table_->sweeps().find(id) : table_->sweeps().end();
    if (it == table_->sweeps().end()) {
      return FieldError("merge", absl::StrCat("no sweep '", id.substr(0, 100), "'"));
    }
    LOOM_RETURN_IF_ERROR(MergeSweep(it->second, table_->jobs(), cells, sweep, jobs, warnings));
  }
  return warnings;
}

namespace {

// The first stored pair of jobs with one seed, of `cell` and of `baseline` (nulls if none).
std::pair<const v1::Job*, const v1::Job*> PairedJobs(const v1::Sweep& sweep,
                                                     const std::map<std::string, v1::Job>& jobs,
                                                     const std::string& cell,
                                                     const std::string& baseline) {
  std::map<uint64_t, const v1::Job*> base;
  for (const v1::SweepJob& sj : sweep.jobs()) {
    auto it = jobs.find(sj.job_id());
    if (sj.cell() == baseline && it != jobs.end()) base[sj.seed()] = &it->second;
  }
  for (const v1::SweepJob& sj : sweep.jobs()) {
    auto it = jobs.find(sj.job_id());
    auto b = base.find(sj.seed());
    if (sj.cell() == cell && it != jobs.end() && b != base.end()) return {&it->second, b->second};
  }
  return {nullptr, nullptr};
}

// A baseline from another sweep: its cell's sweep_id (in a report's cells or curves' cells).
template <typename Cell>
void MarkBaselineSweep(const std::string& baseline, const std::string& baseline_sweep,
                       google::protobuf::RepeatedPtrField<Cell>* cells) {
  for (Cell& cell : *cells) {
    if (cell.cell() == baseline) cell.set_sweep_id(baseline_sweep);
  }
}

// A baseline from another sweep: a warning per cell whose jobs' specs differ from the
// baseline's at one seed in more than the model (the pairing then compares more).
std::vector<std::string> BaselineWarnings(const v1::Sweep& sweep,
                                          const std::map<std::string, v1::Job>& jobs) {
  const std::string& baseline = sweep.spec().baseline();
  std::vector<std::string> warnings;
  for (const std::string& cell : sweep.cells()) {
    if (cell == baseline) continue;
    const auto [job, base] = PairedJobs(sweep, jobs, cell, baseline);
    if (job == nullptr) continue;
    const std::vector<std::string> differ = SpecDifferencesBesidesModel(*job, *base);
    if (differ.empty()) continue;
    warnings.push_back(
        absl::StrCat("cell '", cell, "' and the baseline '", baseline,
                     "' differ in more than the model: ", absl::StrJoin(differ, ", ")));
  }
  return warnings;
}

}  // namespace

struct Coordinator::ReportedSweep {
  v1::Sweep sweep;  // its spec's metric and baseline: the query's where it sets them
  std::map<std::string, v1::Job> jobs;
  std::string baseline_sweep;  // set when the baseline is another sweep's cell
  std::vector<std::string> merge_warnings;
};

absl::StatusOr<Coordinator::ReportedSweep> Coordinator::ReportedSweepOf(const std::string& id,
                                                                        const ReportQuery& query) {
  if (!IsValidId(id)) return absl::InvalidArgumentError("sweep id: malformed");
  ReportedSweep r;
  std::lock_guard<std::mutex> lock(mutex_);
  LOOM_ASSIGN_OR_RETURN(const v1::Sweep* found, FindSweepLocked(id));
  r.sweep = *found;
  for (const v1::SweepJob& sj : r.sweep.jobs()) {
    auto job = table_->jobs().find(sj.job_id());
    if (job != table_->jobs().end()) r.jobs[sj.job_id()] = job->second;
  }
  if (!query.merge.empty()) {
    LOOM_ASSIGN_OR_RETURN(r.merge_warnings, AddReportMergeLocked(query.merge, r.sweep, r.jobs));
  }
  if (!query.baseline.empty()) {
    LOOM_ASSIGN_OR_RETURN(r.baseline_sweep,
                          AddReportBaselineLocked(query.baseline, r.sweep, r.jobs));
  }
  if (!query.metric.empty()) r.sweep.mutable_spec()->set_metric(query.metric);
  return r;
}

absl::StatusOr<v1::SweepReport> Coordinator::ReportSweep(const std::string& id,
                                                         const ReportQuery& query) {
  // The names now; the combination (a reach threshold fits the metric) once the sweep's own
  // fields fill in what the query leaves out.
  LOOM_RETURN_IF_ERROR(
      CheckMetricAndSelect(query.metric, query.select == "reach" ? "" : query.select, 0));
  LOOM_ASSIGN_OR_RETURN(ReportedSweep r, ReportedSweepOf(id, query));
  // A report of another metric or selection than the sweep's own: the same jobs, read again.
  if (!query.select.empty()) r.sweep.mutable_spec()->set_select(query.select);
  if (query.length.has_value()) r.sweep.mutable_spec()->set_length(*query.length);
  if (query.threshold.has_value()) r.sweep.mutable_spec()->set_threshold(*query.threshold);
  const v1::SweepSpec& spec = r.sweep.spec();  // the overrides combined with the sweep's own
  LOOM_RETURN_IF_ERROR(
      CheckMetricAndSelect(spec.metric(), spec.select(), spec.length(), spec.threshold()));
  v1::SweepReport report = BuildSweepReport(r.sweep, r.jobs);  // the bootstrap runs unlocked
  if (!r.baseline_sweep.empty()) {
    MarkBaselineSweep(r.sweep.spec().baseline(), r.baseline_sweep, report.mutable_cells());
    for (std::string& w : BaselineWarnings(r.sweep, r.jobs)) report.add_warnings(std::move(w));
  }
  for (const std::string& id : query.merge) report.add_merged_sweeps(id);
  for (const std::string& w : r.merge_warnings) report.add_warnings(w);
  return report;
}

absl::StatusOr<v1::SweepCurves> Coordinator::SweepCurves(const std::string& id,
                                                         const ReportQuery& query) {
  LOOM_RETURN_IF_ERROR(CheckMetricAndSelect(query.metric, "", 0));
  LOOM_ASSIGN_OR_RETURN(ReportedSweep r, ReportedSweepOf(id, query));
  v1::SweepCurves curves = BuildSweepCurves(r.sweep, r.jobs);
  if (!r.baseline_sweep.empty()) {
    MarkBaselineSweep(r.sweep.spec().baseline(), r.baseline_sweep, curves.mutable_cells());
    for (std::string& w : BaselineWarnings(r.sweep, r.jobs)) curves.add_warnings(std::move(w));
  }
  for (const std::string& id : query.merge) curves.add_merged_sweeps(id);
  for (const std::string& w : r.merge_warnings) curves.add_warnings(w);
  return curves;
}

}  // namespace loom::coordinator
