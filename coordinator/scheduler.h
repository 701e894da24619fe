// Gang scheduling of queued jobs onto worker pools: a pure function of the queue, the free
// slots and the running jobs, so the policy is unit-tested (and simulated at 10 000 nodes by
// loom-sim) without a coordinator. docs/scheduler.md describes it in full.
//
// Order. A job's band is its priority plus one point per aging period waited (so nothing waits
// forever behind a stream of higher priorities). Bands are served highest first; within a band
// the users take turns by fair share: the next job comes from the user whose (slots held now +
// decayed average of slots held) / weight is lowest, and each job placed raises its user's
// score. One user's jobs go in queue order; a sweep's in seed-major order (every cell's first
// seed before any cell's second), so that a partial sweep's report stays paired.
//
// Placement. A job runs only when all of its world_size ranks fit on workers whose labels match
// its pool selector (gang, all-or-nothing), the fullest-free workers first. A job that does not
// fit is skipped so smaller jobs behind it can backfill, until it has waited reserve_after_ms:
// from then on it reserves the matching free slots as they appear. A job beyond a quota, or
// whose sweep has max_concurrent jobs running, waits with the reason and reserves nothing.
//
// Preemption. A job that has waited preempt_after_ms and cannot be placed may stop running jobs
// of strictly lower priority: those that lose the least work (oldest-checkpoint age first, then
// fewest ranks), as few as free its gang, never one protected (it restarted after a preemption
// less than min_run_ms ago) or one already stopping. It then reserves the free matching slots
// until the victims' ranks have gone, and goes before every other job until it is placed, so
// that the slots they free are its own (otherwise an older job could take them and the
// preemptor preempt again).
#ifndef LOOM_COORDINATOR_SCHEDULER_H_
#define LOOM_COORDINATOR_SCHEDULER_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace loom::coordinator {

struct QueuedJob {
  std::string id;
  int world_size = 1;
  int priority = 0;
  std::map<std::string, std::string> pool;  // required worker labels
  int64_t queued_since_ms = 0;
  std::string user;         // the owner: quotas and fair share
  std::string project;      // its `project` label ("" = none), for project quotas
  std::string sweep;        // the sweep that made it ("" = none)
  int sweep_order = 0;      // seed-major position in the sweep: seed index × cells + cell index
  bool preempting = false;  // jobs were stopped for it: it goes first until placed
};

// A scheduled or running job: what preemption may choose from.
struct RunningJob {
  std::string id;
  int priority = 0;
  std::vector<std::pair<std::string, int>> slots;  // worker -> ranks it holds there
  int64_t checkpoint_age_ms = 0;   // since its newest checkpoint, or its attempt's start
  int64_t protected_until_ms = 0;  // restarted after a preemption: not stopped again before
  bool stopping = false;  // asked to stop for a preemption already: its slots will come free
};

// Limits an admin set on the slots one user's, or one project's, jobs hold at once (absent: no
// limit), and what they hold now (scheduled and running jobs); a sweep's max_concurrent and
// its active jobs.
struct Quotas {
  std::map<std::string, int> user_limit, project_limit;
  std::map<std::string, int> user_used, project_used;
  std::map<std::string, int> sweep_limit, sweep_active;
};

// Fair share between users. `weight` absent = 1; `average` is the user's decayed average of
// slots held (UsageLedger); `held` the slots their scheduled and running jobs hold now.
struct FairShare {
  std::map<std::string, double> weight;
  std::map<std::string, double> average;
  std::map<std::string, int> held;
};

// Decayed historical usage, as Slurm and Kueue keep it: an exponentially weighted average of
// the slots each user held, with a configurable half-life. Adding an interval later (rebuilding
// it from job histories) gives the same value as having advanced through it.
class UsageLedger {
 public:
  explicit UsageLedger(double half_life_s = 86400);
  // Moves time to now_ms; `held` is what each user held since the last call.
  void Advance(int64_t now_ms, const std::map<std::string, int>& held);
  // `slots` held from start_ms to end_ms (both <= the ledger's time).
  void AddInterval(const std::string& user, int slots, int64_t start_ms, int64_t end_ms);
  const std::map<std::string, double>& averages() const { return average_; }
  int64_t now_ms() const { return now_ms_; }

 private:
  double Decay(int64_t ms) const;
  double rate_per_ms_;
  int64_t now_ms_ = 0;
  std::map<std::string, double> average_;
};

struct FreeWorker {
  std::string id;
  std::map<std::string, std::string> labels;
  int slots = 0;       // total
  int free_slots = 0;  // not used by running or stopping ranks
};

struct SchedulerOptions {
  double aging_seconds = 86400;       // one priority point per this many seconds waited
  int64_t reserve_after_ms = 300000;  // a blocked job waiting this long reserves slots
  int64_t preempt_after_ms = 600000;  // a blocked job waiting this long may preempt; < 0: never
  int64_t min_run_ms = 600000;        // a preempted job's next attempt is protected this long
};

struct GangPlacement {
  std::string job_id;
  // Ranks 0..world_size-1 in order; ranks on one worker are contiguous, rank 0 on the first.
  std::vector<std::pair<std::string, std::vector<int>>> workers;
};

// Why a queued job was not placed, in numbers; Explain() words it.
struct Waiting {
  enum Kind {
    kUserQuota,     // a: used, b: limit
    kProjectQuota,  // a: used, b: limit
    kSweepLimit,    // a: active, b: max_concurrent
    kNoWorker,      // no live worker matches the pool
    kTooBig,        // a: slots on matching live workers
    kNoSlots,       // a: free, b: total; reserving / preempting as flagged
  };
  int job = 0;  // index into the queue
  Kind kind = kNoSlots;
  int a = 0, b = 0;
  bool reserving = false;
  int preempting = 0;  // victims asked to stop for it in this pass
};

struct Preemption {
  std::string victim;
  std::string for_job;
};

struct ScheduleResult {
  std::vector<GangPlacement> placed;
  std::vector<Waiting> waiting;
  std::vector<Preemption> preempt;
};

bool LabelsMatch(const std::map<std::string, std::string>& pool,
                 const std::map<std::string, std::string>& labels);

// Why the job would go beyond a quota ("" when it fits them): "quota: alice uses 8 of 8 slots".
std::string OverQuota(const QueuedJob& job, const Quotas& quotas);

ScheduleResult Schedule(const std::vector<QueuedJob>& queue, std::vector<FreeWorker> workers,
                        const SchedulerOptions& options, int64_t now_ms, Quotas quotas = {},
                        const FairShare& share = {}, const std::vector<RunningJob>& running = {});

// Job id -> why it waits, in words ("quota: alice uses 8 of 8 slots").
std::map<std::string, std::string> Explain(const ScheduleResult& result,
                                           const std::vector<QueuedJob>& queue);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_SCHEDULER_H_
