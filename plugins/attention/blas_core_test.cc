// OpenBLAS kernel choice (base/blas_core.h): the replacement table, and end to end on this
// machine: a Loom program started without OPENBLAS_CORETYPE must end up on kernels at least as
// wide as the CPU's AVX2/AVX-512 (OpenBLAS reports its choice with OPENBLAS_VERBOSE=2). And the
// threading flavour (cmake/LoomTorch.cmake): with Debian's LibTorch and libopenblas0-openmp
// installed, Loom's programs run the OpenMP build, whose threads are LibTorch's (it reads
// omp_get_max_threads(), which torch::set_num_threads sets, at every call).
#include "base/blas_core.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

namespace loom {
namespace {

TEST(BlasCore, ReplacesOnlySseEraKernelsWithTheWidestTheCpuRuns) {
  CpuVectorFeatures none, avx2, avx512, bf16;
  avx2.avx2_fma = true;
  avx512 = avx2;
  avx512.avx512 = true;
  bf16 = avx512;
  bf16.avx512_bf16 = true;
  EXPECT_EQ(BetterBlasCore("Prescott", bf16), "Cooperlake");
  EXPECT_EQ(BetterBlasCore("prescott", avx512), "SkylakeX");
  EXPECT_EQ(BetterBlasCore("Nehalem", avx2), "Haswell");
  EXPECT_EQ(BetterBlasCore("Prescott", none), "");  // an old CPU keeps old kernels
  EXPECT_EQ(BetterBlasCore("Haswell", bf16), "");   // a modern choice is left alone
  EXPECT_EQ(BetterBlasCore("SkylakeX", bf16), "");
  EXPECT_EQ(BetterBlasCore("Zen", avx2), "");
}

TEST(BlasCore, LoomProgramsRunOnWideKernels) {
  torch::ones({2, 2}).mm(torch::ones({2, 2}));  // LibTorch (and its BLAS) are loaded
  if (openblas_get_corename == nullptr) GTEST_SKIP() << "LibTorch's BLAS is not OpenBLAS";
  const CpuVectorFeatures cpu = DetectCpuVectorFeatures();
  if (!cpu.avx2_fma) GTEST_SKIP() << "CPU without AVX2: OpenBLAS's own choice stands";
  const char* bench = std::getenv("LOOM_BENCH_ATTENTION");
  ASSERT_NE(bench, nullptr) << "ctest sets LOOM_BENCH_ATTENTION";
  const std::string command = std::string("env -u OPENBLAS_CORETYPE -u LOOM_BLAS_CORE_KEEP ") +
                              "OPENBLAS_VERBOSE=2 " + bench + " --help 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output, core;
  char line[512];
  while (std::fgets(line, sizeof line, pipe) != nullptr) {
    output += line;
    std::string l(line);
    if (l.rfind("Core: ", 0) == 0) core = l.substr(6, l.find_first_of("\r\n") - 6);
  }
  ASSERT_EQ(pclose(pipe), 0) << output;
  ASSERT_FALSE(core.empty()) << "OpenBLAS printed no core:\n" << output;
  EXPECT_EQ(BetterBlasCore(core, cpu), "") << "still on " << core << ":\n" << output;
}

TEST(BlasCore, LoomProgramsRunTheOpenMpBuildOnLibTorchsThreads) {
  torch::ones({2, 2}).mm(torch::ones({2, 2}));
  if (openblas_get_parallel == nullptr) GTEST_SKIP() << "LibTorch's BLAS is not OpenBLAS";
#ifndef LOOM_EXPECT_OPENBLAS_OPENMP
  GTEST_SKIP() << "this build does not load the OpenMP build (cmake/LoomTorch.cmake)";
#endif
  EXPECT_EQ(openblas_get_parallel(), 2) << "0 sequential, 1 pthreads, 2 OpenMP";
}

}  // namespace
}  // namespace loom
