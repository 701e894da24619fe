// The `talking_heads` plugin: Talking-Heads Attention (Shazeer et al. 2020).
#include "loom/attention_plugin.h"
#include "plugins/attention/talking_heads/talking_heads_attention.h"

LOOM_ATTENTION_PLUGIN("talking_heads", "Talking-Heads Attention (Shazeer et al. 2020)",
                      [](const LoomAttentionSpecV1& spec) -> loom::AttentionLayerPtr {
                        return std::make_shared<loom::attention::TalkingHeadsAttention>(spec);
                      })
