#include "plugins/attention/kernels/attention_options.h"

#include <stdexcept>

namespace loom::attention::kernels {

Mask ParseMask(const std::string& name) {
  if (name == "interleaved") return Mask::kInterleaved;
  if (name == "block") return Mask::kBlock;
  if (name == "none") return Mask::kNone;
  throw std::invalid_argument("iha: unknown mask '" + name + "'");
}

RopePhase ParseRopePhase(const std::string& name) {
  if (name == "interleaved") return RopePhase::kInterleaved;
  if (name == "token") return RopePhase::kToken;
  throw std::invalid_argument("iha: unknown rope_phase '" + name + "'");
}

Score ParseScore(const std::string& name) {
  if (name == "softmax") return Score::kSoftmax;
  if (name == "linear") return Score::kLinear;
  throw std::invalid_argument("iha: unknown score '" + name + "'");
}

}  // namespace loom::attention::kernels
