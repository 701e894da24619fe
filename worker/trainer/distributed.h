// Data-parallel communication for trainer ranks, over existing engines only:
//   gloo: PyTorch c10d ProcessGroupGloo with a TCPStore rendezvous (CPU). Ranks find each other
//         through LOOM_RANK / LOOM_WORLD_SIZE / LOOM_MASTER_ADDR / LOOM_MASTER_PORT, falling back
//         to torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Rank 0 hosts the store.
//   mpi:  ranks started by mpirun / srun; rank and size from MPI itself, MPI_Allreduce on host
//         buffers (Debian's OpenMPI; compiled in when found, LOOM_HAVE_MPI).
// Backend "auto" picks mpi when an MPI launcher's environment is present (OMPI_COMM_WORLD_SIZE,
// PMI_SIZE), gloo when LOOM_WORLD_SIZE / WORLD_SIZE > 1, and a single rank otherwise.
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
  std::string backend = "none";  // resolved: none | gloo | mpi
  int rank = 0;
  int world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// Reads the launcher's environment for `backend` (auto | gloo | mpi); errors name the variable.
absl::StatusOr<DistributedConfig> DistributedConfigFromEnv(const std::string& backend,
                                                           std::chrono::milliseconds timeout);

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
  // Overwrites the tensors on every rank with root's values (one flat buffer per dtype run).
  absl::Status Broadcast(const std::vector<torch::Tensor>& tensors, int root);
  absl::Status Barrier();

 private:
  explicit Communicator(DistributedConfig config);
  struct Impl;
  DistributedConfig config_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_DISTRIBUTED_H_
