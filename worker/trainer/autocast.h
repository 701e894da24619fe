// Mixed precision (precision: bf16 | fp16): LibTorch's autocast around the forward pass.
// Matmul-like ops run in the low precision with fp32 accumulation; parameters (the master
// weights), gradients and AdamW state stay fp32, and the trainer takes the loss in fp32.
// bf16 runs on the CPU or CUDA; fp16 on CUDA only (with dynamic loss scaling, loss_scaler.h).
#ifndef LOOM_WORKER_TRAINER_AUTOCAST_H_
#define LOOM_WORKER_TRAINER_AUTOCAST_H_

#include <torch/torch.h>

#include <string>

namespace loom::trainer {

// Which devices autocast is on for, and CUDA's autocast type (the CPU's is always bf16), e.g. to
// replay a forward under the same state.
struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cuda_dtype = at::kBFloat16;
  static AutocastState Current();
};

// Sets a state for its lifetime and restores the previous one (clearing autocast's cast cache
// when it turns autocast off).
class AutocastScope {
 public:
  explicit AutocastScope(AutocastState state);
  // Autocast for `device` when `precision` is bf16 or fp16; nothing for fp32 or fp64.
  AutocastScope(const std::string& precision, const torch::Device& device);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastState previous_;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_AUTOCAST_H_
