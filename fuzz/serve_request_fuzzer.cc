// loom-serve's request bodies, parsed as its server does (JSON, then the endpoint's fields
// checked against the limits; prompts encoded by the byte tokenizer), and the error each refusal
// becomes. First byte: 'c' = /v1/chat/completions, else /v1/completions.
#include <nlohmann/json.hpp>
#include <string>

#include "data/tokenizer.h"
#include "fuzz/fuzz_input.h"
#include "serve/openai_request.h"

namespace {

using nlohmann::json;

void CheckError(const absl::Status& s) {
  const loom::serve::ApiError e = loom::serve::ErrorFromStatus(s);
  LOOM_FUZZ_CHECK(e.status >= 400 && e.status < 500, std::string(s.message()));
  (void)loom::serve::ErrorJson(e).dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const auto tokenizer = loom::data::MakeByteTokenizer();
  loom::serve::ServeLimits limits;
  limits.context = 256;
  limits.vocab = 512;
  const json body = json::parse(data + 1, data + size, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return 0;
  if (data[0] == 'c') {
    auto r = loom::serve::ParseChatRequest(body, limits);
    if (!r.ok()) return CheckError(r.status()), 0;
    LOOM_FUZZ_CHECK(r->common.n >= 1 && r->common.n <= limits.max_sequences, body.dump());
  } else {
    auto r = loom::serve::ParseCompletionRequest(body, limits, *tokenizer);
    if (!r.ok()) return CheckError(r.status()), 0;
    for (const auto& p : r->prompts) {
      LOOM_FUZZ_CHECK(static_cast<int64_t>(p.size()) <= limits.context * 32, "prompt length");
      for (uint32_t id : p) LOOM_FUZZ_CHECK(id < limits.vocab, std::to_string(id));
    }
  }
  return 0;
}
