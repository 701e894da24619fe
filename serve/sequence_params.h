// What one sequence asks of the serving engine (serve/engine.h): its prompt and sampling. Apart
// from the engine so that request parsing (serve/openai_request.h) needs no LibTorch.
#ifndef LOOM_SERVE_SEQUENCE_PARAMS_H_
#define LOOM_SERVE_SEQUENCE_PARAMS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace loom::serve {

struct SequenceParams {
  std::vector<uint32_t> prompt;
  bool greedy = true;
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t max_tokens = 16;            // generated tokens at most; 0 = score the prompt only
  std::vector<std::string> stop;      // stop strings (the text is cut before the first)
  std::vector<uint32_t> stop_tokens;  // e.g. <|end|>, EOS (not part of the output)
  uint64_t seed = 1;
  int logprobs = -1;             // -1: none; k >= 0: each token's logprob and its top k
  bool prompt_logprobs = false;  // also score the prompt's tokens (echo with logprobs)
};

}  // namespace loom::serve

#endif  // LOOM_SERVE_SEQUENCE_PARAMS_H_
