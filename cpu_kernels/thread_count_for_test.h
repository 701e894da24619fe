// Tests of the CPU kernels run each case at several LibTorch thread counts: ThreadCount sets the
// count for one scope and restores the previous one, also when an assertion returns early.
#ifndef LOOM_CPU_KERNELS_THREAD_COUNT_FOR_TEST_H_
#define LOOM_CPU_KERNELS_THREAD_COUNT_FOR_TEST_H_

#include <torch/torch.h>

namespace loom::cpu_kernels {

class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(torch::get_num_threads()) { torch::set_num_threads(n); }
  ~ThreadCount() { torch::set_num_threads(saved_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_;
};

}  // namespace loom::cpu_kernels

#endif  // LOOM_CPU_KERNELS_THREAD_COUNT_FOR_TEST_H_
