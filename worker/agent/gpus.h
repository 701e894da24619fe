// A node's GPUs: what it has (NVML, loaded at run time so that CPU nodes and builds need no
// driver, or the operator's --gpus list) and which of them running ranks hold. Each rank gets a
// GPU of its own, and a GPU goes back to the pool only when the rank's process has been reaped.
#ifndef LOOM_WORKER_AGENT_GPUS_H_
#define LOOM_WORKER_AGENT_GPUS_H_

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
