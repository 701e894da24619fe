#include "worker/trainer/inference_commands.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "worker/trainer/checkpoint_model.h"
#include "worker/trainer/generate.h"
#include "worker/trainer/tensor_io.h"

namespace loom::trainer {
namespace {

absl::StatusOr<std::vector<uint32_t>> ParseTokenList(const std::string& text,
                                                     const std::string& flag) {
  std::vector<uint32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    uint32_t id = 0;
    if (!absl::SimpleAtoi(part, &id))
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", part, "' is not a token id"));
    ids.push_back(id);
  }
  if (ids.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": no tokens"));
  return ids;
}

// The tokens of --<tokens_flag> 1,2,3 or of the text of --<text_flag>.
absl::StatusOr<std::vector<uint32_t>> TokensFromArgs(const CliArgs& args, const CheckpointModel& m,
                                                     const std::string& tokens_flag,
                                                     const std::string& text_flag) {
  if (args.Has(tokens_flag)) return ParseTokenList(args.Get(tokens_flag), "--" + tokens_flag);
  if (!args.Has(text_flag)) {
    return absl::InvalidArgumentError(absl::StrCat("give --", tokens_flag, " or --", text_flag));
  }
  return m.tokenizer->Encode(args.Get(text_flag));
}

}  // namespace

absl::Status RunGenerateCommand(const CliArgs& args, const PluginLoader& loader,
                                std::ostream& out) {
  LOOM_ASSIGN_OR_RETURN(std::string where, args.Require("checkpoint"));
  LOOM_ASSIGN_OR_RETURN(CheckpointModel m,
                        LoadCheckpointModel(where, loader, torch::kCPU, torch::kFloat32));
  GenerationRequest request;
  const TextEncoder encode = [&](std::string_view text) { return m.tokenizer->Encode(text); };
  if (args.Has("chat")) {  // one user turn through the checkpoint's chat template
    if (!m.objective)
      return absl::InvalidArgumentError(
          "--chat: this checkpoint has no chat template (not an sft or eval job's)");
    ChatConversation c;
    c.turns.push_back({ChatRole::kUser, args.Get("chat")});
    request.prompt = m.objective->Prompt(c, encode);
  } else {
    LOOM_ASSIGN_OR_RETURN(request.prompt, TokensFromArgs(args, m, "prompt-tokens", "prompt"));
  }
  SamplingOptions o;
  o.greedy = args.Has("greedy");
  LOOM_ASSIGN_OR_RETURN(o.temperature, args.GetDouble("temperature", 1.0, 1e-6, 100));
  LOOM_ASSIGN_OR_RETURN(o.top_p, args.GetDouble("top-p", 1.0, 1e-6, 1.0));
  LOOM_ASSIGN_OR_RETURN(o.max_new_tokens, args.GetInt("max-new-tokens", 16, 0, 1 << 20));
  LOOM_ASSIGN_OR_RETURN(int64_t seed, args.GetInt("seed", 1, 0, INT64_MAX));
  request.seed = static_cast<uint64_t>(seed);
  if (m.objective) o.stop_tokens = m.objective->StopTokens();
  if (m.eos >= 0) o.stop_tokens.push_back(static_cast<uint32_t>(m.eos));
  o.batch = 1;
  auto decode = [&](const std::vector<uint32_t>& ids) { return m.tokenizer->Decode(ids); };
  LOOM_ASSIGN_OR_RETURN(std::vector<Generation> g, Generate(*m.model, {request}, o, decode));
  nlohmann::json j = {{"prompt_tokens", request.prompt},
                      {"tokens", g[0].tokens},
                      {"text", g[0].text},
                      {"finish", g[0].finish}};
  out << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  return absl::OkStatus();
}

absl::Status RunScoreCommand(const CliArgs& args, const PluginLoader& loader, std::ostream& out) {
  LOOM_ASSIGN_OR_RETURN(std::string where, args.Require("checkpoint"));
  LOOM_ASSIGN_OR_RETURN(CheckpointModel m,
                        LoadCheckpointModel(where, loader, torch::kCPU, torch::kFloat32));
  LOOM_ASSIGN_OR_RETURN(std::vector<uint32_t> tokens, TokensFromArgs(args, m, "tokens", "text"));
  LOOM_ASSIGN_OR_RETURN(std::vector<double> logprobs, ScoreTokens(*m.model, tokens));
  nlohmann::json lp = nlohmann::json::array();
  for (double v : logprobs)
    lp.push_back(std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v));
  out << nlohmann::json{{"tokens", tokens}, {"token_logprobs", lp}}.dump() << "\n";
  return absl::OkStatus();
}

absl::Status RunLogitsCommand(const CliArgs& args, const PluginLoader& loader, std::ostream& out) {
  LOOM_ASSIGN_OR_RETURN(std::string where, args.Require("checkpoint"));
  LOOM_ASSIGN_OR_RETURN(std::string path, args.Require("output"));
  const std::string dtype = args.Get("dtype", "float32");
  if (dtype != "float32" && dtype != "float64")
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype: '", dtype, "' is not float32 | float64"));
  const torch::ScalarType type = dtype == "float64" ? torch::kFloat64 : torch::kFloat32;
  LOOM_ASSIGN_OR_RETURN(CheckpointModel m, LoadCheckpointModel(where, loader, torch::kCPU, type));
  LOOM_ASSIGN_OR_RETURN(std::vector<uint32_t> tokens, TokensFromArgs(args, m, "tokens", "text"));
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n > m.model->config().max_seq_len())
    return absl::InvalidArgumentError(absl::StrCat("--tokens: ", n, " tokens exceed max_seq_len ",
                                                   m.model->config().max_seq_len()));
  std::vector<int64_t> ids(tokens.begin(), tokens.end());
  for (int64_t id : ids) {
    if (id >= m.model->config().vocab_size())
      return absl::InvalidArgumentError(
          absl::StrCat("--tokens: ", id, " is outside the vocabulary"));
  }
  torch::Tensor logits;
  try {
    torch::NoGradGuard no_grad;
    torch::Tensor in = torch::tensor(ids, torch::kInt64).view({1, n});
    logits = m.model->forward(ModelInputs{in, {}, {}, {}, {}}).squeeze(0).contiguous();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("logits: ", e.what()));
  }
  LOOM_RETURN_IF_ERROR(SaveTensors(path, {{"logits", logits}}));
  out << nlohmann::json{{"tokens", tokens},
                        {"shape", logits.sizes().vec()},
                        {"dtype", dtype},
                        {"checkpoint", m.dir},
                        {"output", path}}
             .dump()
      << "\n";
  return absl::OkStatus();
}

}  // namespace loom::trainer
