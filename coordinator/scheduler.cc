#include "coordinator/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <queue>
#include <set>
#include <tuple>
#include <unordered_map>

#include "absl/strings/str_cat.h"

namespace loom::coordinator {

bool LabelsMatch(const std::map<std::string, std::string>& pool,
                 const std::map<std::string, std::string>& labels) {
  for (const auto& [k, v] : pool) {
    auto it = labels.find(k);
    if (it == labels.end() || it->second != v) return false;
  }
  return true;
}

UsageLedger::UsageLedger(double half_life_s)
    : rate_per_ms_(std::log(2.0) / (std::max(half_life_s, 1e-3) * 1000.0)) {}

double UsageLedger::Decay(int64_t ms) const {
  return std::exp(-rate_per_ms_ * static_cast<double>(std::max<int64_t>(0, ms)));
}

// The average follows the slots held s as dA/dt = rate · (s − A): over dt with s constant,
// A becomes s + (A − s)·e^(−rate·dt).
void UsageLedger::Advance(int64_t now_ms, const std::map<std::string, int>& held) {
  if (now_ms_ == 0) now_ms_ = now_ms;
  const double d = Decay(now_ms - now_ms_);
  for (auto& [user, a] : average_) a *= d;
  for (const auto& [user, slots] : held) average_[user] += slots * (1.0 - d);
  now_ms_ = std::max(now_ms_, now_ms);
}

void UsageLedger::AddInterval(const std::string& user, int slots, int64_t start_ms,
                              int64_t end_ms) {
  if (end_ms <= start_ms || slots <= 0) return;
  average_[user] += slots * (Decay(now_ms_ - end_ms) - Decay(now_ms_ - start_ms));
}

namespace {

std::string PoolText(const std::map<std::string, std::string>& pool) {
  if (pool.empty()) return "any worker";
  std::string s;
  for (const auto& [k, v] : pool) absl::StrAppend(&s, s.empty() ? "" : ",", k, "=", v);
  return absl::StrCat("pool {", s, "}");
}

std::string QuotaText(const std::string& who, int used, int limit, int need) {
  return absl::StrCat(
      "quota: ", who, " uses ", used, " of ", limit, " slots",
      used + need > limit && used < limit ? absl::StrCat("; this job needs ", need) : "");
}

int Get(const std::map<std::string, int>& m, const std::string& key) {
  auto it = m.find(key);
  return it == m.end() ? 0 : it->second;
}

// The quota or sweep limit the job would go beyond, if any.
bool OverLimit(const QueuedJob& job, const Quotas& q, Waiting& w) {
  auto limit = q.user_limit.find(job.user);
  if (limit != q.user_limit.end() && Get(q.user_used, job.user) + job.world_size > limit->second) {
    w.kind = Waiting::kUserQuota;
    w.a = Get(q.user_used, job.user);
    w.b = limit->second;
    return true;
  }
  limit = job.project.empty() ? q.project_limit.end() : q.project_limit.find(job.project);
  if (limit != q.project_limit.end() &&
      Get(q.project_used, job.project) + job.world_size > limit->second) {
    w.kind = Waiting::kProjectQuota;
    w.a = Get(q.project_used, job.project);
    w.b = limit->second;
    return true;
  }
  limit = job.sweep.empty() ? q.sweep_limit.end() : q.sweep_limit.find(job.sweep);
  if (limit != q.sweep_limit.end() && Get(q.sweep_active, job.sweep) >= limit->second) {
    w.kind = Waiting::kSweepLimit;
    w.a = Get(q.sweep_active, job.sweep);
    w.b = limit->second;
    return true;
  }
  return false;
}

// The matching workers of each distinct pool selector, with their free slots bucketed so that a
// gang takes the fullest-free workers first without sorting every worker for every job: a pass
// over 100 000 queued jobs and 10 000 workers touches each worker once per selector. A bucket is
// a vector of worker indices in id order; an entry whose worker's free count has changed since
// is stale and skipped (within a pass free slots only go down, so an entry never becomes valid
// again).
class FreeSlotIndex {
 public:
  explicit FreeSlotIndex(std::vector<FreeWorker> workers) : workers_(std::move(workers)) {
    auto by_id = [](const FreeWorker& a, const FreeWorker& b) { return a.id < b.id; };
    if (!std::is_sorted(workers_.begin(), workers_.end(), by_id))
      std::sort(workers_.begin(), workers_.end(), by_id);
    pools_of_.resize(workers_.size());
    for (const FreeWorker& w : workers_) max_slots_ = std::max(max_slots_, w.free_slots);
  }

  int PoolOf(const std::map<std::string, std::string>& selector) {
    if (selector.empty() && any_pool_ >= 0) return any_pool_;
    auto [it, added] = index_.try_emplace(selector, static_cast<int>(pools_.size()));
    if (added) Build(selector);
    if (selector.empty()) any_pool_ = it->second;
    return it->second;
  }
  int Free(int pool) const { return pools_[pool].free; }
  int Total(int pool) const { return pools_[pool].total; }
  // Ranks of `worker` that sit on workers of the pool.
  int SlotsIn(int pool, const std::string& worker, int ranks) {
    if (worker_index_.empty()) {
      for (size_t i = 0; i < workers_.size(); ++i)
        worker_index_[workers_[i].id] = static_cast<int>(i);
    }
    auto it = worker_index_.find(worker);
    return it != worker_index_.end() && pools_[pool].member[it->second] ? ranks : 0;
  }
  const std::string& WorkerId(int w) const { return workers_[w].id; }

  // Takes `need` slots (at most the pool's free ones) from its fullest-free workers: worker
  // index and count, in that order.
  std::vector<std::pair<int, int>> Take(int pool, int need) {
    std::vector<std::pair<int, int>> taken;
    Pool& p = pools_[pool];
    for (int f = static_cast<int>(p.by_free.size()) - 1; f > 0 && need > 0; --f) {
      Bucket& b = p.by_free[f];
      while (need > 0 && b.head < b.workers.size()) {
        const int w = b.workers[b.head++];
        if (workers_[w].free_slots != f) continue;  // stale
        const int take = std::min(need, f);
        taken.emplace_back(w, take);
        need -= take;
        SetFree(w, f - take);
      }
    }
    return taken;
  }

 private:
  struct Bucket {
    std::vector<int> workers;  // by index (= id order); entries before head are used up
    size_t head = 0;
  };
  struct Pool {
    std::vector<char> member;
    int total = 0, free = 0;
    std::vector<Bucket> by_free;  // free slots -> workers
  };

  void Build(const std::map<std::string, std::string>& selector) {
    Pool p;
    p.member.assign(workers_.size(), 0);
    p.by_free.resize(max_slots_ + 1);
    const int index = static_cast<int>(pools_.size());
    for (size_t i = 0; i < workers_.size(); ++i) {
      const FreeWorker& w = workers_[i];
      if (!selector.empty() && !LabelsMatch(selector, w.labels)) continue;
      p.member[i] = 1;
      p.total += w.slots;
      p.free += w.free_slots;
      if (w.free_slots > 0) p.by_free[w.free_slots].workers.push_back(static_cast<int>(i));
      pools_of_[i].push_back(index);
    }
    pools_.push_back(std::move(p));
  }

  // A worker with slots left after a take goes to its new bucket, in id order.
  void SetFree(int w, int free) {
    const int old = workers_[w].free_slots;
    workers_[w].free_slots = free;
    for (int pool : pools_of_[w]) {
      Pool& p = pools_[pool];
      p.free -= old - free;
      if (free == 0) continue;
      Bucket& b = p.by_free[free];
      b.workers.insert(
          std::lower_bound(b.workers.begin() + static_cast<long>(b.head), b.workers.end(), w), w);
    }
  }

  std::vector<FreeWorker> workers_;
  std::unordered_map<std::string, int> worker_index_;  // built when preemption needs it
  std::vector<std::vector<int>> pools_of_;             // worker -> the pools it belongs to
  std::vector<Pool> pools_;
  std::map<std::map<std::string, std::string>, int> index_;
  int any_pool_ = -1;
  int max_slots_ = 0;
};

// Victims for preemption, cheapest first: the least work lost (age of the newest checkpoint),
// then the fewest ranks. The candidates are sorted, and the slots still to come per pool
// counted, only when a pass first needs them: most passes preempt nothing.
class Preemptor {
 public:
  Preemptor(const std::vector<RunningJob>& running, int64_t now_ms)
      : running_(running), now_ms_(now_ms), stopping_(running.size()) {
    for (size_t i = 0; i < running.size(); ++i) {
      stopping_[i] = running[i].stopping;
      if (!running[i].stopping && running[i].protected_until_ms <= now_ms)
        lowest_priority_ = std::min(lowest_priority_, running[i].priority);
    }
  }

  const std::string& Victim(int i) const { return running_[i].id; }

  // Slots of jobs already stopping that sit on the pool's workers.
  int Coming(FreeSlotIndex& index, int pool) {
    if (pool >= static_cast<int>(coming_.size())) coming_.resize(pool + 1, -1);
    if (coming_[pool] < 0) {
      coming_[pool] = 0;
      for (size_t i = 0; i < running_.size(); ++i) {
        if (stopping_[i]) coming_[pool] += InPool(index, pool, running_[i]);
      }
    }
    return coming_[pool];
  }

  // Chooses victims of priority below `priority` whose slots in the pool bring `have` to
  // `need`; marks them stopping. Empty when they cannot.
  std::vector<int> Choose(FreeSlotIndex& index, int pool, int priority, int have, int need) {
    if (priority <= lowest_priority_ || failed_.count({pool, priority})) return {};
    SortCandidates();
    std::vector<std::pair<int, int>> chosen;  // running index, its slots in the pool
    for (int i : order_) {
      const RunningJob& r = running_[i];
      if (stopping_[i] || r.priority >= priority) continue;
      const int slots = InPool(index, pool, r);
      if (slots == 0) continue;
      chosen.emplace_back(i, slots);
      have += slots;
      if (have >= need) break;
    }
    if (have < need) {
      failed_.insert({pool, priority});
      return {};
    }
    // Spare the costliest victims that turn out not to be needed.
    for (size_t k = chosen.size(); k-- > 0;) {
      if (have - chosen[k].second >= need) {
        have -= chosen[k].second;
        chosen.erase(chosen.begin() + static_cast<long>(k));
      }
    }
    std::vector<int> victims;
    for (const auto& [i, slots] : chosen) {
      stopping_[i] = true;
      for (size_t p = 0; p < coming_.size(); ++p) {
        if (coming_[p] >= 0) coming_[p] += InPool(index, static_cast<int>(p), running_[i]);
      }
      victims.push_back(i);
    }
    return victims;
  }

 private:
  void SortCandidates() {
    if (sorted_) return;
    sorted_ = true;
    for (size_t i = 0; i < running_.size(); ++i) {
      if (!stopping_[i] && running_[i].protected_until_ms <= now_ms_)
        order_.push_back(static_cast<int>(i));
    }
    std::sort(order_.begin(), order_.end(), [&](int a, int b) {
      const RunningJob &x = running_[a], &y = running_[b];
      return std::make_tuple(x.checkpoint_age_ms, Ranks(x), x.id) <
             std::make_tuple(y.checkpoint_age_ms, Ranks(y), y.id);
    });
  }
  static int Ranks(const RunningJob& r) {
    int n = 0;
    for (const auto& [w, k] : r.slots) n += k;
    return n;
  }
  static int InPool(FreeSlotIndex& index, int pool, const RunningJob& r) {
    int n = 0;
    for (const auto& [w, k] : r.slots) n += index.SlotsIn(pool, w, k);
    return n;
  }

  const std::vector<RunningJob>& running_;
  int64_t now_ms_;
  std::vector<char> stopping_;
  std::vector<int> order_;
  bool sorted_ = false;
  std::vector<int> coming_;  // per pool: -1 until counted
  int lowest_priority_ = 1 << 30;
  std::set<std::pair<int, int>> failed_;  // (pool, priority) that found too few victims
};

// The queue in serving order, bands first; fair share within a band is applied while placing.
struct OrderKey {
  int64_t band;
  int user;
  int64_t since;
  int sweep;
  int sweep_order;
  int job;
};

class Users {
 public:
  int IndexOf(const std::string& user) {
    auto [it, added] = index_.try_emplace(user, static_cast<int>(names_.size()));
    if (added) names_.push_back(user);
    return it->second;
  }
  const std::string& Name(int i) const { return names_[i]; }
  size_t size() const { return names_.size(); }

 private:
  std::unordered_map<std::string, int> index_;
  std::vector<std::string> names_;
};

std::vector<OrderKey> OrderKeys(const std::vector<QueuedJob>& queue,
                                const SchedulerOptions& options, int64_t now_ms, Users& users) {
  std::unordered_map<std::string, int> sweeps;
  std::vector<OrderKey> keys(queue.size());
  const double aging_ms = std::max(options.aging_seconds, 1e-9) * 1000.0;
  for (size_t i = 0; i < queue.size(); ++i) {
    const QueuedJob& j = queue[i];
    const double waited = static_cast<double>(std::max<int64_t>(0, now_ms - j.queued_since_ms));
    keys[i].band = j.preempting ? std::numeric_limits<int64_t>::max()
                                : j.priority + static_cast<int64_t>(std::floor(waited / aging_ms));
    keys[i].user = users.IndexOf(j.user);
    keys[i].since = j.queued_since_ms;
    keys[i].sweep =
        j.sweep.empty()
            ? -1
            : sweeps.try_emplace(j.sweep, static_cast<int>(sweeps.size())).first->second;
    keys[i].sweep_order = j.sweep_order;
    keys[i].job = static_cast<int>(i);
  }
  std::sort(keys.begin(), keys.end(), [&](const OrderKey& a, const OrderKey& b) {
    if (a.band != b.band) return a.band > b.band;
    if (a.user != b.user) return a.user < b.user;
    if (a.since != b.since) return a.since < b.since;
    if (a.sweep != b.sweep) return a.sweep < b.sweep;
    if (a.sweep_order != b.sweep_order) return a.sweep_order < b.sweep_order;
    return queue[a.job].id < queue[b.job].id;
  });
  return keys;
}

class Pass {
 public:
  Pass(const std::vector<QueuedJob>& queue, std::vector<FreeWorker> workers,
       const SchedulerOptions& options, int64_t now_ms, Quotas quotas,
       const std::vector<RunningJob>& running)
      : queue_(queue),
        options_(options),
        now_ms_(now_ms),
        quotas_(std::move(quotas)),
        index_(std::move(workers)),
        preemptor_(running, now_ms) {}

  void Serve(const std::vector<OrderKey>& keys, std::vector<double>& score,
             const std::vector<double>& weight);
  ScheduleResult result;

 private:
  bool Place(const QueuedJob& job, int job_index);

  const std::vector<QueuedJob>& queue_;
  const SchedulerOptions& options_;
  int64_t now_ms_;
  Quotas quotas_;
  FreeSlotIndex index_;
  Preemptor preemptor_;
};

// Within each band the users take turns, the lowest score first (ties: the earliest queued
// job); placing a job raises its user's score by its slots / weight.
void Pass::Serve(const std::vector<OrderKey>& keys, std::vector<double>& score,
                 const std::vector<double>& weight) {
  using Turn = std::tuple<double, int64_t, int, size_t>;  // score, since, user, cursor
  for (size_t begin = 0; begin < keys.size();) {
    size_t end = begin;
    std::priority_queue<Turn, std::vector<Turn>, std::greater<Turn>> turns;
    std::vector<size_t> user_end;
    while (end < keys.size() && keys[end].band == keys[begin].band) {
      size_t u = end;
      while (u < keys.size() && keys[u].band == keys[begin].band && keys[u].user == keys[end].user)
        ++u;
      user_end.push_back(u);
      turns.emplace(score[keys[end].user], keys[end].since, keys[end].user, end);
      end = u;
    }
    std::unordered_map<int, size_t> ends;  // user -> end of its run in this band
    for (size_t u : user_end) ends[keys[u - 1].user] = u;
    while (!turns.empty()) {
      auto [s, since, user, cursor] = turns.top();
      turns.pop();
      const QueuedJob& job = queue_[keys[cursor].job];
      if (Place(job, keys[cursor].job)) score[user] += job.world_size / weight[user];
      if (++cursor < ends[user]) turns.emplace(score[user], keys[cursor].since, user, cursor);
    }
    begin = end;
  }
}

bool Pass::Place(const QueuedJob& job, int job_index) {
  Waiting w;
  w.job = job_index;
  if (OverLimit(job, quotas_, w)) {
    result.waiting.push_back(w);  // waits, reserving nothing: never fails
    return false;
  }
  const int pool = job.pool.empty() ? index_.PoolOf({}) : index_.PoolOf(job.pool);
  const int need = job.world_size;
  if (index_.Free(pool) >= need) {
    GangPlacement p;
    p.job_id = job.id;
    int rank = 0;
    for (const auto& [worker, count] : index_.Take(pool, need)) {
      std::vector<int> ranks(count);
      for (int& r : ranks) r = rank++;
      p.workers.emplace_back(index_.WorkerId(worker), std::move(ranks));
    }
    result.placed.push_back(std::move(p));
    quotas_.user_used[job.user] += need;
    if (!job.project.empty()) quotas_.project_used[job.project] += need;
    if (!job.sweep.empty()) quotas_.sweep_active[job.sweep] += 1;
    return true;
  }
  if (index_.Total(pool) < need) {
    w.kind = index_.Total(pool) == 0 ? Waiting::kNoWorker : Waiting::kTooBig;
    w.a = index_.Total(pool);
    result.waiting.push_back(w);
    return false;
  }
  w.kind = Waiting::kNoSlots;
  w.a = index_.Free(pool);
  w.b = index_.Total(pool);
  const int64_t waited = now_ms_ - job.queued_since_ms;
  bool reserve = waited >= options_.reserve_after_ms;
  if (options_.preempt_after_ms >= 0 && waited >= options_.preempt_after_ms) {
    const int have = index_.Free(pool) + preemptor_.Coming(index_, pool);
    if (have < need) {
      for (int v : preemptor_.Choose(index_, pool, job.priority, have, need)) {
        result.preempt.push_back({preemptor_.Victim(v), job.id});
        ++w.preempting;
      }
    }
    reserve |= w.preempting > 0 || have >= need;
  }
  if (reserve) {
    index_.Take(pool, std::min(need, index_.Free(pool)));  // hold them for this job
    w.reserving = true;
  }
  result.waiting.push_back(w);
  return false;
}

}  // namespace

std::string OverQuota(const QueuedJob& job, const Quotas& quotas) {
  Waiting w;
  if (!OverLimit(job, quotas, w)) return "";
  ScheduleResult r;
  r.waiting.push_back(w);
  return Explain(r, {job}).at(job.id);
}

ScheduleResult Schedule(const std::vector<QueuedJob>& queue, std::vector<FreeWorker> workers,
                        const SchedulerOptions& options, int64_t now_ms, Quotas quotas,
                        const FairShare& share, const std::vector<RunningJob>& running) {
  Users users;
  const std::vector<OrderKey> keys = OrderKeys(queue, options, now_ms, users);
  std::vector<double> score(users.size()), weight(users.size());
  for (size_t u = 0; u < users.size(); ++u) {
    const std::string& name = users.Name(static_cast<int>(u));
    auto w = share.weight.find(name);
    weight[u] = w != share.weight.end() && w->second > 0 ? w->second : 1.0;
    auto a = share.average.find(name);
    score[u] = (Get(share.held, name) + (a == share.average.end() ? 0.0 : a->second)) / weight[u];
  }
  Pass pass(queue, std::move(workers), options, now_ms, std::move(quotas), running);
  pass.Serve(keys, score, weight);
  return std::move(pass.result);
}

std::map<std::string, std::string> Explain(const ScheduleResult& result,
                                           const std::vector<QueuedJob>& queue) {
  std::map<std::string, std::string> out;
  for (const Waiting& w : result.waiting) {
    const QueuedJob& job = queue[w.job];
    std::string text;
    switch (w.kind) {
      case Waiting::kUserQuota:
        text = QuotaText(job.user, w.a, w.b, job.world_size);
        break;
      case Waiting::kProjectQuota:
        text = QuotaText(absl::StrCat("project ", job.project), w.a, w.b, job.world_size);
        break;
      case Waiting::kSweepLimit:
        text = absl::StrCat("sweep ", job.sweep, " has ", w.a, " of max_concurrent ", w.b,
                            " jobs scheduled or running");
        break;
      case Waiting::kNoWorker:
        text = absl::StrCat("no live worker matches ", PoolText(job.pool));
        break;
      case Waiting::kTooBig:
        text = absl::StrCat("needs ", job.world_size, " slots; ", PoolText(job.pool), " has ", w.a,
                            " on live workers");
        break;
      case Waiting::kNoSlots:
        text = absl::StrCat("waiting for ", job.world_size, " slots (", w.a, " free of ", w.b,
                            " in ", PoolText(job.pool), ")");
        if (w.preempting > 0)
          absl::StrAppend(&text, "; preempting ", w.preempting, " lower-priority job",
                          w.preempting == 1 ? "" : "s");
        if (w.reserving) absl::StrAppend(&text, "; reserving slots");
        break;
    }
    out[job.id] = std::move(text);
  }
  return out;
}

}  // namespace loom::coordinator
