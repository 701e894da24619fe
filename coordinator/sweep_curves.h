// A sweep's curves (GET /v1/sweeps/{id}/curves, docs/sweeps.md): the report's statistics at every
// evaluation step instead of one selected value. Per cell, its metric's mean and 95% interval
// across seeds; per cell other than the baseline, cell - baseline paired by seed with its 95%
// paired-t interval. A pure function of the sweep and its jobs, like BuildSweepReport.
#ifndef LOOM_COORDINATOR_SWEEP_CURVES_H_
#define LOOM_COORDINATOR_SWEEP_CURVES_H_

#include <map>
#include <string>

#include "loom/v1/control.pb.h"

namespace loom::coordinator {

// Reads each job's held-out evaluations at the training length (its reasoning evaluations for a
// reasoning metric), the latest attempt's at each step as the report does. Running jobs count
// with the evaluations they have; failed and cancelled jobs are left out, as the report leaves
// them out. Each point's interval is pointwise (not simultaneous over steps).
v1::SweepCurves BuildSweepCurves(const v1::Sweep& sweep,
                                 const std::map<std::string, v1::Job>& jobs);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_SWEEP_CURVES_H_
