// AdamW (Loshchilov & Hutter 2019) with decoupled weight decay, written out rather than taken
// from torch::optim so that its state is plain named tensors: checkpoints store them by
// parameter name (exact resume, resharding across ranks) and the update is the same on every
// LibTorch version. The arithmetic follows torch.optim.AdamW:
//   p ← p·(1 − lr·wd);  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²
//   p ← p − lr/(1 − β1^t) · m / (sqrt(v)/sqrt(1 − β2^t) + ε)
// Weight decay applies to matrices only (parameters with ≥ 2 dimensions: Linear weights,
// embeddings, IHA mixing tensors), never to norm gains, biases or vectors.
#ifndef LOOM_WORKER_TRAINER_ADAMW_H_
#define LOOM_WORKER_TRAINER_ADAMW_H_

#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/trainer/tensor_io.h"

namespace loom::trainer {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  // CPU float32/float64 parameters update in one fused, threaded pass (cpu_kernels/adamw_cpu.h);
  // false keeps the tensor-op path everywhere (the reference, for tests).
  bool fused_cpu = true;
};

class AdamW {
 public:
  // `owns` (ZeRO-1): the parameters this rank updates and keeps moments for; null = all.
  AdamW(const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
        AdamWConfig config, std::function<bool(const std::string&)> owns = nullptr);

  // One update with learning rate `lr` from the parameters' .grad() (parameters without a
  // gradient are left alone).
  void Step(double lr);
  int64_t step() const { return step_; }

  // "<name>.exp_avg" and "<name>.exp_avg_sq" for every parameter this optimizer owns.
  NamedTensors StateTensors() const;
  // Restores the moments of every owned parameter (each must be present with the right shape;
  // others are ignored, which is how a checkpoint reshards onto another partition) and the step.
  absl::Status LoadState(const std::map<std::string, torch::Tensor>& tensors, int64_t step);

 private:
  struct Slot {
    std::string name;
    torch::Tensor param, exp_avg, exp_avg_sq;
    bool decay;
    bool owned;
  };
  void StepWithTensorOps(Slot& s, double lr);

  AdamWConfig config_;
  std::vector<Slot> slots_;
  int64_t step_ = 0;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_ADAMW_H_
