// Bridges storage/safetensors and torch::Tensor, and named tensors and module parameters.
#ifndef LOOM_WORKER_TRAINER_TENSOR_IO_H_
#define LOOM_WORKER_TRAINER_TENSOR_IO_H_

#include <torch/torch.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "storage/safetensors.h"

namespace loom::trainer {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Reads every tensor of a safetensors file into owned CPU tensors.
absl::StatusOr<std::map<std::string, torch::Tensor>> LoadTensors(const std::string& path);
// The same for a file already parsed (checkpoint shards).
absl::StatusOr<std::map<std::string, torch::Tensor>> TensorsFromFile(
    const storage::SafetensorsFile& file);

// Tensors as the storage layer's write descriptors; `keep` holds the CPU contiguous copies the
// descriptors point into and must outlive them.
struct WritableTensors {
  std::vector<torch::Tensor> keep;
  std::vector<storage::TensorToWrite> items;
};
absl::StatusOr<WritableTensors> ToWritable(const NamedTensors& tensors);

// Writes tensors (moved to CPU, made contiguous) atomically. Unsupported dtypes are an error.
absl::Status SaveTensors(const std::string& path, const NamedTensors& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// Copies `tensors` into the module's parameters and buffers by name (converting dtype). Every
// parameter must be present with the right shape, and no tensor may be left over; errors list
// the names.
absl::Status LoadIntoModule(torch::nn::Module& module,
                            const std::map<std::string, torch::Tensor>& tensors);

// The module's parameters and buffers by name, detached.
NamedTensors ModuleTensors(const torch::nn::Module& module);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_TENSOR_IO_H_
