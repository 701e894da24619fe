// Rotary position embedding (RoPE) on the CPU, in one place: rotate-half pairing (dimension i
// pairs with i + d/2), frequency theta^(-2i/d), angles computed in float64 whatever the data type.
// Every CPU path rotates through this file: ApplyRope on [B, H, L, d] tensors (the plugins'
// projections, the IHA reference and decoding paths), RotatePseudoQueriesKeys for IHA's expanded
// pseudo-token sequence, and RotateHalfRows on raw rows with the tables of ExpandedRopeTables
// (the fused kernel, fused_attention.h). The CUDA kernels rotate with the same tables on the GPU
// (IhaRope, iha/cuda/iha_cuda_tiles.h).
#ifndef LOOM_PLUGINS_ATTENTION_KERNELS_ROPE_H_
#define LOOM_PLUGINS_ATTENTION_KERNELS_ROPE_H_

#include <torch/torch.h>

#include <cstdint>
#include <utility>

#include "plugins/attention/kernels/attention_options.h"

namespace loom::attention::kernels {

// Positions as int64 [B or 1, N] on `device`, checked against the input shape.
torch::Tensor CheckedPositions(const torch::Tensor& positions, int64_t batch, int64_t length,
                               const torch::Device& device);

// Rotation angles, float64 on `device`: positions [...] (any numeric dtype, fractional allowed)
// -> [..., d/2], position × theta^(-2i/d).
torch::Tensor RopeAngles(const torch::Tensor& positions, int64_t d, double theta,
                         const torch::Device& device);

// RoPE on x: [B, H, L, d] with d even; positions: [L] or [B, L], any numeric dtype (fractional
// positions are allowed).
torch::Tensor ApplyRope(const torch::Tensor& x, const torch::Tensor& positions, double theta);

// Expanded RoPE positions [B|1, N·P] from token positions [N] or [B, N].
torch::Tensor ExpandedPositions(const torch::Tensor& positions, int64_t p, RopePhase phase);

// RoPE on pseudo-tokens x [B, H, N·P, d] at the expanded positions of token positions [N] or
// [B, N] (options.p, options.rope_phase); x itself when options.rope_theta is 0.
torch::Tensor RotatePseudoTokens(const torch::Tensor& x, const torch::Tensor& positions,
                                 const Options& options);
// The same on one call's pseudo-queries and pseudo-keys [B, H, N·P, d], checking the token
// positions against B and N first (CheckedPositions).
std::pair<torch::Tensor, torch::Tensor> RotatePseudoQueriesKeys(const torch::Tensor& qi,
                                                                const torch::Tensor& ki,
                                                                const torch::Tensor& positions,
                                                                const Options& options);

// The kernels' tables: cos and sin [B|1, N·P, d/2] by expanded index, for q [B, N, H, d] and
// token positions [N] or [B, N], in `type` on q's device; empty [0] tensors without RoPE.
std::pair<torch::Tensor, torch::Tensor> ExpandedRopeTables(const torch::Tensor& q,
                                                           const torch::Tensor& positions,
                                                           const Options& options,
                                                           torch::ScalarType type);

// RoPE in place on `count` rows of width d (row r at rows + r·d), row r's tables at cos + r·d/2
// and sin + r·d/2 (ExpandedRopeTables' rows). inverse: the transposed rotation, for gradients.
template <typename T>
void RotateHalfRows(T* rows, const T* cos, const T* sin, int64_t count, int64_t d, bool inverse) {
  const int64_t half = d / 2;
  const T sign = inverse ? T(-1) : T(1);
  for (int64_t r = 0; r < count; ++r) {
    const T* c = cos + r * half;
    const T* sn = sin + r * half;
    T* x = rows + r * d;
    for (int64_t i = 0; i < half; ++i) {
      const T x1 = x[i], x2 = x[i + half], s = sign * sn[i];
      x[i] = x1 * c[i] - x2 * s;
      x[i + half] = x2 * c[i] + x1 * s;
    }
  }
}

}  // namespace loom::attention::kernels

#endif  // LOOM_PLUGINS_ATTENTION_KERNELS_ROPE_H_
