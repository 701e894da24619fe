#include "worker/trainer/adamw.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cpu_kernels/adamw_cpu.h"

namespace loom::trainer {

AdamW::AdamW(const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
             AdamWConfig config, std::function<bool(const std::string&)> owns)
    : config_(config) {
  for (const auto& [name, p] : named_parameters) {
    const bool owned = !owns || owns(name);
    slots_.push_back({name, p, owned ? torch::zeros_like(p) : torch::Tensor(),
                      owned ? torch::zeros_like(p) : torch::Tensor(), p.dim() >= 2, owned});
  }
}

void AdamW::Step(double lr) {
  torch::NoGradGuard no_grad;
  ++step_;
  // CPU float parameters take one fused pass (cpu_kernels/adamw_cpu.h); the tensor ops below
  // are the reference it is tested against and the path for GPUs and other dtypes.
  std::vector<cpu_kernels::AdamWTensors> fused;
  for (Slot& s : slots_) {
    const torch::Tensor& g = s.param.grad();
    if (!s.owned || !g.defined()) continue;
    cpu_kernels::AdamWTensors t{s.param, g, s.exp_avg, s.exp_avg_sq,
                                s.decay && config_.weight_decay != 0};
    if (config_.fused_cpu && cpu_kernels::FusedAdamWApplies(t)) {
      fused.push_back(std::move(t));
    } else {
      StepWithTensorOps(s, lr);
    }
  }
  if (!fused.empty()) {
    cpu_kernels::FusedAdamWStep(
        fused, {lr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay, step_});
  }
}

void AdamW::StepWithTensorOps(Slot& s, double lr) {
  const double bc1 = 1.0 - std::pow(config_.beta1, static_cast<double>(step_));
  const double bc2 = 1.0 - std::pow(config_.beta2, static_cast<double>(step_));
  const torch::Tensor& g = s.param.grad();
  if (s.decay && config_.weight_decay != 0) s.param.mul_(1.0 - lr * config_.weight_decay);
  s.exp_avg.mul_(config_.beta1).add_(g, 1.0 - config_.beta1);
  s.exp_avg_sq.mul_(config_.beta2).addcmul_(g, g, 1.0 - config_.beta2);
  torch::Tensor denom = (s.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(config_.eps);
  s.param.addcdiv_(s.exp_avg, denom, -lr / bc1);
}

NamedTensors AdamW::StateTensors() const {
  NamedTensors out;
  for (const Slot& s : slots_) {
    if (!s.owned) continue;
    out.emplace_back(s.name + ".exp_avg", s.exp_avg);
    out.emplace_back(s.name + ".exp_avg_sq", s.exp_avg_sq);
  }
  return out;
}

absl::Status AdamW::LoadState(const std::map<std::string, torch::Tensor>& tensors, int64_t step) {
  std::vector<std::string> problems;
  torch::NoGradGuard no_grad;
  for (Slot& s : slots_) {
    if (!s.owned) continue;
    for (auto [suffix, target] : {std::pair<const char*, torch::Tensor*>{".exp_avg", &s.exp_avg},
                                  {".exp_avg_sq", &s.exp_avg_sq}}) {
      auto it = tensors.find(s.name + suffix);
      if (it == tensors.end()) {
        problems.push_back(absl::StrCat("missing ", s.name, suffix));
      } else if (it->second.sizes() != target->sizes()) {
        problems.push_back(absl::StrCat("wrong shape ", s.name, suffix));
      } else {
        target->copy_(it->second);
      }
    }
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer state: ", absl::StrJoin(problems, ", ")));
  }
  step_ = step;
  return absl::OkStatus();
}

}  // namespace loom::trainer
