// Data-parallel communication for trainer ranks, over existing engines only:
//   gloo: PyTorch c10d ProcessGroupGloo with a TCPStore rendezvous (CPU). Ranks find each other
//         through LOOM_RANK / LOOM_WORLD_SIZE / LOOM_MASTER_ADDR / LOOM_MASTER_PORT, falling back
//         to torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Rank 0 hosts the store.
//   nccl: NCCL from the CUDA toolkit, bootstrapped through the same TCPStore (GPU machines;
//         nccl_comm.h); compiled in with the toolkit (LOOM_HAVE_NCCL), refused without a GPU.
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
#include <functional>
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
  // This node's own address, which Gloo's sockets bind to (LOOM_NODE_ADDR, set by the worker
  // agent from its --address); "" = master_addr, right only when every rank is on its node.
  std::string node_addr;
  int master_port = 0;
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// Reads the launcher's environment for `backend` (auto | gloo | mpi); errors name the variable.
absl::StatusOr<DistributedConfig> DistributedConfigFromEnv(const std::string& backend,
                                                           std::chrono::milliseconds timeout);

class Communicator;

// Gradient all-reduce overlapped with the backward pass (what DDP's reducer does): parameters
// are grouped into buckets in reverse registration order (about the order backward produces
// their gradients). Armed for the last micro-batch of a step, a hook on each parameter adds the
// gradient accumulated by earlier micro-batches, copies the sum into its bucket, and a complete
// bucket starts its asynchronous all-reduce while backward goes on; buckets start strictly in
// order so every rank issues the same sequence. Earlier micro-batches accumulate locally with no
// communication. Finish() starts what is left (parameters without a gradient), waits, and writes
// the averaged gradients into .grad.
class GradientReducer {
 public:
  GradientReducer(Communicator* comm, std::vector<torch::Tensor> params, int64_t bucket_bytes);
  ~GradientReducer();
  void Arm();
  absl::Status Finish();
  int buckets() const { return static_cast<int>(buckets_.size()); }
  // Buckets whose all-reduce started before backward returned, in the last Finish().
  int started_during_backward() const { return started_early_; }

 private:
  struct Bucket {
    std::vector<int> params;
    torch::Tensor flat;
    std::vector<int64_t> offsets;
    int ready = 0;
    std::function<absl::Status()> wait;
  };
  void OnGradient(int param, const torch::Tensor& full);
  void LaunchReady();

  Communicator* comm_;
  std::vector<torch::Tensor> params_;
  std::vector<std::pair<int, int64_t>> slot_;  // param -> (bucket, offset)
  std::vector<Bucket> buckets_;
  std::vector<bool> has_grad_;
  std::vector<unsigned> hook_ids_;
  bool armed_ = false;
  bool in_finish_ = false;
  size_t next_launch_ = 0;
  int started_early_ = 0;
  absl::Status error_;
};

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

  // Starts summing `flat` (one contiguous tensor) across ranks; the returned function waits for
  // the result (in place). Gloo runs it on its own thread, so work continues meanwhile; MPI sums
  // before returning. Calls must come in the same order on every rank.
  absl::StatusOr<std::function<absl::Status()>> StartAllReduceSum(torch::Tensor flat);

 private:
  explicit Communicator(DistributedConfig config);

 public:
  struct Impl;  // backend state (declared in distributed.cc)

 private:
  DistributedConfig config_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_DISTRIBUTED_H_
