// A rank's CUDA memory for the loom_train_gpu_memory_* series (docs/deploy.md): what LibTorch's
// caching allocator holds on the rank's device. Readable only where LibTorch was built with CUDA
// (LOOM_TORCH_HAS_CUDA); elsewhere there is nothing to read and no series.
#ifndef LOOM_WORKER_TRAINER_GPU_STATS_H_
#define LOOM_WORKER_TRAINER_GPU_STATS_H_

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>

namespace loom::trainer {

struct GpuMemory {
  int64_t allocated = 0;  // bytes in live tensors
  int64_t reserved = 0;   // bytes the allocator holds from the driver (allocated + cached)
  int64_t peak = 0;       // the most bytes in live tensors since the process started
};

// nullopt for a CPU device or a LibTorch without CUDA.
std::optional<GpuMemory> ReadGpuMemory(const torch::Device& device);

// {"allocated_bytes": .., "reserved_bytes": .., "peak_bytes": ..}: what the worker agent reads
// from LOOM_GPU_STATS_FILE and re-exports with the rank's job, GPU index and UUID.
std::string GpuMemoryJson(const GpuMemory& m);

// Replaces `path` with `text` by rename (no fsync: a status file, rewritten every logged step).
void ReplaceStatusFile(const std::string& path, const std::string& text);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_GPU_STATS_H_
