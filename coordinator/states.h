// The states of jobs, workers and sweeps as enums, each with its one name table. The names are
// what control.proto's string fields, the JSON API, the metrics labels and RocksDB carry; the
// coordinator's logic compares enums and converts at that boundary, through these functions.
#ifndef LOOM_COORDINATOR_STATES_H_
#define LOOM_COORDINATOR_STATES_H_

#include <optional>
#include <vector>

#include "absl/strings/string_view.h"
#include "loom/v1/control.pb.h"

namespace loom::coordinator {

enum class JobState { kQueued, kScheduled, kRunning, kRetrying, kSucceeded, kFailed, kCancelled };
enum class WorkerState { kAlive, kLost };
// Derived from a sweep's jobs, never stored on its own.
enum class SweepState { kRunning, kFinished, kCancelled };

absl::string_view JobStateName(JobState state);
std::optional<JobState> ParseJobState(absl::string_view name);
std::vector<absl::string_view> JobStateNames();  // every job state, in lifecycle order
absl::string_view WorkerStateName(WorkerState state);
std::optional<WorkerState> ParseWorkerState(absl::string_view name);
absl::string_view SweepStateName(SweepState state);

bool IsTerminal(JobState state);  // succeeded, failed, cancelled: nothing more happens
bool IsActive(JobState state);    // scheduled, running: the attempt holds its placement

// The proto boundary. A stored name outside the table reads as nullopt, which matches no state.
std::optional<JobState> JobStateOf(const v1::Job& job);
void SetJobState(v1::Job& job, JobState state);
bool IsTerminal(const v1::Job& job);
bool IsActive(const v1::Job& job);
std::optional<WorkerState> WorkerStateOf(const v1::Worker& worker);
void SetWorkerState(v1::Worker& worker, WorkerState state);
bool IsAlive(const v1::Worker& worker);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_STATES_H_
