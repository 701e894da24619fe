// Pieces every attention plugin shares: option parsing with field-naming errors, spec checks,
// rotary embeddings (kernels/rope.h), mask construction, the materialising scaled-dot-product
// reference and the FLOP bookkeeping. Depends on LibTorch only, so plugins build on a bare GPU
// machine.
#ifndef LOOM_PLUGINS_ATTENTION_COMMON_ATTENTION_COMMON_H_
#define LOOM_PLUGINS_ATTENTION_COMMON_ATTENTION_COMMON_H_

#include <torch/torch.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include "loom/attention_plugin.h"
#include "plugins/attention/kernels/rope.h"

namespace loom::attention {

// Typed access to a plugin's text options. Every getter marks its key as used; Finish() rejects
// keys nobody asked for, so a typo in a config is an error rather than a silent default.
class PluginOptions {
 public:
  PluginOptions(const LoomAttentionSpecV1& spec, std::string plugin);

  int64_t GetInt(const std::string& key, int64_t fallback, int64_t min, int64_t max);
  double GetDouble(const std::string& key, double fallback, double min, double max);
  bool GetBool(const std::string& key, bool fallback);
  std::string GetChoice(const std::string& key, const std::string& fallback,
                        std::initializer_list<const char*> choices);
  void Finish() const;

 private:
  const std::string* Find(const std::string& key);
  [[noreturn]] void Fail(const std::string& key, const std::string& why) const;

  std::string plugin_;
  std::map<std::string, std::string> values_;
  std::set<std::string> used_;
};

// The four projections of multi-head attention that every plugin shares, registered on `module`
// under the interop names q_proj, k_proj, v_proj ([H·d, D]) and o_proj ([D, H·d]), with biases
// when spec.bias is set.
struct Projections {
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
};
Projections RegisterProjections(torch::nn::Module& module, const LoomAttentionSpecV1& spec);

// The KV cache of plugins that attend with per-head keys and values: keys (RoPE applied) and
// values of the tokens so far, their segment ids, and for sliding windows only the last
// window - 1 tokens (older ones can never be attended again).
class KeyValueCache : public AttentionCache {
 public:
  explicit KeyValueCache(int64_t window) : window_(window) {}
  int64_t tokens() const override { return tokens_; }
  int64_t bytes() const override;
  void KeepRows(const torch::Tensor& rows) override;
  void AppendRows(const AttentionCache& other) override;

  struct View {
    torch::Tensor k, v;     // [B, Hk, L, w]: cached then new
    torch::Tensor allowed;  // bool [B|1, 1, T, L]: which keys each new query may attend
  };
  // Appends k [B, Hk, T, dk], v [B, Hv, T, dv] and segments [B, T] (or undefined) of the next T
  // tokens of a causal layer; returns everything the new queries may attend to.
  View Append(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& segments);

 private:
  int64_t window_, tokens_ = 0;
  torch::Tensor k_, v_, segments_;
};

// Segment ids [B, T] (any integer dtype, [T] broadcast) as int64 [B, T]; undefined stays so.
torch::Tensor CheckedSegments(const torch::Tensor& segments, int64_t batch, int64_t length,
                              const torch::Device& device);

// Pieces every decoding cache shares (KeyValueCache, the IHA cache):
// CheckCacheContinues fails (TORCH_CHECK, messages prefixed by `who`) unless a call with `batch`
// rows and segments given or not continues a cache holding `cached_rows` rows with segments or
// not; SameSegment is the bool [B, 1, T, L] mask of queries and keys in the same packed segment
// (segment ids [B, T] and [B, L]); DefinedBytes sums the bytes of the defined tensors.
void CheckCacheContinues(const char* who, int64_t cached_rows, bool cached_segments, int64_t batch,
                         bool segments);
torch::Tensor SameSegment(const torch::Tensor& query_segments, const torch::Tensor& key_segments);
int64_t DefinedBytes(std::initializer_list<const torch::Tensor*> tensors);

// Continuous batching for every cache layout. KeepCacheRows index-selects the batch rows of the
// defined tensors. AppendCacheRows concatenates two caches' rows: each CacheTensor says where a
// tensor keeps its tokens (dim, entries per token); the cache keeping fewer tokens is left-padded
// with zeros, its segments with AttentionCache::kPadSegment (undefined segments count as 1).
struct CacheTensor {
  torch::Tensor* mine;
  torch::Tensor theirs;
  int64_t token_dim = 2, per_token = 1;
};
void KeepCacheRows(std::initializer_list<torch::Tensor*> tensors, const torch::Tensor& rows);
// Leading tokens that are padding (kPadSegment) in every row of segments [B, L]: once the rows
// that needed them have left, a cache drops them (memory, and attention over fewer keys).
int64_t LeadingPadTokens(const torch::Tensor& segments);
void AppendCacheRows(const std::vector<CacheTensor>& tensors, torch::Tensor& my_segments,
                     const torch::Tensor& their_segments, int64_t my_kept, int64_t their_kept);

// Base of plugins built on the four projections: validates the common spec (throws
// InvalidAttentionSpec naming the field), keeps its shape fields and registers the projections
// first, so parameter order (and seeded initialisation) is the same in every plugin.
class ProjectedAttention : public AttentionLayer {
 public:
  // The generic KV-cached decoding step: projections, cache append, Attend(), Output().
  std::unique_ptr<AttentionCache> NewCache() const override;
  torch::Tensor ForwardCached(const torch::Tensor& x, const AttentionInputs& inputs,
                              AttentionCache& cache) override;

 protected:
  ProjectedAttention(const LoomAttentionSpecV1& spec, const std::string& plugin);

  // The plugin's attention between projections: q [B, H, T, d], k [B, H, L, d], v [B, Hv, L, w],
  // allowed bool [B|1, 1, T, L] (or undefined: all) -> heads [B, Hv, T, w].
  virtual torch::Tensor Attend(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& allowed) = 0;
  // Heads v is split into (QueriesKeysValues' v_heads).
  virtual int64_t ValueHeads() const { return n_heads_; }

  // x [B, N, D] -> q, k [B, H, N, d] (RoPE applied when on, unless `rotate` is false: a kernel
  // that rotates as it loads) and v [B, v_heads, N, H·d / v_heads].
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> QueriesKeysValues(
      const torch::Tensor& x, const AttentionInputs& inputs, int64_t v_heads, bool rotate = true);
  // heads [B, H', N, w] with H'·w = H·d -> o_proj of their concatenation, [B, N, D].
  torch::Tensor Output(const torch::Tensor& heads);
  // The four projections' FLOPs per token.
  double ProjectionFlopsPerToken() const;

  std::string plugin_;
  int64_t d_model_, n_heads_, head_dim_, window_;
  bool causal_;
  double rope_theta_;
  Projections proj_;
};

// Checks the fields every plugin relies on; throws InvalidAttentionSpec naming the field.
void ValidateSpec(const LoomAttentionSpecV1& spec, const std::string& plugin);

// Bool [Lq, Lk] mask of allowed (query, key) pairs by sequence index (not by position id):
// causal keeps k <= q; window > 0 keeps |q - k| < window. Queries and keys share one index space.
torch::Tensor AllowedMask(int64_t length, bool causal, int64_t window, const torch::Device& device);

// softmax(q k^T * scale, masked) v, materialising the scores. q, k: [B, H, L, dk], v: [B, H, L,
// dv]; allowed: bool [L, L] or undefined for no mask.
torch::Tensor ReferenceAttention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& allowed,
                                 double scale);

// Mean number of keys a query attends to in a sequence of `length` tokens.
double AverageAttendedKeys(int64_t length, bool causal, int64_t window);

// The layer's mask (bool [L, L] or undefined) with packed-sequence segments applied: `expand`
// positions per token (IHA's P pseudo-tokens share their token's segment). Returns `allowed`
// unchanged without segments, else bool [B, 1, L·expand, L·expand].
torch::Tensor WithSegments(const torch::Tensor& allowed, const torch::Tensor& segments,
                           int64_t batch, int64_t length, int64_t expand,
                           const torch::Device& device);

// Rotary position embedding and the positions it checks: the shared kernels' (kernels/rope.h).
using kernels::ApplyRope;
using kernels::CheckedPositions;

}  // namespace loom::attention

#endif  // LOOM_PLUGINS_ATTENTION_COMMON_ATTENTION_COMMON_H_
