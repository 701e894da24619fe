// The `mha` plugin: global multi-head attention.
#include "loom/attention_plugin.h"
#include "plugins/attention/mha/mha_attention.h"

LOOM_ATTENTION_PLUGIN("mha", "global multi-head attention (Vaswani et al. 2017)",
                      [](const LoomAttentionSpecV1& spec) -> loom::AttentionLayerPtr {
                        return std::make_shared<loom::attention::MultiHeadAttention>(spec, "mha",
                                                                                     false);
                      })
