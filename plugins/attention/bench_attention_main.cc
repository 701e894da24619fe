// loom-bench-attention: wall-clock time and peak extra memory of one attention layer's core
// (q, k, v -> heads; projections excluded) for own MHA, local MHA, the materialising IHA
// reference path (iha-naive), the fused IHA kernel (iha-fused), local IHA at W = N/(2P²) and
// the paper's hybrid 4:1 average (4 local IHA : 1 global MHA). Prints ratios to own MHA, to the
// FLOP floor P² × MHA for global IHA, and achieved GFLOP/s against a matmul ceiling measured in
// the same run. Builds from LibTorch alone (LOOM_ATTENTION_ONLY). A program, not a test:
// results go to docs/benchmarks.md.
#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "attention_common.h"
#include "iha_core.h"
#include "iha_fused.h"

// OpenBLAS (Debian's LibTorch BLAS) keeps its own thread count, which torch::set_num_threads
// does not change: --threads sets both, so every variant runs on the same number of threads.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

using loom::attention::iha::Mask;
using loom::attention::iha::Options;

// Counts live and peak bytes of every CPU tensor allocation: the measured memory.
class TrackingAllocator final : public c10::Allocator {
 public:
  static constexpr size_t kHeader = 64;  // keeps the 64-byte alignment of the payload
  c10::DataPtr allocate(size_t n) const override {
    // aligned_alloc wants a multiple of the alignment.
    void* raw = std::aligned_alloc(kHeader, (n + 2 * kHeader - 1) / kHeader * kHeader);
    if (raw == nullptr) throw std::bad_alloc();
    *static_cast<size_t*>(raw) = n;
    const int64_t now = live_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    void* data = static_cast<char*>(raw) + kHeader;
    return {data, raw, &Delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }
  static void Delete(void* raw) {
    live_.fetch_sub(static_cast<int64_t>(*static_cast<size_t*>(raw)));
    std::free(raw);
  }
  static int64_t live() { return live_.load(); }
  static void ResetPeak() { peak_.store(live_.load()); }
  static int64_t peak() { return peak_.load(); }

 private:
  static std::atomic<int64_t> live_, peak_;
};
std::atomic<int64_t> TrackingAllocator::live_{0};
std::atomic<int64_t> TrackingAllocator::peak_{0};
TrackingAllocator g_allocator;

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

struct Timing {
  double forward_s = 0, total_s = 0;  // best of reps: forward only; forward + backward
  double extra_bytes = 0;             // peak bytes above the inputs during forward + backward
};

Timing Measure(const std::function<torch::Tensor()>& fn, const std::vector<torch::Tensor>& inputs,
               int reps) {
  Timing t;
  t.forward_s = t.total_s = 1e30;
  for (int r = 0; r < reps + 1; ++r) {  // the first run warms up
    for (const auto& x : inputs) x.mutable_grad() = torch::Tensor();
    const int64_t base = TrackingAllocator::live();
    TrackingAllocator::ResetPeak();
    auto start = std::chrono::steady_clock::now();
    torch::Tensor out;
    {
      torch::NoGradGuard no_grad;
      out = fn();
    }
    const double fwd =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    out = torch::Tensor();
    start = std::chrono::steady_clock::now();
    out = fn();
    out.backward(torch::ones_like(out));
    const double total =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (r == 0) continue;
    t.forward_s = std::min(t.forward_s, fwd);
    t.total_s = std::min(t.total_s, total);
    t.extra_bytes = static_cast<double>(TrackingAllocator::peak() - base);
  }
  return t;
}

double MatmulCeiling(int64_t threads) {
  torch::Tensor a = torch::randn({2048, 2048}), b = torch::randn({2048, 2048});
  double best = 1e30;
  for (int r = 0; r < 4; ++r) {
    auto start = std::chrono::steady_clock::now();
    torch::Tensor c = a.mm(b);
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return 2.0 * 2048.0 * 2048.0 * 2048.0 / best / 1e9;
}

std::string Mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", bytes / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = {{"n", "256,512,1024,2048"},
                                              {"heads", "8"},
                                              {"dim", "64"},
                                              {"p", "2,4"},
                                              {"batch", "1"},
                                              {"reps", "2"},
                                              {"threads", "0"},
                                              {"naive-max-n", "2048"},
                                              {"tile", "0"},
                                              {"peer", ""}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a.rfind("--", 0) != 0 || i + 1 >= argc || !flags.count(a.substr(2))) {
      std::fprintf(stderr,
                   "usage: loom-bench-attention [--n 256,512,...] [--heads H] [--dim d] [--p 2,4] "
                   "[--batch B] [--reps R] [--threads T] [--naive-max-n N] [--tile TOKENS] "
                   "[--peer plugins/attention/bench/naive_peer.py]\n");
      return a == "--help" ? 0 : 2;
    }
    flags[a.substr(2)] = argv[++i];
  }
  c10::SetCPUAllocator(&g_allocator, /*priority=*/100);
  if (std::stoll(flags["threads"]) > 0) {
    torch::set_num_threads(static_cast<int>(std::stoll(flags["threads"])));
    if (openblas_set_num_threads != nullptr) {
      openblas_set_num_threads(static_cast<int>(std::stoll(flags["threads"])));
    }
  }
  const int64_t h = std::stoll(flags["heads"]), d = std::stoll(flags["dim"]),
                b = std::stoll(flags["batch"]);
  const int reps = static_cast<int>(std::stoll(flags["reps"]));
  const int64_t naive_max = std::stoll(flags["naive-max-n"]);
  torch::manual_seed(0);
  double ceiling = MatmulCeiling(torch::get_num_threads());
  std::printf(
      "loom-bench-attention: %d threads, fp32, B=%lld H=%lld d=%lld, causal; matmul ceiling %.1f "
      "GFLOP/s "
      "(2048^3 sgemm)\n",
      torch::get_num_threads(), static_cast<long long>(b), static_cast<long long>(h),
      static_cast<long long>(d), ceiling);
  std::printf(
      "times: best of %d, seconds; fwd+bwd = forward and backward; extra = peak bytes allocated "
      "above the "
      "inputs during fwd+bwd\n\n",
      reps);
  std::printf("%5s %2s %-12s %9s %9s %9s %10s %9s %8s %9s\n", "N", "P", "variant", "fwd s",
              "fwd+bwd s", "x MHA", "x P2*MHA", "GFLOP/s", "%ceil", "extra MiB");
  for (int64_t n : ParseList(flags["n"])) {
    for (int64_t p : ParseList(flags["p"])) {
      auto opts = torch::TensorOptions().dtype(torch::kFloat32);
      torch::Tensor q = torch::randn({b, n, h, d}, opts).requires_grad_();
      torch::Tensor k = torch::randn({b, n, h, d}, opts).requires_grad_();
      torch::Tensor v = torch::randn({b, n, h, d}, opts).requires_grad_();
      torch::Tensor aq =
          (torch::eye(h).unsqueeze(-1).repeat({1, 1, p}) + 0.02 * torch::randn({h, h, p}))
              .requires_grad_();
      torch::Tensor ak = aq.detach().clone().requires_grad_(),
                    av = aq.detach().clone().requires_grad_();
      torch::Tensor r =
          (torch::randn({h, h * p}) / std::sqrt(static_cast<double>(h * p))).requires_grad_();
      torch::Tensor positions = torch::arange(n, torch::kInt64);
      const std::vector<torch::Tensor> inputs = {q, k, v, aq, ak, av, r};
      const int64_t w = std::max<int64_t>(1, n / (2 * p * p));  // the paper's local window
      // Shared machines drift: each (N, P) group is compared with a ceiling measured just before
      // it (the best of this and the previous measurement, so a busy moment cannot flatter).
      ceiling = std::max(ceiling, MatmulCeiling(torch::get_num_threads()));
      std::printf("# N=%lld P=%lld: matmul ceiling %.1f GFLOP/s\n", static_cast<long long>(n),
                  static_cast<long long>(p), ceiling);
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));

      auto mha = [&](int64_t window) {
        return [&, window] {
          torch::Tensor qh = q.transpose(1, 2), kh = k.transpose(1, 2), vh = v.transpose(1, 2);
          return loom::attention::ReferenceAttention(
              qh, kh, vh, loom::attention::AllowedMask(n, true, window, q.device()), scale);
        };
      };
      Options global;
      global.p = p;
      global.mask = Mask::kInterleaved;
      Options local = global;
      local.window = w;
      auto naive = [&] {
        return loom::attention::iha::Forward(q, k, v, aq, ak, av, r, positions, global);
      };
      auto fused = [&](const Options& o) {
        loom::attention::iha::FusedOptions f;
        f.tile_tokens = std::stoll(flags["tile"]);
        return [&, o, f] {
          return loom::attention::iha::FusedForward(q, k, v, aq, ak, av, r, positions, o, f);
        };
      };
      // Useful FLOPs of the attention core: 4·d per (query, attended key) pair and head; the
      // backward pass counts twice the forward.
      const double mha_flops =
          4.0 * d * h * b * n * loom::attention::AverageAttendedKeys(n, true, 0);
      const double iha_flops =
          4.0 * d * h * b * n * p *
          loom::attention::iha::AverageAttendedKeys(n, p, Mask::kInterleaved, 0);
      const double local_flops =
          4.0 * d * h * b * n * p *
          loom::attention::iha::AverageAttendedKeys(n, p, Mask::kInterleaved, w);
      const double local_mha_flops =
          4.0 * d * h * b * n * loom::attention::AverageAttendedKeys(n, true, w);

      Timing t_mha = Measure(mha(0), inputs, reps);
      auto row = [&](const char* name, const Timing& t, double flops, bool global_iha) {
        const double gflops = 3.0 * flops / t.total_s / 1e9;
        char floor_ratio[16] = "-";
        if (global_iha)
          std::snprintf(floor_ratio, sizeof(floor_ratio), "%.2f",
                        t.total_s / (p * p * t_mha.total_s));
        std::printf("%5lld %2lld %-12s %9.4f %9.4f %9.2f %10s %9.1f %7.0f%% %9s\n",
                    static_cast<long long>(n), static_cast<long long>(p), name, t.forward_s,
                    t.total_s, t.total_s / t_mha.total_s, floor_ratio, gflops,
                    100.0 * gflops / ceiling, Mib(t.extra_bytes).c_str());
        std::fflush(stdout);
      };
      row("mha", t_mha, mha_flops, false);
      // The same FlashAttention kernel at P = 1 with identity mixing is plain causal MHA that
      // skips the future: what MHA costs with IHA's kernel quality (a second yardstick).
      Options flash_mha;
      flash_mha.p = 1;
      torch::Tensor eye = torch::eye(h).unsqueeze(-1);
      torch::Tensor eye_r = torch::eye(h);
      row("mha-fused",
          Measure(
              [&] {
                return loom::attention::iha::FusedForward(q, k, v, eye, eye, eye, eye_r, positions,
                                                          flash_mha);
              },
              inputs, reps),
          mha_flops, false);
      Timing t_local_mha = Measure(mha(w), inputs, reps);
      row("local-mha", t_local_mha, local_mha_flops, false);
      if (n <= naive_max) row("iha-naive", Measure(naive, inputs, reps), iha_flops, true);
      if (!flags["peer"].empty() && n <= naive_max) {
        // The naive peer: a straightforward PyTorch IHA under Debian's python3-torch, run as a
        // child process at the same shape; its time is compared with our MHA of this run.
        const std::string command = flags["peer"] + " --n " + std::to_string(n) + " --p " +
                                    std::to_string(p) + " --heads " + std::to_string(h) +
                                    " --dim " + std::to_string(d) + " --batch " +
                                    std::to_string(b) + " --reps " + std::to_string(reps);
        Timing peer;
        FILE* pipe = popen(command.c_str(), "r");
        double fwd = 0, total = 0, bytes = 0;
        const bool ok =
            pipe != nullptr && std::fscanf(pipe, "%lf %lf %lf", &fwd, &total, &bytes) == 3;
        if (pipe != nullptr) pclose(pipe);
        if (ok) {
          peer.forward_s = fwd;
          peer.total_s = total;
          peer.extra_bytes = bytes;  // peak RSS growth of the child
          row("py-peer", peer, iha_flops, true);
        } else {
          std::fprintf(stderr, "loom-bench-attention: peer command failed: %s\n", command.c_str());
        }
      }
      row("iha-fused", Measure(fused(global), inputs, reps), iha_flops, true);
      Timing t_local = Measure(fused(local), inputs, reps);
      row("local-iha", t_local, local_flops, false);
      Timing hybrid;
      hybrid.forward_s = (4 * t_local.forward_s + t_mha.forward_s) / 5;
      hybrid.total_s = (4 * t_local.total_s + t_mha.total_s) / 5;
      hybrid.extra_bytes = std::max(t_local.extra_bytes, t_mha.extra_bytes);
      row("hybrid-4:1", hybrid, (4 * local_flops + mha_flops) / 5, false);
    }
  }
  return 0;
}
