// Data-parallel communication for trainer ranks over PyTorch's c10d: ProcessGroupGloo with a
// TCPStore rendezvous (CPU). Never a home-made transport.
//
// Ranks find each other through the environment a launcher sets (the worker agent, a shell
// script, or torchrun): LOOM_RANK / LOOM_WORLD_SIZE / LOOM_MASTER_ADDR / LOOM_MASTER_PORT, falling
// back to torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Rank 0 hosts the store.
// A rank that dies or hangs makes the others fail within the configured timeout with an error
// naming the operation, instead of hanging (Gloo's per-operation timeout).
#ifndef LOOM_WORKER_TRAINER_DISTRIBUTED_H_
#define LOOM_WORKER_TRAINER_DISTRIBUTED_H_

#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace loom::trainer {

struct DistributedConfig {
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// Reads the launcher's environment; world size 1 when nothing is set. Errors name the variable.
absl::StatusOr<DistributedConfig> DistributedConfigFromEnv(std::chrono::milliseconds timeout);

class Communicator {
 public:
  // world_size 1 needs no process group; otherwise joins the Gloo group (blocking until every
  // rank arrives or the timeout passes).
  static absl::StatusOr<std::unique_ptr<Communicator>> Create(const DistributedConfig& config);
  ~Communicator();

  int rank() const { return config_.rank; }
  int world_size() const { return config_.world_size; }

  // Averages the tensors across ranks in place, packed into flat buckets of bucket_bytes.
  absl::Status AllReduceMean(const std::vector<torch::Tensor>& tensors,
                             int64_t bucket_bytes = 25 << 20);
  absl::StatusOr<double> AllReduceMean(double value);
  absl::Status Barrier();

 private:
  explicit Communicator(DistributedConfig config);
  struct Impl;
  DistributedConfig config_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_DISTRIBUTED_H_
