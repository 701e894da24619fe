#include "sim/simulator.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <string>
#include <unordered_map>

#include "absl/strings/str_format.h"
#include "coordinator/clock.h"
#include "coordinator/states.h"

namespace loom::sim {

using coordinator::JobState;

namespace {

struct Node {
  std::string id;
  std::map<std::string, std::string> labels;
  int free = 0;
  bool up = true;
  int64_t repaired_at = 0;
};

struct Job {
  const TraceJob* t = nullptr;
  std::string id;
  JobState state = JobState::kQueued;
  bool submitted = false;
  int64_t remaining_ms = 0;  // work left from the newest checkpoint
  int64_t attempt_start = 0;
  int64_t first_start = -1;
  int64_t stop_at = 0;    // stopping for a preemption: when its ranks have exited
  int stopping_for = -1;  // the job it stops for
  int64_t protected_until = 0;
  std::vector<std::pair<int, int>> placement;  // node, GPUs
};

Percentiles Summarise(std::vector<double> v) {
  Percentiles p;
  p.count = static_cast<int64_t>(v.size());
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))]; };
  p.p50 = at(0.5);
  p.p99 = at(0.99);
  p.max = v.back();
  return p;
}

double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

class ClusterSim {
 public:
  ClusterSim(const Trace& trace, const TraceOptions& to, const SimOptions& o)
      : trace_(trace), options_(o), clock_(0), ledger_(o.half_life_s) {
    const int special = static_cast<int>(to.nodes * to.special_pool_fraction);
    for (int i = 0; i < to.nodes; ++i) {
      Node n;
      n.id = absl::StrFormat("n%05d", i);
      n.labels["gpu"] = i < special ? "a100" : "h100";
      n.free = to.gpus_per_node;
      nodes_.push_back(std::move(n));
    }
    gpus_per_node_ = to.gpus_per_node;
    jobs_.resize(trace.jobs.size());
    for (size_t i = 0; i < jobs_.size(); ++i) {
      jobs_[i].t = &trace.jobs[i];
      jobs_[i].id = absl::StrFormat("j%06d", i);
      jobs_[i].remaining_ms = trace.jobs[i].duration_ms;
      index_[jobs_[i].id] = static_cast<int>(i);
    }
    for (size_t u = 0; u < trace.weights.size(); ++u) {
      users_.push_back(absl::StrFormat("u%03d", u));
      share_weight_[users_.back()] = trace.weights[u];
    }
    usage_ms_.assign(users_.size(), 0);
  }

  SimReport Run();

 private:
  int64_t Progress(const Job& j, int64_t at) const {
    return std::clamp<int64_t>(at - j.attempt_start - options_.start_overhead_ms, 0,
                               j.remaining_ms);
  }
  void Release(Job& j) {
    for (const auto& [node, gpus] : j.placement) nodes_[node].free += gpus;
    j.placement.clear();
    running_.erase(std::find(running_.begin(), running_.end(), &j - jobs_.data()));
  }
  void Enqueue(int job);
  void VictimDone(Job& victim);
  void Dequeue(int job);
  void Requeue(Job& j, int64_t saved_ms);
  void Arrivals(int64_t now);
  void Failures(int64_t now);
  void Ends(int64_t now);
  void Account(int64_t tick_ms);
  void Pass(int64_t now);
  void Start(const coordinator::GangPlacement& p, int64_t now);
  std::vector<coordinator::FreeWorker> FreeWorkers() const;
  std::vector<coordinator::RunningJob> Running(int64_t now) const;
  SimReport Report();

  const Trace& trace_;
  SimOptions options_;
  coordinator::ManualClock clock_;
  coordinator::UsageLedger ledger_;
  std::vector<Node> nodes_;
  int gpus_per_node_ = 8;
  std::vector<Job> jobs_;
  std::unordered_map<std::string, int> index_;
  std::vector<std::string> users_;
  std::map<std::string, double> share_weight_;
  std::vector<double> usage_ms_;  // GPU-ms per user
  std::vector<coordinator::QueuedJob> queue_;
  std::vector<int> queued_job_;               // queue_[i] is jobs_[queued_job_[i]]
  std::unordered_map<int, size_t> in_queue_;  // job -> position
  std::vector<int> running_;                  // scheduled, running or stopping
  size_t next_arrival_ = 0, next_failure_ = 0;
  std::vector<double> pass_ms_, inputs_ms_;
  double used_gpu_ms_ = 0, up_gpu_ms_ = 0, used_waiting_ = 0, up_waiting_ = 0;
  SimReport report_;
};

void ClusterSim::Enqueue(int job) {
  Job& j = jobs_[job];
  j.state = JobState::kQueued;
  coordinator::QueuedJob q;
  q.id = j.id;
  q.world_size = j.t->gpus;
  q.priority = j.t->priority;
  if (j.t->pool == 1) q.pool["gpu"] = "a100";
  q.queued_since_ms = j.t->submit_ms;                     // a requeued job keeps its place
  q.user = options_.fair_share ? users_[j.t->user] : "";  // baseline: one queue, no turns
  in_queue_[job] = queue_.size();
  queue_.push_back(std::move(q));
  queued_job_.push_back(job);
}

// A victim's stop is over (it exited, finished or its node failed).
void ClusterSim::VictimDone(Job& victim) {
  victim.stopping_for = -1;
  victim.stop_at = 0;
}

void ClusterSim::Dequeue(int job) {
  const size_t at = in_queue_.at(job);
  in_queue_.erase(job);
  if (at + 1 != queue_.size()) {
    queue_[at] = std::move(queue_.back());
    queued_job_[at] = queued_job_.back();
    in_queue_[queued_job_[at]] = at;
  }
  queue_.pop_back();
  queued_job_.pop_back();
}

// Back to the queue with the work of its newest checkpoint kept.
void ClusterSim::Requeue(Job& j, int64_t saved_ms) {
  j.remaining_ms -= saved_ms;
  Release(j);
  Enqueue(static_cast<int>(&j - jobs_.data()));
}

void ClusterSim::Arrivals(int64_t now) {
  for (; next_arrival_ < trace_.jobs.size() && trace_.jobs[next_arrival_].submit_ms <= now;
       ++next_arrival_) {
    jobs_[next_arrival_].submitted = true;
    Enqueue(static_cast<int>(next_arrival_));
  }
}

// A failed node's jobs lose the work since their newest checkpoint and are requeued.
void ClusterSim::Failures(int64_t now) {
  for (Node& n : nodes_) {
    if (!n.up && n.repaired_at <= now) {
      n.up = true;
      n.free = gpus_per_node_;
    }
  }
  for (; next_failure_ < trace_.failures.size() && trace_.failures[next_failure_].at_ms <= now;
       ++next_failure_) {
    const NodeFailure& f = trace_.failures[next_failure_];
    Node& node = nodes_[f.node];
    if (!node.up) continue;
    ++report_.failures;
    const std::vector<int> on = running_;
    for (int id : on) {
      Job& j = jobs_[id];
      bool hit = false;
      for (const auto& [n, g] : j.placement) hit |= n == f.node;
      if (!hit) continue;
      const int64_t done = Progress(j, now);
      const int64_t saved = done / options_.checkpoint_every_ms * options_.checkpoint_every_ms;
      if (j.stop_at > 0) VictimDone(j);
      report_.failure_gpu_hours_lost +=
          j.t->gpus * (done - saved + options_.start_overhead_ms) / 3600e3;
      ++report_.requeued_by_failures;
      Requeue(j, saved);
    }
    node.up = false;
    node.free = 0;
    node.repaired_at = now + f.down_ms;
  }
}

// Jobs whose work is done succeed; preempted ones whose ranks have exited are requeued with all
// their work kept (the checkpoint at SIGTERM).
void ClusterSim::Ends(int64_t now) {
  const std::vector<int> on = running_;
  for (int id : on) {
    Job& j = jobs_[id];
    if (j.attempt_start + options_.start_overhead_ms + j.remaining_ms <= now) {
      j.state = JobState::kSucceeded;
      ++report_.succeeded;
      if (j.stop_at > 0) VictimDone(j);
      Release(j);
    } else if (j.stop_at > 0 && j.stop_at <= now) {
      VictimDone(j);
      j.protected_until = -1;  // set when it starts again
      report_.preemption_gpu_hours_lost +=
          j.t->gpus * (options_.stop_ms + options_.start_overhead_ms) / 3600e3;
      Requeue(j, Progress(j, now));
    }
  }
}

void ClusterSim::Account(int64_t tick_ms) {
  int64_t up = 0, used = 0;
  for (const Node& n : nodes_) {
    if (n.up) up += gpus_per_node_;
  }
  for (int id : running_) {
    used += jobs_[id].t->gpus;
    usage_ms_[jobs_[id].t->user] += static_cast<double>(jobs_[id].t->gpus) * tick_ms;
  }
  used_gpu_ms_ += static_cast<double>(used) * tick_ms;
  up_gpu_ms_ += static_cast<double>(up) * tick_ms;
  if (!queue_.empty()) {
    used_waiting_ += static_cast<double>(used) * tick_ms;
    up_waiting_ += static_cast<double>(up) * tick_ms;
  }
  report_.max_queue = std::max<int64_t>(report_.max_queue, queue_.size());
  report_.max_running = std::max<int64_t>(report_.max_running, running_.size());
}

std::vector<coordinator::FreeWorker> ClusterSim::FreeWorkers() const {
  std::vector<coordinator::FreeWorker> out;
  out.reserve(nodes_.size());
  for (const Node& n : nodes_) {
    if (!n.up) continue;
    out.push_back({n.id, n.labels, gpus_per_node_, n.free});
  }
  return out;
}

std::vector<coordinator::RunningJob> ClusterSim::Running(int64_t now) const {
  std::vector<coordinator::RunningJob> out;
  out.reserve(running_.size());
  for (int id : running_) {
    const Job& j = jobs_[id];
    coordinator::RunningJob r;
    r.id = j.id;
    r.priority = j.t->priority;
    for (const auto& [node, gpus] : j.placement) r.slots.emplace_back(nodes_[node].id, gpus);
    const int64_t done = Progress(j, now);
    r.checkpoint_age_ms = done % options_.checkpoint_every_ms;
    r.protected_until_ms = j.protected_until;
    r.stopping = j.stop_at > 0;
    out.push_back(std::move(r));
  }
  return out;
}

void ClusterSim::Start(const coordinator::GangPlacement& p, int64_t now) {
  const int id = index_.at(p.job_id);
  Job& j = jobs_[id];
  Dequeue(id);
  j.state = JobState::kRunning;
  j.attempt_start = now;
  if (j.first_start < 0) j.first_start = now;
  if (j.protected_until == -1) j.protected_until = now + options_.scheduler.min_run_ms;
  for (const auto& [worker, ranks] : p.workers) {
    const int node = std::stoi(worker.substr(1));
    nodes_[node].free -= static_cast<int>(ranks.size());
    j.placement.emplace_back(node, static_cast<int>(ranks.size()));
  }
  running_.push_back(id);
}

void ClusterSim::Pass(int64_t now) {
  auto t0 = std::chrono::steady_clock::now();
  coordinator::FairShare share;
  if (options_.fair_share) {
    share.weight = share_weight_;
    std::map<std::string, int> held;
    for (int id : running_) held[users_[jobs_[id].t->user]] += jobs_[id].t->gpus;
    ledger_.Advance(now, held);
    share.average = ledger_.averages();
    share.held = std::move(held);
  }
  std::vector<coordinator::FreeWorker> workers = FreeWorkers();
  const std::vector<coordinator::RunningJob> running = Running(now);
  inputs_ms_.push_back(MsSince(t0));
  t0 = std::chrono::steady_clock::now();
  const coordinator::ScheduleResult result = coordinator::Schedule(
      queue_, std::move(workers), options_.scheduler, now, {}, share, running);
  pass_ms_.push_back(MsSince(t0));
  for (const auto& p : result.preempt) {
    Job& victim = jobs_[index_.at(p.victim)];
    victim.stop_at = now + options_.stop_ms;
    victim.stopping_for = index_.at(p.for_job);
    // The preemptor goes first until it is placed (QueuedJob::preempting).
    queue_[in_queue_.at(victim.stopping_for)].preempting = true;

    ++report_.preemptions;
  }
  for (const auto& p : result.placed) Start(p, now);
}

SimReport ClusterSim::Run() {
  const int64_t end = static_cast<int64_t>(options_.end_hours * 3600e3);
  while (clock_.NowMs() < end) {
    clock_.Advance(options_.tick_ms);
    const int64_t now = clock_.NowMs();
    Failures(now);
    Ends(now);
    Arrivals(now);
    Pass(now);
    Account(options_.tick_ms);
  }
  return Report();
}

// Weighted max-min fair shares of what each user asked for within the window (water-filling
// over the GPU-time the live nodes had), and Jain's index of usage / fair share.
void Fairness(const Trace& trace, const std::vector<double>& usage, double capacity, int64_t end,
              SimReport& report) {
  const size_t n = trace.weights.size();
  std::vector<double> demand(n, 0), fair(n, 0);
  for (const TraceJob& j : trace.jobs) {
    if (j.submit_ms < end)
      demand[j.user] += j.gpus * static_cast<double>(std::min(j.duration_ms, end - j.submit_ms));
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return demand[a] / trace.weights[a] < demand[b] / trace.weights[b];
  });
  double left = capacity, weight = 0;
  for (size_t u : order) weight += trace.weights[u];
  for (size_t u : order) {
    fair[u] = std::min(demand[u], left * trace.weights[u] / weight);
    left -= fair[u];
    weight -= trace.weights[u];
  }
  double sum = 0, squares = 0;
  int users = 0;
  report.worst_share = 1e9;
  for (size_t u = 0; u < n; ++u) {
    if (fair[u] <= 0) continue;
    const double x = usage[u] / fair[u];
    sum += x;
    squares += x * x;
    ++users;
    report.worst_share = std::min(report.worst_share, x);
    report.best_share = std::max(report.best_share, x);
  }
  report.jain = users > 0 ? sum * sum / (users * squares) : 0;
}

SimReport ClusterSim::Report() {
  report_.utilisation = up_gpu_ms_ > 0 ? used_gpu_ms_ / up_gpu_ms_ : 0;
  report_.utilisation_waiting = up_waiting_ > 0 ? used_waiting_ / up_waiting_ : 0;
  report_.gpu_hours_used = used_gpu_ms_ / 3600e3;
  std::map<int, std::vector<double>> waits;
  for (const Job& j : jobs_) {
    if (!j.submitted) continue;
    if (j.first_start >= 0) {
      waits[j.t->priority].push_back((j.first_start - j.t->submit_ms) / 1000.0);
    } else {
      ++report_.not_started[j.t->priority];
    }
  }
  for (auto& [priority, w] : waits) report_.wait_s[priority] = Summarise(std::move(w));
  report_.pass_ms = Summarise(pass_ms_);
  report_.inputs_ms = Summarise(inputs_ms_);
  Fairness(trace_, usage_ms_, used_gpu_ms_, clock_.NowMs(), report_);
  return report_;
}

}  // namespace

SimReport Simulate(const Trace& trace, const TraceOptions& trace_options,
                   const SimOptions& options) {
  ClusterSim sim(trace, trace_options, options);
  return sim.Run();
}

}  // namespace loom::sim
