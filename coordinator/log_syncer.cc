#include "coordinator/log_syncer.h"

#include <algorithm>

namespace loom::coordinator {

LogSyncer::LogSyncer(StateStore& store, metrics::Registry& registry)
    : store_(store), registry_(registry), thread_([this] { Run(); }) {}

LogSyncer::~LogSyncer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void LogSyncer::After(uint64_t sequence, std::function<void(absl::Status)> done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_.emplace_back(sequence, std::move(done));
  }
  wake_.notify_one();
}

void LogSyncer::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return stop_ || !waiting_.empty(); });
    if (waiting_.empty()) return;  // stopping, nothing left to answer
    std::vector<std::pair<uint64_t, std::function<void(absl::Status)>>> batch;
    batch.swap(waiting_);
    lock.unlock();
    // Everything that arrived while the previous fsync ran goes to disk with this one.
    uint64_t through = 0;
    for (const auto& [sequence, done] : batch) through = std::max(through, sequence);
    bool led = false;
    const absl::Status synced = store_.SyncLogThrough(through, &led);
    if (led) registry_.Increment("loom_coordinator_log_syncs_total");
    for (auto& [sequence, done] : batch) done(synced);
    lock.lock();
  }
}

}  // namespace loom::coordinator
