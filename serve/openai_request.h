// The request side of loom-serve's OpenAI wire format: /v1/completions and /v1/chat/completions
// bodies parsed and checked against the server's limits, with errors that name the field. No
// LibTorch here: the fuzz harness (fuzz/serve_request_fuzzer.cc) builds it alone.
#ifndef LOOM_SERVE_OPENAI_REQUEST_H_
#define LOOM_SERVE_OPENAI_REQUEST_H_

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/tokenizer.h"
#include "loom/sft_plugin.h"
#include "serve/sequence_params.h"

namespace loom::serve {

// {"error": {"message", "type", "param", "code"}} with the HTTP status it goes with.
struct ApiError {
  int status = 400;
  std::string message, type = "invalid_request_error", param, code;
};
nlohmann::json ErrorJson(const ApiError& e);
// InvalidArgument "field: why" → 400 with param = field; NotFound → 404; ResourceExhausted → 429;
// Unavailable → 503; anything else → 500.
ApiError ErrorFromStatus(const absl::Status& s);

struct ServeLimits {
  int64_t context = 0;        // the model's max_seq_len
  int64_t vocab = 0;          // token ids must be below this
  int64_t max_tokens = 1024;  // most tokens one sequence may ask for
  int max_n = 16;             // choices per prompt
  int max_sequences = 64;     // prompts × n in one request
  int max_logprobs = 20;      // top alternatives per token
};

// Text of more bytes than this per token of context cannot fit it, whatever it encodes to, and is
// refused before the tokenizer sees it: encoding is the costliest thing a request can make the
// server do before its length in tokens is known (an 8 MiB prompt took seconds).
constexpr int64_t kMaxPromptBytesPerToken = 32;
absl::Status CheckTextFits(size_t bytes, const ServeLimits& limits, const std::string& field);

// Sampling fields both endpoints share, checked against the limits.
struct CommonRequest {
  std::string model;
  int n = 1;
  bool stream = false, include_usage = false;
  bool has_seed = false;
  SequenceParams params;  // prompt empty; filled per prompt
};

struct CompletionRequest {
  CommonRequest common;
  std::vector<std::vector<uint32_t>> prompts;
  bool echo = false;
};

struct ChatRequest {
  CommonRequest common;
  ChatConversation conversation;
  bool logprobs = false;
};

absl::StatusOr<CompletionRequest> ParseCompletionRequest(const nlohmann::json& body,
                                                         const ServeLimits& limits,
                                                         const data::Tokenizer& tokenizer);
absl::StatusOr<ChatRequest> ParseChatRequest(const nlohmann::json& body, const ServeLimits& limits);

}  // namespace loom::serve

#endif  // LOOM_SERVE_OPENAI_REQUEST_H_
