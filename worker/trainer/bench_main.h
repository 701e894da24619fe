// main() of the loom-bench-* trainer programs: OpenBLAS's wide kernels and malloc settings first
// (base/cpu_process.h), then the benchmark; a failed Status or an escaping exception is
// reported as "<program>: <message>" with exit code 1.
#ifndef LOOM_WORKER_TRAINER_BENCH_MAIN_H_
#define LOOM_WORKER_TRAINER_BENCH_MAIN_H_

#include <exception>
#include <functional>
#include <iostream>

#include "absl/status/status.h"
#include "base/cpu_process.h"

namespace loom::trainer {

inline int BenchmarkMain(const char* program, char** argv,
                         const std::function<absl::Status()>& run) {
  SetUpCpuProcess(argv);  // before any matmul or large allocation
  absl::Status s;
  try {
    s = run();
  } catch (const std::exception& e) {
    s = absl::InternalError(e.what());
  }
  if (!s.ok()) {
    std::cerr << program << ": " << s.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_BENCH_MAIN_H_
