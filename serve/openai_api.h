// The OpenAI wire format of loom-serve: the response bodies of /v1/completions and
// /v1/chat/completions (whole and streamed) in exactly the shape the official clients and
// lm-evaluation-harness's `local-completions` read.
#ifndef LOOM_SERVE_OPENAI_API_H_
#define LOOM_SERVE_OPENAI_API_H_

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/tokenizer.h"
#include "serve/engine.h"
#include "serve/openai_request.h"

namespace loom::serve {

// Text of token ids; ids past the tokenizer's vocabulary (chat-template markers) have none.
std::string DecodeText(const data::Tokenizer& tokenizer, const std::vector<uint32_t>& ids);
// A token as text for logprobs: its decoding when that is valid UTF-8 on its own, otherwise
// "bytes:\xNN..." with its bytes in hex (as vLLM does), so JSON stays valid.
std::string TokenText(const data::Tokenizer& tokenizer, uint32_t token);
// Length of the longest prefix of `text` that does not end inside a UTF-8 sequence (streaming
// sends whole characters only).
size_t CompleteUtf8Prefix(const std::string& text);

// One choice of a finished completion. With echo the prompt's tokens (and their logprobs, the
// first null) come first; text_offset counts characters of the returned text.
nlohmann::json CompletionChoice(int index, const std::vector<uint32_t>& prompt, const Sequence& s,
                                bool echo, const data::Tokenizer& tokenizer);
// One choice of a finished chat completion.
nlohmann::json ChatChoice(int index, const Sequence& s, bool logprobs,
                          const data::Tokenizer& tokenizer);
nlohmann::json Usage(int64_t prompt_tokens, int64_t completion_tokens);

}  // namespace loom::serve

#endif  // LOOM_SERVE_OPENAI_API_H_
