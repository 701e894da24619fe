#include "worker/trainer/checkpoint_model.h"

#include <cmath>
#include <limits>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "loom/spec.h"
#include "storage/checkpoint.h"
#include "storage/checkpoint_store.h"
#include "worker/trainer/job_tokenizer.h"
#include "worker/trainer/plugin_factory.h"
#include "worker/trainer/tensor_io.h"

namespace loom::trainer {
absl::StatusOr<CheckpointModel> LoadCheckpointModel(const std::string& where,
                                                    const PluginLoader& loader,
                                                    const torch::Device& device,
                                                    torch::ScalarType dtype) {
  LOOM_ASSIGN_OR_RETURN(storage::LoadedCheckpoint loaded, storage::LoadNamedCheckpoint(where));
  CheckpointModel out;
  out.dir = loaded.dir;
  out.step = loaded.manifest.step;
  LOOM_ASSIGN_OR_RETURN(out.spec, RecordedSpec(loaded.manifest.state, loaded.dir));
  if (out.spec.model().mode() != "decoder") {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint: ", loaded.dir, " holds an encoder (", out.spec.model().mode(),
                     "); only decoders generate text"));
  }
  LOOM_ASSIGN_OR_RETURN(out.model, Transformer::Create(out.spec.model(), loader));
  std::map<std::string, torch::Tensor> weights;
  constexpr char kModelPrefix[] = "model.";
  for (const auto& shard : loaded.shards) {
    LOOM_ASSIGN_OR_RETURN(auto part, TensorsFromFile(shard));
    for (auto& [name, t] : part) {
      if (absl::StartsWith(name, kModelPrefix)) weights[name.substr(sizeof(kModelPrefix) - 1)] = t;
    }
  }
  if (absl::Status s = LoadIntoModule(*out.model, weights); !s.ok())
    return absl::DataLossError(absl::StrCat("checkpoint: ", loaded.dir, ": ", s.message()));
  out.model->to(device, dtype);
  out.model->eval();
  LOOM_ASSIGN_OR_RETURN(out.tokenizer, JobTokenizer(out.spec));
  out.eos = out.tokenizer->eos_id();
  if (out.spec.kind() == "sft" || out.spec.kind() == "eval") {
    const bool sft = out.spec.kind() == "sft";
    const std::string& format = sft ? out.spec.data().format() : out.spec.reasoning_eval().format();
    LOOM_ASSIGN_OR_RETURN(
        out.objective,
        CreateSftObjective(loader, format.empty() ? "openthoughts" : format,
                           sft ? out.spec.data().format_options() : google::protobuf::Struct(),
                           ChatTokensOf(*out.tokenizer)));
  }
  return out;
}

absl::StatusOr<std::vector<double>> ScoreTokens(Transformer& model,
                                                const std::vector<uint32_t>& tokens) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) return absl::InvalidArgumentError("score: no tokens");
  if (n > model.config().max_seq_len()) {
    return absl::InvalidArgumentError(
        absl::StrCat("score: ", n, " tokens exceed max_seq_len ", model.config().max_seq_len()));
  }
  std::vector<int64_t> ids(tokens.begin(), tokens.end());
  for (int64_t id : ids) {
    if (id >= model.config().vocab_size())
      return absl::InvalidArgumentError(
          absl::StrCat("score: token ", id, " outside the vocabulary"));
  }
  try {
    torch::NoGradGuard no_grad;
    const torch::Device device = model.parameters().front().device();
    torch::Tensor in = torch::tensor(ids, torch::kInt64).view({1, n}).to(device);
    torch::Tensor logp = torch::log_softmax(
        model.forward(ModelInputs{in, {}, {}, {}, {}}).squeeze(0).to(torch::kCPU, torch::kFloat64),
        -1);
    std::vector<double> out(static_cast<size_t>(n), std::numeric_limits<double>::quiet_NaN());
    for (int64_t i = 1; i < n; ++i) out[i] = logp[i - 1][ids[i]].item<double>();
    return out;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("score: ", e.what()));
  }
}

}  // namespace loom::trainer
