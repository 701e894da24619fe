// Group commit off the request threads: callers that wrote a RocksDB batch without sync hand
// the write's sequence number and a continuation to the LogSyncer; its one thread fsyncs the log
// once for everything waiting and then runs each continuation with the result. So a gRPC
// callback thread never blocks on the disk (they are few, and a blocked one would keep the next
// heartbeat from being written while the disk is busy: no two would ever share an fsync).
#ifndef LOOM_COORDINATOR_LOG_SYNCER_H_
#define LOOM_COORDINATOR_LOG_SYNCER_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/state_store.h"
#include "metrics/prometheus.h"

namespace loom::coordinator {

class LogSyncer {
 public:
  // Counts its fsyncs in `registry` as loom_coordinator_log_syncs_total.
  LogSyncer(StateStore& store, metrics::Registry& registry);
  // Syncs and answers whatever is still waiting, then stops.
  ~LogSyncer();

  // done(status) runs on the syncer's thread once the log is on disk through `sequence` (OK), or
  // the fsync failed (the error).
  void After(uint64_t sequence, std::function<void(absl::Status)> done);

 private:
  void Run();

  StateStore& store_;
  metrics::Registry& registry_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<std::pair<uint64_t, std::function<void(absl::Status)>>> waiting_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_LOG_SYNCER_H_
