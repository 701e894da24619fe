// What Loom's CPU programs (loom-train, loom-serve, the loom-bench-* programs) do first thing in
// main(), before any matmul or large allocation: OpenBLAS's widest kernels (base/blas_core.h; may
// re-execute the program) and glibc malloc settings that let training steps reuse freed memory
// (base/malloc_tuning.h).
#ifndef LOOM_BASE_CPU_PROCESS_H_
#define LOOM_BASE_CPU_PROCESS_H_

#include "base/blas_core.h"
#include "base/malloc_tuning.h"

namespace loom {

inline void SetUpCpuProcess(char** argv) {
  ReexecWithBestBlasCore(argv);
  KeepFreedMemoryForReuse();
}

}  // namespace loom

#endif  // LOOM_BASE_CPU_PROCESS_H_
