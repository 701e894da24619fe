// NCCL straight from the CUDA toolkit (/usr/local/cuda), for LibTorch builds without
// ProcessGroupNCCL (Debian's CPU LibTorch) and as the GPU path of dist_backend "nccl". Ranks
// exchange the NCCL unique id through the job's c10d store (the same rendezvous as Gloo); each
// rank uses GPU LOCAL_RANK (or rank modulo the visible devices). Host buffers are staged through
// device memory; device buffers (LibTorch CUDA tensors) are used in place. Compiled only with
// the CUDA toolkit (LOOM_HAVE_NCCL); it runs only where a GPU exists. No NCCL or CUDA header
// leaks out of this file.
#ifndef LOOM_WORKER_TRAINER_NCCL_COMM_H_
#define LOOM_WORKER_TRAINER_NCCL_COMM_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace loom::trainer {

class NcclComm {
 public:
  // set/get: the rendezvous store (get blocks until the key exists or the store times out).
  static absl::StatusOr<std::unique_ptr<NcclComm>> Create(
      int rank, int world_size,
      const std::function<void(const std::string&, const std::string&)>& set,
      const std::function<std::string(const std::string&)>& get);
  ~NcclComm();

  // Sums `count` elements (float32 or float64) across ranks in place. `on_device`: the pointer
  // is CUDA memory of this rank's device.
  absl::Status AllReduceSum(void* data, int64_t count, bool float64, bool on_device);
  absl::Status Broadcast(void* data, int64_t bytes, int root, bool on_device);
  int device() const { return device_; }

 private:
  NcclComm() = default;
  absl::Status Stage(void* data, int64_t bytes, bool on_device, void** device_ptr);
  absl::Status Complete(void* data, void* dev, int64_t bytes, bool on_device, const char* what);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0;
  int device_ = 0;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_NCCL_COMM_H_
