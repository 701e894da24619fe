#include "serve/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"

namespace loom::serve {
namespace {

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

std::vector<TokenOutput> Sequence::Wait(size_t have, std::chrono::milliseconds timeout,
                                        bool* done) const {
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait_for(lock, timeout, [&] { return done_ || tokens_.size() > have; });
  *done = done_;
  return tokens_;
}

bool Sequence::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::string Sequence::finish_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return finish_;
}

std::string Sequence::text() const {
  std::lock_guard<std::mutex> lock(mu_);
  return text_;
}

absl::Status Sequence::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

std::vector<TokenOutput> Sequence::prompt_scores() const {
  std::lock_guard<std::mutex> lock(mu_);
  return prompt_scores_;
}

void Sequence::Push(TokenOutput token) {
  std::lock_guard<std::mutex> lock(mu_);
  tokens_.push_back(std::move(token));
  changed_.notify_all();
}

void Sequence::SetPromptScores(std::vector<TokenOutput> scores) {
  std::lock_guard<std::mutex> lock(mu_);
  prompt_scores_ = std::move(scores);
}

void Sequence::Finish(std::string reason, std::string text, absl::Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return;
  done_ = true;
  finish_ = std::move(reason);
  text_ = std::move(text);
  status_ = std::move(status);
  changed_.notify_all();
}

std::vector<TokenLogprob> TopLogprobs(const torch::Tensor& logprobs, int k) {
  const auto* lp = logprobs.data_ptr<double>();
  const int64_t v = logprobs.numel();
  std::vector<int64_t> order(static_cast<size_t>(v));
  std::iota(order.begin(), order.end(), 0);
  const int64_t top = std::min<int64_t>(k, v);
  std::partial_sort(order.begin(), order.begin() + top, order.end(), [&](int64_t a, int64_t b) {
    return lp[a] > lp[b] || (lp[a] == lp[b] && a < b);
  });
  std::vector<TokenLogprob> out;
  for (int64_t i = 0; i < top; ++i) out.push_back({static_cast<uint32_t>(order[i]), lp[order[i]]});
  return out;
}

namespace {

// Remembered block keys (8 bytes and a node each); past this the set starts afresh.
constexpr size_t kMaxSeenBlocks = 1 << 18;

}  // namespace

PrefixCache::PrefixCache(int64_t budget_bytes, int64_t block_tokens)
    : budget_(budget_bytes), block_(std::max<int64_t>(block_tokens, 1)) {}

std::vector<uint64_t> PrefixCache::Keys(const std::vector<uint32_t>& tokens, int64_t blocks) const {
  std::vector<uint64_t> keys;
  uint64_t h = 0x6c6f6f6d70726566ULL;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t i = b * block_; i < (b + 1) * block_; ++i)
      h = trainer::SplitMix64(h ^ tokens[static_cast<size_t>(i)]);
    keys.push_back(h);
  }
  return keys;
}

std::shared_ptr<const PrefixEntry> PrefixCache::Lookup(const std::vector<uint32_t>& tokens,
                                                       const std::vector<uint64_t>& keys,
                                                       int score_k) {
  for (size_t d = keys.size(); d > 0; --d) {
    auto it = map_.find(keys[d - 1]);
    if (it == map_.end()) continue;
    const PrefixEntry& e = *it->second.entry;
    const size_t n = d * static_cast<size_t>(block_);
    if (e.tokens.size() != n || !std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin()))
      continue;  // a hash collision
    if (score_k >= 0 && e.score_k < score_k) continue;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return it->second.entry;
  }
  return nullptr;
}

void PrefixCache::Erase(std::unordered_map<uint64_t, Slot>::iterator it) {
  bytes_ -= it->second.entry->bytes;
  --entries_;
  lru_.erase(it->second.lru);
  map_.erase(it);
}

bool PrefixCache::Insert(uint64_t key, std::shared_ptr<PrefixEntry> entry) {
  if (entry->bytes > budget_) return false;
  auto old = map_.find(key);
  if (old != map_.end() &&
      (old->second.entry.use_count() > 1 || old->second.entry->score_k >= entry->score_k))
    return false;
  int64_t held = 0;  // bytes of entries in use: they stay
  for (const auto& kv : map_)
    if (kv.second.entry.use_count() > 1) held += kv.second.entry->bytes;
  if (held + entry->bytes > budget_) return false;
  if (old != map_.end()) Erase(old);  // the new one also holds scores: it replaces the old
  // Least recently used first.
  auto victim = lru_.end();
  while (bytes_ + entry->bytes > budget_ && victim != lru_.begin()) {
    --victim;
    auto it = map_.find(*victim);
    if (it->second.entry.use_count() > 1) continue;
    const auto after = std::next(victim);  // stays valid when `victim` is erased
    Erase(it);
    ++evictions_;
    victim = after;
  }
  bytes_ += entry->bytes;
  ++entries_;
  lru_.push_front(key);
  map_[key] = Slot{std::move(entry), lru_.begin()};
  return true;
}

int64_t PrefixCache::SeenDepth(const std::vector<uint64_t>& keys) const {
  for (size_t d = keys.size(); d > 0; --d)
    if (seen_.count(keys[d - 1])) return static_cast<int64_t>(d);
  return 0;
}

void PrefixCache::Remember(const std::vector<uint64_t>& keys) {
  if (seen_.size() + keys.size() > kMaxSeenBlocks) seen_.clear();
  seen_.insert(keys.begin(), keys.end());
}

void DeclareServeMetrics(metrics::Registry& r) {
  const std::vector<double> latency = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                       0.25,  0.5,    1,     2.5,  5,     10,   30};
  r.DeclareCounter("loom_serve_requests_total", "HTTP requests answered, by route and status code");
  r.DeclareHistogram("loom_serve_request_seconds", "HTTP request handling time, by route", latency);
  r.DeclareHistogram("loom_serve_queue_seconds",
                     "Time a sequence waited for a batch row (queued to prefill)", latency);
  r.DeclareHistogram("loom_serve_time_to_first_token_seconds",
                     "Time from queueing a sequence to its first generated token", latency);
  r.DeclareHistogram("loom_serve_inter_token_seconds",
                     "Time between consecutive generated tokens of a sequence", latency);
  r.DeclareCounter("loom_serve_prompt_tokens_total", "Prompt tokens of the sequences admitted");
  r.DeclareCounter("loom_serve_prefill_tokens_total",
                   "Token positions prefill computed (rows x padded length; a prompt shared by "
                   "the n choices of a request counts once)");
  r.DeclareCounter("loom_serve_generated_tokens_total", "Tokens generated (sampled)");
  r.DeclareGauge("loom_serve_kv_cache_bytes", "Bytes the running batch's KV caches hold");
  r.DeclareGauge("loom_serve_batch_size", "Rows in the running decode batch");
  r.DeclareGauge("loom_serve_queued_sequences", "Sequences waiting for a batch row");
  r.DeclareCounter("loom_serve_cancelled_total", "Sequences dropped because their client left");
  r.DeclareCounter("loom_serve_prefix_cache_hit_tokens_total",
                   "Prompt tokens whose KV came from the prefix cache (per prefilled prompt)");
  r.DeclareCounter(
      "loom_serve_prefix_cache_miss_tokens_total",
      "Prompt tokens prefill computed with the prefix cache on (per prefilled prompt)");
  r.DeclareCounter("loom_serve_prefix_cache_evictions_total",
                   "Prefix cache entries evicted to stay under the budget");
  r.DeclareGauge("loom_serve_prefix_cache_bytes", "Bytes the prefix cache's entries hold");
  r.DeclareGauge("loom_serve_prefix_cache_entries", "Prefixes the prefix cache holds");
}

Engine::Engine(std::shared_ptr<trainer::Transformer> model, Decoder decode, EngineOptions options,
               metrics::Registry* registry)
    : model_(std::move(model)), decode_(std::move(decode)), options_(options), registry_(registry) {
  device_ = model_->parameters().front().device();
  state_ = model_->NewDecodeState();
  if (registry_) DeclareServeMetrics(*registry_);
  if (options_.prefix_cache_bytes > 0) {
    prefix_cache_ =
        std::make_unique<PrefixCache>(options_.prefix_cache_bytes, options_.prefix_block);
  }
  thread_ = std::thread([this] { Loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

absl::Status Engine::Submit(const std::vector<std::shared_ptr<Sequence>>& sequences) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return absl::UnavailableError("the server is shutting down");
    DropCancelledQueued();  // a departed client's sequences hold no queue slots
    if (queue_.size() + sequences.size() > static_cast<size_t>(options_.max_queue)) {
      return absl::ResourceExhaustedError(absl::StrCat("the queue is full (", queue_.size(), " of ",
                                                       options_.max_queue,
                                                       " sequences waiting); retry later"));
    }
    for (const auto& s : sequences) queue_.push_back(s);
    if (registry_)
      registry_->Set("loom_serve_queued_sequences", static_cast<double>(queue_.size()));
  }
  wake_.notify_all();
  return absl::OkStatus();
}

int64_t Engine::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(queue_.size());
}

void Engine::Loop() {
  torch::NoGradGuard no_grad;  // thread-local: this thread runs every forward
  while (true) {
    std::vector<std::shared_ptr<Sequence>> joining;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || !queue_.empty() || !rows_.empty(); });
      if (stop_) break;
      DropCancelledQueued();
      joining = TakeAdmissible();
      if (registry_)
        registry_->Set("loom_serve_queued_sequences", static_cast<double>(queue_.size()));
    }
    try {
      if (!joining.empty()) Prefill(joining);
      DropFinishedRows();
      if (!rows_.empty()) {
        DecodeStep();
        DropFinishedRows();
      }
    } catch (const std::exception& e) {  // LibTorch reports through exceptions
      FailAll(e.what());
    }
    if (registry_) {
      registry_->Set("loom_serve_batch_size", static_cast<double>(rows_.size()));
      registry_->Set("loom_serve_kv_cache_bytes", static_cast<double>(state_.bytes()));
    }
  }
  const absl::Status down = absl::UnavailableError("the server shut down");
  for (Row& row : rows_) row.seq->Finish("cancelled", "", down);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : queue_) s->Finish("cancelled", "", down);
}

// Called with mu_ held, every engine step: a client that leaves while queued is answered at
// once, not when the queue reaches its sequence (which behind long rows can take minutes).
void Engine::DropCancelledQueued() {
  std::deque<std::shared_ptr<Sequence>> kept;
  for (auto& s : queue_) {
    if (!s->cancelled()) {
      kept.push_back(std::move(s));
      continue;
    }
    s->Finish("cancelled", "");
    if (registry_) registry_->Increment("loom_serve_cancelled_total");
  }
  queue_ = std::move(kept);
}

// Called with mu_ held: queued sequences that fit in the batch.
std::vector<std::shared_ptr<Sequence>> Engine::TakeAdmissible() {
  std::vector<std::shared_ptr<Sequence>> joining;
  while (!queue_.empty() &&
         rows_.size() + joining.size() < static_cast<size_t>(options_.max_batch)) {
    joining.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  return joining;
}

namespace {

// The rows prefilled for `joining`: with sharing one per distinct prompt (the first sequence
// that has it), else one per sequence; `row_of` maps each joining sequence to its row.
std::vector<int64_t> PrefillRows(const std::vector<std::shared_ptr<Sequence>>& joining, bool share,
                                 std::vector<int64_t>* row_of) {
  std::vector<int64_t> rows;
  std::map<std::vector<uint32_t>, int64_t> seen;
  for (size_t i = 0; i < joining.size(); ++i) {
    const auto [it, fresh] =
        seen.try_emplace(joining[i]->params().prompt, static_cast<int64_t>(rows.size()));
    row_of->push_back(fresh || !share ? static_cast<int64_t>(rows.size()) : it->second);
    if (fresh || !share) rows.push_back(static_cast<int64_t>(i));
  }
  return rows;
}

}  // namespace

void Engine::Prefill(const std::vector<std::shared_ptr<Sequence>>& joining) {
  if (prefix_cache_) return PrefillCached(joining);
  std::vector<int64_t> row_of;
  const std::vector<int64_t> rows = PrefillRows(joining, options_.share_prefill, &row_of);
  const int64_t b = static_cast<int64_t>(rows.size());
  int64_t longest = 0;
  for (const auto& s : joining)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(s->params().prompt.size()));
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  // Left padding in the pad segment; real tokens at their own positions 0..n-1.
  torch::Tensor tokens = torch::zeros({b, longest}, i64),
                positions = torch::zeros({b, longest}, i64);
  torch::Tensor segments = torch::full({b, longest}, AttentionCache::kPadSegment, i64);
  auto tok = tokens.accessor<int64_t, 2>(), pos = positions.accessor<int64_t, 2>(),
       seg = segments.accessor<int64_t, 2>();
  for (int64_t r = 0; r < b; ++r) {
    const auto& prompt = joining[static_cast<size_t>(rows[r])]->params().prompt;
    const int64_t n = static_cast<int64_t>(prompt.size()), pad = longest - n;
    for (int64_t i = 0; i < n; ++i) {
      tok[r][pad + i] = prompt[i];
      pos[r][pad + i] = i;
      seg[r][pad + i] = 1;
    }
  }
  trainer::DecodeState fresh = model_->NewDecodeState();
  trainer::ModelInputs in{tokens.to(device_), positions.to(device_), {}, {}, segments.to(device_)};
  torch::Tensor logits = model_->ForwardCached(in, fresh);  // [B, longest, V]
  prefill_tokens_ += b * longest;
  if (registry_)
    registry_->Increment("loom_serve_prefill_tokens_total", static_cast<double>(b * longest));
  torch::Tensor last = logits.select(1, longest - 1).to(torch::kCPU, torch::kFloat64).contiguous();
  std::vector<int64_t> keep;  // a prefill row per joining row that goes on; repeats fork it
  for (size_t j = 0; j < joining.size(); ++j) {
    const int64_t r = row_of[j];
    if (StartRow(joining[j], last[r], logits[r], longest)) keep.push_back(r);
  }
  if (keep.empty()) return;
  std::vector<int64_t> identity(static_cast<size_t>(b));
  std::iota(identity.begin(), identity.end(), 0);
  if (keep != identity) fresh.KeepRows(torch::tensor(keep, torch::kInt64));
  state_.AppendRows(fresh);
}

struct Engine::PromptRow {
  const std::vector<uint32_t>* prompt = nullptr;
  int score_k = -1;                         // the most top alternatives a sequence scores with
  std::vector<uint64_t> keys;               // of its whole blocks before the last token
  std::shared_ptr<const PrefixEntry> base;  // the deepest cached prefix, then the extended one
  int64_t target = 0;                       // blocks to snapshot first (0: none)
  int64_t hit = 0;                          // prompt tokens computed for it by no one else
  Chunk rest;                               // the tokens after `base`
  torch::Tensor last;                       // float64 CPU [vocab]
  std::vector<TokenOutput> scores;
};

void Engine::PrefillCached(const std::vector<std::shared_ptr<Sequence>>& joining) {
  std::vector<int64_t> row_of;
  const std::vector<int64_t> firsts = PrefillRows(joining, options_.share_prefill, &row_of);
  std::vector<PromptRow> rows(firsts.size());
  for (size_t r = 0; r < rows.size(); ++r)
    rows[r].prompt = &joining[static_cast<size_t>(firsts[r])]->params().prompt;
  for (size_t j = 0; j < joining.size(); ++j) {
    const SequenceParams& p = joining[j]->params();
    int& k = rows[static_cast<size_t>(row_of[j])].score_k;
    if (p.prompt_logprobs) k = std::max(k, std::max(p.logprobs, 0));
  }
  PlanPrefix(rows);
  ExtendPrefixes(rows);
  std::vector<Chunk*> rest;
  for (PromptRow& row : rows) {
    const int64_t from = row.base ? static_cast<int64_t>(row.base->tokens.size()) : 0;
    row.rest = Chunk{row.prompt,  row.base, from, static_cast<int64_t>(row.prompt->size()),
                     row.score_k, {},       {}};
    rest.push_back(&row.rest);
  }
  RunChunks(rest);
  int64_t hit = 0, miss = 0;
  for (PromptRow& row : rows) {
    row.last = ChunkResults(row.rest, row.score_k >= 0 ? &row.scores : nullptr);
    row.rest.base.reset();  // the entry is no longer in use
    hit += row.hit;
    miss += static_cast<int64_t>(row.prompt->size()) - row.hit;
  }
  prefix_hit_tokens_ += hit;
  prefix_miss_tokens_ += miss;
  if (registry_) {
    registry_->Increment("loom_serve_prefix_cache_hit_tokens_total", static_cast<double>(hit));
    registry_->Increment("loom_serve_prefix_cache_miss_tokens_total", static_cast<double>(miss));
  }
  RecordPrefixMetrics();  // before any sequence of this admission can finish
  std::vector<const trainer::DecodeState*> going_on;
  for (size_t j = 0; j < joining.size(); ++j) {
    PromptRow& row = rows[static_cast<size_t>(row_of[j])];
    const SequenceParams& p = joining[j]->params();
    if (p.prompt_logprobs) {
      std::vector<TokenOutput> scores = row.scores;
      const size_t k = static_cast<size_t>(std::max(p.logprobs, 0));
      for (TokenOutput& t : scores) t.top.resize(std::min(t.top.size(), k));
      joining[j]->SetPromptScores(std::move(scores));
    }
    if (StartRow(joining[j], row.last, {}, 0)) going_on.push_back(&row.rest.state);
  }
  if (!going_on.empty()) state_.AppendRows(MergeRows(going_on));
}

// Pairwise, so each row is copied log2(R) times rather than up to R by appending one at a time.
trainer::DecodeState Engine::MergeRows(const std::vector<const trainer::DecodeState*>& rows) const {
  std::vector<trainer::DecodeState> parts;
  for (const trainer::DecodeState* s : rows) {
    parts.push_back(model_->NewDecodeState());
    parts.back().AppendRows(*s);
  }
  while (parts.size() > 1) {
    std::vector<trainer::DecodeState> next;
    for (size_t i = 0; i < parts.size(); i += 2) {
      if (i + 1 < parts.size()) parts[i].AppendRows(parts[i + 1]);
      next.push_back(std::move(parts[i]));
    }
    parts = std::move(next);
  }
  return parts.empty() ? model_->NewDecodeState() : std::move(parts.front());
}

// Where each prompt starts (the deepest cached prefix) and which prefix to snapshot first: the
// deepest block it shares with another prompt of this admission or an earlier one (the next
// prompt that branches there hits), else all its whole blocks (a prompt sent again hits).
void Engine::PlanPrefix(std::vector<PromptRow>& rows) {
  PrefixCache& cache = *prefix_cache_;
  const int64_t block = cache.block();
  std::unordered_map<uint64_t, int> shared;  // block key -> prompts of this admission with it
  for (PromptRow& row : rows) {
    // The last token is always computed: its logits start the row.
    row.keys = cache.Keys(*row.prompt, (static_cast<int64_t>(row.prompt->size()) - 1) / block);
    for (uint64_t k : row.keys) ++shared[k];
  }
  for (PromptRow& row : rows) {
    row.base = cache.Lookup(*row.prompt, row.keys, row.score_k);
    const int64_t cached = row.base ? static_cast<int64_t>(row.base->tokens.size()) / block : 0;
    const int64_t whole = static_cast<int64_t>(row.keys.size());
    row.hit = cached * block;
    int64_t branch = cache.SeenDepth(row.keys);
    for (int64_t d = whole; d > branch; --d) {
      if (shared[row.keys[static_cast<size_t>(d - 1)]] > 1) {
        branch = d;
        break;
      }
    }
    row.target = branch > cached ? branch : (whole > cached ? whole : 0);
  }
  for (const PromptRow& row : rows) cache.Remember(row.keys);
}

// Computes the planned snapshots (once for the prompts that share one), caches them, and makes
// them the prompts' bases.
void Engine::ExtendPrefixes(std::vector<PromptRow>& rows) {
  const int64_t block = prefix_cache_->block();
  std::vector<Chunk> chunks;
  chunks.reserve(rows.size());  // RunChunks keeps pointers
  std::vector<uint64_t> keys;
  std::vector<int64_t> chunk_of(rows.size(), -1);
  for (size_t r = 0; r < rows.size(); ++r) {
    PromptRow& row = rows[r];
    if (row.target == 0) continue;
    const int64_t from = row.base ? static_cast<int64_t>(row.base->tokens.size()) : 0,
                  to = row.target * block;
    for (size_t c = 0; c < chunks.size() && chunk_of[r] < 0; ++c) {
      const Chunk& other = chunks[c];
      if (other.to == to && other.base == row.base &&
          std::equal(row.prompt->begin(), row.prompt->begin() + to, other.prompt->begin()))
        chunk_of[r] = static_cast<int64_t>(c);
    }
    if (chunk_of[r] >= 0) {  // another prompt computes it
      Chunk& c = chunks[static_cast<size_t>(chunk_of[r])];
      c.score_k = std::max(c.score_k, row.score_k);
      row.hit += to - from;
      continue;
    }
    chunk_of[r] = static_cast<int64_t>(chunks.size());
    chunks.push_back(Chunk{row.prompt, row.base, from, to, row.score_k, {}, {}});
    keys.push_back(row.keys[static_cast<size_t>(row.target - 1)]);
  }
  std::vector<Chunk*> run;
  for (Chunk& c : chunks) run.push_back(&c);
  RunChunks(run);
  std::vector<std::shared_ptr<const PrefixEntry>> made;
  for (size_t c = 0; c < chunks.size(); ++c) {
    auto e = std::make_shared<PrefixEntry>();
    e->tokens.assign(chunks[c].prompt->begin(), chunks[c].prompt->begin() + chunks[c].to);
    e->score_k = chunks[c].score_k;
    e->last = ChunkResults(chunks[c], e->score_k >= 0 ? &e->scores : nullptr);
    e->state = std::move(chunks[c].state);
    e->bytes = e->state.bytes() + e->last.numel() * 8 +
               static_cast<int64_t>(e->tokens.size() * sizeof(uint32_t));
    for (const TokenOutput& t : e->scores)
      e->bytes += static_cast<int64_t>(sizeof(TokenOutput) + t.top.size() * sizeof(TokenLogprob));
    prefix_cache_->Insert(keys[c], e);  // when it does not fit, this admission still uses it
    made.push_back(std::move(e));
  }
  for (size_t r = 0; r < rows.size(); ++r)
    if (chunk_of[r] >= 0) rows[r].base = made[static_cast<size_t>(chunk_of[r])];
}

// One forward per group of chunks with equal start and length, so no row is padded: a
// snapshot holds only real tokens, and windows see the same tokens as an uncached prefill.
void Engine::RunChunks(const std::vector<Chunk*>& chunks) {
  std::map<std::pair<int64_t, int64_t>, std::vector<Chunk*>> groups;
  for (Chunk* c : chunks) groups[{c->from, c->to - c->from}].push_back(c);
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  for (auto& [shape, group] : groups) {
    const int64_t from = shape.first, t = shape.second, g = static_cast<int64_t>(group.size());
    trainer::DecodeState state = model_->NewDecodeState();
    if (from > 0) {
      std::vector<const trainer::DecodeState*> bases;
      for (Chunk* c : group) bases.push_back(&c->base->state);
      state = MergeRows(bases);
      // Own copies (KeepRows copies rows): nothing is ever written through an entry's tensors.
      state.KeepRows(torch::arange(g, i64));
    }
    torch::Tensor tokens = torch::empty({g, t}, i64);
    auto tok = tokens.accessor<int64_t, 2>();
    for (int64_t r = 0; r < g; ++r)
      for (int64_t i = 0; i < t; ++i) tok[r][i] = (*group[r]->prompt)[from + i];
    torch::Tensor positions = torch::arange(from, from + t, i64).unsqueeze(0).repeat({g, 1});
    trainer::ModelInputs in{
        tokens.to(device_), positions.to(device_), {}, {}, torch::ones({g, t}, i64).to(device_)};
    torch::Tensor logits = model_->ForwardCached(in, state);  // [g, t, V]
    prefill_tokens_ += g * t;
    if (registry_)
      registry_->Increment("loom_serve_prefill_tokens_total", static_cast<double>(g * t));
    for (int64_t r = 0; r < g; ++r) {
      Chunk& c = *group[static_cast<size_t>(r)];
      c.logits = logits[r];
      if (g == 1) {
        c.state = std::move(state);
        break;
      }
      c.state = model_->NewDecodeState();
      c.state.AppendRows(state);
      c.state.KeepRows(torch::full({1}, r, i64));
    }
  }
}

torch::Tensor Engine::ChunkResults(const Chunk& c, std::vector<TokenOutput>* out) const {
  const int64_t t = c.to - c.from;
  torch::Tensor cpu =
      (out ? c.logits : c.logits.narrow(0, t - 1, 1)).to(torch::kCPU, torch::kFloat64);
  torch::Tensor last = cpu[cpu.size(0) - 1].contiguous().clone();
  if (!out) return last;
  // Row i of `before` predicts token first + i: the base's last logits, then this chunk's.
  const std::vector<uint32_t>& prompt = *c.prompt;
  int64_t first = c.from;
  torch::Tensor before = cpu.narrow(0, 0, t - 1);
  if (c.base) {
    *out = c.base->scores;
    before = torch::cat({c.base->last.unsqueeze(0), before});
  } else {
    out->push_back(TokenOutput{prompt[0], std::numeric_limits<double>::quiet_NaN(), {}});
    first = 1;
  }
  torch::Tensor lp = torch::log_softmax(before, -1).contiguous();
  for (int64_t i = first; i < c.to; ++i) {
    torch::Tensor row = lp[i - first];
    const uint32_t token = prompt[static_cast<size_t>(i)];
    out->push_back(TokenOutput{token, row[token].item<double>(), TopLogprobs(row, c.score_k)});
  }
  return last;
}

void Engine::RecordPrefixMetrics() {
  if (!registry_) return;
  registry_->Set("loom_serve_prefix_cache_bytes", static_cast<double>(prefix_cache_->bytes()));
  registry_->Set("loom_serve_prefix_cache_entries", static_cast<double>(prefix_cache_->entries()));
  const int64_t evictions = prefix_cache_->evictions();
  if (evictions > reported_evictions_) {
    registry_->Increment("loom_serve_prefix_cache_evictions_total",
                         static_cast<double>(evictions - reported_evictions_));
  }
  reported_evictions_ = evictions;
}

bool Engine::StartRow(const std::shared_ptr<Sequence>& s, const torch::Tensor& last,
                      const torch::Tensor& all, int64_t longest) {
  const SequenceParams& p = s->params();
  const int64_t n = static_cast<int64_t>(p.prompt.size());
  if (registry_) {
    registry_->Observe("loom_serve_queue_seconds", SecondsSince(s->queued_at));
    registry_->Increment("loom_serve_prompt_tokens_total", static_cast<double>(n));
  }
  if (p.prompt_logprobs && all.defined()) ScorePrompt(*s, all.narrow(0, longest - n, n));
  if (p.max_tokens == 0) {
    s->Finish("length", "");
    return false;
  }
  Row row{s, trainer::SequenceRng(p.seed), {}, n, {}, 0, Clock::now()};
  row.sampling.greedy = p.greedy;
  row.sampling.temperature = p.temperature;
  row.sampling.top_p = p.top_p;
  if (!Emit(row, last)) return false;
  rows_.push_back(std::move(row));
  return true;
}

void Engine::ScorePrompt(Sequence& s, const torch::Tensor& logits) {
  const SequenceParams& p = s.params();
  torch::Tensor lp = torch::log_softmax(logits.to(torch::kCPU, torch::kFloat64), -1).contiguous();
  std::vector<TokenOutput> scores(p.prompt.size());
  scores[0].token = p.prompt[0];
  scores[0].logprob = std::numeric_limits<double>::quiet_NaN();
  for (size_t i = 1; i < p.prompt.size(); ++i) {
    torch::Tensor row = lp[static_cast<int64_t>(i) - 1];
    scores[i].token = p.prompt[i];
    scores[i].logprob = row[p.prompt[i]].item<double>();
    scores[i].top = TopLogprobs(row, std::max(p.logprobs, 0));
  }
  s.SetPromptScores(std::move(scores));
}

void Engine::DecodeStep() {
  const int64_t b = static_cast<int64_t>(rows_.size());
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  torch::Tensor tokens = torch::empty({b, 1}, i64), positions = torch::empty({b, 1}, i64);
  auto tok = tokens.accessor<int64_t, 2>(), pos = positions.accessor<int64_t, 2>();
  for (int64_t r = 0; r < b; ++r) {
    tok[r][0] = rows_[r].next;
    pos[r][0] = rows_[r].length;
  }
  trainer::ModelInputs in{
      tokens.to(device_), positions.to(device_), {}, {}, torch::ones({b, 1}, i64).to(device_)};
  // One device-to-host copy per step; rows are sampled on the host.
  torch::Tensor logits =
      model_->ForwardCached(in, state_).select(1, 0).to(torch::kCPU, torch::kFloat64).contiguous();
  for (int64_t r = 0; r < b; ++r) {
    Row& row = rows_[r];
    ++row.length;
    if (!row.seq->cancelled()) Emit(row, logits[r]);
  }
}

bool Engine::Emit(Row& row, const torch::Tensor& logits) {
  const SequenceParams& p = row.seq->params();
  const uint32_t t = trainer::SampleToken(logits, row.sampling, row.rng);
  if (registry_) {
    registry_->Increment("loom_serve_generated_tokens_total");
    if (row.generated.empty()) {
      registry_->Observe("loom_serve_time_to_first_token_seconds",
                         SecondsSince(row.seq->queued_at));
    } else {
      registry_->Observe("loom_serve_inter_token_seconds", SecondsSince(row.last_token));
    }
  }
  row.last_token = Clock::now();
  if (std::find(p.stop_tokens.begin(), p.stop_tokens.end(), t) != p.stop_tokens.end()) {
    row.seq->Finish("stop", decode_(row.generated));
    return false;
  }
  TokenOutput out;
  out.token = t;
  if (p.logprobs >= 0) {
    torch::Tensor lp = torch::log_softmax(logits, -1).contiguous();
    out.logprob = lp[t].item<double>();
    out.top = TopLogprobs(lp, p.logprobs);
  }
  row.generated.push_back(t);
  row.seq->Push(std::move(out));
  if (!p.stop.empty()) {
    std::string text = decode_(row.generated);
    size_t cut = std::string::npos;
    for (const std::string& s : p.stop) cut = std::min(cut, text.find(s));
    if (cut != std::string::npos) {
      row.seq->Finish("stop", text.substr(0, cut));
      return false;
    }
  }
  const bool context_full = row.length >= model_->config().max_seq_len();
  if (static_cast<int64_t>(row.generated.size()) >= p.max_tokens || context_full) {
    row.seq->Finish("length", decode_(row.generated));
    return false;
  }
  row.next = t;
  return true;
}

void Engine::DropFinishedRows() {
  std::vector<int64_t> keep;
  std::vector<Row> kept;
  for (size_t r = 0; r < rows_.size(); ++r) {
    Row& row = rows_[r];
    if (row.seq->cancelled() && !row.seq->done()) {
      row.seq->Finish("cancelled", decode_(row.generated));
      if (registry_) registry_->Increment("loom_serve_cancelled_total");
    }
    if (row.seq->done()) continue;
    keep.push_back(static_cast<int64_t>(r));
    kept.push_back(std::move(row));
  }
  if (keep.size() < rows_.size()) state_.KeepRows(torch::tensor(keep, torch::kInt64));
  rows_ = std::move(kept);
}

void Engine::FailAll(const std::string& why) {
  const absl::Status error = absl::InternalError(absl::StrCat("generation failed: ", why));
  for (Row& row : rows_) row.seq->Finish("error", "", error);
  rows_.clear();
  state_ = model_->NewDecodeState();
}

}  // namespace loom::serve
