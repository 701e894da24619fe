// OpenBLAS kernel choice for LibTorch's CPU matmuls.
//
// Debian's LibTorch does its GEMMs in OpenBLAS, which picks its kernels once, when the library
// loads, from the CPU model. A CPU newer than the library (Debian 12 ships OpenBLAS 0.3.21;
// Sapphire Rapids cloud VMs, for one) is not in its table and gets the SSE3 "Prescott" kernels:
// measured 30 GFLOP/s instead of 138 (AVX-512) on one core of the development VM, for every
// matmul of training, evaluation and benchmarks. OpenBLAS reads OPENBLAS_CORETYPE only at load,
// so Loom's CPU programs call ReexecWithBestBlasCore() first thing in main(): if OpenBLAS runs
// an SSE-era kernel on a CPU with AVX2 or AVX-512, set OPENBLAS_CORETYPE to the best kernel the
// CPU can run and re-execute the program (same PID, arguments and descriptors). Nothing happens
// when OPENBLAS_CORETYPE is already set (the user's choice), when LOOM_BLAS_CORE_KEEP is set,
// or when the BLAS is not OpenBLAS (MKL in the PyTorch wheels).
#ifndef LOOM_BASE_BLAS_CORE_H_
#define LOOM_BASE_BLAS_CORE_H_

#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

// OpenBLAS's entry points, weak: null where LibTorch's BLAS is not OpenBLAS (MKL in the PyTorch
// wheels). The thread count is OpenBLAS's own; torch::set_num_threads does not change it.
extern "C" {
char* openblas_get_corename(void) __attribute__((weak));
void openblas_set_num_threads(int) __attribute__((weak));
int openblas_get_num_threads(void) __attribute__((weak));
int openblas_get_parallel(void) __attribute__((weak));  // 0 sequential, 1 pthreads, 2 OpenMP
}

namespace loom {

// OpenBLAS's threading build: "OpenMP" (its GEMMs run on LibTorch's OpenMP pool and follow
// torch::set_num_threads), "pthreads" (a pool and a thread count of its own), "sequential", or
// "" when LibTorch's BLAS is not OpenBLAS.
inline const char* OpenBlasThreading() {
  if (openblas_get_parallel == nullptr) return "";
  switch (openblas_get_parallel()) {
    case 0:
      return "sequential";
    case 1:
      return "pthreads";
    default:
      return "OpenMP";
  }
}

struct CpuVectorFeatures {
  bool avx2_fma = false;
  bool avx512 = false;       // F, BW, VL, DQ: OpenBLAS's SkylakeX kernels
  bool avx512_bf16 = false;  // with the above: its Cooperlake kernels (used for newer CPUs too)
};

inline CpuVectorFeatures DetectCpuVectorFeatures() {
  CpuVectorFeatures f;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();  // the checks include the OS's support for the register state
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = f.avx2_fma && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
  f.avx512_bf16 = f.avx512 && __builtin_cpu_supports("avx512bf16");
#endif
#endif
  return f;
}

// The OPENBLAS_CORETYPE to switch to when OpenBLAS chose `current` on a CPU with `cpu`, or ""
// to keep it: only SSE-era kernels are replaced, by the widest the CPU runs.
inline std::string BetterBlasCore(const std::string& current, const CpuVectorFeatures& cpu) {
  std::string name;
  for (char c : current) name += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  static const char* const kSseEra[] = {"prescott",  "core2",  "penryn",  "dunnington",
                                        "nehalem",   "atom",   "katmai",  "coppermine",
                                        "northwood", "banias", "generic", "unknown"};
  bool sse_era = false;
  for (const char* old : kSseEra) sse_era |= name == old;
  if (!sse_era) return "";
  if (cpu.avx512_bf16) return "Cooperlake";
  if (cpu.avx512) return "SkylakeX";
  if (cpu.avx2_fma) return "Haswell";
  return "";
}

// Call first in main(). Returns only when the program keeps running as it is.
inline void ReexecWithBestBlasCore(char** argv) {
  if (openblas_get_corename == nullptr || std::getenv("OPENBLAS_CORETYPE") != nullptr ||
      std::getenv("LOOM_BLAS_CORE_KEEP") != nullptr) {
    return;
  }
  const char* current = openblas_get_corename();
  const std::string better =
      BetterBlasCore(current != nullptr ? current : "", DetectCpuVectorFeatures());
  if (better.empty()) return;
  // Set even if the exec fails: a child process started later still gets the better kernels.
  setenv("OPENBLAS_CORETYPE", better.c_str(), 1);
  std::fprintf(stderr,
               "loom: OpenBLAS chose its %s kernels on a CPU with %s; restarting with "
               "OPENBLAS_CORETYPE=%s (LOOM_BLAS_CORE_KEEP=1 keeps them)\n",
               current, better == "Haswell" ? "AVX2" : "AVX-512", better.c_str());
  std::fflush(stderr);
  // The resolved path rather than /proc/self/exe: the process keeps its name ("loom-train", not
  // "exe") for ps, pkill and /proc/<pid>/comm.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    execv(self, argv);
  }
  execv("/proc/self/exe", argv);
  std::fprintf(stderr, "loom: restart failed; continuing with the %s kernels\n", current);
}

}  // namespace loom

#endif  // LOOM_BASE_BLAS_CORE_H_
