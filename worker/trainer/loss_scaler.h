// Dynamic loss scaling (loss_scale.mode: dynamic; the default for precision fp16), as PyTorch's
// GradScaler does it: fp16 activation gradients of a small loss underflow to zero, so the loss is
// multiplied by a large scale before backward and the fp32 parameter gradients are divided by it
// before clipping and the update. A step whose gradients overflowed (an inf or NaN gradient norm)
// is skipped and the scale backed off; after `growth_interval` clean steps in a row it grows.
// Scales stay powers of two times the initial scale, so scaling and unscaling are exact.
#ifndef LOOM_WORKER_TRAINER_LOSS_SCALER_H_
#define LOOM_WORKER_TRAINER_LOSS_SCALER_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace loom::trainer {

class LossScaler {
 public:
  struct Options {
    double initial = 65536;  // 2^16, GradScaler's default
    double growth = 2;
    double backoff = 0.5;
    int64_t growth_interval = 2000;
  };
  explicit LossScaler(Options options);

  double scale() const { return scale_; }
  // Clean steps since the last overflow or growth.
  int64_t good_steps() const { return good_steps_; }

  torch::Tensor Scale(const torch::Tensor& loss) const { return loss * scale_; }
  // Divides every defined gradient by the scale, in place.
  void Unscale(const std::vector<torch::Tensor>& params) const;
  // After a step: `finite` = its gradients did not overflow. Returns true when the scale changed.
  bool Update(bool finite);

  // Checkpoint state: the scale (exactly, as a hex float) and the clean-step count.
  std::string State() const;
  absl::Status Restore(const std::string& state);

 private:
  Options options_;
  double scale_;
  int64_t good_steps_ = 0;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_LOSS_SCALER_H_
