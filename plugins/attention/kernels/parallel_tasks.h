// How Loom's fused CPU kernels (fused_attention.cc, simplicial/simplicial_cpu.cc) spread their
// tasks over cores: LibTorch's own OpenMP pool, contiguous ranges per thread with stealing from
// the back. Includers are compiled with OpenMP (loom_openmp_sources in CMake).
#ifndef LOOM_PLUGINS_ATTENTION_KERNELS_PARALLEL_TASKS_H_
#define LOOM_PLUGINS_ATTENTION_KERNELS_PARALLEL_TASKS_H_

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>

#include "base/blas_core.h"

namespace loom::attention::kernels {

// Tasks [0, count) dealt out as one contiguous range per thread. A thread takes its own range
// from the front, in order; when it is empty, it takes the last task of another thread's range.
// Callers put batch rows outermost, so that most tasks run on the thread whose share of the rows
// the row-split linears computed (block t of the B·N rows on thread t, cpu_kernels/linear_cpu.h):
// the tile loads of q, k and v then hit that core's cache instead of the other core's. Handing
// tasks out in plain index order made two threads spend most of the extra time of a small-window
// layer on those loads. Stealing from the back keeps the end of a call balanced.
class TaskRanges {
 public:
  TaskRanges(int64_t count, int threads) : threads_(threads), ranges_(new Range[threads]) {
    TORCH_CHECK(count < (int64_t{1} << 31), "fused kernel: too many tasks (", count, ")");
    for (int t = 0; t < threads; ++t) {
      ranges_[t].bounds = Pack(count * t / threads, count * (t + 1) / threads);
    }
  }

  // The next task of thread t, or -1 when none is left anywhere.
  int64_t Next(int t) {
    if (const int64_t task = Take(ranges_[t], /*front=*/true); task >= 0) return task;
    for (int i = 1; i < threads_; ++i) {
      if (const int64_t task = Take(ranges_[(t + i) % threads_], /*front=*/false); task >= 0) {
        return task;
      }
    }
    return -1;
  }

 private:
  struct alignas(64) Range {  // [begin, end) packed as begin | end << 32; a line of its own
    std::atomic<uint64_t> bounds{0};
  };

  static uint64_t Pack(int64_t begin, int64_t end) {
    return static_cast<uint64_t>(begin) | (static_cast<uint64_t>(end) << 32);
  }

  static int64_t Take(Range& r, bool front) {
    uint64_t bounds = r.bounds.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t begin = static_cast<int64_t>(bounds & 0xffffffffu);
      const int64_t end = static_cast<int64_t>(bounds >> 32);
      if (begin >= end) return -1;
      const uint64_t rest = front ? Pack(begin + 1, end) : Pack(begin, end - 1);
      if (r.bounds.compare_exchange_weak(bounds, rest, std::memory_order_relaxed)) {
        return front ? begin : end - 1;
      }
    }
  }

  int threads_;
  std::unique_ptr<Range[]> ranges_;
};

// Runs fn(scratch, task) for task in [0, count) on at::get_num_threads() threads with autograd
// off, dealt out by TaskRanges (callers order tasks with batch rows outermost and, within a row,
// heavy ones first); each thread owns one scratch from make_scratch(). The threads are
// LibTorch's own OpenMP pool (this file is compiled with -fopenmp against the OpenMP runtime
// LibTorch uses), so the kernel never runs a second pool beside LibTorch's, and thread t of
// this region is the thread that ran block t of LibTorch's last parallel_for.
template <typename MakeScratch, typename Fn>
void ParallelTasks(int64_t count, MakeScratch make_scratch, Fn fn) {
  // Tile GEMMs are small: each task runs its GEMMs on its own thread and parallelism comes from
  // the tasks. OpenMP OpenBLAS does that by itself inside a parallel region; the pthreads build
  // would queue every thread's GEMMs on its one pool, so it is told to (a process-wide setting,
  // hence only outside parallel regions).
  const bool nested = omp_in_parallel() != 0;
  const bool pin_blas = !nested && std::strcmp(loom::OpenBlasThreading(), "pthreads") == 0 &&
                        openblas_set_num_threads != nullptr && openblas_get_num_threads != nullptr;
  const int blas_threads = pin_blas ? openblas_get_num_threads() : 0;
  if (pin_blas) openblas_set_num_threads(1);
  const int threads =
      nested
          ? 1
          : static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count)));
  TaskRanges tasks(count, threads);
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    try {
      torch::NoGradGuard no_grad;
      auto scratch = make_scratch();
      const int t = threads == 1 ? 0 : omp_get_thread_num();
      for (int64_t i = tasks.Next(t); i >= 0 && !failed; i = tasks.Next(t)) fn(scratch, i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
      failed = true;  // the others stop after their current task
    }
  }
  if (pin_blas) openblas_set_num_threads(blas_threads);
  if (error) std::rethrow_exception(error);
}

}  // namespace loom::attention::kernels

#endif  // LOOM_PLUGINS_ATTENTION_KERNELS_PARALLEL_TASKS_H_
