#include "coordinator/sweep.h"

#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "coordinator/states.h"
#include "coordinator/stats.h"
#include "coordinator/submit_validation.h"
#include "loom/job_curve.h"
#include "loom/proto_json.h"
#include "loom/spec.h"

namespace loom::coordinator {
namespace {

// The evaluation a job's value comes from: its last held-out one (validation evaluations of
// data.splits jobs count as held-out; its last reasoning evaluation for a reasoning metric), the
// one with the lowest eval loss (best by validation), or for `test` its last test evaluation (the
// test split at the best validation epoch). With a length, only the end-of-run evaluations at
// that eval.lengths length count. Null when it has none.
const v1::EvalResult* ChosenEval(const v1::Job& job, const std::string& metric,
                                 const std::string& select, int64_t length) {
  const v1::EvalResult* chosen = nullptr;
  for (const v1::EvalResult* ep : JobCurve(job)) {
    const v1::EvalResult& e = *ep;
    const bool wanted = length > 0         ? e.kind() == "length" && e.length() == length
                        : select == "test" ? e.kind() == "test"
                                           : CountsFor(e, metric);
    if (!wanted) continue;
    if (chosen == nullptr ||
        (select == "best" ? e.eval_loss() < chosen->eval_loss() : e.step() >= chosen->step())) {
      chosen = &e;
    }
  }
  return chosen;
}

// select reach: the earliest held-out evaluation at or past the threshold (a loss at or below
// it); null when none is.
const v1::EvalResult* ReachingEval(const v1::Job& job, const v1::SweepReport& report) {
  const v1::EvalResult* first = nullptr;
  for (const v1::EvalResult* ep : JobCurve(job)) {
    const v1::EvalResult& e = *ep;
    if (!CountsFor(e, report.metric())) continue;
    const double m = EvalMetric(e, report.metric());
    const bool reached =
        report.metric() == "eval_loss" ? m <= report.threshold() : m >= report.threshold();
    if (reached && (first == nullptr || e.step() < first->step())) first = &e;
  }
  return first;
}

// select mean: the metric averaged over a job's held-out evaluations after step 0 (the area
// under its learning curve over the trained steps, in the metric's units when evaluations are
// evenly spaced); the step-0 evaluation only measures the initialisation. Null without one.
std::optional<double> MeanOverEvals(const v1::Job& job, const std::string& metric, int64_t* last) {
  double sum = 0;
  int count = 0;
  for (const v1::EvalResult* ep : JobCurve(job)) {
    const v1::EvalResult& e = *ep;
    if (!CountsFor(e, metric) || e.step() <= 0) continue;
    sum += EvalMetric(e, metric);
    ++count;
    *last = std::max(*last, e.step());
  }
  if (count == 0) return std::nullopt;
  return sum / count;
}

enum class Outcome { kValue, kPending, kFailed };

// What one job of a cell contributes: a value (filled into *v), not yet (pending), or nothing
// (failed, cancelled, or succeeded without an evaluation to read). *from: the one evaluation the
// value is read from (select final, best, test), else null.
Outcome JobOutcome(const v1::Job* job, const v1::SweepReport& report, v1::SeedValue* v,
                   const v1::EvalResult** from) {
  *from = nullptr;
  const std::optional<JobState> state =
      job == nullptr ? std::optional<JobState>(JobState::kQueued) : JobStateOf(*job);
  if (state == JobState::kFailed || state == JobState::kCancelled) return Outcome::kFailed;
  const bool succeeded = state == JobState::kSucceeded;
  const v1::EvalResult* e = nullptr;
  if (report.select() == "reach") {
    // A running job that has reached the threshold has its value already.
    e = job == nullptr ? nullptr : ReachingEval(*job, report);
    if (e != nullptr) {
      v->set_value(static_cast<double>(e->step()));
      v->set_step(e->step());
      return Outcome::kValue;
    }
    e = succeeded ? ChosenEval(*job, report.metric(), "final", 0) : nullptr;
    if (e == nullptr) return succeeded ? Outcome::kFailed : Outcome::kPending;
    v->set_value(static_cast<double>(e->step()));
    v->set_step(e->step());
    v->set_censored(true);
    return Outcome::kValue;
  }
  if (report.select() == "mean") {
    // Only a finished curve: the mean of a running job's first evaluations would favour it.
    if (!succeeded) return Outcome::kPending;
    int64_t last = 0;
    const std::optional<double> m = MeanOverEvals(*job, report.metric(), &last);
    if (!m) return Outcome::kFailed;
    v->set_value(*m);
    v->set_step(last);
    return Outcome::kValue;
  }
  e = succeeded ? ChosenEval(*job, report.metric(), report.select(), report.length()) : nullptr;
  if (e == nullptr) return succeeded ? Outcome::kFailed : Outcome::kPending;
  v->set_value(EvalMetric(*e, report.metric()));
  v->set_step(e->step());
  *from = e;
  return Outcome::kValue;
}

// select reach: which of two seeds' jobs reached the threshold first, where that is known.
void CountOrder(const v1::SeedValue& cell, const v1::SeedValue& base, v1::PairedDifference* d) {
  const int64_t c = cell.step(), b = base.step();
  if (!cell.censored() && !base.censored()) {
    if (c < b) d->set_first(d->first() + 1);
    if (c > b) d->set_later(d->later() + 1);
    if (c == b) d->set_ties(d->ties() + 1);
  } else if (!cell.censored() && c <= b) {  // the baseline had not reached it by step b
    d->set_first(d->first() + 1);
  } else if (!base.censored() && b <= c) {
    d->set_later(d->later() + 1);
  } else {
    d->set_unordered(d->unordered() + 1);
  }
}

// One cell's values by seed, and the evaluation each was read from (select final, best, test).
struct CellSeeds {
  std::map<uint64_t, v1::SeedValue> values;
  std::map<uint64_t, const v1::EvalResult*> evals;
};

// Per problem of a reasoning evaluation, its score under `metric` (the fraction of correct or
// answered samples, or whether the majority answer was right); empty when its per-problem lists
// are missing (an older trainer) or inconsistent (a hostile worker's report).
std::vector<double> ProblemScores(const v1::EvalResult& e, const std::string& metric) {
  const int n = e.problem_samples_size();
  if (n == 0 || e.problem_correct_size() != n || e.problem_answered_size() != n ||
      e.problem_majority_correct_size() != n) {
    return {};
  }
  std::vector<double> out;
  for (int i = 0; i < n; ++i) {
    const int samples = e.problem_samples(i), correct = e.problem_correct(i),
              answered = e.problem_answered(i);
    if (samples <= 0 || correct < 0 || correct > samples || answered < 0 || answered > samples)
      return {};
    out.push_back(metric == "maj@k"      ? (e.problem_majority_correct(i) ? 1.0 : 0.0)
                  : metric == "answered" ? static_cast<double>(answered) / samples
                                         : static_cast<double>(correct) / samples);
  }
  return out;
}

// The paired difference over problems: when every paired seed's two evaluations scored one and
// the same problem set, per problem the cell's score minus the baseline's, averaged over the
// seeds, and the paired t over problems. Nothing when they did not.
void AddProblemDifference(const CellSeeds& cell, const CellSeeds& base, const std::string& metric,
                          v1::PairedDifference* d) {
  std::vector<double> sum;
  std::string problem_set;
  int seeds = 0;
  for (const auto& [seed, e] : cell.evals) {
    auto b = base.evals.find(seed);
    if (b == base.evals.end()) continue;
    if (problem_set.empty()) problem_set = e->problem_set();
    if (problem_set.empty() || e->problem_set() != problem_set ||
        b->second->problem_set() != problem_set) {
      return;
    }
    const std::vector<double> x = ProblemScores(*e, metric), y = ProblemScores(*b->second, metric);
    if (x.empty() || x.size() != y.size() || (!sum.empty() && sum.size() != x.size())) return;
    sum.resize(x.size(), 0.0);
    for (size_t i = 0; i < x.size(); ++i) sum[i] += x[i] - y[i];
    ++seeds;
  }
  if (seeds == 0) return;
  for (double& v : sum) v /= seeds;
  const Interval t = TInterval(sum);
  d->set_problems(static_cast<int>(sum.size()));
  d->set_problem_mean(Mean(sum));
  d->set_problem_t_low(t.low);
  d->set_problem_t_high(t.high);
  d->set_problem_p_value(TTestPValue(sum));
}

// The paired difference of `cell` against the report's baseline over the seeds both have a
// value for (under reach: both reached the threshold; the order counts take the rest).
void AddDifference(const std::string& cell, const std::map<std::string, CellSeeds>& by_cell,
                   v1::SweepReport* report) {
  static const CellSeeds kNone;
  auto seeds = [&](const std::string& name) -> const CellSeeds& {
    auto it = by_cell.find(name);
    return it == by_cell.end() ? kNone : it->second;
  };
  const auto& base_values = seeds(report->baseline()).values;
  v1::PairedDifference* d = report->add_differences();
  d->set_cell(cell);
  d->set_baseline(report->baseline());
  std::vector<double> diffs;
  for (const auto& [seed, v] : seeds(cell).values) {
    auto base = base_values.find(seed);
    if (base == base_values.end()) continue;
    if (report->select() == "reach") CountOrder(v, base->second, d);
    if (!v.censored() && !base->second.censored())
      diffs.push_back(v.value() - base->second.value());
  }
  if (report->select() == "reach") d->set_sign_p_value(SignTestPValue(d->first(), d->later()));
  d->set_n(static_cast<int>(diffs.size()));
  if (diffs.empty()) return;
  const Interval t = TInterval(diffs), boot = BootstrapInterval(diffs);
  d->set_mean(Mean(diffs));
  d->set_sd(SampleSd(diffs));
  d->set_t_low(t.low);
  d->set_t_high(t.high);
  d->set_p_value(TTestPValue(diffs));
  d->set_boot_low(boot.low);
  d->set_boot_high(boot.high);
  if (IsReasoningMetric(report->metric()) && report->select() == "final")
    AddProblemDifference(seeds(cell), seeds(report->baseline()), report->metric(), d);
}

// One cell's statistics into `cell` and its values by seed into *seeds.
void FillCell(const v1::Sweep& sweep, const std::map<std::string, v1::Job>& jobs,
              v1::SweepReport& report, v1::CellStats* cell, CellSeeds* seeds) {
  std::vector<double> values;  // of the seeds that count in the mean (not censored)
  for (const v1::SweepJob& sj : sweep.jobs()) {
    if (sj.cell() != cell->cell()) continue;
    auto it = jobs.find(sj.job_id());
    v1::SeedValue v;
    const v1::EvalResult* from = nullptr;
    switch (JobOutcome(it == jobs.end() ? nullptr : &it->second, report, &v, &from)) {
      case Outcome::kFailed:
        cell->set_failed(cell->failed() + 1);
        continue;
      case Outcome::kPending:
        cell->set_pending(cell->pending() + 1);
        report.set_complete(false);
        continue;
      case Outcome::kValue:
        break;
    }
    v.set_seed(sj.seed());
    v.set_job_id(sj.job_id());
    if (v.censored()) {
      cell->set_censored(cell->censored() + 1);
    } else {
      values.push_back(v.value());
    }
    *cell->add_values() = v;
    seeds->values[sj.seed()] = v;
    if (from != nullptr) seeds->evals[sj.seed()] = from;
  }
  cell->set_n(static_cast<int>(values.size()));
  if (values.empty()) return;
  const Interval ci = TInterval(values);
  cell->set_mean(Mean(values));
  cell->set_sd(SampleSd(values));
  cell->set_ci_low(ci.low);
  cell->set_ci_high(ci.high);
}

}  // namespace

bool CountsFor(const v1::EvalResult& e, const std::string& metric) {
  return IsReasoningMetric(metric) ? e.kind() == "reasoning" : IsHeldOut(e);
}

double EvalMetric(const v1::EvalResult& e, const std::string& metric) {
  if (metric == "accuracy") return e.accuracy();
  if (metric == "exact_match") return e.exact_match();
  if (metric == "pass@1") return e.pass_at_1();
  if (metric == "maj@k") return e.maj_at_k();
  if (metric == "answered") return e.answered();
  return e.eval_loss();
}

namespace {

// The top-level fields of JobSpec in which x and y differ, besides `ignored`; "world_size" too.
std::vector<std::string> DifferingFields(const v1::Job& a, const v1::Job& b, v1::JobSpec x,
                                         v1::JobSpec y, const std::set<std::string>& ignored) {
  std::vector<std::string> out;
  // A 0 set explicitly is the same 0 as one left unset (jobs resolved before 2026-12-07 have no
  // presence for these fields; a preset's jobs now do).
  ClearExplicitZeros(&x);
  ClearExplicitZeros(&y);
  const google::protobuf::Descriptor* d = v1::JobSpec::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {  // fields are moved out of the copies one by one
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (ignored.count(f->name())) continue;
    v1::JobSpec fx, fy;
    x.GetReflection()->SwapFields(&x, &fx, {f});
    y.GetReflection()->SwapFields(&y, &fy, {f});
    if (!google::protobuf::util::MessageDifferencer::Equals(fx, fy)) out.push_back(f->name());
  }
  if (a.world_size() != b.world_size()) out.push_back("world_size");
  return out;
}

// What does not change a run: its name, paths, threads and distributed transport.
const std::set<std::string>& NotOfTheRun() {
  static const std::set<std::string> kFields = {"name",         "seed",
                                                "checkpoint",   "metrics",
                                                "threads",      "dist_timeout_seconds",
                                                "dist_backend", "dist_bucket_bytes"};
  return kFields;
}

// The spec with the fields its seed filled in (data.seed, model.init_seed) cleared; one set
// apart from the seed is kept, so that it still shows as a difference.
v1::JobSpec WithoutSeedFields(v1::JobSpec spec) {
  if (spec.data().seed() == spec.seed()) spec.mutable_data()->clear_seed();
  if (spec.model().init_seed() == spec.seed()) spec.mutable_model()->clear_init_seed();
  return spec;
}

}  // namespace

std::vector<std::string> SpecDifferencesBesidesModel(const v1::Job& a, const v1::Job& b) {
  std::set<std::string> ignored = NotOfTheRun();
  ignored.insert("model");
  return DifferingFields(a, b, a.spec(), b.spec(), ignored);
}

std::vector<std::string> SpecDifferencesBesidesSeed(const v1::Job& a, const v1::Job& b) {
  return DifferingFields(a, b, WithoutSeedFields(a.spec()), WithoutSeedFields(b.spec()),
                         NotOfTheRun());
}

v1::SweepReport BuildSweepReport(const v1::Sweep& sweep,
                                 const std::map<std::string, v1::Job>& jobs) {
  v1::SweepReport report;
  const v1::SweepSpec& spec = sweep.spec();
  report.set_sweep_id(sweep.id());
  report.set_metric(spec.metric().empty() ? "eval_loss" : spec.metric());
  report.set_select(spec.select().empty() ? "final" : spec.select());
  report.set_length(spec.length());
  if (report.select() == "reach") report.set_threshold(spec.threshold());
  report.set_baseline(spec.baseline().empty() && !sweep.cells().empty() ? sweep.cells(0)
                                                                        : spec.baseline());
  report.set_complete(true);
  std::map<std::string, CellSeeds> by_cell;
  for (const std::string& name : sweep.cells()) {
    v1::CellStats* cell = report.add_cells();
    cell->set_cell(name);
    FillCell(sweep, jobs, report, cell, &by_cell[name]);
  }
  for (const std::string& name : sweep.cells()) {
    if (name != report.baseline()) AddDifference(name, by_cell, &report);
  }
  return report;
}

}  // namespace loom::coordinator
