// The request side of loom-serve's OpenAI wire format: bodies to requests, errors to their JSON.
#include "serve/openai_request.h"

#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace loom::serve {
namespace {

using json = nlohmann::json;

absl::Status Invalid(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

// Every key must be one the endpoint knows: a misspelt option is an error, not a silent default.
absl::Status CheckKnownFields(const json& body, const std::set<std::string>& known) {
  if (!body.is_object()) return Invalid("body", "must be a JSON object");
  for (const auto& [key, value] : body.items()) {
    if (known.count(key) == 0) {
      return Invalid(key, absl::StrCat("unknown field (known: ", absl::StrJoin(known, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

bool IsSet(const json& body, const char* key) { return body.contains(key) && !body[key].is_null(); }

absl::StatusOr<double> Number(const json& body, const char* key, double fallback, double min,
                              double max) {
  if (!IsSet(body, key)) return fallback;
  if (!body[key].is_number()) return Invalid(key, "must be a number");
  const double v = body[key].get<double>();
  if (!(v >= min && v <= max))
    return Invalid(key, absl::StrFormat("must be in [%g, %g]", min, max));
  return v;
}

absl::StatusOr<int64_t> Integer(const json& body, const char* key, int64_t fallback, int64_t min,
                                int64_t max) {
  if (!IsSet(body, key)) return fallback;
  if (!body[key].is_number_integer()) return Invalid(key, "must be an integer");
  const int64_t v = body[key].get<int64_t>();
  if (v < min || v > max) return Invalid(key, absl::StrCat("must be in [", min, ", ", max, "]"));
  return v;
}

absl::StatusOr<bool> Bool(const json& body, const char* key) {
  if (!IsSet(body, key)) return false;
  if (!body[key].is_boolean()) return Invalid(key, "must be true or false");
  return body[key].get<bool>();
}

absl::StatusOr<std::vector<std::string>> StopStrings(const json& body) {
  std::vector<std::string> stop;
  if (!IsSet(body, "stop")) return stop;
  const json& s = body["stop"];
  if (s.is_string()) {
    stop.push_back(s.get<std::string>());
  } else if (s.is_array() && s.size() <= 4) {
    for (const json& e : s) {
      if (!e.is_string()) return Invalid("stop", "must be a string or a list of strings");
      stop.push_back(e.get<std::string>());
    }
  } else {
    return Invalid("stop", "must be a string or a list of at most 4 strings");
  }
  for (const std::string& x : stop)
    if (x.empty()) return Invalid("stop", "stop strings must not be empty");
  return stop;
}

// Fields OpenAI defines that Loom does not implement must keep their neutral value.
absl::Status CheckNeutral(const json& body) {
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    if (IsSet(body, key) && (!body[key].is_number() || body[key].get<double>() != 0))
      return Invalid(key, "only 0 is supported");
  }
  if (IsSet(body, "logit_bias") && !(body["logit_bias"].is_object() && body["logit_bias"].empty()))
    return Invalid("logit_bias", "is not supported");
  if (IsSet(body, "suffix")) return Invalid("suffix", "is not supported");
  return absl::OkStatus();
}

absl::StatusOr<CommonRequest> ParseCommon(const json& body, const ServeLimits& limits,
                                          const char* max_tokens_key, int64_t max_tokens_default) {
  CommonRequest r;
  if (IsSet(body, "model")) {
    if (!body["model"].is_string()) return Invalid("model", "must be a string");
    r.model = body["model"].get<std::string>();
  }
  if (absl::Status s = CheckNeutral(body); !s.ok()) return s;
  auto n = Integer(body, "n", 1, 1, limits.max_n);
  if (!n.ok()) return n.status();
  r.n = static_cast<int>(*n);
  if (IsSet(body, "best_of")) {
    auto best_of = Integer(body, "best_of", r.n, r.n, r.n);
    if (!best_of.ok()) return Invalid("best_of", "only best_of = n is supported");
  }
  auto stream = Bool(body, "stream");
  if (!stream.ok()) return stream.status();
  r.stream = *stream;
  if (IsSet(body, "stream_options")) {
    const json& o = body["stream_options"];
    if (!o.is_object() || !r.stream) return Invalid("stream_options", "an object, with stream");
    for (const auto& [k, v] : o.items()) {
      if (k != "include_usage" || !v.is_boolean())
        return Invalid("stream_options", "only include_usage (boolean) is known");
      r.include_usage = v.get<bool>();
    }
  }
  SequenceParams& p = r.params;
  auto temperature = Number(body, "temperature", 1.0, 0.0, 2.0);
  auto top_p = Number(body, "top_p", 1.0, 0.0, 1.0);
  auto max_tokens = Integer(body, max_tokens_key, max_tokens_default, 0, limits.max_tokens);
  auto stop = StopStrings(body);
  for (const absl::Status& s :
       {temperature.status(), top_p.status(), max_tokens.status(), stop.status()})
    if (!s.ok()) return s;
  if (*top_p == 0) return Invalid("top_p", "must be > 0");
  p.greedy = *temperature == 0;
  p.temperature = p.greedy ? 1.0 : *temperature;
  p.top_p = *top_p;
  p.max_tokens = *max_tokens;
  p.stop = *stop;
  if (IsSet(body, "seed")) {
    if (!body["seed"].is_number_integer()) return Invalid("seed", "must be an integer");
    p.seed = static_cast<uint64_t>(body["seed"].get<int64_t>());
    r.has_seed = true;
  } else {
    p.seed = std::random_device{}();
  }
  if (IsSet(body, "user") && !body["user"].is_string()) return Invalid("user", "must be a string");
  return r;
}

absl::StatusOr<std::vector<uint32_t>> TokenIds(const json& ids, const ServeLimits& limits) {
  std::vector<uint32_t> out;
  for (const json& id : ids) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= limits.vocab)
      return Invalid("prompt",
                     absl::StrCat("token ids must be integers in [0, ", limits.vocab, ")"));
    out.push_back(static_cast<uint32_t>(id.get<int64_t>()));
  }
  return out;
}

// prompt: a string, a list of strings, a list of token ids, or a list of token-id lists.
absl::StatusOr<std::vector<std::vector<uint32_t>>> Prompts(const json& body,
                                                           const ServeLimits& limits,
                                                           const data::Tokenizer& tokenizer) {
  if (!IsSet(body, "prompt")) return Invalid("prompt", "required");
  const json& p = body["prompt"];
  std::vector<std::vector<uint32_t>> prompts;
  if (p.is_string()) {
    LOOM_RETURN_IF_ERROR(CheckTextFits(p.get_ref<const std::string&>().size(), limits, "prompt"));
    prompts.push_back(tokenizer.Encode(p.get<std::string>()));
  } else if (p.is_array() && !p.empty() && p[0].is_number()) {
    auto ids = TokenIds(p, limits);
    if (!ids.ok()) return ids.status();
    prompts.push_back(*ids);
  } else if (p.is_array() && !p.empty()) {
    for (const json& e : p) {
      if (e.is_string()) {
        LOOM_RETURN_IF_ERROR(
            CheckTextFits(e.get_ref<const std::string&>().size(), limits, "prompt"));
        prompts.push_back(tokenizer.Encode(e.get<std::string>()));
      } else if (e.is_array()) {
        auto ids = TokenIds(e, limits);
        if (!ids.ok()) return ids.status();
        prompts.push_back(*ids);
      } else {
        return Invalid("prompt", "list entries must be strings or token-id lists");
      }
    }
  } else {
    return Invalid("prompt", "a string, a list of strings, token ids or token-id lists");
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) return Invalid("prompt", absl::StrCat("prompt ", i, " is empty"));
    if (static_cast<int64_t>(prompts[i].size()) > limits.context) {
      return Invalid("prompt", absl::StrCat("prompt ", i, " has ", prompts[i].size(),
                                            " tokens; the model's context is ", limits.context));
    }
  }
  return prompts;
}

absl::StatusOr<ChatConversation> Messages(const json& body) {
  if (!IsSet(body, "messages") || !body["messages"].is_array() || body["messages"].empty())
    return Invalid("messages", "required: a non-empty list of {role, content}");
  ChatConversation c;
  for (const json& m : body["messages"]) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string()) {
      return Invalid("messages", "each message needs a string role and a string content");
    }
    const std::string role = m["role"].get<std::string>();
    ChatRole r;
    if (role == "system" || role == "developer") {
      r = ChatRole::kSystem;
    } else if (role == "user") {
      r = ChatRole::kUser;
    } else if (role == "assistant") {
      r = ChatRole::kAssistant;
    } else {
      return Invalid("messages",
                     absl::StrCat("role '", role, "' is not system | user | assistant"));
    }
    c.turns.push_back({r, m["content"].get<std::string>()});
  }
  return c;
}

}  // namespace

json ErrorJson(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

ApiError ErrorFromStatus(const absl::Status& s) {
  ApiError e;
  e.message = std::string(s.message());
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument: {
      e.status = 400;
      const size_t colon = e.message.find(": ");
      if (colon != std::string::npos && e.message.find(' ') > colon)
        e.param = e.message.substr(0, colon);
      break;
    }
    case absl::StatusCode::kNotFound:
      e.status = 404;
      e.code = "model_not_found";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.status = 429;
      e.type = "rate_limit_error";
      break;
    case absl::StatusCode::kUnauthenticated:
      e.status = 401;
      e.type = "authentication_error";
      break;
    case absl::StatusCode::kUnavailable:
      e.status = 503;
      e.type = "server_error";
      break;
    default:
      e.status = 500;
      e.type = "server_error";
  }
  return e;
}

absl::StatusOr<CompletionRequest> ParseCompletionRequest(const json& body,
                                                         const ServeLimits& limits,
                                                         const data::Tokenizer& tokenizer) {
  static const std::set<std::string> kKnown = {"model",
                                               "prompt",
                                               "max_tokens",
                                               "temperature",
                                               "top_p",
                                               "n",
                                               "stream",
                                               "stop",
                                               "seed",
                                               "logprobs",
                                               "echo",
                                               "stream_options",
                                               "user",
                                               "suffix",
                                               "best_of",
                                               "logit_bias",
                                               "presence_penalty",
                                               "frequency_penalty"};
  if (absl::Status s = CheckKnownFields(body, kKnown); !s.ok()) return s;
  CompletionRequest r;
  auto common = ParseCommon(body, limits, "max_tokens", 16);
  if (!common.ok()) return common.status();
  r.common = *std::move(common);
  auto prompts = Prompts(body, limits, tokenizer);
  if (!prompts.ok()) return prompts.status();
  r.prompts = *std::move(prompts);
  auto echo = Bool(body, "echo");
  if (!echo.ok()) return echo.status();
  r.echo = *echo;
  auto logprobs = Integer(body, "logprobs", -1, 0, limits.max_logprobs);
  if (!logprobs.ok()) return logprobs.status();
  r.common.params.logprobs = static_cast<int>(*logprobs);
  r.common.params.prompt_logprobs = r.echo && *logprobs >= 0;
  if (r.echo && r.common.stream) return Invalid("echo", "is not supported with stream");
  if (static_cast<int64_t>(r.prompts.size()) * r.common.n > limits.max_sequences) {
    return Invalid(
        "n", absl::StrCat(r.prompts.size(), " prompts × n = ", r.common.n, " exceed the server's ",
                          limits.max_sequences, " sequences per request"));
  }
  return r;
}

absl::Status CheckTextFits(size_t bytes, const ServeLimits& limits, const std::string& field) {
  const int64_t most = limits.context * kMaxPromptBytesPerToken;
  if (static_cast<int64_t>(bytes) <= most) return absl::OkStatus();
  return Invalid(field,
                 absl::StrCat(bytes, " bytes of text cannot fit the model's context of ",
                              limits.context, " tokens (at most ", most, " bytes are encoded)"));
}

absl::StatusOr<ChatRequest> ParseChatRequest(const json& body, const ServeLimits& limits) {
  static const std::set<std::string> kKnown = {"model",
                                               "messages",
                                               "max_tokens",
                                               "max_completion_tokens",
                                               "temperature",
                                               "top_p",
                                               "n",
                                               "stream",
                                               "stop",
                                               "seed",
                                               "logprobs",
                                               "top_logprobs",
                                               "stream_options",
                                               "user",
                                               "logit_bias",
                                               "presence_penalty",
                                               "frequency_penalty"};
  if (absl::Status s = CheckKnownFields(body, kKnown); !s.ok()) return s;
  const char* max_key =
      IsSet(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  ChatRequest r;
  auto common = ParseCommon(body, limits, max_key, limits.max_tokens);
  if (!common.ok()) return common.status();
  r.common = *std::move(common);
  auto messages = Messages(body);
  if (!messages.ok()) return messages.status();
  size_t bytes = 0;
  for (const auto& turn : messages->turns) bytes += turn.text.size();
  LOOM_RETURN_IF_ERROR(CheckTextFits(bytes, limits, "messages"));
  r.conversation = *std::move(messages);
  auto logprobs = Bool(body, "logprobs");
  auto top = Integer(body, "top_logprobs", 0, 0, limits.max_logprobs);
  if (!logprobs.ok()) return logprobs.status();
  if (!top.ok()) return top.status();
  if (IsSet(body, "top_logprobs") && !*logprobs)
    return Invalid("top_logprobs", "needs logprobs: true");
  r.logprobs = *logprobs;
  r.common.params.logprobs = r.logprobs ? static_cast<int>(*top) : -1;
  if (r.common.n > limits.max_sequences)
    return Invalid("n", absl::StrCat("exceeds the server's ", limits.max_sequences, " sequences"));
  return r;
}

}  // namespace loom::serve
