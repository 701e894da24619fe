// A trained model ready for inference: the job spec recorded in a checkpoint's manifest, the
// model built from it with its attention plugins, its weights, the tokenizer the job trained
// with and, for SFT and eval jobs, the chat objective (template and stop tokens). Used by
// `loom-train generate|score` and by loom-serve.
#ifndef LOOM_WORKER_TRAINER_CHECKPOINT_MODEL_H_
#define LOOM_WORKER_TRAINER_CHECKPOINT_MODEL_H_

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/tokenizer.h"
#include "loom/sft_plugin.h"
#include "loom/v1/job.pb.h"
#include "worker/trainer/model.h"
#include "worker/trainer/plugin_loader.h"

namespace loom::trainer {

struct CheckpointModel {
  std::string dir;  // the step directory loaded
  int64_t step = 0;
  v1::JobSpec spec;  // as the job recorded it (resolved)
  std::shared_ptr<Transformer> model;
  std::unique_ptr<data::Tokenizer> tokenizer;
  SftObjectivePtr objective;  // null for pretraining checkpoints (no chat template)
  int64_t eos = -1;           // the tokenizer's end-of-text token, -1 when none
};

// `where`: a step directory (with manifest.json) or a checkpoint root (its newest checkpoint
// that verifies). The model is put on `device` in `dtype` and in eval mode.
absl::StatusOr<CheckpointModel> LoadCheckpointModel(const std::string& where,
                                                    const PluginLoader& loader,
                                                    const torch::Device& device,
                                                    torch::ScalarType dtype);

// Log-probabilities of every token of `tokens` given the ones before it, from one full
// (uncached) forward pass: entry 0 is NaN (nothing predicts the first token), entry i is
// log p(tokens[i] | tokens[< i]). In float64.
absl::StatusOr<std::vector<double>> ScoreTokens(Transformer& model,
                                                const std::vector<uint32_t>& tokens);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_CHECKPOINT_MODEL_H_
