// The `local` plugin: multi-head attention restricted to a sliding window of `window` tokens.
#include "loom/attention_plugin.h"
#include "plugins/attention/mha/mha_attention.h"

LOOM_ATTENTION_PLUGIN("local", "sliding-window multi-head attention (window in tokens)",
                      [](const LoomAttentionSpecV1& spec) -> loom::AttentionLayerPtr {
                        return std::make_shared<loom::attention::MultiHeadAttention>(spec, "local",
                                                                                     true);
                      })
