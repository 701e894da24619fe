#include "worker/trainer/generate.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <numeric>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace loom::trainer {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

namespace {

double Uniform(std::mt19937_64& rng) {  // 53 random bits, the same on every platform
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

}  // namespace

std::mt19937_64 SequenceRng(uint64_t seed) { return std::mt19937_64(SplitMix64(seed)); }

uint32_t SampleToken(const torch::Tensor& logits, const SamplingOptions& o, std::mt19937_64& rng) {
  torch::Tensor row = logits.detach().to(torch::kCPU, torch::kFloat64).contiguous();
  const auto* l = row.data_ptr<double>();
  const int64_t v = row.numel();
  if (o.greedy) return static_cast<uint32_t>(std::max_element(l, l + v) - l);
  const double max = *std::max_element(l, l + v);
  std::vector<double> p(static_cast<size_t>(v));
  double total = 0;
  for (int64_t i = 0; i < v; ++i) total += p[i] = std::exp((l[i] - max) / o.temperature);
  std::vector<int64_t> order(static_cast<size_t>(v));
  std::iota(order.begin(), order.end(), 0);
  // Descending probability, ties by token id: deterministic.
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
  size_t keep = order.size();
  if (o.top_p < 1.0) {
    double mass = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      mass += p[order[i]] / total;
      if (mass >= o.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (size_t i = 0; i < keep; ++i) kept += p[order[i]];
  const double u = Uniform(rng) * kept;
  double acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[order[i]];
    if (u < acc) return static_cast<uint32_t>(order[i]);
  }
  return static_cast<uint32_t>(order[keep - 1]);
}

namespace {

absl::Status CheckRequests(const Transformer& model, const std::vector<GenerationRequest>& requests,
                           const SamplingOptions& o) {
  if (model.config().mode() != "decoder")
    return absl::InvalidArgumentError("generation needs a decoder model");
  if (o.batch < 1) return absl::InvalidArgumentError("generation: batch must be >= 1");
  if (!o.greedy && !(o.temperature > 0))
    return absl::InvalidArgumentError("generation: temperature must be > 0");
  const int64_t vocab = model.config().vocab_size(), max_len = model.config().max_seq_len();
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& prompt = requests[i].prompt;
    if (prompt.empty()) return absl::InvalidArgumentError(absl::StrCat("prompt ", i, " is empty"));
    if (static_cast<int64_t>(prompt.size()) >= max_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt ", i, " has ", prompt.size(), " tokens; max_seq_len is ", max_len));
    }
    for (uint32_t t : prompt) {
      if (t >= vocab)
        return absl::InvalidArgumentError(
            absl::StrCat("prompt ", i, ": token ", t, " is outside the vocabulary of ", vocab));
    }
  }
  return absl::OkStatus();
}

// One batch of requests being decoded together.
struct DecodeBatch {
  const std::vector<GenerationRequest>* requests = nullptr;
  size_t first = 0;
  int64_t rows = 0, longest = 0;
  std::vector<int64_t> length;  // each prompt's length
  std::vector<std::mt19937_64> rng;
  std::vector<bool> done;
  bool padded = false;  // prompts of different lengths: segment ids mask the pads
  torch::Device device = torch::kCPU;
};

// Which requests of [first, last) are prefilled: with sharing, the first of each distinct
// prompt; `row_of` maps every row of the batch to its prefill row.
struct PrefillPlan {
  std::vector<size_t> prefilled;
  std::vector<int64_t> row_of;
  bool forked() const { return prefilled.size() < row_of.size(); }
};

PrefillPlan PlanPrefill(const std::vector<GenerationRequest>& requests, size_t first, size_t last,
                        bool share) {
  PrefillPlan plan;
  std::map<std::vector<uint32_t>, int64_t> seen;
  for (size_t i = first; i < last; ++i) {
    const auto [it, fresh] =
        seen.try_emplace(requests[i].prompt, static_cast<int64_t>(plan.prefilled.size()));
    if (fresh || !share) {
      plan.row_of.push_back(static_cast<int64_t>(plan.prefilled.size()));
      plan.prefilled.push_back(i);
    } else {
      plan.row_of.push_back(it->second);
    }
  }
  return plan;
}

// Every row's length, random stream and state for requests [first, last).
void StartRows(DecodeBatch& batch, size_t last) {
  const auto& requests = *batch.requests;
  batch.rows = static_cast<int64_t>(last - batch.first);
  for (size_t i = batch.first; i < last; ++i) {
    const int64_t n = static_cast<int64_t>(requests[i].prompt.size());
    batch.longest = std::max(batch.longest, n);
    batch.length.push_back(n);
    batch.rng.push_back(SequenceRng(requests[i].seed));
  }
  for (int64_t n : batch.length) batch.padded |= n < batch.longest;
  batch.done.assign(static_cast<size_t>(batch.rows), false);
}

// The prompts of the requests `prefilled`, left-padded to the batch's longest: real tokens at
// the right end, pads in segment 0 with position 0 (the same layout with or without sharing).
ModelInputs PromptInputs(const DecodeBatch& batch, const std::vector<size_t>& prefilled,
                         uint32_t pad_token) {
  const auto& requests = *batch.requests;
  const int64_t b = static_cast<int64_t>(prefilled.size());
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  torch::Tensor tokens = torch::full({b, batch.longest}, static_cast<int64_t>(pad_token), i64);
  torch::Tensor positions = torch::zeros({b, batch.longest}, i64);
  torch::Tensor segments = torch::zeros({b, batch.longest}, i64);
  auto tok = tokens.accessor<int64_t, 2>(), pos = positions.accessor<int64_t, 2>(),
       seg = segments.accessor<int64_t, 2>();
  for (int64_t r = 0; r < b; ++r) {
    const auto& prompt = requests[prefilled[static_cast<size_t>(r)]].prompt;
    const int64_t n = static_cast<int64_t>(prompt.size()), pad = batch.longest - n;
    for (int64_t i = 0; i < n; ++i) {
      tok[r][pad + i] = static_cast<int64_t>(prompt[i]);
      pos[r][pad + i] = i;
      seg[r][pad + i] = 1;
    }
  }
  ModelInputs in;
  in.tokens = tokens.to(batch.device);
  in.positions = positions.to(batch.device);
  if (batch.padded) in.segments = segments.to(batch.device);
  return in;
}

// Samples every unfinished row's next token from `logits` ([rows, vocab]); returns the inputs of
// the next decode step, or nullopt when every row has finished.
std::optional<ModelInputs> SampleStep(DecodeBatch& batch, const torch::Tensor& logits, int64_t step,
                                      const SamplingOptions& o, const TokenDecoder& decode,
                                      Generation* out, GenerationStats* stats) {
  const int64_t b = batch.rows;
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  torch::Tensor next = torch::full({b, 1}, static_cast<int64_t>(o.pad), i64);
  torch::Tensor next_pos = torch::zeros({b, 1}, i64);
  auto next_tok = next.accessor<int64_t, 2>(), next_p = next_pos.accessor<int64_t, 2>();
  // One device-to-host copy per step; rows are sampled on the host.
  const torch::Tensor host_logits = logits.to(torch::kCPU, torch::kFloat64).contiguous();
  bool any = false;
  for (int64_t r = 0; r < b; ++r) {
    next_p[r][0] = batch.length[r] + step;
    if (batch.done[r]) continue;
    Generation& g = out[r];
    const uint32_t t = SampleToken(host_logits[r], o, batch.rng[r]);
    ++stats->generated_tokens;
    if (std::find(o.stop_tokens.begin(), o.stop_tokens.end(), t) != o.stop_tokens.end()) {
      g.finish = "stop_token";
      batch.done[r] = true;
      continue;
    }
    g.tokens.push_back(t);
    next_tok[r][0] = static_cast<int64_t>(t);
    if (!o.stop.empty()) {
      g.text = decode(g.tokens);
      for (const std::string& s : o.stop) {
        if (g.text.find(s) != std::string::npos) {
          g.finish = "stop_string";
          batch.done[r] = true;
        }
      }
    }
    any |= !batch.done[r];
  }
  if (!any) return std::nullopt;
  ModelInputs in;
  in.tokens = next.to(batch.device);
  in.positions = next_pos.to(batch.device);
  if (batch.padded) in.segments = torch::ones({b, 1}, i64).to(batch.device);
  return in;
}

// The final text; a stop string cuts it at the earliest one, dropping its tokens' text.
void Finish(Generation& g, const SamplingOptions& o, const TokenDecoder& decode) {
  if (g.finish.empty()) g.finish = "length";
  g.text = decode(g.tokens);
  if (g.finish != "stop_string") return;
  size_t cut = g.text.size();
  for (const std::string& s : o.stop) cut = std::min(cut, g.text.find(s));
  g.text.resize(cut);
}

void GenerateBatch(Transformer& model, DecodeBatch& batch, size_t last, const SamplingOptions& o,
                   const TokenDecoder& decode, Generation* out, GenerationStats* stats) {
  DecodeState state = model.NewDecodeState();
  StartRows(batch, last);
  const PrefillPlan plan = PlanPrefill(*batch.requests, batch.first, last, o.share_prefill);
  torch::Tensor logits = model.ForwardCached(PromptInputs(batch, plan.prefilled, o.pad), state)
                             .select(1, batch.longest - 1);
  stats->prefill_tokens += static_cast<int64_t>(plan.prefilled.size()) * batch.longest;
  if (plan.forked()) {  // one cache row per request from here on: decoding is unchanged
    const torch::Tensor rows = torch::tensor(plan.row_of, torch::kInt64).to(batch.device);
    state.KeepRows(rows);
    logits = logits.index_select(0, rows);
  }
  const int64_t budget = std::min(o.max_new_tokens, model.config().max_seq_len() - batch.longest);
  for (int64_t step = 0; step < budget; ++step) {
    std::optional<ModelInputs> next = SampleStep(batch, logits, step, o, decode, out, stats);
    if (!next) break;
    logits = model.ForwardCached(*next, state).select(1, 0);
    stats->peak_cache_bytes = std::max(stats->peak_cache_bytes, state.bytes());
  }
  for (int64_t r = 0; r < batch.rows; ++r) Finish(out[r], o, decode);
  stats->sequences += batch.rows;
}

}  // namespace

absl::StatusOr<std::vector<Generation>> Generate(Transformer& model,
                                                 const std::vector<GenerationRequest>& requests,
                                                 const SamplingOptions& o,
                                                 const TokenDecoder& decode,
                                                 GenerationStats* stats) {
  LOOM_RETURN_IF_ERROR(CheckRequests(model, requests, o));
  const auto start_time = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  const torch::Device device = model.parameters().front().device();
  std::vector<Generation> out(requests.size());
  GenerationStats local;
  try {
    for (size_t first = 0; first < requests.size(); first += static_cast<size_t>(o.batch)) {
      DecodeBatch batch;
      batch.requests = &requests;
      batch.first = first;
      batch.device = device;
      const size_t last = std::min(requests.size(), first + static_cast<size_t>(o.batch));
      GenerateBatch(model, batch, last, o, decode, out.data() + first, &local);
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("generation: ", e.what()));
  }
  local.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
  if (stats) *stats = local;
  return out;
}

}  // namespace loom::trainer
