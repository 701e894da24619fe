// The built-in presets (docs/jobs.md): a model and the job defaults around it. ResolveJobSpec
// (spec.cc) lays a spec over its preset.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "loom/spec.h"

namespace loom {

absl::StatusOr<v1::ModelConfig> ModelPreset(const std::string& name) {
  v1::ModelConfig c;
  if (name == "tiny-cpu") {
    // The demo model: 4 layers alternating a 32-token sliding window with global attention.
    c.set_d_model(128);
    c.set_n_layers(4);
    c.set_n_heads(4);
    c.set_vocab_size(256);
    c.set_max_seq_len(256);
    c.set_rope_theta(10000);
    c.set_tie_embeddings(true);
    auto* local = c.add_schedule();
    local->set_repeat(1);
    local->mutable_attention()->set_plugin("local");
    local->mutable_attention()->set_window(32);
    auto* global = c.add_schedule();
    global->set_repeat(1);
    global->mutable_attention()->set_plugin("mha");
  } else if (name == "micro") {
    // Test-sized: seconds per hundred steps on one core.
    c.set_d_model(64);
    c.set_n_layers(2);
    c.set_n_heads(4);
    c.set_vocab_size(256);
    c.set_max_seq_len(128);
    c.set_rope_theta(10000);
    c.set_tie_embeddings(true);
  } else if (name == "paper-2.4b") {
    // spec/iha.md: 2.4B decoder, 26 layers, D 2560, H 20 (d 128), FFN 10240, vocabulary 128256
    // (Llama-3 tokenizer), RoPE theta 500000, context 8192. Global attention in every layer; set
    // `hybrid` or `schedule` for the IHA and Global+Local variants.
    c.set_d_model(2560);
    c.set_n_layers(26);
    c.set_n_heads(20);
    c.set_ffn_hidden(10240);
    c.set_ffn_activation("swiglu");
    c.set_vocab_size(128256);
    c.set_max_seq_len(8192);
    c.set_rope_theta(500000);
  } else {
    return absl::NotFoundError(
        absl::StrCat("preset: unknown '", name, "' (known: tiny-cpu, micro, paper-2.4b)"));
  }
  return c;
}

int64_t PresetWarmup(int64_t preset_warmup, int64_t steps) {
  return std::min<int64_t>(preset_warmup, std::max<int64_t>(0, steps / 10));
}

absl::StatusOr<v1::JobSpec> JobPreset(const std::string& name) {
  v1::JobSpec j;
  LOOM_ASSIGN_OR_RETURN(*j.mutable_model(), ModelPreset(name));
  j.set_kind("pretrain");
  auto* o = j.mutable_optimizer();
  o->set_beta1(0.9);
  o->set_beta2(0.95);
  o->set_weight_decay(0.1);
  o->set_clip_norm(1.0);
  if (name == "paper-2.4b") {
    o->set_lr(8e-4);
    o->set_min_lr(8e-6);
    o->set_warmup_steps(1000);
    j.set_seq_len(8192);
    j.set_micro_batch(1);
    j.set_steps(100000);
    j.set_precision("bf16");
    j.set_device("cuda");
    return j;
  }
  o->set_lr(3e-3);
  o->set_min_lr(3e-4);
  o->set_warmup_steps(20);
  j.set_seq_len(64);
  j.set_micro_batch(name == "micro" ? 8 : 16);
  j.set_steps(name == "micro" ? 150 : 300);
  j.set_precision("fp32");
  return j;
}

}  // namespace loom
