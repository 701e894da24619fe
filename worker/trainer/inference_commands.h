// `loom-train generate`, `score` and `logits`: a checkpoint's continuation of a prompt (the batch
// generator of generate.h) and the log-probability of each token of a sequence from one full,
// uncached forward pass. Both print one JSON object; loom-serve's tests use them as the
// independent reference for what the server returns.
#ifndef LOOM_WORKER_TRAINER_INFERENCE_COMMANDS_H_
#define LOOM_WORKER_TRAINER_INFERENCE_COMMANDS_H_

#include <ostream>

#include "absl/status/status.h"
#include "base/cli_args.h"
#include "worker/trainer/plugin_loader.h"

namespace loom::trainer {

// --checkpoint DIR, --prompt TEXT | --prompt-tokens 1,2,3 | --chat TEXT (one user turn through an
// sft checkpoint's chat template), --max-new-tokens N (16), --greedy or
// --temperature T --top-p P --seed S. Prints {"prompt_tokens", "tokens", "text", "finish"}.
absl::Status RunGenerateCommand(const CliArgs& args, const PluginLoader& loader, std::ostream& out);
// --checkpoint DIR, --tokens 1,2,3 | --text TEXT. Prints {"tokens", "token_logprobs"} (the first
// is null).
absl::Status RunScoreCommand(const CliArgs& args, const PluginLoader& loader, std::ostream& out);
// --checkpoint DIR, --tokens 1,2,3 | --text TEXT, --output logits.safetensors, --dtype float32 |
// float64. Writes the full logits [N, V] of one forward pass (tensor "logits", in the compute
// dtype): what interop tests compare an exported model's logits with.
absl::Status RunLogitsCommand(const CliArgs& args, const PluginLoader& loader, std::ostream& out);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_INFERENCE_COMMANDS_H_
