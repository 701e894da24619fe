#include "coordinator/scheduler.h"

#include <algorithm>

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

}  // namespace

std::string OverQuota(const QueuedJob& job, const Quotas& q) {
  auto limit = q.user_limit.find(job.user);
  const int user_used = q.user_used.count(job.user) ? q.user_used.at(job.user) : 0;
  if (limit != q.user_limit.end() && user_used + job.world_size > limit->second)
    return QuotaText(job.user, user_used, limit->second, job.world_size);
  if (job.project.empty()) return "";
  limit = q.project_limit.find(job.project);
  const int project_used = q.project_used.count(job.project) ? q.project_used.at(job.project) : 0;
  if (limit != q.project_limit.end() && project_used + job.world_size > limit->second)
    return QuotaText(absl::StrCat("project ", job.project), project_used, limit->second,
                     job.world_size);
  return "";
}

ScheduleResult Schedule(std::vector<QueuedJob> queue, std::vector<FreeWorker> workers,
                        const SchedulerOptions& options, int64_t now_ms, Quotas quotas) {
  auto effective = [&](const QueuedJob& j) {
    const double waited_s =
        static_cast<double>(std::max<int64_t>(0, now_ms - j.queued_since_ms)) / 1000.0;
    return static_cast<double>(j.priority) + waited_s / std::max(options.aging_seconds, 1e-9);
  };
  std::stable_sort(queue.begin(), queue.end(), [&](const QueuedJob& a, const QueuedJob& b) {
    const double ea = effective(a), eb = effective(b);
    if (ea != eb) return ea > eb;
    if (a.queued_since_ms != b.queued_since_ms) return a.queued_since_ms < b.queued_since_ms;
    return a.id < b.id;
  });
  ScheduleResult result;
  for (const QueuedJob& job : queue) {
    if (std::string over = OverQuota(job, quotas); !over.empty()) {
      result.waiting[job.id] = std::move(over);  // waits, reserving nothing: never fails
      continue;
    }
    std::vector<FreeWorker*> matching;
    int total = 0, free = 0;
    for (FreeWorker& w : workers) {
      if (!LabelsMatch(job.pool, w.labels)) continue;
      total += w.slots;
      free += w.free_slots;
      if (w.free_slots > 0) matching.push_back(&w);
    }
    // Fewest workers first: the fullest-free workers take the most ranks.
    std::stable_sort(matching.begin(), matching.end(),
                     [](const FreeWorker* a, const FreeWorker* b) {
                       if (a->free_slots != b->free_slots) return a->free_slots > b->free_slots;
                       return a->id < b->id;
                     });
    if (free >= job.world_size) {
      GangPlacement p;
      p.job_id = job.id;
      int rank = 0;
      for (FreeWorker* w : matching) {
        if (rank == job.world_size) break;
        std::vector<int> ranks;
        while (rank < job.world_size && static_cast<int>(ranks.size()) < w->free_slots) {
          ranks.push_back(rank++);
        }
        w->free_slots -= static_cast<int>(ranks.size());
        p.workers.emplace_back(w->id, std::move(ranks));
      }
      result.placed.push_back(std::move(p));
      quotas.user_used[job.user] += job.world_size;
      if (!job.project.empty()) quotas.project_used[job.project] += job.world_size;
      continue;
    }
    if (total < job.world_size) {
      result.waiting[job.id] =
          total == 0 ? absl::StrCat("no live worker matches ", PoolText(job.pool))
                     : absl::StrCat("needs ", job.world_size, " slots; ", PoolText(job.pool),
                                    " has ", total, " on live workers");
      continue;
    }
    result.waiting[job.id] = absl::StrCat("waiting for ", job.world_size, " slots (", free,
                                          " free of ", total, " in ", PoolText(job.pool), ")");
    if (now_ms - job.queued_since_ms >= options.reserve_after_ms) {
      // Starvation guard: hold the free matching slots for this job.
      int need = job.world_size;
      for (FreeWorker* w : matching) {
        const int take = std::min(need, w->free_slots);
        w->free_slots -= take;
        need -= take;
        if (need == 0) break;
      }
      absl::StrAppend(&result.waiting[job.id], "; reserving slots");
    }
  }
  return result;
}

}  // namespace loom::coordinator
