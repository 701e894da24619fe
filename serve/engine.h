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
//
// Prefix caching (EngineOptions::prefix_cache_bytes > 0): the KV caches of prompt prefixes are
// kept across requests (PrefixCache), so a prompt that starts with a cached prefix prefills only
// the rest. The cache ABI has no "slice by token range", so an entry is a whole-prefix snapshot:
// one cache row holding exactly the prefix's tokens (a whole number of blocks, no padding). A
// prefill that can reuse or create one runs in chunks of equal length and equal start, never
// padded, so a snapshot holds only real tokens and sliding windows keep their last tokens.
#ifndef LOOM_SERVE_ENGINE_H_
#define LOOM_SERVE_ENGINE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
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
  // Prefix cache budget (0: off; loom-serve --prefix-cache-mb sets it) and block length.
  int64_t prefix_cache_bytes = 0;
  int64_t prefix_block = 16;
};

// A cached prompt prefix: one cache row holding exactly `tokens` (a whole number of blocks).
struct PrefixEntry {
  std::vector<uint32_t> tokens;
  trainer::DecodeState state;  // one row, no padding
  torch::Tensor last;          // float64 CPU [vocab]: the logits after the prefix's last token
  int score_k = -1;            // >= 0: `scores` holds the prefix's tokens scored with top k
  std::vector<TokenOutput> scores;
  int64_t bytes = 0;  // what the budget counts: caches, logits, scores
};

// Prefix snapshots keyed by a hash chain over blocks of token ids (block i's key hashes key
// i - 1 and its ids; ids are compared on a hit, so a collision is a miss), least recently used
// evicted under a byte budget. An entry is in use while a shared_ptr beyond the cache's holds it
// (a prefill reading it); entries in use are never evicted. Engine thread only, except the
// counters.
class PrefixCache {
 public:
  PrefixCache(int64_t budget_bytes, int64_t block_tokens);
  int64_t block() const { return block_; }
  // Keys of the first `blocks` blocks of `tokens`.
  std::vector<uint64_t> Keys(const std::vector<uint32_t>& tokens, int64_t blocks) const;
  // The deepest entry that is a prefix of `tokens` (keys: Keys(tokens, ...)) and, for
  // score_k >= 0, holds scores with at least top score_k; null if none. Marks it used.
  std::shared_ptr<const PrefixEntry> Lookup(const std::vector<uint32_t>& tokens,
                                            const std::vector<uint64_t>& keys, int score_k);
  // Adds `entry` under the key of its last block, evicting least recently used entries not in
  // use; false (nothing changes) when it cannot fit or an equal or better entry is there.
  bool Insert(uint64_t key, std::shared_ptr<PrefixEntry> entry);
  // Blocks of the longest prefix of `keys` seen by Remember: where earlier prompts branched.
  int64_t SeenDepth(const std::vector<uint64_t>& keys) const;
  void Remember(const std::vector<uint64_t>& keys);

  int64_t budget() const { return budget_; }
  int64_t bytes() const { return bytes_; }
  int64_t entries() const { return entries_; }
  int64_t evictions() const { return evictions_; }

 private:
  struct Slot {
    std::shared_ptr<PrefixEntry> entry;
    std::list<uint64_t>::iterator lru;
  };
  void Erase(std::unordered_map<uint64_t, Slot>::iterator it);

  const int64_t budget_, block_;
  std::atomic<int64_t> bytes_{0}, entries_{0}, evictions_{0};
  std::unordered_map<uint64_t, Slot> map_;
  std::list<uint64_t> lru_;  // most recently used first
  std::unordered_set<uint64_t> seen_;
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
  // Prompt tokens whose KV came from the prefix cache / were computed (per prefilled prompt).
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }
  int64_t prefix_miss_tokens() const { return prefix_miss_tokens_; }
  // Null when prefix caching is off. Its counters may be read from any thread.
  const PrefixCache* prefix_cache() const { return prefix_cache_.get(); }

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
  // Prefix caching: one forward row of tokens [from, to) of `prompt` after `base` (null iff
  // from is 0); RunChunks fills `state` (one row) and `logits` ([to - from, vocab], device).
  struct Chunk {
    const std::vector<uint32_t>* prompt = nullptr;
    std::shared_ptr<const PrefixEntry> base;
    int64_t from = 0, to = 0;
    int score_k = -1;  // >= 0: score the tokens (top k)
    trainer::DecodeState state;
    torch::Tensor logits;
  };
  // A prefilled prompt of a cached prefill: its plan, then its chunk's results.
  struct PromptRow;
  void PrefillCached(const std::vector<std::shared_ptr<Sequence>>& joining);
  void PlanPrefix(std::vector<PromptRow>& rows);
  void ExtendPrefixes(std::vector<PromptRow>& rows);
  void RunChunks(const std::vector<Chunk*>& chunks);
  // The scores of chunk `c`'s tokens appended to `out` (its base's first), and its last logits.
  torch::Tensor ChunkResults(const Chunk& c, std::vector<TokenOutput>* out) const;
  void RecordPrefixMetrics();
  // One state holding `rows`' rows in order (each a state of the model's layers).
  trainer::DecodeState MergeRows(const std::vector<const trainer::DecodeState*>& rows) const;
  // Starts the row of `s` from its prefill logits (last position [vocab], all positions
  // [longest, vocab]); false when the sequence already ended.
  // `all` undefined: the prompt was scored already (prefix caching).
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
  std::atomic<int64_t> prefill_tokens_{0}, prefix_hit_tokens_{0}, prefix_miss_tokens_{0};
  std::unique_ptr<PrefixCache> prefix_cache_;
  int64_t reported_evictions_ = 0;

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
