// Builds objects from plugins: attention layers (a layer's place in the model and its
// AttentionConfig become the plugin's C spec) and SFT chat objectives; takes ownership of what
// the plugin returns.
#ifndef LOOM_WORKER_TRAINER_PLUGIN_FACTORY_H_
#define LOOM_WORKER_TRAINER_PLUGIN_FACTORY_H_

#include <string>

#include "absl/status/statusor.h"
#include "data/chat.h"
#include "loom/attention_plugin.h"
#include "loom/sft_plugin.h"
#include "loom/v1/model.pb.h"
#include "worker/trainer/plugin_loader.h"

namespace loom::trainer {

struct AttentionShape {
  int64_t d_model = 0;
  int64_t n_heads = 0;
  int64_t head_dim = 0;
  bool causal = true;
  bool bias = false;
  double rope_theta = 0;
  int64_t layer_index = 0;
  int64_t n_layers = 1;
};

absl::StatusOr<AttentionLayerPtr> CreateAttentionLayer(const PluginLoader& loader,
                                                       const v1::AttentionConfig& config,
                                                       const AttentionShape& shape);

// The SFT objective plugin `name` (data.format) with its options (data.format_options), for the
// job's tokenizer: its vocabulary (base_vocab) and chat tokens (job_tokenizer.h ChatTokensOf).
absl::StatusOr<SftObjectivePtr> CreateSftObjective(const PluginLoader& loader,
                                                   const std::string& name,
                                                   const google::protobuf::Struct& options,
                                                   const data::ChatTemplate& tokens);
// A tokenizer without chat tokens of `base_vocab` ids (the byte tokenizer: 256).
inline absl::StatusOr<SftObjectivePtr> CreateSftObjective(const PluginLoader& loader,
                                                          const std::string& name,
                                                          const google::protobuf::Struct& options,
                                                          int64_t base_vocab) {
  data::ChatTemplate tokens;
  tokens.base_vocab = base_vocab;
  return CreateSftObjective(loader, name, options, tokens);
}

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_PLUGIN_FACTORY_H_
