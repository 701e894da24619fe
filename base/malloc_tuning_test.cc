// base/malloc_tuning.h: with the settings, a loop that allocates, touches and frees the same
// blocks every "step" (what a training step does with its activations) stops page-faulting them
// in again after the first step; without them glibc gives the memory back and faults it in every
// step (the control, so the first assertion cannot pass by accident). Each case runs in a forked
// child: mallopt settings are process-wide.
#include "base/malloc_tuning.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace loom {
namespace {

constexpr size_t kBlockBytes = 3 << 20;  // above glibc's initial 128 KiB mmap threshold
constexpr int kBlocks = 8, kSteps = 12, kWarmupSteps = 2;
constexpr long kPagesPerStep = kBlocks * (kBlockBytes / 4096);

long MinorFaults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Through volatile pointers, so the compiler cannot pair and drop the malloc and free.
void* (*volatile g_malloc)(size_t) = std::malloc;
void (*volatile g_free)(void*) = std::free;

// Minor page faults per step after the warm-up steps.
long FaultsPerStep() {
  long start = 0;
  for (int step = 0; step < kSteps; ++step) {
    if (step == kWarmupSteps) start = MinorFaults();
    void* blocks[kBlocks];
    for (void*& b : blocks) {
      b = g_malloc(kBlockBytes);
      std::memset(b, step + 1, kBlockBytes);
    }
    for (void* b : blocks) g_free(b);
  }
  return (MinorFaults() - start) / (kSteps - kWarmupSteps);
}

// Runs the step loop in a child, after KeepFreedMemoryForReuse() when `tuned`; returns its
// faults per step, or -1 when the settings were expected but not applied.
long FaultsPerStepInChild(bool tuned) {
  int fds[2];
  if (pipe(fds) != 0) return -2;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    long result = tuned && !KeepFreedMemoryForReuse() ? -1 : FaultsPerStep();
    (void)!write(fds[1], &result, sizeof result);
    _exit(0);
  }
  close(fds[1]);
  long result = -2;
  if (read(fds[0], &result, sizeof result) != sizeof result) result = -2;
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return result;
}

TEST(MallocTuning, StepsReuseFreedMemoryInsteadOfFaultingItInAgain) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "glibc only";
#endif
  unsetenv("GLIBC_TUNABLES");
  const long untuned = FaultsPerStepInChild(false);
  const long tuned = FaultsPerStepInChild(true);
  ASSERT_GE(untuned, 0);
  ASSERT_GE(tuned, 0) << "KeepFreedMemoryForReuse() did not apply its settings";
  std::printf("minor faults per step of %ld pages: %ld with glibc's defaults, %ld tuned\n",
              kPagesPerStep, untuned, tuned);
  // glibc's defaults give the freed blocks back to the kernel: most pages fault in every step.
  EXPECT_GT(untuned, kPagesPerStep / 2) << "the control no longer shows the fault churn";
  // Kept for reuse: almost none do (measured 0).
  EXPECT_LT(tuned, kPagesPerStep / 20) << "untuned: " << untuned << " faults per step";
}

TEST(MallocTuning, TheUsersOwnMallocTunablesAreLeftAlone) {
#if !defined(__GLIBC__)
  GTEST_SKIP() << "glibc only";
#endif
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2", 1);
    const bool applied = KeepFreedMemoryForReuse();
    unsetenv("GLIBC_TUNABLES");
    const bool applied_without = KeepFreedMemoryForReuse();
    const char out[2] = {applied ? '1' : '0', applied_without ? '1' : '0'};
    (void)!write(fds[1], out, 2);
    _exit(0);
  }
  close(fds[1]);
  char in[2] = {'?', '?'};
  ASSERT_EQ(read(fds[0], in, 2), 2);
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  EXPECT_EQ(in[0], '0') << "GLIBC_TUNABLES naming glibc.malloc must win";
  EXPECT_EQ(in[1], '1');
}

}  // namespace
}  // namespace loom
