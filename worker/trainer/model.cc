#include "model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "attention_factory.h"
#include "loom/status_macros.h"

namespace loom::trainer {
namespace {

absl::Status FieldError(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("model.", field, ": ", why));
}

// Replaces c->hybrid() by the equivalent explicit schedule.
absl::Status ExpandHybrid(v1::ModelConfig* c) {
  v1::HybridSchedule h = c->hybrid();
  if (h.local_per_global() < 0)
    return FieldError("hybrid.local_per_global", "must be >= 0 (0 = 4)");
  if (h.local_per_global() == 0) h.set_local_per_global(4);
  if (h.local_kind().empty()) h.set_local_kind("iha");
  if (h.global_kind().empty()) h.set_global_kind("mha");
  if (h.window() < 0) return FieldError("hybrid.window", "must be >= 0 (0 = max_seq_len / (2·P²))");
  int64_t p = c->n_heads();
  if (auto it = h.iha_options().fields().find("p"); it != h.iha_options().fields().end()) {
    if (it->second.kind_case() != google::protobuf::Value::kNumberValue ||
        it->second.number_value() < 1 ||
        it->second.number_value() != std::floor(it->second.number_value())) {
      return FieldError("hybrid.iha_options.p", "must be a positive integer");
    }
    p = static_cast<int64_t>(it->second.number_value());
  }
  const int64_t window =
      h.window() > 0 ? h.window() : std::max<int64_t>(1, c->max_seq_len() / (2 * p * p));
  auto entry = [&](const std::string& kind, int32_t repeat, int64_t w) {
    auto* e = c->add_schedule();
    e->set_repeat(repeat);
    e->mutable_attention()->set_plugin(kind);
    e->mutable_attention()->set_window(w);
    if (kind == "iha") *e->mutable_attention()->mutable_options() = h.iha_options();
  };
  entry(h.local_kind(), h.local_per_global(), window);
  entry(h.global_kind(), 1, 0);
  c->clear_hybrid();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ModelConfig> ResolveModelConfig(const v1::ModelConfig& in) {
  v1::ModelConfig c = in;
  if (c.d_model() <= 0 || c.d_model() > 65536)
    return FieldError("d_model", "must be in [1, 65536]");
  if (c.n_layers() <= 0 || c.n_layers() > 1024)
    return FieldError("n_layers", "must be in [1, 1024]");
  if (c.n_heads() <= 0 || c.n_heads() > 1024) return FieldError("n_heads", "must be in [1, 1024]");
  if (c.head_dim() < 0) return FieldError("head_dim", "must be >= 0 (0 = d_model / n_heads)");
  if (c.head_dim() == 0) {
    if (c.d_model() % c.n_heads() != 0) {
      return FieldError("n_heads",
                        absl::StrCat("d_model ", c.d_model(), " is not divisible by n_heads ",
                                     c.n_heads(), " (or set head_dim)"));
    }
    c.set_head_dim(c.d_model() / c.n_heads());
  }
  if (c.ffn_hidden() < 0) return FieldError("ffn_hidden", "must be >= 0 (0 = 4 * d_model)");
  if (c.ffn_hidden() == 0) c.set_ffn_hidden(4 * c.d_model());
  if (c.ffn_activation().empty()) c.set_ffn_activation("gelu");
  if (c.ffn_activation() != "gelu" && c.ffn_activation() != "swiglu") {
    return FieldError("ffn_activation",
                      absl::StrCat("'", c.ffn_activation(), "' is not gelu | swiglu"));
  }
  if (c.vocab_size() <= 0) return FieldError("vocab_size", "must be >= 1");
  if (c.max_seq_len() <= 0) return FieldError("max_seq_len", "must be >= 1");
  if (!std::isfinite(c.rope_theta()) || c.rope_theta() < 0) {
    return FieldError("rope_theta", "must be a finite number >= 0 (0 = off)");
  }
  if (c.rope_theta() > 0 && c.head_dim() % 2 != 0) {
    return FieldError("head_dim", "must be even when RoPE is on");
  }
  if (c.mode().empty()) c.set_mode("decoder");
  if (c.mode() != "decoder" && c.mode() != "encoder") {
    return FieldError("mode", absl::StrCat("'", c.mode(), "' is not decoder | encoder"));
  }
  if (c.mode() == "encoder") {
    if (c.num_classes() <= 0) return FieldError("num_classes", "must be >= 1 in encoder mode");
    if (c.tie_embeddings()) return FieldError("tie_embeddings", "has no meaning in encoder mode");
  } else {
    if (c.num_classes() != 0) return FieldError("num_classes", "is for encoder mode only");
    if (c.grid_max_rows() != 0 || c.grid_max_cols() != 0) {
      return FieldError("grid_max_rows", "grid positions are for encoder mode only");
    }
  }
  if (c.grid_max_rows() < 0 || c.grid_max_cols() < 0 ||
      (c.grid_max_rows() > 0) != (c.grid_max_cols() > 0)) {
    return FieldError("grid_max_rows",
                      "grid_max_rows and grid_max_cols must both be > 0 or both 0");
  }
  if (c.norm_eps() < 0 || !std::isfinite(c.norm_eps()))
    return FieldError("norm_eps", "must be >= 0");
  if (c.norm_eps() == 0) c.set_norm_eps(1e-5);
  if (c.has_hybrid()) {
    if (!c.schedule().empty()) return FieldError("hybrid", "is exclusive with schedule");
    LOOM_RETURN_IF_ERROR(ExpandHybrid(&c));
  }
  if (c.schedule().empty()) {
    auto* entry = c.add_schedule();
    entry->set_repeat(1);
    entry->mutable_attention()->set_plugin("mha");
  }
  for (int i = 0; i < c.schedule_size(); ++i) {
    const auto& e = c.schedule(i);
    const std::string field = absl::StrCat("schedule[", i, "]");
    if (e.repeat() <= 0) return FieldError(field + ".repeat", "must be >= 1");
    if (e.attention().plugin().empty())
      return FieldError(field + ".attention.plugin", "is required");
    if (e.attention().window() < 0) return FieldError(field + ".attention.window", "must be >= 0");
    if (e.attention().window() > c.max_seq_len()) {
      return FieldError(
          field + ".attention.window",
          absl::StrCat(e.attention().window(), " exceeds max_seq_len ", c.max_seq_len()));
    }
  }
  return c;
}

std::vector<v1::AttentionConfig> ExpandSchedule(const v1::ModelConfig& c) {
  std::vector<v1::AttentionConfig> layers;
  while (static_cast<int>(layers.size()) < c.n_layers()) {
    for (const auto& entry : c.schedule()) {
      for (int r = 0; r < entry.repeat() && static_cast<int>(layers.size()) < c.n_layers(); ++r) {
        layers.push_back(entry.attention());
      }
    }
  }
  return layers;
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight_ = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight_;
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
  if (swiglu_) return down_(torch::silu(gate_(x)) * up_(x));
  return down_(torch::gelu(up_(x)));
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

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const AttentionInputs& inputs) {
  torch::Tensor h = x + attention_->forward(attention_norm_(x), inputs);
  return h + ffn_(ffn_norm_(h));
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
  torch::manual_seed(c.init_seed());
  std::shared_ptr<Transformer> model(new Transformer(c));
  const int64_t d = c.d_model();
  model->embed_ = model->register_module("embed", torch::nn::Embedding(c.vocab_size(), d));
  torch::nn::init::normal_(model->embed_->weight, 0.0, 0.02);
  if (c.grid_max_rows() > 0) {
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
    LOOM_ASSIGN_OR_RETURN(AttentionLayerPtr attention,
                          CreateAttentionLayer(loader, layers[i], shape));
    Block block(d, c.ffn_hidden(), c.ffn_activation() == "swiglu", c.norm_eps(),
                std::move(attention));
    model->layers_->push_back(block);
    model->blocks_.push_back(block);
  }
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
  for (Block& block : blocks_) h = block(h, attention_inputs);
  h = final_norm_(h);
  if (head_) return head_(h);
  return torch::nn::functional::linear(h, embed_->weight);  // tied LM head
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
