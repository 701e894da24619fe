#include "coordinator/sweep_curves.h"

#include <vector>

#include "coordinator/states.h"
#include "coordinator/stats.h"
#include "coordinator/sweep.h"
#include "loom/job_curve.h"

namespace loom::coordinator {
namespace {

using SeedSteps = std::map<uint64_t, std::map<int64_t, double>>;  // seed -> step -> value

// One cell's values by seed and step. Clears *complete when one of its jobs has not ended.
SeedSteps CellValues(const v1::Sweep& sweep, const std::map<std::string, v1::Job>& jobs,
                     const std::string& cell, const std::string& metric, bool* complete) {
  SeedSteps out;
  for (const v1::SweepJob& sj : sweep.jobs()) {
    if (sj.cell() != cell) continue;
    auto it = jobs.find(sj.job_id());
    if (it == jobs.end() || !IsTerminal(it->second)) *complete = false;
    if (it == jobs.end()) continue;
    const std::optional<JobState> state = JobStateOf(it->second);
    if (state == JobState::kFailed || state == JobState::kCancelled) continue;
    for (const v1::EvalResult* e : JobCurve(it->second)) {
      if (CountsFor(*e, metric)) out[sj.seed()][e->step()] = EvalMetric(*e, metric);
    }
  }
  return out;
}

void AddPoint(int64_t step, const std::vector<double>& values, bool paired,
              google::protobuf::RepeatedPtrField<v1::CurvePoint>* points) {
  v1::CurvePoint* p = points->Add();
  const Interval ci = TInterval(values);
  p->set_step(step);
  p->set_n(static_cast<int>(values.size()));
  p->set_mean(Mean(values));
  p->set_sd(SampleSd(values));
  p->set_ci_low(ci.low);
  p->set_ci_high(ci.high);
  if (paired) p->set_p_value(TTestPValue(values));
}

void FillCellCurve(const SeedSteps& values, v1::CellCurve* curve) {
  std::map<int64_t, std::vector<double>> by_step;
  for (const auto& [seed, steps] : values) {
    for (const auto& [step, v] : steps) by_step[step].push_back(v);
  }
  for (const auto& [step, vs] : by_step) AddPoint(step, vs, false, curve->mutable_points());
  curve->set_seeds(static_cast<int>(values.size()));
}

// d = cell - baseline at each step, over the seeds both evaluated at that step.
void FillDifferenceCurve(const SeedSteps& cell, const SeedSteps& base, v1::DifferenceCurve* curve) {
  std::map<int64_t, std::vector<double>> by_step;
  for (const auto& [seed, steps] : cell) {
    auto b = base.find(seed);
    if (b == base.end()) continue;
    for (const auto& [step, v] : steps) {
      auto bv = b->second.find(step);
      if (bv != b->second.end()) by_step[step].push_back(v - bv->second);
    }
  }
  for (const auto& [step, ds] : by_step) AddPoint(step, ds, true, curve->mutable_points());
}

}  // namespace

v1::SweepCurves BuildSweepCurves(const v1::Sweep& sweep,
                                 const std::map<std::string, v1::Job>& jobs) {
  v1::SweepCurves curves;
  const v1::SweepSpec& spec = sweep.spec();
  curves.set_sweep_id(sweep.id());
  curves.set_metric(spec.metric().empty() ? "eval_loss" : spec.metric());
  curves.set_baseline(spec.baseline().empty() && !sweep.cells().empty() ? sweep.cells(0)
                                                                        : spec.baseline());
  bool complete = true;
  std::map<std::string, SeedSteps> by_cell;
  for (const std::string& name : sweep.cells()) {
    by_cell[name] = CellValues(sweep, jobs, name, curves.metric(), &complete);
    v1::CellCurve* cell = curves.add_cells();
    cell->set_cell(name);
    FillCellCurve(by_cell[name], cell);
  }
  curves.set_complete(complete);
  for (const std::string& name : sweep.cells()) {
    if (name == curves.baseline()) continue;
    v1::DifferenceCurve* d = curves.add_differences();
    d->set_cell(name);
    d->set_baseline(curves.baseline());
    FillDifferenceCurve(by_cell[name], by_cell[curves.baseline()], d);
  }
  return curves;
}

}  // namespace loom::coordinator
