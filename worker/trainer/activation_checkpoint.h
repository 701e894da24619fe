// Activation checkpointing: run part of the model without keeping its intermediate activations
// and recompute them in the backward pass (memory for time). The model uses it per block
// (model.activation_checkpointing: full) or per attention sublayer (selective).
#ifndef LOOM_WORKER_TRAINER_ACTIVATION_CHECKPOINT_H_
#define LOOM_WORKER_TRAINER_ACTIVATION_CHECKPOINT_H_

#include <torch/torch.h>

#include <functional>
#include <vector>

namespace loom::trainer {

using TensorFn = std::function<torch::Tensor(const torch::Tensor&)>;

// fn(x), keeping only x: the forward runs without an autograd graph; the backward runs fn(x)
// again with one and backpropagates through it into x and `params` (every tensor fn reads that
// needs a gradient, e.g. a module's parameters). fn must be deterministic (no dropout, no
// sampling), which every Loom layer is. Without grad mode, or when nothing needs a gradient,
// it is just fn(x).
torch::Tensor Recompute(const TensorFn& fn, const torch::Tensor& x,
                        const std::vector<torch::Tensor>& params);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_ACTIVATION_CHECKPOINT_H_
