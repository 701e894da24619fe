// loom-bench-simplicial: one `simplicial` layer's training step (forward, backward) with the fused
// CPU kernel against the same layer on the reference path (LibTorch ops chunked over queries),
// same weights and inputs, in the same run. Prints per shape the median seconds of each, the
// ratio reference / fused, the effective GFLOP/s (3 × the layer's forward FLOPs, the usual
// forward + backward count) and the largest output difference. Defaults: the App. D relation
// shape (docs/results.md): batch 32, 8 heads of 16, d_model 128, encoder (--mask none), N 100.
//
//   loom-bench-simplicial [--n 64,100] [--batch 32] [--heads 8] [--dim 16] [--mask none|causal]
//                         [--window1 0] [--window2 0] [--segments none|ragged] [--threads 1]
//                         [--reps 5]
// --segments ragged: rows of 36, 49, 64, 81 and 100 tokens padded to N, as relation batches
// drawn from a fixed split are (the FLOP count still counts every position).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "base/cpu_process.h"
#include "plugins/attention/bench/bench_flags.h"
#include "plugins/attention/simplicial/simplicial_attention.h"

namespace {

using loom::attention::SimplicialAttention;
// The benchmark's settings; flags as in the header, checked with errors that name the flag.
struct Settings {
  std::vector<int64_t> n;
  int64_t batch = 32, heads = 8, dim = 16, window1 = 0, window2 = 0, threads = 1, reps = 5;
  bool causal = false, ragged = false;
};

constexpr char kUsage[] =
    "usage: loom-bench-simplicial [--n 64,100] [--batch B] [--heads H] [--dim d] "
    "[--mask none|causal] [--window1 W] [--window2 W] [--segments none|ragged] [--threads T] "
    "[--reps R]";

// The settings, or nullopt after printing the usage (exit 0 on --help, else 2 and the error).
std::optional<Settings> ParseSettings(int argc, char** argv, int* exit_code) {
  loom::attention::bench::BenchFlags flags({{"n", "64,100"},
                                            {"batch", "32"},
                                            {"heads", "8"},
                                            {"dim", "16"},
                                            {"mask", "none"},
                                            {"window1", "0"},
                                            {"window2", "0"},
                                            {"segments", "none"},
                                            {"threads", "1"},
                                            {"reps", "5"}});
  Settings s;
  if (flags.Parse(argc, argv)) {
    s.n = flags.IntList("n", 1, 65536);
    s.batch = flags.Int("batch", 1, 4096);
    s.heads = flags.Int("heads", 1, 256);
    s.dim = flags.Int("dim", 1, 1024);
    s.window1 = flags.Int("window1", 0, 1 << 20);
    s.window2 = flags.Int("window2", 0, 1 << 20);
    s.threads = flags.Int("threads", 1, 1024);
    s.reps = flags.Int("reps", 1, 1000);
    s.causal = flags.Choice("mask", {"none", "causal"}) == "causal";
    s.ragged = flags.Choice("segments", {"none", "ragged"}) == "ragged";
  }
  if (flags.Exit("loom-bench-simplicial", kUsage, exit_code)) return std::nullopt;
  return s;
}

// The layer's spec; `options` must outlive the layer (the spec points into it).
LoomAttentionSpecV1 Spec(const Settings& s, std::vector<LoomOption>* options) {
  LoomAttentionSpecV1 spec{};
  spec.n_heads = s.heads;
  spec.head_dim = s.dim;
  spec.d_model = s.heads * s.dim;
  spec.causal = s.causal;
  spec.n_layers = 1;
  spec.options = options->data();
  spec.num_options = options->size();
  return spec;
}

// Median seconds of `reps` timed steps (forward, backward of a fixed projection) after one warm-up;
// the last step's output in *y.
double TimeSteps(SimplicialAttention& layer, const torch::Tensor& x, const torch::Tensor& probe,
                 const loom::AttentionInputs& in, int64_t reps, torch::Tensor* y) {
  std::vector<double> seconds;
  for (int64_t r = 0; r <= reps; ++r) {
    layer.zero_grad();
    const auto start = std::chrono::steady_clock::now();
    torch::Tensor out = layer.forward(x, in);
    (out * probe).sum().backward();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (r > 0) seconds.push_back(s);
    *y = out.detach();
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

// Relation batches as the trainer packs them from a fixed split: row b holds an m×m grid,
// m = 6 + b mod 5 (capped so m² <= n), then padding (segment 0).
torch::Tensor RaggedSegments(int64_t batch, int64_t n) {
  torch::Tensor seg = torch::zeros({batch, n}, torch::kInt64);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t m = 6 + b % 5;
    seg[b].narrow(0, 0, std::min(n, m * m)).fill_(1);
  }
  return seg;
}

void RunShape(const Settings& s, int64_t n) {
  const std::string w1 = std::to_string(s.window1), w2 = std::to_string(s.window2);
  std::vector<LoomOption> fused_options = {
      {"window1", w1.c_str()}, {"window2", w2.c_str()}, {"kernel", "fused"}};
  std::vector<LoomOption> reference_options = fused_options;
  reference_options.back().value = "reference";
  torch::manual_seed(0);
  SimplicialAttention fused(Spec(s, &fused_options));
  SimplicialAttention reference(Spec(s, &reference_options));
  {
    torch::NoGradGuard no_grad;
    auto src = fused.named_parameters();
    for (auto& p : reference.named_parameters()) p.value().copy_(src[p.key()]);
  }
  const int64_t d_model = s.heads * s.dim;
  torch::Tensor x = torch::randn({s.batch, n, d_model}),
                probe = torch::randn({s.batch, n, d_model});
  loom::AttentionInputs in{torch::arange(n), {}};
  if (s.ragged) in.segments = RaggedSegments(s.batch, n);
  torch::Tensor yr, yf;
  const double tr = TimeSteps(reference, x, probe, in, s.reps, &yr);
  const double tf = TimeSteps(fused, x, probe, in, s.reps, &yf);
  const double flops = 3.0 * fused.ForwardFlopsPerToken(n) * static_cast<double>(s.batch * n);
  std::printf("%5lld %7s %6s %4s,%-4s %12.4f %12.4f %8.2fx %10.1f %10.1f %10.2e\n",
              static_cast<long long>(n), s.causal ? "causal" : "none", s.ragged ? "ragged" : "none",
              w1.c_str(), w2.c_str(), tr, tf, tr / tf, flops / tr / 1e9, flops / tf / 1e9,
              (yr - yf).abs().max().item<double>());
}

}  // namespace

int main(int argc, char** argv) {
  loom::SetUpCpuProcess(argv);  // before any matmul or large allocation (base/cpu_process.h)
  int exit_code = 0;
  const std::optional<Settings> settings = ParseSettings(argc, argv, &exit_code);
  if (!settings) return exit_code;
  const Settings& s = *settings;
  torch::set_num_threads(static_cast<int>(s.threads));
  std::printf(
      "loom-bench-simplicial: batch %lld, %lld heads of %lld, %d thread(s), median of %lld "
      "steps\n",
      static_cast<long long>(s.batch), static_cast<long long>(s.heads),
      static_cast<long long>(s.dim), torch::get_num_threads(), static_cast<long long>(s.reps));
  std::printf("%5s %7s %6s %9s %12s %12s %9s %10s %10s %10s\n", "N", "mask", "segs", "w1,w2",
              "reference s", "fused s", "ratio", "ref GF/s", "fused GF/s", "max |dy|");
  for (int64_t n : s.n) RunShape(s, n);
  return 0;
}
