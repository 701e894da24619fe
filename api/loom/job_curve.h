// A job's evaluations as one curve. A job restarted from a checkpoint evaluates again at the
// steps after that checkpoint which its earlier attempt had evaluated, and the job keeps both
// (each with its attempt); the run that produced the job's result is the latest attempt's, so
// per (kind, length, step) only its evaluation counts. The sweep report and `loom sweep report
// --plot` read jobs through this (experiments/export_sweep.py the same way, in Python).
#ifndef LOOM_API_JOB_CURVE_H_
#define LOOM_API_JOB_CURVE_H_

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "loom/v1/control.pb.h"

namespace loom {

// A held-out evaluation: fresh samples (heldout, or no kind from older trainers) or the
// validation split, as opposed to the test split and end-of-run length evaluations.
inline bool IsHeldOut(const v1::EvalResult& e) {
  return e.kind().empty() || e.kind() == "heldout" || e.kind() == "validation";
}

// The job's evaluations, the latest attempt's at each (kind, length, step), in the job's order.
inline std::vector<const v1::EvalResult*> JobCurve(const v1::Job& job) {
  std::map<std::tuple<std::string, int64_t, int64_t>, const v1::EvalResult*> latest;
  for (const auto& e : job.evals()) {
    const v1::EvalResult*& at = latest[{e.kind(), e.length(), e.step()}];
    if (at == nullptr || e.attempt() >= at->attempt()) at = &e;
  }
  std::vector<const v1::EvalResult*> out;
  for (const auto& e : job.evals()) {
    if (latest[{e.kind(), e.length(), e.step()}] == &e) out.push_back(&e);
  }
  return out;
}

}  // namespace loom

#endif  // LOOM_API_JOB_CURVE_H_
