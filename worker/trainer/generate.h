// Text generation with the KV cache: batched prompts (left-padded, pads in their own segment so
// no real token attends to them), temperature / top-p sampling or greedy decoding, stop tokens
// and stop strings, and one random stream per sequence so a sample does not depend on which
// other prompts share its batch. Requests of one batch with equal prompts (the k samples of a
// Maj@k eval) are prefilled once and their KV caches forked (AttentionCache::KeepRows with
// repeated rows): the same tokens for the same seeds, k times fewer prefill tokens.
#ifndef LOOM_WORKER_TRAINER_GENERATE_H_
#define LOOM_WORKER_TRAINER_GENERATE_H_

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/trainer/model.h"

namespace loom::trainer {

struct SamplingOptions {
  bool greedy = false;
  double temperature = 0.6;
  double top_p = 1.0;  // keep the smallest set of most likely tokens whose mass reaches top_p
  int64_t max_new_tokens = 256;
  std::vector<std::string> stop;      // stop strings, matched on the decoded text
  std::vector<uint32_t> stop_tokens;  // e.g. the chat template's <|end|>
  int64_t batch = 16;                 // sequences decoded together
  uint32_t pad = 0;                   // token fed at left padding (never attended to)
  bool share_prefill = true;          // equal prompts of a batch share one prefill row
};

struct GenerationRequest {
  std::vector<uint32_t> prompt;
  uint64_t seed = 1;  // this sequence's random stream
};

struct Generation {
  std::vector<uint32_t> tokens;  // generated tokens, without a stop token (a stop string's stay)
  std::string text;              // decoded, cut before a stop string
  std::string finish;            // "stop_token" | "stop_string" | "length"
};

struct GenerationStats {
  int64_t sequences = 0, generated_tokens = 0, peak_cache_bytes = 0;
  // Token positions the prefill forward passes computed (rows x padded prompt length): a prompt
  // shared by k requests of a batch counts once with share_prefill.
  int64_t prefill_tokens = 0;
  double seconds = 0;
};

using TokenDecoder = std::function<std::string(const std::vector<uint32_t>&)>;

// Decodes every request with `model` (a decoder; parameters' device and dtype are used). Rows
// stop at a stop token, a stop string, max_new_tokens, or model.max_seq_len.
absl::StatusOr<std::vector<Generation>> Generate(Transformer& model,
                                                 const std::vector<GenerationRequest>& requests,
                                                 const SamplingOptions& options,
                                                 const TokenDecoder& decode,
                                                 GenerationStats* stats = nullptr);

// SplitMix64's finaliser: decorrelates per-sequence seeds (and hashes loom-serve's prefix blocks).
uint64_t SplitMix64(uint64_t x);

// The random stream of a sequence with `seed` (SplitMix64 of it): Generate and loom-serve draw
// the same samples for the same seed.
std::mt19937_64 SequenceRng(uint64_t seed);

// The next token from one row of logits (any float dtype, any device): argmax when greedy, else
// temperature then top-p, drawing u in [0, 1) from `rng`. Exposed for tests.
uint32_t SampleToken(const torch::Tensor& logits, const SamplingOptions& options,
                     std::mt19937_64& rng);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_GENERATE_H_
