// Interleaved Head Attention (Duvvuri et al., arXiv:2602.21371), functional core.
//
// Given per-head queries, keys and values of H heads, IHA builds P pseudo-heads per head as
// learned mixtures of ALL H heads (alpha tensors [H, H, P], indexed [source m, target h,
// pseudo j]), interleaves the pseudo-tokens token-major (expanded position s = n·P + j), runs
// ordinary scaled dot-product attention per head over the N·P sequence (so pseudo-query j meets
// pseudo-keys of every index j' — up to P² patterns per head), un-interleaves, and collapses the
// H·P pseudo outputs back to H heads with a learned R [H, H·P] (indexed [h, h'·P + j]).
//
// This file is the reference path: it materialises the P-times expanded Q/K/V and the
// (N·P)×(N·P) scores. It is what every faster kernel is tested against. The module
// (iha_attention.h) and the theorem tests (hand-built weights) both call it.
#ifndef LOOM_PLUGINS_ATTENTION_IHA_IHA_CORE_H_
#define LOOM_PLUGINS_ATTENTION_IHA_IHA_CORE_H_

#include <torch/torch.h>

#include <cstdint>
#include <utility>

#include "plugins/attention/kernels/attention_options.h"
#include "plugins/attention/kernels/fused_attention.h"

namespace loom::attention::iha {

// IHA's options are the shared kernels' (kernels/attention_options.h).
using kernels::Mask;
using kernels::Options;
using kernels::ParseMask;
using kernels::ParseRopePhase;
using kernels::ParseScore;
using kernels::RopePhase;
using kernels::Score;

// x: [B, N, H, d], alpha: [H, H, P] -> pseudo-heads interleaved per head: [B, H, N·P, d], with
// row s = n·P + j holding sum_m alpha[m, h, j] · x[b, n, m, :].
torch::Tensor MixAndInterleave(const torch::Tensor& x, const torch::Tensor& alpha);

// Allowed (query s, key s') pairs on the expanded sequence: bool [N·P, N·P].
torch::Tensor AllowedMask(int64_t n, int64_t p, Mask mask, int64_t window,
                          const torch::Device& device);

// The same rule between arbitrary expanded query indices s [Tq] and key indices s' [Lk] (int64):
// bool [Tq, Lk]. Incremental decoding uses it for new queries against cached keys.
torch::Tensor AllowedBetween(const torch::Tensor& s, const torch::Tensor& t, int64_t p, Mask mask,
                             int64_t window);

// Mean number of pseudo-keys one pseudo-query attends to (exact, for FLOP accounting).
double AverageAttendedKeys(int64_t n, int64_t p, Mask mask, int64_t window);

// Attention probabilities (softmax) or coefficients (linear) per head: [B, H, N·P, N·P].
// q, k: [B, N, H, dk]; positions as for Forward.
torch::Tensor AttentionWeights(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                               const torch::Tensor& positions, const Options& options);

// The IHA layer between projections: q, k: [B, N, H, dk]; v: [B, N, H, dv]; alpha_*: [H, H, P];
// collapse: [H, H·P]; positions: int64 token positions [N] or [B, N] (needed with RoPE).
// Returns the collapsed heads [B, N, H, dv] (before concatenation and the output projection).
torch::Tensor Forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                      const torch::Tensor& alpha_v, const torch::Tensor& collapse,
                      const torch::Tensor& positions, const Options& options);

// IHA on the shared fused kernel (kernels/fused_attention.h): its pseudo outputs
// (FusedPseudoOutputs, same contract as PseudoOutputs) and FusedForward, those with the collapse
// (the module's path when the fused kernel is selected).
using kernels::FusedOptions;
using kernels::FusedPseudoOutputs;
torch::Tensor FusedForward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                           const torch::Tensor& alpha_v, const torch::Tensor& collapse,
                           const torch::Tensor& positions, const Options& options,
                           const FusedOptions& fused = {});

// The pseudo outputs before the collapse: [B, N, H, P, dv].
torch::Tensor PseudoOutputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                            const torch::Tensor& alpha_v, const torch::Tensor& positions,
                            const Options& options);

// Collapse pseudo outputs [B, N, H, P, dv] with R [H, H·P] -> [B, N, H, dv]: on CPU float32 and
// float64 tensors the row kernel of collapse_cpu.h, elsewhere EinsumCollapse.
torch::Tensor Collapse(const torch::Tensor& pseudo, const torch::Tensor& collapse);
// The collapse as one einsum (what the row kernel is tested against).
torch::Tensor EinsumCollapse(const torch::Tensor& pseudo, const torch::Tensor& collapse);

}  // namespace loom::attention::iha

#endif  // LOOM_PLUGINS_ATTENTION_IHA_IHA_CORE_H_
