// The coordinator's one source of time (wall-clock milliseconds since the epoch): heartbeat
// silence, leases and fencing, queue ages, event and checkpoint times all read it. Production
// uses SystemClock; tests use ManualClock and move time on themselves instead of sleeping.
#ifndef LOOM_COORDINATOR_CLOCK_H_
#define LOOM_COORDINATOR_CLOCK_H_

#include <atomic>
#include <chrono>
#include <cstdint>

namespace loom::coordinator {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual int64_t NowMs() = 0;
};

class SystemClock : public Clock {
 public:
  int64_t NowMs() override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

// Stands still until told to move; safe to read from the coordinator's background loop.
class ManualClock : public Clock {
 public:
  explicit ManualClock(int64_t start_ms) : now_ms_(start_ms) {}
  int64_t NowMs() override { return now_ms_.load(); }
  void Advance(int64_t ms) { now_ms_ += ms; }

 private:
  std::atomic<int64_t> now_ms_;
};

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_CLOCK_H_
