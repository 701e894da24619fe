#include "worker/trainer/lease.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "loom/exit_codes.h"
#include "loom/lease_clock.h"

namespace loom::trainer {
namespace {

// The expiry the file holds, or -1 when it cannot be read (treated as expired: the agent only
// ever replaces the file whole).
int64_t ReadExpiry(const char* path) {
  std::ifstream in(path);
  long long expiry = -1;
  if (!(in >> expiry)) return -1;
  return expiry;
}

[[noreturn]] void Expire(const char* path, const char* when) {
  std::fprintf(stderr,
               "loom-train: lease expired (%s, %s): the worker agent lost the coordinator; "
               "stopping so that no other attempt of this job overlaps with this one\n",
               path, when);
  std::fflush(stderr);
  _exit(kExitLeaseExpired);
}

}  // namespace

void StartLeaseWatchdog() {
  const char* path = std::getenv("LOOM_LEASE_FILE");
  if (path == nullptr || *path == '\0') return;
  RequireLease("at start");
  std::thread([path] {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      RequireLease("watchdog");
    }
  }).detach();
}

void RequireLease(const char* before_what) {
  const char* path = std::getenv("LOOM_LEASE_FILE");
  if (path == nullptr || *path == '\0') return;
  if (LeaseClockMs() > ReadExpiry(path)) Expire(path, before_what);
}

}  // namespace loom::trainer
