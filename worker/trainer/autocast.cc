#include "worker/trainer/autocast.h"

#include <ATen/autocast_mode.h>

#include "loom/torch_compat.h"

namespace loom::trainer {
namespace {

// LibTorch 2.4 replaced the per-device setters with device-type ones.
void Apply(const AutocastState& s) {
#if LOOM_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCPU, s.cpu);
  at::autocast::set_autocast_dtype(at::kCUDA, s.cuda_dtype);
  at::autocast::set_autocast_enabled(at::kCUDA, s.cuda);
#else
  at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
  at::autocast::set_cpu_enabled(s.cpu);
  at::autocast::set_autocast_gpu_dtype(s.cuda_dtype);
  at::autocast::set_enabled(s.cuda);
#endif
}

}  // namespace

AutocastState AutocastState::Current() {
  AutocastState s;
#if LOOM_TORCH_AT_LEAST(2, 4)
  s.cpu = at::autocast::is_autocast_enabled(at::kCPU);
  s.cuda = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
#else
  s.cpu = at::autocast::is_cpu_enabled();
  s.cuda = at::autocast::is_enabled();
  s.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
#endif
  return s;
}

AutocastScope::AutocastScope(AutocastState state) : previous_(AutocastState::Current()) {
  Apply(state);
}

AutocastScope::AutocastScope(const std::string& precision, const torch::Device& device)
    : AutocastScope(precision == "bf16" || precision == "fp16"
                        ? AutocastState{device.is_cpu(), device.is_cuda(),
                                        precision == "fp16" ? at::kHalf : at::kBFloat16}
                        : AutocastState::Current()) {}

AutocastScope::~AutocastScope() {
  const AutocastState now = AutocastState::Current();
  Apply(previous_);
  if ((now.cpu && !previous_.cpu) || (now.cuda && !previous_.cuda)) at::autocast::clear_cache();
}

}  // namespace loom::trainer
