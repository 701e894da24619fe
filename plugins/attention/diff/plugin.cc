// The `diff` plugin: differential attention (Ye et al. 2024, Differential Transformer).
#include "loom/attention_plugin.h"
#include "plugins/attention/diff/diff_attention.h"

LOOM_ATTENTION_PLUGIN("diff", "Differential attention (Ye et al. 2024)",
                      [](const LoomAttentionSpecV1& spec) -> loom::AttentionLayerPtr {
                        return std::make_shared<loom::attention::DiffAttention>(spec);
                      })
