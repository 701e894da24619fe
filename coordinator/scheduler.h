// Gang scheduling of queued jobs onto worker pools: a pure function of the queue and the free
// slots, so the policy is unit-tested without a coordinator.
//
// Policy: jobs are taken by effective priority (priority + waited seconds / aging_seconds, so a
// waiting job gains one priority point per aging period), then by queue time. A job runs only
// when all of its world_size ranks fit on workers whose labels match its pool selector (gang,
// all-or-nothing). A job that does not fit is skipped so smaller jobs behind it can backfill the
// free slots, until it has waited reserve_after_ms: from then on it reserves the matching free
// slots as they appear, so a stream of small jobs cannot starve it. A job whose owner or project
// would go beyond its quota waits (with the reason) and reserves nothing.
#ifndef LOOM_COORDINATOR_SCHEDULER_H_
#define LOOM_COORDINATOR_SCHEDULER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loom::coordinator {

struct QueuedJob {
  std::string id;
  int world_size = 1;
  int priority = 0;
  std::map<std::string, std::string> pool;  // required worker labels
  int64_t queued_since_ms = 0;
  std::string user;     // the owner, for user quotas
  std::string project;  // its `project` label ("" = none), for project quotas
};

// Limits an admin set on the slots one user's, or one project's, jobs hold at once (absent: no
// limit), and what they hold now (scheduled and running jobs).
struct Quotas {
  std::map<std::string, int> user_limit, project_limit;
  std::map<std::string, int> user_used, project_used;
};

struct FreeWorker {
  std::string id;
  std::map<std::string, std::string> labels;
  int slots = 0;       // total
  int free_slots = 0;  // not used by running or stopping ranks
};

struct SchedulerOptions {
  double aging_seconds = 60;          // one priority point per this many seconds waited
  int64_t reserve_after_ms = 300000;  // a blocked job waiting this long reserves slots
};

struct GangPlacement {
  std::string job_id;
  // Ranks 0..world_size-1 in order; ranks on one worker are contiguous, rank 0 on the first.
  std::vector<std::pair<std::string, std::vector<int>>> workers;
};

struct ScheduleResult {
  std::vector<GangPlacement> placed;
  std::map<std::string, std::string> waiting;  // job id -> why it was not placed
};

bool LabelsMatch(const std::map<std::string, std::string>& pool,
                 const std::map<std::string, std::string>& labels);

// Why the job would go beyond a quota ("" when it fits them): "quota: alice uses 8 of 8 slots".
std::string OverQuota(const QueuedJob& job, const Quotas& quotas);

ScheduleResult Schedule(std::vector<QueuedJob> queue, std::vector<FreeWorker> workers,
                        const SchedulerOptions& options, int64_t now_ms, Quotas quotas = {});

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_SCHEDULER_H_
