// What an attention call asks of the shared kernels (kernels/fused_attention.h, the IHA CUDA
// kernels, the IHA reference path): pseudo-heads per head, mask, window, RoPE, score and scale,
// and the call's packed-sequence segments. IHA's options are these (iha/iha_core.h); multi-head
// attention is the case P = 1.
#ifndef LOOM_PLUGINS_ATTENTION_KERNELS_ATTENTION_OPTIONS_H_
#define LOOM_PLUGINS_ATTENTION_KERNELS_ATTENTION_OPTIONS_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace loom::attention::kernels {

enum class Mask {
  kInterleaved,  // s' <= s on the expanded sequence (a stock causal call on N·P positions)
  kBlock,        // token-level causality n' <= n; a token's P pseudo-tokens all see each other
  kNone,         // bidirectional (encoders)
};
enum class RopePhase {
  kInterleaved,  // pseudo-token (n, j) rotates at position pos(n)·P + j (the paper's choice)
  kToken,        // every pseudo-token of token n rotates at pos(n)
};
enum class Score {
  kSoftmax,  // softmax(q·k · scale) over allowed keys
  kLinear,   // (q·k · scale) over allowed keys, no normalisation (theory constructions)
};

struct Options {
  int64_t p = 1;  // pseudo-heads per head
  Mask mask = Mask::kInterleaved;
  int64_t window = 0;     // tokens; > 0 keeps |s - s'| < window·P on the expanded sequence
  double rope_theta = 0;  // > 0: RoPE on pseudo queries and keys, after mixing
  RopePhase rope_phase = RopePhase::kInterleaved;
  Score score = Score::kSoftmax;
  double scale = 0;  // <= 0: 1/sqrt(dk)
  // Per call, not configuration: packed-sequence segment ids [B, N] (AttentionInputs.segments);
  // a pseudo-token attends only within its token's segment. Undefined: one sequence per row.
  torch::Tensor segments;
};

Mask ParseMask(const std::string& name);            // "interleaved" | "block" | "none"
RopePhase ParseRopePhase(const std::string& name);  // "interleaved" | "token"
Score ParseScore(const std::string& name);          // "softmax" | "linear"

}  // namespace loom::attention::kernels

#endif  // LOOM_PLUGINS_ATTENTION_KERNELS_ATTENTION_OPTIONS_H_
