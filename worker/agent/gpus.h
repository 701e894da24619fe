// A node's GPUs: what it has (NVML, loaded at run time so that CPU nodes and builds need no
// driver, or the operator's --gpus list) and which of them running ranks hold. Each rank gets a
// GPU of its own, and a GPU goes back to the pool only when the rank's process has been reaped.
#ifndef LOOM_WORKER_AGENT_GPUS_H_
#define LOOM_WORKER_AGENT_GPUS_H_

#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "loom/v1/control.pb.h"

namespace loom::agent {

// NVML's GPUs (index, UUID, model, memory), or none: no libnvidia-ml, no driver, no GPU. `why`
// says which when there are none.
std::vector<v1::Gpu> DiscoverGpus(std::string* why);

// --gpus: "auto" (discover), "none", or a comma-separated list of device indices ("0,1,3"),
// which is how CPU-only machines exercise GPU scheduling.
absl::StatusOr<std::vector<v1::Gpu>> GpusFromFlag(const std::string& flag, std::string* why);

// What CUDA_VISIBLE_DEVICES names a GPU by: its UUID when known (immune to CUDA's and NVML's
// different device orders), else its index.
std::string VisibleDeviceName(const v1::Gpu& gpu);

// Live readings of a GPU from NVML, for the per-rank GPU series (docs/deploy.md). Open() is null
// where there is no NVML (CPU nodes, --gpus lists on machines without a driver).
class NvmlSampler {
 public:
  static std::unique_ptr<NvmlSampler> Open();
  ~NvmlSampler();
  NvmlSampler(const NvmlSampler&) = delete;
  NvmlSampler& operator=(const NvmlSampler&) = delete;

  struct Reading {
    double utilization = 0;  // fraction of the last sample period a kernel ran (0..1)
    int64_t memory_used_bytes = 0;
  };
  // By UUID when the inventory has one, else by index; nullopt when NVML cannot read it.
  std::optional<Reading> Read(const v1::Gpu& gpu) const;

 private:
  NvmlSampler() = default;
  void* lib_ = nullptr;
  int (*shutdown_)() = nullptr;
  int (*by_index_)(unsigned, void**) = nullptr;
  int (*by_uuid_)(const char*, void**) = nullptr;
  int (*utilization_)(void*, void*) = nullptr;
  int (*memory_)(void*, void*) = nullptr;
};

class GpuPool {
 public:
  explicit GpuPool(const std::vector<v1::Gpu>& gpus);
  bool empty() const { return all_.empty(); }
  int free_count() const { return static_cast<int>(free_.size()); }
  // The lowest free GPU (its position in the inventory), or an error when every GPU is held.
  absl::StatusOr<int> Take();
  void Give(int gpu);
  const v1::Gpu& gpu(int i) const { return all_[static_cast<size_t>(i)]; }

 private:
  std::vector<v1::Gpu> all_;
  std::set<int> free_;
};

}  // namespace loom::agent

#endif  // LOOM_WORKER_AGENT_GPUS_H_
