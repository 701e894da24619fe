#include "worker/trainer/gpu_stats.h"

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"

#ifdef LOOM_TORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace loom::trainer {

std::optional<GpuMemory> ReadGpuMemory(const torch::Device& device) {
  if (!device.is_cuda()) return std::nullopt;
#ifdef LOOM_TORCH_HAS_CUDA
  // Index 0 of each stat array is the aggregate over pool types in every LibTorch version.
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  GpuMemory m;
  m.allocated = stats.allocated_bytes[0].current;
  m.reserved = stats.reserved_bytes[0].current;
  m.peak = stats.allocated_bytes[0].peak;
  return m;
#else
  return std::nullopt;
#endif
}

std::string GpuMemoryJson(const GpuMemory& m) {
  return absl::StrCat("{\"allocated_bytes\":", m.allocated, ",\"reserved_bytes\":", m.reserved,
                      ",\"peak_bytes\":", m.peak, "}\n");
}

void ReplaceStatusFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc | std::ios::binary);
    if (!(out << text)) return;
  }
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace loom::trainer
