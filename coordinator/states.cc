#include "coordinator/states.h"

#include <string>
#include <utility>

namespace loom::coordinator {
namespace {

// The name tables: the only place the state strings are spelled.
constexpr std::pair<JobState, absl::string_view> kJobStates[] = {
    {JobState::kQueued, "queued"},       {JobState::kScheduled, "scheduled"},
    {JobState::kRunning, "running"},     {JobState::kRetrying, "retrying"},
    {JobState::kSucceeded, "succeeded"}, {JobState::kFailed, "failed"},
    {JobState::kCancelled, "cancelled"},
};
constexpr std::pair<WorkerState, absl::string_view> kWorkerStates[] = {
    {WorkerState::kAlive, "alive"},
    {WorkerState::kLost, "lost"},
};
constexpr std::pair<SweepState, absl::string_view> kSweepStates[] = {
    {SweepState::kRunning, "running"},
    {SweepState::kFinished, "finished"},
    {SweepState::kCancelled, "cancelled"},
};

template <typename E, size_t N>
absl::string_view NameIn(const std::pair<E, absl::string_view> (&table)[N], E state) {
  for (const auto& [value, name] : table) {
    if (value == state) return name;
  }
  return "";
}

template <typename E, size_t N>
std::optional<E> ParseIn(const std::pair<E, absl::string_view> (&table)[N],
                         absl::string_view name) {
  for (const auto& [value, n] : table) {
    if (n == name) return value;
  }
  return std::nullopt;
}

}  // namespace

absl::string_view JobStateName(JobState state) { return NameIn(kJobStates, state); }
std::optional<JobState> ParseJobState(absl::string_view name) { return ParseIn(kJobStates, name); }

std::vector<absl::string_view> JobStateNames() {
  std::vector<absl::string_view> names;
  for (const auto& [value, name] : kJobStates) names.push_back(name);
  return names;
}

absl::string_view WorkerStateName(WorkerState state) { return NameIn(kWorkerStates, state); }
std::optional<WorkerState> ParseWorkerState(absl::string_view name) {
  return ParseIn(kWorkerStates, name);
}

absl::string_view SweepStateName(SweepState state) { return NameIn(kSweepStates, state); }

bool IsTerminal(JobState state) {
  return state == JobState::kSucceeded || state == JobState::kFailed ||
         state == JobState::kCancelled;
}

bool IsActive(JobState state) {
  return state == JobState::kScheduled || state == JobState::kRunning;
}

std::optional<JobState> JobStateOf(const v1::Job& job) { return ParseJobState(job.state()); }

void SetJobState(v1::Job& job, JobState state) { job.set_state(std::string(JobStateName(state))); }

bool IsTerminal(const v1::Job& job) {
  const std::optional<JobState> state = JobStateOf(job);
  return state && IsTerminal(*state);
}

bool IsActive(const v1::Job& job) {
  const std::optional<JobState> state = JobStateOf(job);
  return state && IsActive(*state);
}

std::optional<WorkerState> WorkerStateOf(const v1::Worker& worker) {
  return ParseWorkerState(worker.state());
}

void SetWorkerState(v1::Worker& worker, WorkerState state) {
  worker.set_state(std::string(WorkerStateName(state)));
}

bool IsAlive(const v1::Worker& worker) { return WorkerStateOf(worker) == WorkerState::kAlive; }

}  // namespace loom::coordinator
