#include "plugins/attention/common/attention_common.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "cpu_kernels/linear_cpu.h"

namespace loom::attention {

using cpu_kernels::Linear;

PluginOptions::PluginOptions(const LoomAttentionSpecV1& spec, std::string plugin)
    : plugin_(std::move(plugin)) {
  if (spec.num_options > 0 && spec.options == nullptr) {
    throw InvalidAttentionSpec(plugin_ + ": options: null array with num_options > 0");
  }
  for (size_t i = 0; i < spec.num_options; ++i) {
    const LoomOption& o = spec.options[i];
    if (o.key == nullptr || o.value == nullptr) {
      throw InvalidAttentionSpec(plugin_ + ": options[" + std::to_string(i) +
                                 "]: null key or value");
    }
    if (!values_.emplace(o.key, o.value).second) {
      throw InvalidAttentionSpec(plugin_ + ": options." + o.key + ": given twice");
    }
  }
}

const std::string* PluginOptions::Find(const std::string& key) {
  used_.insert(key);
  auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

void PluginOptions::Fail(const std::string& key, const std::string& why) const {
  throw InvalidAttentionSpec(plugin_ + ": options." + key + ": " + why);
}

int64_t PluginOptions::GetInt(const std::string& key, int64_t fallback, int64_t min, int64_t max) {
  const std::string* text = Find(key);
  if (text == nullptr) return fallback;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text->c_str(), &end, 10);
  if (text->empty() || *end != '\0' || errno == ERANGE)
    Fail(key, "'" + *text + "' is not an integer");
  if (v < min || v > max) {
    Fail(key, std::to_string(v) + " is out of range [" + std::to_string(min) + ", " +
                  std::to_string(max) + "]");
  }
  return v;
}

double PluginOptions::GetDouble(const std::string& key, double fallback, double min, double max) {
  const std::string* text = Find(key);
  if (text == nullptr) return fallback;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(text->c_str(), &end);
  if (text->empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) {
    Fail(key, "'" + *text + "' is not a finite number");
  }
  if (v < min || v > max) {
    std::ostringstream os;
    os << v << " is out of range [" << min << ", " << max << "]";
    Fail(key, os.str());
  }
  return v;
}

bool PluginOptions::GetBool(const std::string& key, bool fallback) {
  const std::string* text = Find(key);
  if (text == nullptr) return fallback;
  if (*text == "true" || *text == "1") return true;
  if (*text == "false" || *text == "0") return false;
  Fail(key, "'" + *text + "' is not a boolean (true or false)");
}

std::string PluginOptions::GetChoice(const std::string& key, const std::string& fallback,
                                     std::initializer_list<const char*> choices) {
  const std::string* text = Find(key);
  if (text == nullptr) return fallback;
  std::string allowed;
  for (const char* c : choices) {
    if (*text == c) return *text;
    allowed += allowed.empty() ? c : std::string(" | ") + c;
  }
  Fail(key, "'" + *text + "' is not one of " + allowed);
}

void PluginOptions::Finish() const {
  for (const auto& [key, value] : values_) {
    if (used_.count(key) == 0) {
      throw InvalidAttentionSpec(plugin_ + ": options." + key + ": unknown option");
    }
  }
}

void ValidateSpec(const LoomAttentionSpecV1& spec, const std::string& plugin) {
  auto fail = [&](const std::string& field, const std::string& why) {
    throw InvalidAttentionSpec(plugin + ": " + field + ": " + why);
  };
  constexpr int64_t kMaxDim = int64_t{1} << 20;
  if (spec.d_model <= 0 || spec.d_model > kMaxDim) fail("d_model", "must be in [1, 2^20]");
  if (spec.n_heads <= 0 || spec.n_heads > 4096) fail("n_heads", "must be in [1, 4096]");
  if (spec.head_dim <= 0 || spec.head_dim > 65536) fail("head_dim", "must be in [1, 65536]");
  if (spec.causal != 0 && spec.causal != 1) fail("causal", "must be 0 or 1");
  if (spec.bias != 0 && spec.bias != 1) fail("bias", "must be 0 or 1");
  if (spec.window < 0) fail("window", "must be >= 0 (0 = global)");
  if (!std::isfinite(spec.rope_theta) || spec.rope_theta < 0) {
    fail("rope_theta", "must be a finite number >= 0 (0 = no RoPE)");
  }
  if (spec.rope_theta > 0 && spec.head_dim % 2 != 0) {
    fail("head_dim", "must be even when RoPE is on (rope_theta > 0)");
  }
  if (spec.n_layers <= 0) fail("n_layers", "must be >= 1");
  if (spec.layer_index < 0 || spec.layer_index >= spec.n_layers) {
    fail("layer_index", "must be in [0, n_layers)");
  }
}

Projections RegisterProjections(torch::nn::Module& module, const LoomAttentionSpecV1& spec) {
  const int64_t inner = spec.n_heads * spec.head_dim;
  auto linear = [&](const char* name, int64_t in, int64_t out) {
    return module.register_module(
        name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(spec.bias != 0)));
  };
  Projections p;
  p.q = linear("q_proj", spec.d_model, inner);
  p.k = linear("k_proj", spec.d_model, inner);
  p.v = linear("v_proj", spec.d_model, inner);
  p.o = linear("o_proj", inner, spec.d_model);
  return p;
}

ProjectedAttention::ProjectedAttention(const LoomAttentionSpecV1& spec, const std::string& plugin)
    : plugin_(plugin) {
  ValidateSpec(spec, plugin);
  d_model_ = spec.d_model;
  n_heads_ = spec.n_heads;
  head_dim_ = spec.head_dim;
  window_ = spec.window;
  causal_ = spec.causal != 0;
  rope_theta_ = spec.rope_theta;
  proj_ = RegisterProjections(*this, spec);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> ProjectedAttention::QueriesKeysValues(
    const torch::Tensor& x, const AttentionInputs& inputs, int64_t v_heads, bool rotate) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == d_model_, plugin_, ": x must be [B, N, ", d_model_,
              "], got ", x.sizes());
  const int64_t b = x.size(0), n = x.size(1);
  auto split = [&](const torch::Tensor& t, int64_t heads) {
    return t.view({b, n, heads, n_heads_ * head_dim_ / heads}).transpose(1, 2);
  };
  torch::Tensor q = split(Linear(proj_.q, x), n_heads_), k = split(Linear(proj_.k, x), n_heads_);
  if (rope_theta_ > 0 && rotate) {
    torch::Tensor pos = CheckedPositions(inputs.positions, b, n, x.device());
    q = ApplyRope(q, pos, rope_theta_);
    k = ApplyRope(k, pos, rope_theta_);
  }
  return {q, k, split(Linear(proj_.v, x), v_heads)};
}

std::unique_ptr<AttentionCache> ProjectedAttention::NewCache() const {
  return std::make_unique<KeyValueCache>(window_);
}

torch::Tensor ProjectedAttention::ForwardCached(const torch::Tensor& x,
                                                const AttentionInputs& inputs,
                                                AttentionCache& cache) {
  TORCH_CHECK(causal_, plugin_, ": incremental decoding needs a causal (decoder) layer");
  auto* kv = dynamic_cast<KeyValueCache*>(&cache);
  TORCH_CHECK(kv != nullptr, plugin_, ": the cache was not made by this layer's NewCache()");
  auto [q, k, v] = QueriesKeysValues(x, inputs, ValueHeads());
  KeyValueCache::View view = kv->Append(k, v, inputs.segments);
  return Output(Attend(q, view.k, view.v, view.allowed));
}

torch::Tensor CheckedSegments(const torch::Tensor& segments, int64_t batch, int64_t length,
                              const torch::Device& device) {
  if (!segments.defined()) return segments;
  torch::Tensor s = segments.to(device, torch::kInt64);
  if (s.dim() == 1) s = s.unsqueeze(0);
  TORCH_CHECK(s.dim() == 2 && (s.size(0) == 1 || s.size(0) == batch) && s.size(1) == length,
              "attention: segments must be [B, N] = [", batch, ", ", length, "], got ",
              segments.sizes());
  return s.expand({batch, length});
}

void CheckCacheContinues(const char* who, int64_t cached_rows, bool cached_segments, int64_t batch,
                         bool segments) {
  TORCH_CHECK(cached_rows == batch, who, ": batch of ", batch, " rows, the cache holds ",
              cached_rows);
  TORCH_CHECK(segments == cached_segments, who, ": give segments on every call or on none");
}

torch::Tensor SameSegment(const torch::Tensor& query_segments, const torch::Tensor& key_segments) {
  return (query_segments.unsqueeze(2) == key_segments.unsqueeze(1)).unsqueeze(1);
}

int64_t DefinedBytes(std::initializer_list<const torch::Tensor*> tensors) {
  int64_t total = 0;
  for (const torch::Tensor* t : tensors)
    if (t->defined()) total += t->numel() * static_cast<int64_t>(t->element_size());
  return total;
}

int64_t KeyValueCache::bytes() const { return DefinedBytes({&k_, &v_, &segments_}); }

void KeepCacheRows(std::initializer_list<torch::Tensor*> tensors, const torch::Tensor& rows) {
  for (torch::Tensor* t : tensors) {
    if (t->defined()) *t = t->index_select(0, rows.to(t->device(), torch::kInt64));
  }
}

int64_t LeadingPadTokens(const torch::Tensor& segments) {
  if (!segments.defined() || segments.size(0) == 0) return 0;
  torch::Tensor real = (segments != AttentionCache::kPadSegment).any(0).to(torch::kCPU);
  const auto* r = real.data_ptr<bool>();
  int64_t n = 0;
  while (n < real.numel() && !r[n]) ++n;
  return n;
}

namespace {

torch::Tensor PadFront(const torch::Tensor& t, int64_t dim, int64_t count, int64_t fill) {
  if (count == 0) return t;
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes[static_cast<size_t>(dim)] = count;
  return torch::cat({torch::full(sizes, fill, t.options()), t}, dim);
}

}  // namespace

void AppendCacheRows(const std::vector<CacheTensor>& tensors, torch::Tensor& my_segments,
                     const torch::Tensor& their_segments, int64_t my_kept, int64_t their_kept) {
  TORCH_CHECK(!tensors.empty() && tensors.front().mine->defined(), "AppendRows: empty cache");
  const int64_t kept = std::max(my_kept, their_kept);
  const int64_t my_rows = tensors.front().mine->size(0),
                their_rows = tensors.front().theirs.size(0);
  for (const CacheTensor& c : tensors) {
    TORCH_CHECK(c.mine->defined() == c.theirs.defined(),
                "AppendRows: the caches come from differently configured layers");
    if (!c.mine->defined()) continue;
    *c.mine = torch::cat({PadFront(*c.mine, c.token_dim, (kept - my_kept) * c.per_token, 0),
                          PadFront(c.theirs, c.token_dim, (kept - their_kept) * c.per_token, 0)},
                         0);
  }
  if (!my_segments.defined() && !their_segments.defined() && my_kept == their_kept) return;
  auto segments = [&](const torch::Tensor& s, int64_t rows, int64_t length) {
    torch::Tensor all =
        s.defined() ? s
                    : torch::ones({rows, length}, torch::TensorOptions()
                                                      .dtype(torch::kInt64)
                                                      .device(tensors.front().mine->device()));
    return PadFront(all, 1, kept - length, AttentionCache::kPadSegment);
  };
  my_segments = torch::cat(
      {segments(my_segments, my_rows, my_kept), segments(their_segments, their_rows, their_kept)},
      0);
}

void KeyValueCache::KeepRows(const torch::Tensor& rows) {
  if (rows.numel() == 0) {
    *this = KeyValueCache(window_);
    return;
  }
  KeepCacheRows({&k_, &v_, &segments_}, rows);
  const int64_t drop = LeadingPadTokens(segments_);
  if (drop == 0) return;
  const int64_t kept = k_.size(2) - drop;
  k_ = k_.narrow(2, drop, kept);
  v_ = v_.narrow(2, drop, kept);
  segments_ = segments_.narrow(1, drop, kept);
  tokens_ -= drop;
}

void KeyValueCache::AppendRows(const AttentionCache& base) {
  const auto* other = dynamic_cast<const KeyValueCache*>(&base);
  TORCH_CHECK(other != nullptr && other->window_ == window_,
              "attention cache: AppendRows needs a cache made by the same layer");
  if (other->tokens_ == 0) return;
  if (tokens_ == 0) {
    *this = *other;
    return;
  }
  AppendCacheRows({{&k_, other->k_, 2, 1}, {&v_, other->v_, 2, 1}}, segments_, other->segments_,
                  k_.size(2), other->k_.size(2));
  tokens_ = std::max(tokens_, other->tokens_);
}

KeyValueCache::View KeyValueCache::Append(const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& segments) {
  const int64_t b = k.size(0), t = k.size(2);
  torch::Tensor seg = CheckedSegments(segments, b, t, k.device());
  if (tokens_ > 0) {
    CheckCacheContinues("attention cache", k_.size(0), segments_.defined(), b, seg.defined());
  }
  View view;
  view.k = tokens_ > 0 ? torch::cat({k_, k}, 2) : k;
  view.v = tokens_ > 0 ? torch::cat({v_, v}, 2) : v;
  torch::Tensor all_seg = seg.defined() && tokens_ > 0 ? torch::cat({segments_, seg}, 1) : seg;
  const int64_t length = view.k.size(2), first = tokens_ + t - length;  // index of key 0
  auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(k.device());
  torch::Tensor qi = torch::arange(tokens_, tokens_ + t, i64).unsqueeze(1);
  torch::Tensor ki = torch::arange(first, first + length, i64).unsqueeze(0);
  torch::Tensor allowed = ki <= qi;  // causal
  if (window_ > 0) allowed = allowed & (qi - ki < window_);
  allowed = allowed.view({1, 1, t, length});
  if (all_seg.defined()) allowed = allowed & SameSegment(seg, all_seg);
  view.allowed = allowed;
  tokens_ += t;
  // Keep what later queries can still see: everything, or the last window - 1 tokens.
  const int64_t keep = window_ > 0 ? std::min(length, window_ - 1) : length;
  k_ = view.k.narrow(2, length - keep, keep);
  v_ = view.v.narrow(2, length - keep, keep);
  if (all_seg.defined()) segments_ = all_seg.narrow(1, length - keep, keep);
  if (window_ > 0) {  // own the kept slice, so the full tensors can be freed
    k_ = k_.contiguous().clone();
    v_ = v_.contiguous().clone();
    if (segments_.defined()) segments_ = segments_.clone();
  }
  return view;
}

torch::Tensor ProjectedAttention::Output(const torch::Tensor& heads) {
  return Linear(
      proj_.o, heads.transpose(1, 2).reshape({heads.size(0), heads.size(2), n_heads_ * head_dim_}));
}

double ProjectedAttention::ProjectionFlopsPerToken() const {
  return 2.0 * 4.0 * static_cast<double>(d_model_) * static_cast<double>(n_heads_ * head_dim_);
}

torch::Tensor AllowedMask(int64_t length, bool causal, int64_t window,
                          const torch::Device& device) {
  auto idx = torch::arange(length, torch::TensorOptions().dtype(torch::kInt64).device(device));
  torch::Tensor diff = idx.unsqueeze(1) - idx.unsqueeze(0);  // q - k
  torch::Tensor allowed =
      torch::ones({length, length}, torch::TensorOptions().dtype(torch::kBool).device(device));
  if (causal) allowed = allowed & (diff >= 0);
  if (window > 0) allowed = allowed & (diff.abs() < window);
  return allowed;
}

torch::Tensor ReferenceAttention(const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const torch::Tensor& allowed,
                                 double scale) {
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (allowed.defined()) {
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  return torch::matmul(torch::softmax(scores, -1), v);
}

double AverageAttendedKeys(int64_t length, bool causal, int64_t window) {
  if (length <= 0) return 0.0;
  const int64_t w = window > 0 ? window : length;
  double total = 0;
  for (int64_t i = 0; i < length; ++i) {
    const int64_t before = std::min(i, w - 1);
    const int64_t after = causal ? 0 : std::min(length - 1 - i, w - 1);
    total += static_cast<double>(before + after + 1);
  }
  return total / static_cast<double>(length);
}

torch::Tensor WithSegments(const torch::Tensor& allowed, const torch::Tensor& segments,
                           int64_t batch, int64_t length, int64_t expand,
                           const torch::Device& device) {
  if (!segments.defined()) return allowed;
  torch::Tensor s = CheckedSegments(segments, batch, length, device);
  if (expand > 1) s = s.repeat_interleave(expand, 1);  // expanded index s -> token s / P
  torch::Tensor same = (s.unsqueeze(2) == s.unsqueeze(1)).unsqueeze(1);  // [B, 1, L', L']
  return allowed.defined() ? same & allowed : same;
}

}  // namespace loom::attention
