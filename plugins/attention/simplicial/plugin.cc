// The `simplicial` plugin: 2-simplicial (trilinear) attention (Clift et al. 2019; windows after
// Roy et al. 2025).
#include "loom/attention_plugin.h"
#include "plugins/attention/simplicial/simplicial_attention.h"

LOOM_ATTENTION_PLUGIN("simplicial", "2-simplicial trilinear attention (Clift et al. 2019)",
                      [](const LoomAttentionSpecV1& spec) -> loom::AttentionLayerPtr {
                        return std::make_shared<loom::attention::SimplicialAttention>(spec);
                      })
