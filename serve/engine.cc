#include "serve/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

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
}

Engine::Engine(std::shared_ptr<trainer::Transformer> model, Decoder decode, EngineOptions options,
               metrics::Registry* registry)
    : model_(std::move(model)), decode_(std::move(decode)), options_(options), registry_(registry) {
  device_ = model_->parameters().front().device();
  state_ = model_->NewDecodeState();
  if (registry_) DeclareServeMetrics(*registry_);
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

bool Engine::StartRow(const std::shared_ptr<Sequence>& s, const torch::Tensor& last,
                      const torch::Tensor& all, int64_t longest) {
  const SequenceParams& p = s->params();
  const int64_t n = static_cast<int64_t>(p.prompt.size());
  if (registry_) {
    registry_->Observe("loom_serve_queue_seconds", SecondsSince(s->queued_at));
    registry_->Increment("loom_serve_prompt_tokens_total", static_cast<double>(n));
  }
  if (p.prompt_logprobs) ScorePrompt(*s, all.narrow(0, longest - n, n));
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
