// A sweep's cells as job specs (docs/sweeps.md): the grid and the listed cells expanded, a
// cell's overrides applied to the base spec. Pure functions of the sweep file, in a library of
// their own so that the CLI can expand a sweep without a coordinator (`loom sweep expand`).
#ifndef LOOM_COORDINATOR_SWEEP_CELLS_H_
#define LOOM_COORDINATOR_SWEEP_CELLS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "loom/v1/control.pb.h"

namespace loom::coordinator {

// What one sweep may create (docs/control-plane.md, "Input limits"): checked by CheckSweepSize
// from the request's counts before any cell is built.
inline constexpr int kMaxSweepJobs = 1000;
inline constexpr size_t kMaxSweepSpecBytes = size_t{32} << 20;  // jobs x spec bytes, in all

struct SweepCell {
  std::string name;
  std::vector<std::pair<std::string, google::protobuf::Value>> set;  // path -> value, in order
};

// A report's metric (eval_loss | accuracy | exact_match), selection (final | best | test |
// reach | mean), eval.lengths length (0 = the training length) and, for reach, the threshold;
// empty/0 means the default. Errors name the field.
absl::Status CheckMetricAndSelect(const std::string& metric, const std::string& select,
                                  int64_t length = 0, double threshold = 0);

// pass@1 | maj@k | answered: read from the reasoning evaluations (kind reasoning), which are
// what a job's curve has for them; the other metrics from its held-out evaluations.
bool IsReasoningMetric(const std::string& metric);

// cells x grid combinations x seeds <= kMaxSweepJobs and those jobs' specs within
// kMaxSweepSpecBytes, counted from the request alone: nothing proportional to the product is
// allocated before it holds. Errors name the field.
absl::Status CheckSweepSize(const v1::SweepSpec& spec);

// Checks the spec's own fields (seeds, metric, select, sizes) and expands its cells: the grid's
// combinations (paths in order, values in order), crossed with the listed cells when both are
// given. Errors name the field.
absl::StatusOr<std::vector<SweepCell>> ExpandSweep(const v1::SweepSpec& spec);

// `base` with the cell's overrides applied (paths like "optimizer.lr" or
// "model.schedule[0].attention.plugin", relative to the JobSpec; missing objects are created, an
// index may append one element) and spec.seed = seed. Errors name the cell and the path.
absl::StatusOr<v1::JobSpec> ApplyCell(const v1::JobSpec& base, const SweepCell& cell,
                                      uint64_t seed);

// A cell value as a name part: strings as they are, anything else as JSON.
std::string ValueText(const google::protobuf::Value& v);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_SWEEP_CELLS_H_
