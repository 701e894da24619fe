// What accelerators this process can use. CUDA support is compiled in when the toolkit is
// found at build time (LOOM_HAVE_CUDA); whether a GPU exists is only known at run time, and
// "no GPU" is a normal answer that makes the trainer fall back to the CPU.
#ifndef LOOM_WORKER_TRAINER_DEVICES_H_
#define LOOM_WORKER_TRAINER_DEVICES_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace loom::trainer {

struct DeviceReport {
  bool cuda_compiled = false;  // Loom's own CUDA code is in this build
  int cuda_devices = 0;        // GPUs the CUDA runtime sees (0 without a driver)
  std::string cuda_status;     // why there are none, when there are none
  std::vector<std::string> cuda_names;
  bool torch_cuda = false;  // LibTorch itself was built with CUDA and sees a GPU
  int cpu_threads = 0;      // LibTorch intra-op threads
};

DeviceReport DetectDevices();

// The CUDA device of this rank among the `visible` ones: the only one when the launcher bound the
// rank to a single GPU (the worker agent sets CUDA_VISIBLE_DEVICES per rank), else LOCAL_RANK
// (torchrun, Slurm). `local_rank` is the LOCAL_RANK variable (null: 0). A LOCAL_RANK beyond the
// visible devices is an error, never a silently shared GPU.
absl::StatusOr<int> CudaDeviceForRank(const char* local_rank, int visible);

// Runs a small kernel on `device` and checks its result: a GPU that is listed but broken
// (driver mismatch, ECC fault) fails here rather than mid-training.
absl::Status CudaSelfTest(int device);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_DEVICES_H_
