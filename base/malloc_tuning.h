// glibc malloc settings for Loom's CPU programs (loom-train, loom-serve, the benchmarks).
//
// A training step allocates and frees the same few-MiB activations and gradients every step.
// glibc serves a block above its mmap threshold (128 KiB at first; raised only when such a block
// is freed, and then with a trim threshold of twice that) with a fresh mmap, and gives the top
// of the heap back to the kernel beyond the trim threshold, so each step page-faults much of its
// working set in again: measured 1.3 million minor faults in a short loom-bench-train run on the
// wide model, system time 7.5 % of user time (0.25 million and 2.4–4.8 % with these settings).
// Fixing the mmap threshold at its largest (32 MiB: blocks up to it come from the heap) and keeping
// freed heap memory lets the steady-state steps reuse the memory the first step faulted in. A
// process that set its own malloc tunables (GLIBC_TUNABLES naming glibc.malloc) is left alone.
#ifndef LOOM_BASE_MALLOC_TUNING_H_
#define LOOM_BASE_MALLOC_TUNING_H_

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace loom {

// mallopt refuses mmap thresholds above half the arena heap size (64 MiB on 64-bit).
constexpr int kMallocMmapThreshold = 32 << 20;
// Freed heap memory kept for reuse instead of returned to the kernel.
constexpr int kMallocTrimThreshold = 1 << 30;

// Returns whether the settings were applied (false: not glibc, or the user's own tunables).
inline bool KeepFreedMemoryForReuse() {
#if defined(__GLIBC__)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr) return false;
  return mallopt(M_MMAP_THRESHOLD, kMallocMmapThreshold) == 1 &&
         mallopt(M_TRIM_THRESHOLD, kMallocTrimThreshold) == 1;
#else
  return false;
#endif
}

}  // namespace loom

#endif  // LOOM_BASE_MALLOC_TUNING_H_
