// What export and import share: the name mapping between Loom's model tensors and Hugging Face
// names, the attention kind of every layer with its options resolved, and the tensors (names
// and shapes) a model of a given configuration has.
#ifndef LOOM_INTEROP_HF_MODEL_H_
#define LOOM_INTEROP_HF_MODEL_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "loom/v1/model.pb.h"

namespace loom::interop {

// Loom's name inside a checkpoint's "model." prefix ("layers.3.attention.q_proj.weight") to the
// Hugging Face name ("model.layers.3.self_attn.q_proj.weight"), and back. "" when a name has no
// counterpart.
std::string HfName(const std::string& loom_name);
std::string LoomName(const std::string& hf_name);

// One layer's attention as a folder describes it: defaults of the plugin made explicit.
struct LayerAttention {
  std::string kind;  // "mha" | "local" | "iha"
  int64_t window = 0;
  // iha only (docs/iha.md): pseudo-heads, mask, RoPE phase, score, scale (0 = 1/sqrt(d)).
  int64_t p = 0;
  std::string mask, rope_phase, score;
  double scale = 0;
};

// Every layer of a resolved decoder model. FailedPrecondition names the layer for what a folder
// cannot describe (another plugin, an encoder, grid positions).
absl::StatusOr<std::vector<LayerAttention>> ResolveLayers(const v1::ModelConfig& resolved);

// The model's tensors by Loom name, with their shapes.
std::map<std::string, std::vector<int64_t>> ExpectedShapes(
    const v1::ModelConfig& resolved, const std::vector<LayerAttention>& layers);

// Compares a set of named shapes with the expected ones: every missing, unexpected and
// mis-shaped tensor named (by the caller's naming, `display`). `what` starts the message.
absl::Status CheckShapes(const std::map<std::string, std::vector<int64_t>>& expected,
                         const std::map<std::string, std::vector<int64_t>>& found,
                         const std::string& what, std::string (*display)(const std::string&));

}  // namespace loom::interop

#endif  // LOOM_INTEROP_HF_MODEL_H_
