// Attention plugins: the spec a factory receives and the C++ module it returns.
//
// The model never names an attention type. For every layer it fills a LoomAttentionSpecV1 and
// asks the plugin named by the layer schedule for a loom::AttentionLayer. Plugins share the
// process's LibTorch, so the object is a C++ module; the build stamp check in the loader
// guarantees both sides agree on LibTorch and the C++ library ABI.
//
// Conventions every attention plugin follows (docs/plugins.md):
//   * input and output hidden states are [B, N, D]; rows are tokens;
//   * positions are token indices, int64 [N] (shared by the batch) or [B, N];
//   * causal (decoder): token n sees tokens n' <= n; bidirectional (encoder): all tokens;
//   * window W > 0 additionally restricts token n to |n - n'| < W (decoder: 0 <= n - n' < W);
//   * rope_theta > 0 applies rotary embeddings (rotate-half pairing) to queries and keys;
//   * weights: q_proj, k_proj, v_proj, o_proj laid out like torch::nn::Linear ([out, in]).
#ifndef LOOM_API_ATTENTION_PLUGIN_H_
#define LOOM_API_ATTENTION_PLUGIN_H_

#include "loom/plugin_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct LoomAttentionSpecV1 {
  int64_t d_model;      // D
  int64_t n_heads;      // H
  int64_t head_dim;     // d; D need not equal H * d
  int32_t causal;       // 1: decoder, 0: encoder (bidirectional)
  int32_t bias;         // 1: projections carry a bias
  int64_t window;       // sliding window in tokens; 0 = global
  double rope_theta;    // > 0: RoPE base; 0: no rotary embedding
  int64_t layer_index;  // 0-based index of this layer in the stack
  int64_t n_layers;     // depth of the stack
  const LoomOption* options;
  size_t num_options;
} LoomAttentionSpecV1;

#ifdef __cplusplus
}  // extern "C"

#include <torch/torch.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <string>

#include "loom/torch_compat.h"

namespace loom {

struct AttentionInputs {
  // int64 token positions, [N] or [B, N]. Required when the layer uses RoPE.
  torch::Tensor positions;
  // Packed sequences: integer segment ids [B, N] (or undefined: one sequence per row). A token
  // attends only to tokens of its own segment (on top of the layer's causal / window mask), so
  // examples packed into one row cannot see each other; segments are contiguous runs.
  torch::Tensor segments;
};

// What a layer keeps between incremental decoding calls (generation with a KV cache). Made by
// the layer's NewCache(); only that layer knows its contents.
class AttentionCache {
 public:
  virtual ~AttentionCache() = default;
  // Tokens appended so far per row (sequence indices 0 .. tokens() - 1).
  virtual int64_t tokens() const = 0;
  // Bytes of tensor memory the cache holds now.
  virtual int64_t bytes() const = 0;

  // Continuous batching (loom-serve): rows leave and join a running batch between steps.
  // Keeps only the rows `rows` (int64 [R], indices into this cache's batch, in that order).
  // An index may repeat: each occurrence becomes an independent copy of that row (shared
  // prefill forks one prompt's cache into the rows of its n samples). Afterwards the rows must
  // not alias: appending to one never changes another. No change to the interface, so plugins
  // built for this ABI version stay loadable; one that copies rows by index_select (as every
  // built-in cache does) already satisfies it.
  virtual void KeepRows(const torch::Tensor& rows) = 0;
  // Appends the rows of `other` (made by the same layer's NewCache(), on the same device) after
  // this cache's rows. The cache holding fewer tokens is left-padded to the other's count with
  // entries in segment kPadSegment, which no query attends to; a cache without segments gets
  // segment 1 for its tokens, so later calls on the merged cache must pass segments.
  virtual void AppendRows(const AttentionCache& other) = 0;
  static constexpr int64_t kPadSegment = -1;
};

class AttentionLayer : public torch::nn::Module {
 public:
  ~AttentionLayer() override = default;

  // x: [B, N, D] -> [B, N, D].
  virtual torch::Tensor forward(const torch::Tensor& x, const AttentionInputs& inputs) = 0;

  // Incremental decoding (causal layers only). An empty cache for any batch size.
  virtual std::unique_ptr<AttentionCache> NewCache() const = 0;
  // x: [B, T, D], the next T tokens of each row, at sequence indices cache.tokens() ..
  // cache.tokens() + T - 1; inputs.positions [T] or [B, T]; inputs.segments [B, T] for all calls
  // on a cache or none (left padding: pad tokens in their own segment). Returns what forward()
  // over the whole sequence so far would return for these T rows, and appends them to the cache.
  virtual torch::Tensor ForwardCached(const torch::Tensor& x, const AttentionInputs& inputs,
                                      AttentionCache& cache) = 0;

  // Forward FLOPs per token (a multiply-add counts 2) for a sequence of `context` tokens,
  // averaged over the positions of that sequence: projections plus the score and value
  // products over the keys each query really attends to (causal and window masks counted).
  virtual double ForwardFlopsPerToken(int64_t context) const = 0;

  int64_t NumParameters() const {
    int64_t total = 0;
    for (const auto& p : parameters()) total += p.numel();
    return total;
  }
};

using AttentionLayerPtr = std::shared_ptr<AttentionLayer>;

// What an attention plugin's create() stores in *out: an owned holder of the module.
struct AttentionLayerHolder {
  AttentionLayerPtr layer;
};

// Thrown by plugin factories for a bad spec or option; becomes LOOM_INVALID_ARGUMENT at the
// boundary. The message must name the field.
class InvalidAttentionSpec : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace loom

// Defines the plugin entry point for an attention plugin. FACTORY is a callable
// `loom::AttentionLayerPtr(const LoomAttentionSpecV1&)` that may throw.
#define LOOM_ATTENTION_PLUGIN(NAME, DESCRIPTION, FACTORY)                                \
  LOOM_DEFINE_PLUGIN(NAME, DESCRIPTION, LOOM_PLUGIN_KIND_ATTENTION, LoomAttentionSpecV1, \
                     ::loom::AttentionLayerHolder, ::loom::InvalidAttentionSpec, FACTORY)

#endif  // __cplusplus

#endif  // LOOM_API_ATTENTION_PLUGIN_H_
