#include "worker/trainer/plugin_factory.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "loom/spec.h"

namespace loom::trainer {

absl::StatusOr<AttentionLayerPtr> CreateAttentionLayer(const PluginLoader& loader,
                                                       const v1::AttentionConfig& config,
                                                       const AttentionShape& shape) {
  LOOM_ASSIGN_OR_RETURN(const LoadedPlugin* plugin,
                        loader.Find(config.plugin(), LOOM_PLUGIN_KIND_ATTENTION));
  LOOM_ASSIGN_OR_RETURN(auto options, OptionsAsText(config.options(), "attention.options"));
  std::vector<LoomOption> c_options;
  for (const auto& [k, v] : options) c_options.push_back(LoomOption{k.c_str(), v.c_str()});

  LoomAttentionSpecV1 spec{};
  spec.d_model = shape.d_model;
  spec.n_heads = shape.n_heads;
  spec.head_dim = shape.head_dim;
  spec.causal = shape.causal ? 1 : 0;
  spec.bias = shape.bias ? 1 : 0;
  spec.window = config.window();
  spec.rope_theta = shape.rope_theta;
  spec.layer_index = shape.layer_index;
  spec.n_layers = shape.n_layers;
  spec.options = c_options.data();
  spec.num_options = c_options.size();

  char error[1024] = {0};
  void* object = nullptr;
  const int32_t code = plugin->plugin->create(&spec, &object, error, sizeof(error));
  const std::string where = absl::StrCat("layer ", shape.layer_index, " (", config.plugin(), ")");
  if (code != LOOM_OK || object == nullptr) {
    const std::string message = absl::StrCat(where, ": ", error[0] ? error : "create failed");
    return code == LOOM_INVALID_ARGUMENT ? absl::InvalidArgumentError(message)
                                         : absl::InternalError(message);
  }
  AttentionLayerPtr layer = static_cast<AttentionLayerHolder*>(object)->layer;
  plugin->plugin->destroy(object);
  if (!layer) return absl::InternalError(absl::StrCat(where, ": plugin returned an empty layer"));
  return layer;
}

absl::StatusOr<SftObjectivePtr> CreateSftObjective(const PluginLoader& loader,
                                                   const std::string& name,
                                                   const google::protobuf::Struct& options,
                                                   const data::ChatTemplate& tokens) {
  LOOM_ASSIGN_OR_RETURN(const LoadedPlugin* plugin, loader.Find(name, LOOM_PLUGIN_KIND_SFT));
  LOOM_ASSIGN_OR_RETURN(auto text, OptionsAsText(options, "data.format_options"));
  std::vector<LoomOption> c_options;
  for (const auto& [k, v] : text) c_options.push_back(LoomOption{k.c_str(), v.c_str()});
  LoomSftSpecV1 spec{};
  spec.base_vocab = tokens.base_vocab;
  spec.header_start = tokens.header_start;
  spec.header_end = tokens.header_end;
  spec.turn_end = tokens.turn_end;
  spec.begin_of_text = tokens.begin_of_text;
  spec.options = c_options.data();
  spec.num_options = c_options.size();
  char error[1024] = {0};
  void* object = nullptr;
  const int32_t code = plugin->plugin->create(&spec, &object, error, sizeof(error));
  if (code != LOOM_OK || object == nullptr) {
    const std::string message =
        absl::StrCat("data.format ", name, ": ", error[0] ? error : "create failed");
    return code == LOOM_INVALID_ARGUMENT ? absl::InvalidArgumentError(message)
                                         : absl::InternalError(message);
  }
  SftObjectivePtr objective = static_cast<SftObjectiveHolder*>(object)->objective;
  plugin->plugin->destroy(object);
  if (!objective)
    return absl::InternalError(absl::StrCat("data.format ", name, ": plugin returned nothing"));
  return objective;
}

}  // namespace loom::trainer
