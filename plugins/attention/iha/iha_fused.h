// Fused IHA attention (FlashAttention-style) that never materialises the P-times expanded
// Q/K/V of the whole sequence nor the (N·P)×(N·P) scores.
//
// Work is split into tiles of T tokens (T·P pseudo-tokens). For one batch row and one query
// tile, each head h mixes its tile's pseudo-queries from the original H heads (one small GEMM:
// alpha[:, h, :]ᵀ · q[tile]), applies RoPE on the fly, and walks the key tiles the mask allows,
// mixing each key tile's pseudo-keys and pseudo-values the same way, with an online softmax
// (running max and sum). Tiles wholly outside the mask (causal future, outside a sliding window)
// are skipped; tiles wholly inside it skip the masking. Only the log-sum-exp per pseudo-query is
// kept for the backward pass, which recomputes scores tile by tile (FlashAttention-2): one pass
// over key tiles accumulates dK/dV and their alpha gradients, one over query tiles dQ. Work is
// parallel over (batch row × tile); heads run inside a task, so each task owns its slice of the
// gradient of q/k/v and no two tasks write the same memory.
//
// Within a tile the pseudo-tokens are token-major (row i·P + j is token n0 + i, pseudo j: the
// expanded index s = n·P + j of the reference, iha_core.h), so every mask allows one contiguous
// column range per row.
// Extra memory: O(T·P·d) per task plus the output and log-sum-exp, O(N·P·d) in all.
#ifndef LOOM_PLUGINS_ATTENTION_IHA_IHA_FUSED_H_
#define LOOM_PLUGINS_ATTENTION_IHA_IHA_FUSED_H_

#include <torch/torch.h>

#include "iha_core.h"

namespace loom::attention::iha {

struct FusedOptions {
  int64_t tile_tokens = 0;  // tokens per tile; 0 = chosen from P and the head width
  bool poison_output =
      false;  // tests: fill the output with NaN first (every element must be written)
};

// Same contract as PseudoOutputs (iha_core.h): [B, N, H, P, dv], differentiable with respect to
// q, k, v and the three alpha tensors. CPU tensors (any floating type); other devices work but
// are slow (many small kernels).
torch::Tensor FusedPseudoOutputs(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& alpha_q,
                                 const torch::Tensor& alpha_k, const torch::Tensor& alpha_v,
                                 const torch::Tensor& positions, const Options& options,
                                 const FusedOptions& fused = {});

// Forward with the collapse (the module's path when the fused kernel is selected).
torch::Tensor FusedForward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                           const torch::Tensor& alpha_v, const torch::Tensor& collapse,
                           const torch::Tensor& positions, const Options& options,
                           const FusedOptions& fused = {});

}  // namespace loom::attention::iha

#endif  // LOOM_PLUGINS_ATTENTION_IHA_IHA_FUSED_H_
