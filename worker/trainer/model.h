// The Loom transformer: token embedding, pre-norm blocks (RMSNorm → attention → residual,
// RMSNorm → FFN → residual), final RMSNorm and a head. Decoder mode is a causal language model
// (LM head, optionally tied to the embedding); encoder mode is bidirectional with a
// per-position classification head and optional learned (row, column) embeddings for grid
// tasks. Attention layers come from plugins picked by the config's schedule: this file never
// names an attention type.
#ifndef LOOM_WORKER_TRAINER_MODEL_H_
#define LOOM_WORKER_TRAINER_MODEL_H_

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "loom/attention_plugin.h"
#include "loom/spec.h"
#include "loom/v1/model.pb.h"
#include "worker/trainer/plugin_loader.h"

namespace loom::trainer {

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  double eps_;
  torch::Tensor weight_;
};
TORCH_MODULE(RMSNorm);

class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(int64_t d_model, int64_t hidden, bool swiglu);
  torch::Tensor forward(const torch::Tensor& x);
  double FlopsPerToken() const;

 private:
  bool swiglu_;
  int64_t d_model_, hidden_;
  torch::nn::Linear up_{nullptr}, gate_{nullptr}, down_{nullptr};
};
TORCH_MODULE(FeedForward);

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t ffn_hidden, bool swiglu, double eps,
            AttentionLayerPtr attention);
  torch::Tensor forward(const torch::Tensor& x, const AttentionInputs& inputs);
  torch::Tensor ForwardCached(const torch::Tensor& x, const AttentionInputs& inputs,
                              AttentionCache& cache);
  const AttentionLayer& attention() const { return *attention_; }
  const FeedForwardImpl& ffn() const { return *ffn_; }
  // model.activation_checkpointing: "" / "none", "full" or "selective".
  void set_checkpointing(const std::string& mode) { checkpointing_ = mode; }

 private:
  torch::Tensor Attend(const torch::Tensor& x, const AttentionInputs& inputs);
  torch::Tensor Feed(const torch::Tensor& h) { return ffn_(ffn_norm_(h)); }

  std::string checkpointing_;
  RMSNorm attention_norm_{nullptr}, ffn_norm_{nullptr};
  AttentionLayerPtr attention_;
  FeedForward ffn_{nullptr};
};
TORCH_MODULE(Block);

struct ModelInputs {
  torch::Tensor tokens;     // int64 [B, N]
  torch::Tensor positions;  // int64 [N] or [B, N]; undefined = 0..N-1
  torch::Tensor grid_rows;  // encoder grid tasks: int64 [B, N] row / column of each token
  torch::Tensor grid_cols;
  torch::Tensor segments;  // packed examples: int [B, N] segment ids (attention stays inside one)
};

// Incremental decoding state of a decoder: one attention cache per layer.
struct DecodeState {
  std::vector<std::unique_ptr<AttentionCache>> caches;
  int64_t tokens() const { return caches.empty() ? 0 : caches.front()->tokens(); }
  int64_t bytes() const;
  // Continuous batching: keep only `rows` (int64 indices, in order; a repeated index copies its
  // row, which is how shared prefill forks one prompt into n samples) / append `other`'s rows
  // after these (AttentionCache::KeepRows / AppendRows on every layer; throws like LibTorch).
  void KeepRows(const torch::Tensor& rows);
  void AppendRows(const DecodeState& other);
};

class Transformer : public torch::nn::Module {
 public:
  // Builds the model, creating one attention layer per schedule entry from `loader`'s plugins.
  // Seeds LibTorch's generator with config.init_seed first so initialisation is reproducible.
  static absl::StatusOr<std::shared_ptr<Transformer>> Create(const v1::ModelConfig& config,
                                                             const PluginLoader& loader);

  // Returns logits [B, N, vocab] (decoder) or [B, N, num_classes] (encoder).
  torch::Tensor forward(const ModelInputs& inputs);

  // Generation: an empty state, then logits [B, T, vocab] for the next T tokens of each row given
  // the tokens the state has seen (equal to forward() over the whole prefix); appends them.
  // inputs.positions default to the state's token count + 0..T-1.
  DecodeState NewDecodeState() const;
  torch::Tensor ForwardCached(const ModelInputs& inputs, DecodeState& state);

  const v1::ModelConfig& config() const { return config_; }
  int64_t NumParameters() const;
  // Forward FLOPs per token at a context length, summed over layers and the head.
  double ForwardFlopsPerToken(int64_t context) const;
  // Per-layer attention FLOPs per token (for reporting schedules).
  std::vector<double> AttentionFlopsPerToken(int64_t context) const;

 private:
  explicit Transformer(v1::ModelConfig config) : config_(std::move(config)) {}
  static absl::StatusOr<std::shared_ptr<Transformer>> Build(const v1::ModelConfig& resolved,
                                                            const PluginLoader& loader);

  v1::ModelConfig config_;
  torch::nn::Embedding embed_{nullptr}, row_embed_{nullptr}, col_embed_{nullptr};
  torch::nn::ModuleList layers_{nullptr};
  std::vector<Block> blocks_;  // the same modules as layers_, typed
  RMSNorm final_norm_{nullptr};
  torch::nn::Linear head_{nullptr};
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_MODEL_H_
