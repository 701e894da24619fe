// Job and model specs: JSON parsing, presets, defaults and validation. No LibTorch, so the
// coordinator validates exactly what the trainer will accept. Every error names the field
// ("model.n_heads: ...", "optimizer.lr: ...").
#ifndef LOOM_API_SPEC_H_
#define LOOM_API_SPEC_H_

#include <google/protobuf/struct.pb.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "loom/v1/job.pb.h"
#include "loom/v1/model.pb.h"

namespace loom {

// Fills model defaults (head_dim, ffn_hidden, norm_eps, mode, schedule, hybrid expansion) and
// rejects bad values.
absl::StatusOr<v1::ModelConfig> ResolveModelConfig(const v1::ModelConfig& config);

// One AttentionConfig per layer: the schedule cycled to n_layers.
std::vector<v1::AttentionConfig> ExpandSchedule(const v1::ModelConfig& resolved);

// Built-in models: "tiny-cpu", "micro", "paper-2.4b" (spec/iha.md: 26 layers, D 2560, H 20).
absl::StatusOr<v1::ModelConfig> ModelPreset(const std::string& name);

// Built-in jobs: "tiny-cpu" (the demo), "micro" (tests), "paper-2.4b" (the paper's model and
// optimiser: AdamW (0.9, 0.95), wd 0.1, lr 8e-4, 1000 warm-up steps, cosine to 8e-6, clip 1.0,
// bf16, context 8192).
absl::StatusOr<v1::JobSpec> JobPreset(const std::string& name);

// A preset's warm-up is sized for its own run length: for a run of `steps` the preset's value
// applies up to a tenth of the run.
int64_t PresetWarmup(int64_t preset_warmup, int64_t steps);

// Parses JSON into a message; unknown fields and wrong types are InvalidArgument naming them.
absl::Status ParseJsonMessage(const std::string& json, const std::string& source,
                              google::protobuf::Message* out);

// A job spec file: JSON, or YAML when the name ends in .yaml / .yml (converted to the same JSON
// mapping: plain scalars that read as numbers or booleans become those, quoted ones stay strings).
absl::StatusOr<v1::JobSpec> ReadJobSpecFile(const std::string& path);

// YAML text to JSON text; errors carry the line and column.
absl::StatusOr<std::string> YamlToJson(const std::string& yaml, const std::string& source);

// Applies the preset (fields the spec leaves unset come from it), fills defaults, resolves the
// model and validates everything, including cross-field consistency (seq_len <= max_seq_len,
// windows, vocabulary vs tokenizer, precision vs device).
absl::StatusOr<v1::JobSpec> ResolveJobSpec(const v1::JobSpec& spec);

// The job spec a checkpoint recorded in its manifest's state ("spec": the JSON the trainer wrote;
// fields a newer Loom added are ignored). FailedPrecondition when it records none (written by an
// old Loom), DataLoss when it does not parse; `dir` names the checkpoint in both.
absl::StatusOr<v1::JobSpec> RecordedSpec(const std::map<std::string, std::string>& state,
                                         const std::string& dir);

// Eval and serve jobs may leave `model` out: it is taken from the job spec a checkpoint recorded in
// its manifest (the text of manifest.json, parsed by storage::ManifestFromJson; `source` names it
// in errors). Does nothing when the spec is not an eval or serve job or has a model.
absl::Status FillModelFromManifest(v1::JobSpec* spec, const std::string& manifest_json,
                                   const std::string& source);

// The fields that are proto3 `optional` so that an explicit 0 survives a preset (model.rope_theta;
// optimizer.min_lr, warmup_steps, beta1, beta2, weight_decay, clip_norm) lose that presence where
// they hold 0: the encoding they had before 2026-12-07, when they had no presence. Hashes and spec
// comparisons use it, so a spec that sets one to 0 compares equal to one that leaves it at 0 and
// to what an older Loom recorded. Creates no message the spec lacks.
void ClearExplicitZeros(v1::JobSpec* spec);

// Stable hashes (64-bit FNV-1a of a deterministic serialisation, hex) that checkpoints record:
// ModelHash of the model alone (resume refuses a spec whose model differs), SpecHash of the
// model and training fields (name, steps, checkpoint, metrics and threads left out).
std::string ModelHash(const v1::JobSpec& resolved);
std::string SpecHash(const v1::JobSpec& resolved);

// Free-form options (attention.options, data.task_options, ...) as the text map plugins and tasks
// receive: strings stay, integral numbers print without a fraction, booleans as true/false.
// Nested values are an InvalidArgument naming `field`.key.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> OptionsAsText(
    const google::protobuf::Struct& options, const std::string& field);

}  // namespace loom

#endif  // LOOM_API_SPEC_H_
