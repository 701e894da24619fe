// The `iha` plugin: Interleaved Head Attention, global (window 0) or local (window > 0).
#include "loom/attention_plugin.h"
#include "plugins/attention/iha/iha_attention.h"

LOOM_ATTENTION_PLUGIN("iha", "Interleaved Head Attention (Duvvuri et al. 2026), global or local",
                      [](const LoomAttentionSpecV1& spec) -> loom::AttentionLayerPtr {
                        return std::make_shared<loom::attention::iha::IhaAttention>(spec);
                      })
