// Sweeps (docs/sweeps.md): a base job, cells made of JobSpec overrides (a grid and/or a list),
// and seeds. Expansion into ordinary jobs (sweep_cells.h) and the report (per-cell intervals,
// paired differences against a baseline cell) are pure functions of the sweep and its jobs; the
// coordinator stores and schedules.
#ifndef LOOM_COORDINATOR_SWEEP_H_
#define LOOM_COORDINATOR_SWEEP_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/sweep_cells.h"
#include "loom/v1/control.pb.h"

namespace loom::coordinator {

// Whether `e` is one of the evaluations a metric is read from.
bool CountsFor(const v1::EvalResult& e, const std::string& metric);
// The value of a metric (eval_loss | accuracy | exact_match | pass@1 | maj@k | answered).
double EvalMetric(const v1::EvalResult& e, const std::string& metric);

// The top-level fields in which two jobs' specs differ (jobs of one seed: seed-derived fields
// such as data.seed are compared too), besides the model, the seed and what
// does not change the run (paths, threads, distributed transport), and "world_size" when the
// jobs' world sizes differ: what else a comparison of the two by seed compares.
std::vector<std::string> SpecDifferencesBesidesModel(const v1::Job& a, const v1::Job& b);

// The same for two jobs of different seeds that should be one cell's (a pooled sweep's cell
// against this sweep's): the model is compared, and so are data.seed and model.init_seed where
// a spec sets them to something else than its seed.
std::vector<std::string> SpecDifferencesBesidesSeed(const v1::Job& a, const v1::Job& b);

// The report of a sweep from its jobs (jobs missing from the map count as pending).
v1::SweepReport BuildSweepReport(const v1::Sweep& sweep,
                                 const std::map<std::string, v1::Job>& jobs);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_SWEEP_H_
