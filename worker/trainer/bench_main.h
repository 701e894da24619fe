// main() of the loom-bench-* trainer programs: OpenBLAS's wide kernels and malloc settings first
// (base/cpu_process.h), then the benchmark; a failed Status or an escaping exception is
// reported as "<program>: <message>" with exit code 1.
#ifndef LOOM_WORKER_TRAINER_BENCH_MAIN_H_
#define LOOM_WORKER_TRAINER_BENCH_MAIN_H_

#include <cstdint>
#include <exception>
#include <functional>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "base/cpu_process.h"

namespace loom::trainer {

// What the decoding benchmarks (loom-bench-generate, loom-bench-serve) compare: global MHA and
// global IHA with both cache layouts, as (name, attention config JSON).
inline std::vector<std::pair<std::string, std::string>> DecodingVariants(int64_t p) {
  const std::string pp = std::to_string(p);
  return {{"mha", R"({"plugin": "mha"})"},
          {"iha P=" + pp + ", kv_cache pseudo",
           R"({"plugin": "iha", "options": {"p": ")" + pp + R"(", "kv_cache": "pseudo"}})"},
          {"iha P=" + pp + ", kv_cache heads",
           R"({"plugin": "iha", "options": {"p": ")" + pp + R"(", "kv_cache": "heads"}})"}};
}

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
