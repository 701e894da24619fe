// The fused CPU kernel of 2-simplicial attention (simplicial_attention.h has the definition).
//
// Why: the LibTorch path materialises the scores of a query chunk for every batch row and head
// at once ([B, H, c, n1, n2]); at the relation-composition shape (B 32, H 8, N 100, d 16) that
// is 10 MB per query, so every elementwise pass (mask, softmax, its backward) streams memory and
// a training step ran at 24 GFLOP/s against MHA's 119 (docs/results.md, App. D cost table).
// Here one task owns one (batch row, head) and walks tiles of c queries. A tile is compacted to
// what its queries see: rows are the allowed (query i, key j) pairs, columns the keys l of the
// second set any of them sees (gathered), so padding and other packed segments cost nothing but
// the one tile that straddles a boundary. Its scores are one [rows × cols] block, sized to stay
// in L2 (at most 2^16 elements): W = scale·(q_i ⊙ k_j) row by row, S = W·K'ᵀ, softmax per query
// over its rows, M = P·V', o_i = Σ_j v_j ⊙ M_ij. Products are direct BLAS calls
// (kernels/cpu_tile_ops.h).
//
// Only the log-sum-exp per query is kept; the backward pass recomputes a tile's P from it
// (FlashAttention-2 style) and, because a task owns its (row, head), accumulates dk, dk', dv,
// dv' without atomics: dv_j += M_ij ⊙ dO_i; dM = v ⊙ dO; dP = dM·V'ᵀ; dV' += Pᵀ·dM;
// dS = P ⊙ (dP − dO_i·o_i); dW = dS·K'; dK' += dSᵀ·W; dq_i, dk_j from dW.
//
// Masks are exact per element, as the reference path has them: each query's band (causal,
// windows) and packed segment (segment ids compared, not assumed contiguous) decide its rows,
// and its columns are masked where it sees fewer than the tile's union. float32 computes in
// float32, float64 in float64; other dtypes and devices take the reference path.
#ifndef LOOM_PLUGINS_ATTENTION_SIMPLICIAL_SIMPLICIAL_CPU_H_
#define LOOM_PLUGINS_ATTENTION_SIMPLICIAL_SIMPLICIAL_CPU_H_

#include <torch/torch.h>

#include <cstdint>

namespace loom::attention {

struct SimplicialMask {
  bool causal = true;
  int64_t window1 = 0, window2 = 0;  // effective windows, 0 = unbounded
};

// True when SimplicialCpu takes these tensors: CPU, float32 or float64.
bool SimplicialCpuSupports(const torch::Tensor& q);

// q [B, H, N, d]; k and v [B, H, N, 2d], the two key (value) sets concatenated on the last axis
// (k | k', v | v'); segments int64 [B, N] (undefined: one sequence per row). Returns the heads
// [B, H, N, d], differentiable in q, k and v.
torch::Tensor SimplicialCpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& segments, const SimplicialMask& mask,
                            double scale);

}  // namespace loom::attention

#endif  // LOOM_PLUGINS_ATTENTION_SIMPLICIAL_SIMPLICIAL_CPU_H_
