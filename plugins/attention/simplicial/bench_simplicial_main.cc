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
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "base/cpu_process.h"
#include "plugins/attention/simplicial/simplicial_attention.h"

namespace {

using loom::attention::SimplicialAttention;
using Flags = std::map<std::string, std::string>;

std::optional<Flags> ParseFlags(int argc, char** argv, int* exit_code) {
  Flags flags = {{"n", "64,100"},  {"batch", "32"},     {"heads", "8"},   {"dim", "16"},
                 {"mask", "none"}, {"window1", "0"},    {"window2", "0"}, {"threads", "1"},
                 {"reps", "5"},    {"segments", "none"}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a.rfind("--", 0) != 0 || i + 1 >= argc || !flags.count(a.substr(2)) ||
        (a == "--mask" && std::string(argv[i + 1]) != "none" &&
         std::string(argv[i + 1]) != "causal") ||
        (a == "--segments" && std::string(argv[i + 1]) != "none" &&
         std::string(argv[i + 1]) != "ragged")) {
      std::fprintf(stderr,
                   "usage: loom-bench-simplicial [--n 64,100] [--batch B] [--heads H] [--dim d] "
                   "[--mask none|causal] [--window1 W] [--window2 W] [--segments none|ragged] "
                   "[--threads T] [--reps R]\n");
      *exit_code = a == "--help" ? 0 : 2;
      return std::nullopt;
    }
    flags[a.substr(2)] = argv[++i];
  }
  return flags;
}

// The layer's spec; `options` must outlive the layer (the spec points into it).
LoomAttentionSpecV1 Spec(const Flags& f, bool causal, std::vector<LoomOption>* options) {
  LoomAttentionSpecV1 s{};
  s.n_heads = std::stoll(f.at("heads"));
  s.head_dim = std::stoll(f.at("dim"));
  s.d_model = s.n_heads * s.head_dim;
  s.causal = causal;
  s.n_layers = 1;
  s.options = options->data();
  s.num_options = options->size();
  return s;
}

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoll(item));
  return out;
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

void RunShape(const Flags& f, int64_t n) {
  const int64_t batch = std::stoll(f.at("batch")), reps = std::stoll(f.at("reps"));
  const int64_t d_model = std::stoll(f.at("heads")) * std::stoll(f.at("dim"));
  const bool causal = f.at("mask") == "causal";
  std::vector<LoomOption> fused_options = {{"window1", f.at("window1").c_str()},
                                           {"window2", f.at("window2").c_str()},
                                           {"kernel", "fused"}};
  std::vector<LoomOption> reference_options = fused_options;
  reference_options.back().value = "reference";
  torch::manual_seed(0);
  SimplicialAttention fused(Spec(f, causal, &fused_options));
  SimplicialAttention reference(Spec(f, causal, &reference_options));
  {
    torch::NoGradGuard no_grad;
    auto src = fused.named_parameters();
    for (auto& p : reference.named_parameters()) p.value().copy_(src[p.key()]);
  }
  torch::Tensor x = torch::randn({batch, n, d_model}), probe = torch::randn({batch, n, d_model});
  loom::AttentionInputs in{torch::arange(n), {}};
  if (f.at("segments") == "ragged") in.segments = RaggedSegments(batch, n);
  torch::Tensor yr, yf;
  const double tr = TimeSteps(reference, x, probe, in, reps, &yr);
  const double tf = TimeSteps(fused, x, probe, in, reps, &yf);
  const double flops = 3.0 * fused.ForwardFlopsPerToken(n) * static_cast<double>(batch * n);
  std::printf("%5lld %7s %6s %4s,%-4s %12.4f %12.4f %8.2fx %10.1f %10.1f %10.2e\n",
              static_cast<long long>(n), f.at("mask").c_str(), f.at("segments").c_str(),
              f.at("window1").c_str(), f.at("window2").c_str(), tr, tf, tr / tf, flops / tr / 1e9,
              flops / tf / 1e9, (yr - yf).abs().max().item<double>());
}

}  // namespace

int main(int argc, char** argv) {
  loom::SetUpCpuProcess(argv);  // before any matmul or large allocation (base/cpu_process.h)
  int exit_code = 0;
  const std::optional<Flags> flags = ParseFlags(argc, argv, &exit_code);
  if (!flags) return exit_code;
  torch::set_num_threads(static_cast<int>(std::stoll(flags->at("threads"))));
  std::printf("loom-bench-simplicial: batch %s, %s heads of %s, %d thread(s), median of %s steps\n",
              flags->at("batch").c_str(), flags->at("heads").c_str(), flags->at("dim").c_str(),
              torch::get_num_threads(), flags->at("reps").c_str());
  std::printf("%5s %7s %6s %9s %12s %12s %9s %10s %10s %10s\n", "N", "mask", "segs", "w1,w2",
              "reference s", "fused s", "ratio", "ref GF/s", "fused GF/s", "max |dy|");
  for (int64_t n : ParseList(flags->at("n"))) RunShape(*flags, n);
  return 0;
}
