#include "plugins/attention/simplicial/simplicial_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_kernels/linear_cpu.h"
#include "plugins/attention/simplicial/simplicial_cpu.h"

namespace loom::attention {

using cpu_kernels::Linear;

namespace {

constexpr int64_t kMaxOption = int64_t{1} << 30;
// Elements an auto-sized chunk's intermediates may hold in all, B·H·chunk·band1·(band2 + 2d):
// the scores and the two [chunk, band1, d] products (32 MiB in float64).
constexpr int64_t kChunkBudget = int64_t{1} << 22;

// The tighter of two windows, 0 meaning unbounded.
int64_t Tighter(int64_t a, int64_t b) { return a == 0 ? b : b == 0 ? a : std::min(a, b); }

// Keys one query may attend to in a sequence of `length` (one of the two key sets).
double AttendedKeys(int64_t i, int64_t length, bool causal, int64_t window) {
  const int64_t w = window > 0 ? window : length;
  const int64_t after = causal ? 0 : std::min(length - 1 - i, w - 1);
  return static_cast<double>(std::min(i, w - 1) + after + 1);
}

// Which queries [qa, qa + count) may see which keys [ka, ka + n) of one set, by sequence index.
torch::Tensor IndexMask(int64_t qa, int64_t count, int64_t ka, int64_t n, bool causal,
                        int64_t window, const torch::Device& device) {
  auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(device);
  torch::Tensor qi = torch::arange(qa, qa + count, i64).unsqueeze(1);
  torch::Tensor ki = torch::arange(ka, ka + n, i64).unsqueeze(0);
  torch::Tensor m = torch::ones({count, n}, i64.dtype(torch::kBool));
  if (causal) m = m & (ki <= qi);
  if (window > 0) m = m & ((qi - ki).abs() < window);
  return m.view({1, 1, count, n});
}

}  // namespace

void SimplicialCache::AppendRows(const AttentionCache& other) {
  TORCH_CHECK(dynamic_cast<const SimplicialCache*>(&other) != nullptr,
              "simplicial cache: AppendRows needs a cache made by the same layer");
  KeyValueCache::AppendRows(other);
}

SimplicialAttention::SimplicialAttention(const LoomAttentionSpecV1& spec)
    : ProjectedAttention(spec, "simplicial") {
  PluginOptions opts(spec, plugin_);
  window1_ = Tighter(window_, opts.GetInt("window1", 0, 0, kMaxOption));
  window2_ = Tighter(window_, opts.GetInt("window2", 0, 0, kMaxOption));
  scale_ = opts.GetDouble("scale", 1.0 / std::sqrt(static_cast<double>(head_dim_)), 1e-12, 1e12);
  rope_ = opts.GetChoice("rope", "none", {"none", "rotate"}) == "rotate";
  kernel_ = opts.GetChoice("kernel", "auto", {"auto", "fused", "reference"});
  query_chunk_ = opts.GetInt("query_chunk", 0, 0, kMaxOption);
  opts.Finish();
  if (rope_ && rope_theta_ <= 0) {
    throw InvalidAttentionSpec("simplicial: options.rope: 'rotate' needs rope_theta > 0");
  }
  // Registered after the four shared projections, so their seeded init matches other plugins.
  auto linear = [&](const char* name) {
    const int64_t inner = n_heads_ * head_dim_;
    return register_module(
        name, torch::nn::Linear(torch::nn::LinearOptions(d_model_, inner).bias(spec.bias != 0)));
  };
  k2 = linear("k2_proj");
  v2 = linear("v2_proj");
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> SimplicialAttention::Project(
    const torch::Tensor& x, const AttentionInputs& inputs) {
  auto [q, k, v] = QueriesKeysValues(x, inputs, n_heads_, rope_);
  const int64_t b = x.size(0), n = x.size(1);
  auto split = [&](const torch::Tensor& t) {
    return t.view({b, n, n_heads_, head_dim_}).transpose(1, 2);
  };
  torch::Tensor k2_heads = split(Linear(k2, x)), v2_heads = split(Linear(v2, x));
  if (rope_) {
    k2_heads =
        ApplyRope(k2_heads, CheckedPositions(inputs.positions, b, n, x.device()), rope_theta_);
  }
  return {q, torch::cat({k, k2_heads}, -1), torch::cat({v, v2_heads}, -1)};
}

torch::Tensor SimplicialAttention::forward(const torch::Tensor& x, const AttentionInputs& inputs) {
  auto [q, k, v] = Project(x, inputs);
  if (UsesFusedKernel(q)) {
    torch::Tensor segments = CheckedSegments(inputs.segments, x.size(0), x.size(1), x.device());
    return Output(SimplicialCpu(q, k, v, segments, {causal_, window1_, window2_}, scale_));
  }
  // Causal and window masks are built per chunk from indices; only segments need a tensor.
  torch::Tensor base =
      WithSegments(torch::Tensor(), inputs.segments, x.size(0), x.size(1), 1, x.device());
  return Output(Simplicial(q, k, v, base, 0, 0));
}

bool SimplicialAttention::UsesFusedKernel(const torch::Tensor& q) const {
  if (kernel_ == "reference") return false;
  const bool supported = SimplicialCpuSupports(q);
  TORCH_CHECK(supported || kernel_ == "auto", plugin_,
              ": options.kernel 'fused' runs on CPU float32 or float64 tensors, got ", q.device(),
              " ", q.scalar_type());
  return supported;
}

std::unique_ptr<AttentionCache> SimplicialAttention::NewCache() const {
  // Later queries never reach back further than the wider window (both must be bounded).
  const int64_t keep = window1_ > 0 && window2_ > 0 ? std::max(window1_, window2_) : 0;
  return std::make_unique<SimplicialCache>(keep);
}

torch::Tensor SimplicialAttention::ForwardCached(const torch::Tensor& x,
                                                 const AttentionInputs& inputs,
                                                 AttentionCache& cache) {
  TORCH_CHECK(causal_, plugin_, ": incremental decoding needs a causal (decoder) layer");
  auto* kv = dynamic_cast<SimplicialCache*>(&cache);
  TORCH_CHECK(kv != nullptr, plugin_, ": the cache was not made by this layer's NewCache()");
  auto [q, k, v] = Project(x, inputs);
  const int64_t q0 = kv->tokens();
  KeyValueCache::View view = kv->Append(k, v, inputs.segments);
  const int64_t k0 = q0 + x.size(1) - view.k.size(2);  // sequence index of the first cached key
  return Output(Simplicial(q, view.k, view.v, view.allowed, q0, k0));
}

torch::Tensor SimplicialAttention::Attend(const torch::Tensor&, const torch::Tensor&,
                                          const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, plugin_, ": Attend() is not used (two key and value sets)");
  return {};
}

torch::Tensor SimplicialAttention::Simplicial(const torch::Tensor& q, const torch::Tensor& k,
                                              const torch::Tensor& v, const torch::Tensor& base,
                                              int64_t q0, int64_t k0) const {
  const int64_t t = q.size(2), l = k.size(2);
  int64_t chunk = query_chunk_;
  if (chunk == 0) {
    // A chunk of c queries reaches c + w - 1 keys of a windowed set: halve c until it fits.
    auto band = [&](int64_t c, int64_t w) { return w > 0 ? std::min(l, c + w - 1) : l; };
    auto elements = [&](int64_t c) {
      return q.size(0) * n_heads_ * c * band(c, window1_) * (band(c, window2_) + 2 * head_dim_);
    };
    for (chunk = std::max<int64_t>(t, 1); chunk > 1 && elements(chunk) > kChunkBudget;) {
      chunk = (chunk + 1) / 2;
    }
  }
  std::vector<torch::Tensor> parts;
  for (int64_t from = 0; from < t; from += chunk) {
    parts.push_back(Chunk(q, k, v, base, q0, k0, from, std::min(chunk, t - from)));
  }
  return parts.size() == 1 ? parts[0] : torch::cat(parts, 2);
}

torch::Tensor SimplicialAttention::Chunk(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const torch::Tensor& base,
                                         int64_t q0, int64_t k0, int64_t from,
                                         int64_t count) const {
  const int64_t d = head_dim_, qa = q0 + from, l = k.size(2);
  // Keys, values and mask of one set (half 0: k, v; 1: k', v') over the band these queries reach.
  auto band = [&](int64_t window, int64_t half) {
    int64_t lo = k0, hi = k0 + l;  // sequence indices, hi exclusive
    if (window > 0) lo = std::max(lo, qa - window + 1);
    if (causal_) hi = std::min(hi, qa + count);
    if (!causal_ && window > 0) hi = std::min(hi, qa + count + window - 1);
    torch::Tensor mask = IndexMask(qa, count, lo, hi - lo, causal_, window, q.device());
    if (base.defined()) mask = mask & base.narrow(2, from, count).narrow(3, lo - k0, hi - lo);
    return std::make_tuple(k.narrow(2, lo - k0, hi - lo).narrow(3, half * d, d),
                           v.narrow(2, lo - k0, hi - lo).narrow(3, half * d, d), mask);
  };
  auto [k1, v1, m1] = band(window1_, 0);
  auto [k2b, v2b, m2] = band(window2_, 1);
  torch::Tensor qc = q.narrow(2, from, count) * scale_;
  // a[b, h, i, j, l] = sum_t q_it k_jt k'_lt: (q_i ⊙ k_j) · k'_l.
  torch::Tensor logits =
      torch::matmul(qc.unsqueeze(3) * k1.unsqueeze(2), k2b.transpose(-2, -1).unsqueeze(2));
  torch::Tensor allowed = m1.unsqueeze(-1) & m2.unsqueeze(-2);  // [B|1, 1, c, n1, n2]
  logits = logits.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  torch::Tensor p = torch::softmax(logits.flatten(-2), -1).view(logits.sizes());
  // o_i = sum_j v_j ⊙ (sum_l P_ijl v'_l): never materialises v_j ⊙ v'_l.
  return (torch::matmul(p, v2b.unsqueeze(2)) * v1.unsqueeze(2)).sum(3);
}

double SimplicialAttention::ForwardFlopsPerToken(int64_t context) const {
  const double d = static_cast<double>(head_dim_), h = static_cast<double>(n_heads_);
  const double projections = 2.0 * 6.0 * static_cast<double>(d_model_) * h * d;
  if (context <= 0) return projections;
  double total = 0;
  for (int64_t i = 0; i < context; ++i) {
    const double n1 = AttendedKeys(i, context, causal_, window1_);
    const double n2 = AttendedKeys(i, context, causal_, window2_);
    // Per allowed pair: (q ⊙ k_j) · k'_l and P · v'_l, a multiply-add per feature each (4d).
    // Per allowed j: q ⊙ k_j (d multiplies) and v_j ⊙ mixed, summed over j (2d).
    total += 4.0 * d * n1 * n2 + 3.0 * d * n1;
  }
  return projections + h * total / static_cast<double>(context);
}

}  // namespace loom::attention
