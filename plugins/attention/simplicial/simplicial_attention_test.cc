// The simplicial plugin against a float64 reference written here with plain loops over (i, j, l)
// (tolerance 1e-10 absolute): causal, windowed, encoder, packed, RoPE on, both kernels, every
// query chunking of the reference path; finite-difference gradients of input and weights for
// both kernels; the fused kernel against the reference path on shapes with several tiles,
// non-contiguous segments, float64 and float32, outputs and gradients; cached decoding (token by
// token, in chunks, rows kept and appended) equal to forward (1e-12); option errors naming the
// option; FLOPs and parameters by hand.
#include "plugins/attention/simplicial/simplicial_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "plugins/attention/common/attention_test_util.h"
#include "plugins/attention/mha/mha_attention.h"
#include "plugins/attention/simplicial/simplicial_cpu.h"

namespace loom::attention::simplicial_test {
namespace {

constexpr auto f64 = torch::kFloat64;
constexpr int64_t kD = 4;  // head width of every case (even, for RoPE)
using Vec = std::vector<double>;

// Head `head` (width d) of projection (w, bias) for token n of row b, RoPE at position n if
// theta > 0 (rotate-half pairing, frequency theta^(-2i/d)).
Vec Project(const torch::Tensor& w, const torch::Tensor& bias, const torch::Tensor& x, int64_t b,
            int64_t n, int64_t head, int64_t d, double theta) {
  auto W = w.accessor<double, 2>();
  auto X = x.accessor<double, 3>();
  Vec out(d, 0.0);
  for (int64_t e = 0; e < d; ++e) {
    if (bias.defined()) out[e] = bias[head * d + e].item<double>();
    for (int64_t c = 0; c < x.size(2); ++c) out[e] += W[head * d + e][c] * X[b][n][c];
  }
  if (theta <= 0) return out;
  Vec r(d);
  for (int64_t i = 0; i < d / 2; ++i) {
    const double a = n * std::pow(theta, -2.0 * i / static_cast<double>(d));
    r[i] = out[i] * std::cos(a) - out[i + d / 2] * std::sin(a);
    r[i + d / 2] = out[i + d / 2] * std::cos(a) + out[i] * std::sin(a);
  }
  return r;
}

struct Case {
  bool causal;
  int64_t w1, w2;  // effective windows, 0 = unbounded
  double theta;    // > 0: RoPE on q, k, k'
  bool segments;
  int64_t chunk;  // query_chunk option
  std::string kernel = "auto";
};

bool Sees(const Case& c, const std::vector<int64_t>& seg, int64_t i, int64_t j, int64_t w) {
  return (!c.causal || j <= i) && (w == 0 || std::abs(i - j) < w) && seg[i] == seg[j];
}

// One head's output for query i of row b: the definition, loops over (j, l).
Vec ReferenceHead(SimplicialAttention& m, const Case& c, const torch::Tensor& x,
                  const std::vector<int64_t>& seg, int64_t b, int64_t i, int64_t h) {
  auto p = m.named_parameters();
  auto bias = [&](const char* name) {
    return p.contains(std::string(name) + ".bias") ? p[std::string(name) + ".bias"]
                                                   : torch::Tensor();
  };
  auto proj = [&](const char* name, int64_t n, double theta) {
    return Project(p[std::string(name) + ".weight"], bias(name), x, b, n, h, kD, theta);
  };
  const int64_t n = x.size(1);
  const Vec q = proj("q_proj", i, c.theta);
  std::vector<std::vector<double>> logits(n, Vec(n, 0.0));
  double mx = -1e300, z = 0;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t l = 0; l < n; ++l) {
      if (!Sees(c, seg, i, j, c.w1) || !Sees(c, seg, i, l, c.w2)) continue;
      const Vec k = proj("k_proj", j, c.theta), k2 = proj("k2_proj", l, c.theta);
      double a = 0;
      for (int64_t t = 0; t < kD; ++t) a += q[t] * k[t] * k2[t];
      logits[j][l] = a / std::sqrt(static_cast<double>(kD));
      mx = std::max(mx, logits[j][l]);
    }
  }
  Vec o(kD, 0.0);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t l = 0; l < n; ++l) {
      if (!Sees(c, seg, i, j, c.w1) || !Sees(c, seg, i, l, c.w2)) continue;
      const double e = std::exp(logits[j][l] - mx);
      z += e;
      const Vec v = proj("v_proj", j, 0), v2 = proj("v2_proj", l, 0);
      for (int64_t t = 0; t < kD; ++t) o[t] += e * v[t] * v2[t];
    }
  }
  for (double& t : o) t /= z;
  return o;
}

std::vector<LoomOption>* CaseOptions(const Case& c) {
  std::vector<std::pair<std::string, std::string>> kv = {{"window1", std::to_string(c.w1)},
                                                         {"window2", std::to_string(c.w2)},
                                                         {"query_chunk", std::to_string(c.chunk)},
                                                         {"kernel", c.kernel}};
  if (c.theta > 0) kv.push_back({"rope", "rotate"});
  return KeptOptions(kv);
}

TEST(SimplicialAttention, MatchesLoopReference) {
  std::vector<Case> cases = {{true, 0, 0, 0, false, 0},  {true, 0, 0, 0, false, 1},
                             {true, 3, 2, 0, false, 2},  {true, 2, 4, 100, true, 0},
                             {false, 0, 0, 0, false, 4}, {false, 2, 3, 0, true, 1},
                             {true, 4, 0, 100, true, 3}, {false, 0, 2, 100, false, 0}};
  for (Case& c : cases) c.kernel = "reference";
  for (const bool causal : {true, false}) {  // the fused kernel (chunking does not apply)
    cases.push_back({causal, 0, 0, 0, false, 0, "fused"});
    cases.push_back({causal, 3, 2, 0, true, 0, "fused"});
    cases.push_back({causal, 2, 0, 100, true, 0, "fused"});
  }
  for (const Case& c : cases) {
    torch::manual_seed(7);
    LoomAttentionSpecV1 spec = TestSpec(8, 2, kD, c.causal, 0, c.theta, CaseOptions(c));
    spec.bias = c.segments ? 1 : 0;  // biases in the packed cases
    SimplicialAttention m(spec);
    m.to(f64);
    const int64_t B = 2, N = 7, H = 2, d = kD;
    torch::Tensor x = torch::randn({B, N, 8}, f64);
    std::vector<int64_t> seg = {1, 1, 1, 2, 2, 2, 2};
    AttentionInputs in{torch::arange(N), {}};
    if (c.segments) in.segments = torch::tensor(seg).unsqueeze(0).expand({B, N});
    if (!c.segments) seg.assign(N, 1);
    torch::Tensor y = m.forward(x, in);
    torch::Tensor concat = torch::zeros({B, N, H * d}, f64);
    auto C = concat.accessor<double, 3>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < N; ++i)
        for (int64_t h = 0; h < H; ++h) {
          Vec o = ReferenceHead(m, c, x, seg, b, i, h);
          for (int64_t t = 0; t < d; ++t) C[b][i][h * d + t] = o[t];
        }
    torch::Tensor expected = torch::linear(concat, m.named_parameters()["o_proj.weight"],
                                           m.named_parameters().contains("o_proj.bias")
                                               ? m.named_parameters()["o_proj.bias"]
                                               : torch::Tensor());
    EXPECT_LT((y - expected).abs().max().item<double>(), 1e-10)
        << c.kernel << " causal " << c.causal << " w " << c.w1 << "," << c.w2 << " chunk "
        << c.chunk;
  }
}

// Autograd gradients of a fixed projection of the output equal central differences (step
// 1e-6, tolerance 1e-7) for every weight entry and every input entry, windowed, packed and (the
// reference path) chunked, with both kernels.
TEST(SimplicialAttention, GradientsMatchFiniteDifferences) {
  for (const char* kernel : {"reference", "fused"}) {
    torch::manual_seed(8);
    auto* o =
        KeptOptions({{"window1", "3"}, {"window2", "2"}, {"query_chunk", "2"}, {"kernel", kernel}});
    SimplicialAttention m(TestSpec(4, 2, 2, true, 0, 0, o));
    m.to(f64);
    torch::Tensor x = torch::randn({1, 6, 4}, f64).requires_grad_();
    torch::Tensor probe = torch::randn({1, 6, 4}, f64);
    AttentionInputs in{torch::arange(6), torch::tensor({{1, 1, 1, 2, 2, 1}}, torch::kInt64)};
    auto loss = [&] { return (m.forward(x, in) * probe).sum(); };
    const int64_t checked = ExpectGradientsMatchFiniteDifferences(
        m, loss, [](const std::string&) { return 1; }, 1e-7);
    EXPECT_EQ(checked, m.NumParameters()) << kernel;
    x.mutable_grad() = torch::Tensor();
    loss().backward();
    EXPECT_EQ(ExpectGradientMatchesFiniteDifferences(x, x.grad().clone(), loss, 1, 1e-7, "x"),
              x.numel())
        << kernel;
  }
}

// The output and every gradient (input and weights) of a module made from `spec` with m's weights.
std::vector<torch::Tensor> OutputAndGradients(SimplicialAttention& m,
                                              const LoomAttentionSpecV1& spec,
                                              const torch::Tensor& x0, const AttentionInputs& in,
                                              const torch::Tensor& probe) {
  SimplicialAttention copy(spec);
  copy.to(x0.scalar_type());
  {
    torch::NoGradGuard no_grad;
    auto src = m.named_parameters();
    for (auto& p : copy.named_parameters()) p.value().copy_(src[p.key()]);
  }
  torch::Tensor x = x0.clone().requires_grad_();
  torch::Tensor y = copy.forward(x, in);
  (y * probe).sum().backward();
  std::vector<torch::Tensor> out = {y.detach(), x.grad()};
  for (auto& p : copy.named_parameters()) out.push_back(p.value().grad());
  return out;
}

// The fused kernel against the reference path where the fused kernel has several query tiles
// (N 80: tiles of 8 queries unwindowed, 32 windowed), a partial last tile, three batch rows and
// segments of two kinds: ids that recur (0 0 0 1 1 1 2 2 2 0 ...: not contiguous runs) and ragged
// padding as the trainer packs relation batches (1 for a row's first 80, 72 or 48 tokens, 0
// after): float64 within 1e-12 of the largest value, float32 within 2e-5 of it. Two threads give
// the one-thread result bitwise (a task owns a (row, head): no order of accumulation depends on
// the threads).
TEST(SimplicialAttention, FusedKernelEqualsReferencePath) {
  enum Segments { kNone, kRecurring, kPadded };
  struct Shape {
    bool causal;
    int64_t w1, w2;
    Segments segments;
  };
  for (const Shape s :
       {Shape{true, 0, 0, kNone}, Shape{false, 0, 0, kRecurring}, Shape{false, 0, 0, kPadded},
        Shape{true, 5, 3, kRecurring}, Shape{false, 4, 0, kPadded}, Shape{true, 0, 7, kPadded}}) {
    for (const auto type : {torch::kFloat64, torch::kFloat32}) {
      torch::manual_seed(21);
      auto spec = [&](const char* kernel) {
        return TestSpec(12, 3, 8, s.causal, 0, 0,
                        KeptOptions({{"window1", std::to_string(s.w1)},
                                     {"window2", std::to_string(s.w2)},
                                     {"kernel", kernel}}));
      };
      SimplicialAttention m(spec("auto"));
      m.to(type);
      const int64_t B = 3, N = 80;
      torch::Tensor x = torch::randn({B, N, 12}, type), probe = torch::randn({B, N, 12}, type);
      AttentionInputs in{torch::arange(N), {}};
      if (s.segments == kRecurring) in.segments = (torch::arange(N) / 3 % 3).repeat({B, 1});
      if (s.segments == kPadded) {
        in.segments = torch::zeros({B, N}, torch::kInt64);
        for (int64_t b = 0; b < B; ++b) in.segments[b].narrow(0, 0, N - b * b * 8).fill_(1);
      }
      const auto fused = OutputAndGradients(m, spec("fused"), x, in, probe);
      const auto reference = OutputAndGradients(m, spec("reference"), x, in, probe);
      ASSERT_EQ(fused.size(), reference.size());
      const double tol = type == torch::kFloat64 ? 1e-12 : 2e-5;
      for (size_t i = 0; i < fused.size(); ++i) {
        const double scale = std::max(1.0, reference[i].abs().max().item<double>());
        EXPECT_LT((fused[i] - reference[i]).abs().max().item<double>(), tol * scale)
            << "tensor " << i << " causal " << s.causal << " w " << s.w1 << "," << s.w2
            << " segments " << static_cast<int>(s.segments) << " " << type;
      }
      const int threads = torch::get_num_threads();
      torch::set_num_threads(1);
      const auto one = OutputAndGradients(m, spec("fused"), x, in, probe);
      torch::set_num_threads(2);
      const auto two = OutputAndGradients(m, spec("fused"), x, in, probe);
      torch::set_num_threads(threads);
      for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << i;
    }
  }
}

// The fused kernel refuses what it cannot run, with the reason; the option names its choices.
TEST(SimplicialAttention, FusedKernelRefusesOtherTypes) {
  torch::Tensor q = torch::randn({1, 1, 3, 2}).to(torch::kBFloat16);
  torch::Tensor k = torch::randn({1, 1, 3, 4}).to(torch::kBFloat16);
  try {
    SimplicialCpu(q, k, k, {}, {}, 1.0);
    ADD_FAILURE() << "bfloat16 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("CPU float32 or float64"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(SimplicialCpuSupports(q));
  EXPECT_TRUE(SimplicialCpuSupports(q.to(torch::kFloat32)));
  EXPECT_EQ(SimplicialAttention(TestSpec(8, 2, kD, true, 0, 0)).kernel(), "auto");
}

// Decoding through the cache, token by token and in uneven chunks, gives forward()'s rows.
TEST(SimplicialAttention, CachedDecodingEqualsForward) {
  for (auto [w1, w2, rope] :
       {std::tuple<int, int, bool>{0, 0, false}, {3, 2, true}, {2, 0, false}}) {
    torch::manual_seed(9);
    std::vector<std::pair<std::string, std::string>> kv = {{"window1", std::to_string(w1)},
                                                           {"window2", std::to_string(w2)}};
    if (rope) kv.push_back({"rope", "rotate"});
    SimplicialAttention m(TestSpec(8, 2, kD, true, 0, 100, KeptOptions(kv)));
    m.to(f64);
    torch::NoGradGuard no_grad;
    const int64_t n = 9;
    torch::Tensor x = torch::randn({2, n, 8}, f64);
    torch::Tensor expected = m.forward(x, {torch::arange(n), {}});
    for (const std::vector<int64_t>& chunks :
         {std::vector<int64_t>(n, 1), std::vector<int64_t>{4, 1, 3, 1}}) {
      auto cache = m.NewCache();
      std::vector<torch::Tensor> parts;
      int64_t at = 0;
      for (int64_t c : chunks) {
        parts.push_back(
            m.ForwardCached(x.narrow(1, at, c), {torch::arange(at, at + c), {}}, *cache));
        at += c;
        EXPECT_EQ(cache->tokens(), at);
      }
      EXPECT_LT((torch::cat(parts, 1) - expected).abs().max().item<double>(), 1e-12)
          << "w " << w1 << "," << w2 << " chunks " << chunks.size();
    }
  }
}

// The automatic chunking (here 300 queries split so a chunk stays under 2^22 elements) gives what
// one chunk gives.
TEST(SimplicialAttention, AutoChunksEqualOneChunk) {
  torch::manual_seed(12);
  SimplicialAttention one(TestSpec(8, 1, kD, true, 0, 0,
                                   KeptOptions({{"query_chunk", "300"}, {"kernel", "reference"}})));
  SimplicialAttention autosized(
      TestSpec(8, 1, kD, true, 0, 0, KeptOptions({{"kernel", "reference"}})));
  one.to(f64);
  autosized.to(f64);
  torch::NoGradGuard no_grad;
  auto src = one.named_parameters();
  for (auto& p : autosized.named_parameters()) p.value().copy_(src[p.key()]);
  torch::Tensor x = torch::randn({1, 300, 8}, f64);
  AttentionInputs in{torch::arange(300), {}};
  EXPECT_LT((one.forward(x, in) - autosized.forward(x, in)).abs().max().item<double>(), 1e-12);
}

// Feeds x [B, T, D] at positions from..from+T-1 (per row) with segments 1 through `cache`.
torch::Tensor Step(SimplicialAttention& m, AttentionCache& cache, const torch::Tensor& x,
                   const torch::Tensor& positions) {
  return m.ForwardCached(x, {positions, torch::ones({x.size(0), x.size(1)}, torch::kInt64)}, cache);
}

// Rows kept (one repeated) and rows appended (the shorter cache left-padded) continue exactly as
// each row decoded alone; another layer's cache is refused.
TEST(SimplicialAttention, KeepRowsAndAppendRowsContinueEachRow) {
  torch::manual_seed(10);
  SimplicialAttention m(TestSpec(8, 2, kD, true, 0, 0, KeptOptions({{"window1", "4"}})));
  m.to(f64);
  torch::NoGradGuard no_grad;
  torch::Tensor a = torch::randn({1, 7, 8}, f64), b = torch::randn({1, 5, 8}, f64);
  auto last = [&](const torch::Tensor& seq) {
    return m.forward(seq, {torch::arange(seq.size(1)), {}}).select(1, seq.size(1) - 1);
  };
  auto ca = m.NewCache(), cb = m.NewCache();
  Step(m, *ca, torch::cat({a.narrow(1, 0, 4), b.narrow(1, 0, 4), a.narrow(1, 0, 4)}, 0),
       torch::arange(4));
  ca->KeepRows(torch::tensor({2, 1, 1}, torch::kInt64));  // rows: a, b, b (a copy)
  EXPECT_EQ(ca->tokens(), 4);
  torch::Tensor next = torch::cat({a.narrow(1, 4, 1), b.narrow(1, 4, 1), b.narrow(1, 4, 1)}, 0);
  torch::Tensor y = Step(m, *ca, next, torch::arange(4, 5));
  EXPECT_LT((y[0] - last(a.narrow(1, 0, 5))).abs().max().item<double>(), 1e-12);
  EXPECT_LT((y[1] - last(b)).abs().max().item<double>(), 1e-12);
  EXPECT_LT((y[2] - last(b)).abs().max().item<double>(), 1e-12);
  Step(m, *cb, b.narrow(1, 0, 2), torch::arange(2));  // a 2-token cache appended to 5 tokens
  ca->KeepRows(torch::tensor({0}, torch::kInt64));
  ca->AppendRows(*cb);
  EXPECT_EQ(ca->tokens(), 5);
  torch::Tensor pos = torch::tensor({5, 2}, torch::kInt64).view({2, 1});
  y = Step(m, *ca, torch::cat({a.narrow(1, 5, 1), b.narrow(1, 2, 1)}, 0), pos);
  EXPECT_LT((y[0] - last(a.narrow(1, 0, 6))).abs().max().item<double>(), 1e-12);
  EXPECT_LT((y[1] - last(b.narrow(1, 0, 3))).abs().max().item<double>(), 1e-12);
  MultiHeadAttention mha(TestSpec(8, 2, kD, true, 0, 0), "mha", false);
  auto other = mha.NewCache();
  EXPECT_THROW(ca->AppendRows(*other), c10::Error);
  EXPECT_THROW(m.ForwardCached(next, {torch::arange(1), {}}, *other), c10::Error);
}

std::string CreateError(std::vector<std::pair<std::string, std::string>> options,
                        double theta = 0) {
  try {
    SimplicialAttention m(TestSpec(8, 2, kD, true, 0, theta, KeptOptions(std::move(options))));
  } catch (const InvalidAttentionSpec& e) {
    return e.what();
  }
  return "";
}

TEST(SimplicialAttention, BadOptionsNameTheOption) {
  auto has = [](const std::string& error, const std::string& part) {
    return error.find(part) != std::string::npos;
  };
  EXPECT_TRUE(has(CreateError({{"window1", "-1"}}), "simplicial: options.window1: -1 is out"));
  EXPECT_TRUE(has(CreateError({{"window2", "two"}}), "options.window2: 'two' is not an integer"));
  EXPECT_TRUE(has(CreateError({{"windw1", "2"}}), "options.windw1: unknown option"));
  EXPECT_TRUE(has(CreateError({{"scale", "0"}}), "options.scale"));
  EXPECT_TRUE(has(CreateError({{"query_chunk", "-3"}}), "options.query_chunk"));
  EXPECT_TRUE(has(CreateError({{"rope", "yes"}}), "options.rope: 'yes' is not one of"));
  EXPECT_TRUE(has(CreateError({{"kernel", "cuda"}}), "options.kernel: 'cuda' is not one of"));
  EXPECT_TRUE(has(CreateError({{"rope", "rotate"}}), "options.rope: 'rotate' needs rope_theta"));
  EXPECT_EQ(CreateError({{"rope", "rotate"}, {"window1", "3"}, {"scale", "0.25"}}, 100), "");
}

// The layer's spec window bounds both key sets; the options can only tighten it.
TEST(SimplicialAttention, SpecWindowBoundsBothKeySets) {
  auto windows = [](int64_t spec, const char* w1, const char* w2) {
    SimplicialAttention m(
        TestSpec(8, 2, kD, true, spec, 0, KeptOptions({{"window1", w1}, {"window2", w2}})));
    return std::make_pair(m.window1(), m.window2());
  };
  EXPECT_EQ(windows(0, "3", "0"), std::make_pair(int64_t{3}, int64_t{0}));
  EXPECT_EQ(windows(4, "0", "2"), std::make_pair(int64_t{4}, int64_t{2}));
  EXPECT_EQ(windows(4, "6", "5"), std::make_pair(int64_t{4}, int64_t{4}));
}

// By hand for D = 4, H = 1, d = 2: projections 2·6·D·H·d = 96; per query and head, 4d per
// allowed (j, l) pair plus 3d per allowed j.
TEST(SimplicialAttention, FlopsMatchAHandCount) {
  SimplicialAttention global(TestSpec(4, 1, 2, true, 0, 0));
  // Context 3, causal: pairs 1 + 4 + 9 = 14, keys 1 + 2 + 3 = 6.
  EXPECT_DOUBLE_EQ(global.ForwardFlopsPerToken(3), 96 + (8.0 * 14 + 6.0 * 6) / 3);
  SimplicialAttention windowed(
      TestSpec(4, 1, 2, true, 0, 0, KeptOptions({{"window1", "2"}, {"window2", "1"}})));
  // Context 4: j counts 1, 2, 2, 2 and l counts 1, 1, 1, 1: pairs 7, keys 7.
  EXPECT_DOUBLE_EQ(windowed.ForwardFlopsPerToken(4), 96 + (8.0 * 7 + 6.0 * 7) / 4);
  SimplicialAttention encoder(TestSpec(4, 1, 2, false, 0, 0, KeptOptions({{"window1", "2"}})));
  // Context 3, encoder: j counts 2, 3, 2 and l counts 3, 3, 3: pairs 21, keys 7.
  EXPECT_DOUBLE_EQ(encoder.ForwardFlopsPerToken(3), 96 + (8.0 * 21 + 6.0 * 7) / 3);
}

// Five projections of [H·d, D] (q, k, k', v, v') and o_proj [D, H·d]: 6·D·H·d weights, plus
// 5·H·d + D biases when bias is set.
TEST(SimplicialAttention, ParameterCount) {
  LoomAttentionSpecV1 spec = TestSpec(8, 2, kD, true, 0, 0);
  EXPECT_EQ(SimplicialAttention(spec).NumParameters(), 6 * 8 * 2 * kD);
  spec.bias = 1;
  EXPECT_EQ(SimplicialAttention(spec).NumParameters(), 6 * 8 * 2 * kD + 5 * 2 * kD + 8);
  auto names = SimplicialAttention(spec).named_parameters().keys();
  EXPECT_EQ(names[0], "q_proj.weight");  // the shared projections first, as in every plugin
  EXPECT_EQ(names[names.size() - 2], "v2_proj.weight");
}

}  // namespace
}  // namespace loom::attention::simplicial_test
