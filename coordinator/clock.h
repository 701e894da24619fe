// The coordinator's sources of time. Wall-clock milliseconds since the epoch (NowMs) for what
// people read and what is stored: event, heartbeat and checkpoint times, queue ages, the fence
// shown as not_before_ms. A monotonic clock (SteadyMs) for everything that measures an interval
// the system's safety depends on: heartbeat silence, leases and fences, which an NTP step of the
// wall clock must not move. Production uses SystemClock; tests use ManualClock and move time on
// themselves instead of sleeping.
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
  virtual int64_t SteadyMs() = 0;
};

class SystemClock : public Clock {
 public:
  int64_t NowMs() override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  int64_t SteadyMs() override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

// Stands still until told to move; safe to read from the coordinator's background loop.
// Advance moves both clocks; StepWall moves the wall clock alone (an NTP step).
class ManualClock : public Clock {
 public:
  explicit ManualClock(int64_t start_ms) : now_ms_(start_ms) {}
  int64_t NowMs() override { return now_ms_.load(); }
  int64_t SteadyMs() override { return steady_ms_.load(); }
  void Advance(int64_t ms) {
    now_ms_ += ms;
    steady_ms_ += ms;
  }
  void StepWall(int64_t ms) { now_ms_ += ms; }

 private:
  std::atomic<int64_t> now_ms_;
  std::atomic<int64_t> steady_ms_{1000000};
};

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_CLOCK_H_
