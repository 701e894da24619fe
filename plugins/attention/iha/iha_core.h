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
#include <string>
#include <utility>

namespace loom::attention::iha {

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

// Expanded RoPE positions [B|1, N·P] from token positions [N] or [B, N].
torch::Tensor ExpandedPositions(const torch::Tensor& positions, int64_t p, RopePhase phase);

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
