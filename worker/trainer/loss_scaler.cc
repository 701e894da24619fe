#include "worker/trainer/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace loom::trainer {

LossScaler::LossScaler(Options options) : options_(options), scale_(options.initial) {}

void LossScaler::Unscale(const std::vector<torch::Tensor>& params) const {
  const double inverse = 1.0 / scale_;
  torch::NoGradGuard no_grad;
  for (const torch::Tensor& p : params) {
    if (p.grad().defined()) p.mutable_grad().mul_(inverse);
  }
}

bool LossScaler::Update(bool finite) {
  if (!finite) {
    scale_ = std::max(scale_ * options_.backoff, 1.0);  // below 1 it would shrink gradients
    good_steps_ = 0;
    return true;
  }
  if (++good_steps_ < options_.growth_interval) return false;
  good_steps_ = 0;
  const double grown = scale_ * options_.growth;
  if (grown > 0x1p127) return false;  // the largest power of two a float holds
  scale_ = grown;
  return true;
}

std::string LossScaler::State() const { return absl::StrFormat("%a %d", scale_, good_steps_); }

absl::Status LossScaler::Restore(const std::string& state) {
  std::vector<std::string> parts = absl::StrSplit(state, ' ');
  char* end = nullptr;
  const double scale = parts.size() == 2 ? std::strtod(parts[0].c_str(), &end) : 0;
  int64_t good = 0;
  if (parts.size() != 2 || end == parts[0].c_str() || *end != '\0' || !std::isfinite(scale) ||
      scale < 1 || !absl::SimpleAtoi(parts[1], &good) || good < 0) {
    return absl::DataLossError(absl::StrCat("malformed loss-scaler state '", state, "'"));
  }
  scale_ = scale;
  good_steps_ = good;
  return absl::OkStatus();
}

}  // namespace loom::trainer
