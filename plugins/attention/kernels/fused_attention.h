// Fused attention for CPU tensors (FlashAttention-style): IHA's pseudo-heads (P ≥ 1, mixed from
// the H heads) and, at P = 1 without mixing, multi-head attention (FusedHeadAttention: the `mha`
// and `local` plugins). It never materialises the P-times expanded Q/K/V of the whole sequence
// nor the (N·P)×(N·P) scores.
//
// Work is split into tiles of T tokens (T·P pseudo-tokens). For one batch row, head and query
// tile, the tile's pseudo-queries are mixed from the original H heads (Σ_m alpha[m, h, j]·q[m]),
// rotated (RoPE) and scaled on the fly; the kernel walks the key tiles the mask allows, mixing
// each key tile's pseudo-keys and pseudo-values the same way, with an online softmax (running
// max and sum). Under sliding windows, consecutive allowed tiles are taken as one block (one
// GEMM each instead of one per tile). Tiles wholly outside the mask (causal future, outside a
// sliding window, another packed segment) are skipped; tiles wholly inside it skip the masking;
// inside a tile every row touches only its allowed column range. Score and value products are
// direct BLAS calls on raw scratch buffers; exp, max and sums are vectorised row loops (AVX-512 /
// AVX2 / baseline chosen at load time).
//
// Only the log-sum-exp per pseudo-query is kept for the backward pass, which recomputes scores
// tile by tile (FlashAttention-2) in one pass: a task owns one (batch row, head), so it owns that
// head's pseudo gradients dQ̃, dK̃, dṼ and needs no atomics; a second pass un-mixes them into
// the gradients of q, k, v and the alpha tensors.
//
// Within a tile the pseudo-tokens are token-major (row i·P + j is token n0 + i, pseudo j: the
// expanded index s = n·P + j of the IHA reference, iha/iha_core.h).
// Dtypes: float32 and float64 compute in their own precision; bfloat16 and float16 inputs are
// mixed into float32 tiles (fp32 accumulate) and the outputs rounded back.
// Extra memory: O(T·P·(T·P + d)) scratch per thread; the forward keeps only the output and the
// log-sum-exp; the backward holds the three pseudo gradients and the heads-major upstream
// gradient, each [B, H, N·P, d]: O(N·P·d) in all, never O((N·P)²).
#ifndef LOOM_PLUGINS_ATTENTION_KERNELS_FUSED_ATTENTION_H_
#define LOOM_PLUGINS_ATTENTION_KERNELS_FUSED_ATTENTION_H_

#include <torch/torch.h>

#include "plugins/attention/kernels/attention_options.h"

namespace loom::attention::kernels {

struct FusedOptions {
  int64_t tile_tokens = 0;  // tokens per tile; 0 = DefaultTileTokens(P, window)
  // Most tokens of consecutive tiles taken as one block of GEMMs (rounded down to whole tiles, at
  // least one); 0 = DefaultBlockTokens(P, window, tile).
  int64_t block_tokens = 0;
  bool poison_output =
      false;  // tests: fill the output with NaN first (every element must be written)
};

// Tokens per tile when FusedOptions.tile_tokens is 0: about 256 pseudo-tokens, fewer for
// sliding windows (measured in docs/benchmarks.md).
int64_t DefaultTileTokens(int64_t p, int64_t window);

// Tokens per block when FusedOptions.block_tokens is 0: a global tile's worth for sliding
// windows (their small tiles' GEMMs batched), one tile otherwise.
int64_t DefaultBlockTokens(int64_t p, int64_t window, int64_t tile);

// Same contract as the IHA reference's PseudoOutputs (iha/iha_core.h): [B, N, H, P, dv],
// differentiable with respect to q, k, v and the three alpha tensors. CPU tensors only (float64,
// float32, bfloat16, float16).
torch::Tensor FusedPseudoOutputs(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& alpha_q,
                                 const torch::Tensor& alpha_k, const torch::Tensor& alpha_v,
                                 const torch::Tensor& positions, const Options& options,
                                 const FusedOptions& fused = {});

// Multi-head attention on the same kernel (P = 1, no mixing: the `mha` and `local` plugins'
// fused path): q, k [B, N, H, dk], v [B, N, H, dv], each with a contiguous last dimension (a
// transposed [B, H, N, d] tensor passes without a copy), before RoPE: with options.rope_theta > 0
// the kernel rotates each query and key tile as it loads it (positions [N] or [B, N]), so RoPE
// costs no passes over q and k of its own; options: p = 1, mask interleaved (causal) or none,
// window, score, scale, rope_theta, segments. Returns [B, N, H, dv], differentiable with respect
// to q, k and v.
torch::Tensor FusedHeadAttention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& positions,
                                 const Options& options, const FusedOptions& fused = {});

}  // namespace loom::attention::kernels

#endif  // LOOM_PLUGINS_ATTENTION_KERNELS_FUSED_ATTENTION_H_
