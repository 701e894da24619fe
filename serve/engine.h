// The serving engine: continuous batching over the attention plugins' KV caches.
//
// One thread owns the model. Each iteration it admits queued sequences while the batch has
// room (their prompts are prefilled together, left-padded, and their caches appended to the
// running batch: AttentionCache::AppendRows), then decodes one token for every row in a single
// forward pass, and drops the rows that finished or whose client left (KeepRows). A request
// never waits for another request to finish; rows join and leave between steps.
//
// Each sequence decodes exactly what it would decode alone: pad entries are masked out by their
// segment (AttentionCache::kPadSegment), positions are the row's own, and the random stream is
// the sequence's own (trainer::SequenceRng of its seed, the same draws as `loom-train generate`).
//
// Shared prefill: sequences admitted together with equal prompts (the n choices of a request)
// are prefilled as one row whose caches are then forked (KeepRows with repeated rows), so a
// prompt with n = 16 costs one prefill, not 16; each choice still samples from its own stream.
#ifndef LOOM_SERVE_ENGINE_H_
#define LOOM_SERVE_ENGINE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "metrics/prometheus.h"
#include "serve/sequence_params.h"
#include "worker/trainer/generate.h"
#include "worker/trainer/model.h"

namespace loom::serve {

using Clock = std::chrono::steady_clock;

struct TokenLogprob {
  uint32_t token = 0;
  double logprob = 0;
};

// One token of the output (or of the prompt, when scored): its log-probability under the
// model's distribution (before temperature and top-p) and the top alternatives.
struct TokenOutput {
  uint32_t token = 0;
  double logprob = 0;
  std::vector<TokenLogprob> top;
};

// A sequence in flight. The engine thread appends tokens; the request's thread waits on it.
class Sequence {
 public:
  explicit Sequence(SequenceParams params) : params_(std::move(params)) {}
  const SequenceParams& params() const { return params_; }

  // The client is gone: the engine drops the row before its next step.
  void Cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }

  // Waits up to timeout for tokens past `have` or the end; returns all tokens so far.
  std::vector<TokenOutput> Wait(size_t have, std::chrono::milliseconds timeout, bool* done) const;
  bool done() const;
  // After done: "stop" (stop token or string), "length" (max_tokens or the context), or
  // "cancelled"; the output text with a stop string cut off; an error if the engine failed.
  std::string finish_reason() const;
  std::string text() const;
  absl::Status status() const;
  // The prompt's tokens scored (prompt_logprobs): entry 0 has no logprob (NaN).
  std::vector<TokenOutput> prompt_scores() const;

  // Engine side.
  void Push(TokenOutput token);
  void SetPromptScores(std::vector<TokenOutput> scores);
  void Finish(std::string reason, std::string text, absl::Status status = absl::OkStatus());

  Clock::time_point queued_at = Clock::now();

 private:
  const SequenceParams params_;
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mu_;
  mutable std::condition_variable changed_;
  std::vector<TokenOutput> tokens_, prompt_scores_;
  bool done_ = false;
  std::string finish_, text_;
  absl::Status status_;
};

struct EngineOptions {
  int max_batch = 32;         // rows decoded together
  int max_queue = 256;        // sequences waiting for a row; beyond: Submit refuses
  bool share_prefill = true;  // equal prompts admitted together share one prefill row
};

class Engine {
 public:
  using Decoder = trainer::TokenDecoder;
  // `registry` (may be null) receives the loom_serve_* engine metrics (DeclareServeMetrics).
  Engine(std::shared_ptr<trainer::Transformer> model, Decoder decode, EngineOptions options,
         metrics::Registry* registry);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues the sequences of one request, all or none: ResourceExhausted when the queue has no
  // room for all of them.
  absl::Status Submit(const std::vector<std::shared_ptr<Sequence>>& sequences);

  const trainer::Transformer& model() const { return *model_; }
  int64_t queued() const;
  // Token positions prefill has computed so far (loom_serve_prefill_tokens_total).
  int64_t prefill_tokens() const { return prefill_tokens_; }

 private:
  struct Row {
    std::shared_ptr<Sequence> seq;
    std::mt19937_64 rng;
    trainer::SamplingOptions sampling;
    int64_t length = 0;  // tokens of this row in the cache
    std::vector<uint32_t> generated;
    uint32_t next = 0;  // sampled, not yet fed
    Clock::time_point last_token;
  };

  void Loop();
  void DropCancelledQueued();
  std::vector<std::shared_ptr<Sequence>> TakeAdmissible();
  void Prefill(const std::vector<std::shared_ptr<Sequence>>& joining);
  // Starts the row of `s` from its prefill logits (last position [vocab], all positions
  // [longest, vocab]); false when the sequence already ended.
  bool StartRow(const std::shared_ptr<Sequence>& s, const torch::Tensor& last,
                const torch::Tensor& all, int64_t longest);
  // The prompt's log-probabilities from its prefill logits [n, vocab].
  void ScorePrompt(Sequence& s, const torch::Tensor& logits);
  void DecodeStep();
  // Samples the next token of `row` from its logits [vocab] (float64 CPU); false when it ended.
  bool Emit(Row& row, const torch::Tensor& logits);
  void DropFinishedRows();
  void FailAll(const std::string& why);

  std::shared_ptr<trainer::Transformer> model_;
  Decoder decode_;
  EngineOptions options_;
  metrics::Registry* registry_;
  torch::Device device_{torch::kCPU};

  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Sequence>> queue_;
  bool stop_ = false;
  std::atomic<int64_t> prefill_tokens_{0};

  // Engine thread only.
  trainer::DecodeState state_;
  std::vector<Row> rows_;
  std::thread thread_;
};

// The loom_serve_* families (docs/serve.md lists them).
void DeclareServeMetrics(metrics::Registry& registry);

// Log-softmax of one row of logits and its top-k entries (ties by lower token id).
std::vector<TokenLogprob> TopLogprobs(const torch::Tensor& logprobs, int k);

}  // namespace loom::serve

#endif  // LOOM_SERVE_ENGINE_H_
