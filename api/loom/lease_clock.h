// The clock of the rank lease (docs/control-plane.md, "Fencing"): the worker agent writes the
// lease expiry into LOOM_LEASE_FILE as milliseconds on this clock, its ranks compare against
// it. CLOCK_MONOTONIC (steady_clock on Linux) is shared by every process of a node and does not
// jump with the wall clock.
#ifndef LOOM_LEASE_CLOCK_H_
#define LOOM_LEASE_CLOCK_H_

#include <chrono>
#include <cstdint>

namespace loom {

inline int64_t LeaseClockMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace loom

#endif  // LOOM_LEASE_CLOCK_H_
