// bf16 mixed precision (precision: bf16): LibTorch's autocast on the CPU or CUDA around the
// forward pass. Matmul-like ops run in bf16 with fp32 accumulation; parameters (the master
// weights), gradients and AdamW state stay fp32, and the trainer takes the loss in fp32.
#ifndef LOOM_WORKER_TRAINER_AUTOCAST_H_
#define LOOM_WORKER_TRAINER_AUTOCAST_H_

#include <torch/torch.h>

namespace loom::trainer {

// Which devices autocast is on for (in bf16), e.g. to replay a forward under the same state.
struct AutocastState {
  bool cpu = false, cuda = false;
  static AutocastState Current();
};

// Sets a state for its lifetime and restores the previous one (clearing autocast's cast cache
// when it turns autocast off).
class AutocastScope {
 public:
  explicit AutocastScope(AutocastState state);
  // bf16 autocast for `device` when enabled; nothing otherwise.
  AutocastScope(bool enabled, const torch::Device& device);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastState previous_;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_AUTOCAST_H_
