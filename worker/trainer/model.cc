#include "worker/trainer/model.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cpu_kernels/linear_cpu.h"
#include "loom/spec.h"
#include "worker/trainer/activation_checkpoint.h"
#include "worker/trainer/plugin_factory.h"
#include "worker/trainer/rms_norm_cpu.h"

namespace loom::trainer {
RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight_ = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  if (CpuRmsNormApplies(x, weight_)) return CpuRmsNorm(x, weight_, eps_);
  return CompositeRmsNorm(x, weight_, eps_);
}

FeedForwardImpl::FeedForwardImpl(int64_t d_model, int64_t hidden, bool swiglu)
    : swiglu_(swiglu), d_model_(d_model), hidden_(hidden) {
  using torch::nn::LinearOptions;
  up_ = register_module("up", torch::nn::Linear(LinearOptions(d_model, hidden).bias(false)));
  if (swiglu)
    gate_ = register_module("gate", torch::nn::Linear(LinearOptions(d_model, hidden).bias(false)));
  down_ = register_module("down", torch::nn::Linear(LinearOptions(hidden, d_model).bias(false)));
}

torch::Tensor FeedForwardImpl::forward(const torch::Tensor& x) {
  using cpu_kernels::Linear;
  if (swiglu_) return Linear(down_, torch::silu(Linear(gate_, x)) * Linear(up_, x));
  return Linear(down_, torch::gelu(Linear(up_, x)));
}

double FeedForwardImpl::FlopsPerToken() const {
  return 2.0 * static_cast<double>(d_model_) * static_cast<double>(hidden_) * (swiglu_ ? 3 : 2);
}

BlockImpl::BlockImpl(int64_t d_model, int64_t ffn_hidden, bool swiglu, double eps,
                     AttentionLayerPtr attention) {
  attention_norm_ = register_module("attention_norm", RMSNorm(d_model, eps));
  attention_ = register_module<AttentionLayer>("attention", std::move(attention));
  ffn_norm_ = register_module("ffn_norm", RMSNorm(d_model, eps));
  ffn_ = register_module("ffn", FeedForward(d_model, ffn_hidden, swiglu));
}

torch::Tensor BlockImpl::Attend(const torch::Tensor& x, const AttentionInputs& inputs) {
  return attention_->forward(attention_norm_(x), inputs);
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const AttentionInputs& inputs) {
  if (checkpointing_ == "full") {  // keep only the block's input
    return Recompute(
        [this, inputs](const torch::Tensor& in) {
          torch::Tensor h = in + Attend(in, inputs);
          return h + Feed(h);
        },
        x, parameters());
  }
  torch::Tensor attended;
  if (checkpointing_ == "selective") {  // recompute the attention sublayer, keep the FFN's
    std::vector<torch::Tensor> params = attention_->parameters();
    for (const auto& p : attention_norm_->parameters()) params.push_back(p);
    attended = Recompute([this, inputs](const torch::Tensor& in) { return Attend(in, inputs); }, x,
                         params);
  } else {
    attended = Attend(x, inputs);
  }
  torch::Tensor h = x + attended;
  return h + Feed(h);
}

torch::Tensor BlockImpl::ForwardCached(const torch::Tensor& x, const AttentionInputs& inputs,
                                       AttentionCache& cache) {
  torch::Tensor h = x + attention_->ForwardCached(attention_norm_(x), inputs, cache);
  return h + ffn_(ffn_norm_(h));
}

int64_t DecodeState::bytes() const {
  int64_t total = 0;
  for (const auto& c : caches) total += c->bytes();
  return total;
}

void DecodeState::KeepRows(const torch::Tensor& rows) {
  for (auto& c : caches) c->KeepRows(rows);
}

void DecodeState::AppendRows(const DecodeState& other) {
  TORCH_CHECK(other.caches.size() == caches.size(), "decode state: ", other.caches.size(),
              " layers appended to ", caches.size());
  for (size_t i = 0; i < caches.size(); ++i) caches[i]->AppendRows(*other.caches[i]);
}

absl::StatusOr<std::shared_ptr<Transformer>> Transformer::Create(const v1::ModelConfig& config,
                                                                 const PluginLoader& loader) {
  LOOM_ASSIGN_OR_RETURN(v1::ModelConfig c, ResolveModelConfig(config));
  try {
    return Build(c, loader);
  } catch (const std::exception& e) {  // LibTorch reports through exceptions; they stop here
    return absl::InternalError(absl::StrCat("building the model: ", e.what()));
  }
}

absl::StatusOr<std::shared_ptr<Transformer>> Transformer::Build(const v1::ModelConfig& c,
                                                                const PluginLoader& loader) {
  // Pairing (docs/sweeps.md): each module draws its initial values from the generator seeded
  // with (init_seed, its name), so a parameter that two models both have with the same shape
  // (embeddings, FFNs, the q/k/v/o projections of MHA and IHA) starts identical in both, however
  // many other parameters either one has.
  auto seed_for = [&c](const std::string& name) {
    uint64_t h = 0xcbf29ce484222325ULL ^ c.init_seed();  // FNV-1a over the name
    for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ULL;
    torch::manual_seed(h);
  };
  std::shared_ptr<Transformer> model(new Transformer(c));
  const int64_t d = c.d_model();
  seed_for("embed");
  model->embed_ = model->register_module("embed", torch::nn::Embedding(c.vocab_size(), d));
  torch::nn::init::normal_(model->embed_->weight, 0.0, 0.02);
  if (c.grid_max_rows() > 0) {
    seed_for("row_embed");
    model->row_embed_ =
        model->register_module("row_embed", torch::nn::Embedding(c.grid_max_rows(), d));
    model->col_embed_ =
        model->register_module("col_embed", torch::nn::Embedding(c.grid_max_cols(), d));
    torch::nn::init::normal_(model->row_embed_->weight, 0.0, 0.02);
    torch::nn::init::normal_(model->col_embed_->weight, 0.0, 0.02);
  }
  const std::vector<v1::AttentionConfig> layers = ExpandSchedule(c);
  model->layers_ = model->register_module("layers", torch::nn::ModuleList());
  for (int i = 0; i < c.n_layers(); ++i) {
    AttentionShape shape;
    shape.d_model = d;
    shape.n_heads = c.n_heads();
    shape.head_dim = c.head_dim();
    shape.causal = c.mode() == "decoder";
    shape.bias = c.attention_bias();
    shape.rope_theta = c.rope_theta();
    shape.layer_index = i;
    shape.n_layers = c.n_layers();
    seed_for(absl::StrCat("layers.", i, ".attention"));
    LOOM_ASSIGN_OR_RETURN(AttentionLayerPtr attention,
                          CreateAttentionLayer(loader, layers[i], shape));
    seed_for(absl::StrCat("layers.", i, ".block"));
    Block block(d, c.ffn_hidden(), c.ffn_activation() == "swiglu", c.norm_eps(),
                std::move(attention));
    block->set_checkpointing(c.activation_checkpointing());
    model->layers_->push_back(block);
    model->blocks_.push_back(block);
  }
  seed_for("head");
  model->final_norm_ = model->register_module("final_norm", RMSNorm(d, c.norm_eps()));
  if (c.mode() == "encoder") {
    model->head_ = model->register_module("head", torch::nn::Linear(d, c.num_classes()));
  } else if (!c.tie_embeddings()) {
    model->head_ = model->register_module(
        "lm_head", torch::nn::Linear(torch::nn::LinearOptions(d, c.vocab_size()).bias(false)));
  }
  return model;
}

torch::Tensor Transformer::forward(const ModelInputs& in) {
  TORCH_CHECK(in.tokens.dim() == 2, "model: tokens must be [B, N], got ", in.tokens.sizes());
  const int64_t length = in.tokens.size(1);
  TORCH_CHECK(length <= config_.max_seq_len(), "model: sequence of ", length,
              " tokens exceeds max_seq_len ", config_.max_seq_len());
  torch::Tensor h = embed_(in.tokens);
  if (row_embed_) {
    TORCH_CHECK(in.grid_rows.defined() && in.grid_cols.defined(),
                "model: grid_rows and grid_cols are required with grid positions");
    h = h + row_embed_(in.grid_rows) + col_embed_(in.grid_cols);
  }
  AttentionInputs attention_inputs;
  attention_inputs.positions =
      in.positions.defined()
          ? in.positions
          : torch::arange(length, torch::TensorOptions().dtype(torch::kInt64).device(h.device()));
  attention_inputs.segments = in.segments;
  for (Block& block : blocks_) h = block(h, attention_inputs);
  h = final_norm_(h);
  if (head_) return cpu_kernels::Linear(head_, h);
  return cpu_kernels::Linear(h, embed_->weight);  // tied LM head
}

DecodeState Transformer::NewDecodeState() const {
  DecodeState state;
  for (const Block& block : blocks_) state.caches.push_back(block->attention().NewCache());
  return state;
}

torch::Tensor Transformer::ForwardCached(const ModelInputs& in, DecodeState& state) {
  TORCH_CHECK(config_.mode() == "decoder", "model: generation needs a decoder");
  TORCH_CHECK(in.tokens.dim() == 2, "model: tokens must be [B, N], got ", in.tokens.sizes());
  TORCH_CHECK(state.caches.size() == blocks_.size(), "model: decode state of ", state.caches.size(),
              " layers for a model of ", blocks_.size());
  const int64_t start = state.tokens(), length = in.tokens.size(1);
  TORCH_CHECK(start + length <= config_.max_seq_len(), "model: ", start + length,
              " tokens exceed max_seq_len ", config_.max_seq_len());
  torch::Tensor h = embed_(in.tokens);
  AttentionInputs attention_inputs;
  attention_inputs.positions =
      in.positions.defined()
          ? in.positions
          : torch::arange(start, start + length,
                          torch::TensorOptions().dtype(torch::kInt64).device(h.device()));
  attention_inputs.segments = in.segments;
  for (size_t i = 0; i < blocks_.size(); ++i)
    h = blocks_[i]->ForwardCached(h, attention_inputs, *state.caches[i]);
  h = final_norm_(h);
  if (head_) return cpu_kernels::Linear(head_, h);
  return cpu_kernels::Linear(h, embed_->weight);
}

int64_t Transformer::NumParameters() const {
  int64_t total = 0;
  for (const auto& p : parameters()) total += p.numel();
  return total;
}

std::vector<double> Transformer::AttentionFlopsPerToken(int64_t context) const {
  std::vector<double> out;
  for (const Block& block : blocks_)
    out.push_back(block->attention().ForwardFlopsPerToken(context));
  return out;
}

double Transformer::ForwardFlopsPerToken(int64_t context) const {
  double total = 0;
  for (const Block& block : blocks_) {
    total += block->attention().ForwardFlopsPerToken(context) + block->ffn().FlopsPerToken();
  }
  const int64_t out_width =
      config_.mode() == "encoder" ? config_.num_classes() : config_.vocab_size();
  return total + 2.0 * config_.d_model() * out_width;
}

}  // namespace loom::trainer
