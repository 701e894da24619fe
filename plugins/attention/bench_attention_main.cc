// loom-bench-attention: wall-clock time and peak extra memory of one attention layer's core
// (q, k, v -> heads; projections excluded) for the mha plugin's kernel (the flash kernel at
// P = 1 without mixing on the CPU), its dense reference, the IHA kernel at P = 1 with identity
// mixing, local MHA, the materialising IHA reference path (iha-naive), the stock SDPA route
// (LibTorch >= 2.0), the fast IHA kernel of the device (iha-fused on the CPU, iha-cuda with
// --device cuda), local IHA at W = N/(2P²) and the paper's hybrid 4:1 average (4 local IHA :
// 1 global MHA). Causal (decoder) by default, --mask none for encoders. Prints ratios to MHA,
// to the FLOP floor P² × MHA for global IHA, and achieved GFLOP/s against a matmul ceiling
// measured in the same run. Builds from LibTorch alone (LOOM_ATTENTION_ONLY). A program, not a
// test: results go to docs/benchmarks.md.
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
#include "iha_cuda.h"
#include "iha_fused.h"
#include "loom/torch_compat.h"

#ifdef LOOM_TORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif
#include "loom/blas_core.h"

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

// Where the variants run: the CPU (bytes counted by TrackingAllocator) or a CUDA device
// (timings synchronise the device; bytes from the CUDA caching allocator's peak statistics).
struct Device {
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat32;

  bool cuda() const { return device.is_cuda(); }
  void Sync() const {
    if (cuda()) torch::cuda::synchronize();
  }
  int64_t LiveBytes() const {
#ifdef LOOM_TORCH_HAS_CUDA
    if (cuda()) {
      // Index 0 is the aggregate over pool types in every LibTorch version.
      return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index())
          .allocated_bytes[0]
          .current;
    }
#endif
    return TrackingAllocator::live();
  }
  void ResetPeak() const {
#ifdef LOOM_TORCH_HAS_CUDA
    if (cuda()) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
      return;
    }
#endif
    TrackingAllocator::ResetPeak();
  }
  int64_t PeakBytes() const {
#ifdef LOOM_TORCH_HAS_CUDA
    if (cuda()) {
      return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index())
          .allocated_bytes[0]
          .peak;
    }
#endif
    return TrackingAllocator::peak();
  }
};

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

Timing Measure(const Device& dev, const std::function<torch::Tensor()>& fn,
               const std::vector<torch::Tensor>& inputs, int reps) {
  Timing t;
  t.forward_s = t.total_s = 1e30;
  for (int r = 0; r < reps + 1; ++r) {  // the first run warms up
    for (const auto& x : inputs) x.mutable_grad() = torch::Tensor();
    dev.Sync();
    const int64_t base = dev.LiveBytes();
    dev.ResetPeak();
    auto start = std::chrono::steady_clock::now();
    torch::Tensor out;
    {
      torch::NoGradGuard no_grad;
      out = fn();
    }
    dev.Sync();
    const double fwd = Seconds(start);
    out = torch::Tensor();
    start = std::chrono::steady_clock::now();
    out = fn();
    out.backward(torch::ones_like(out));
    dev.Sync();
    const double total = Seconds(start);
    if (r == 0) continue;
    t.forward_s = std::min(t.forward_s, fwd);
    t.total_s = std::min(t.total_s, total);
    t.extra_bytes = static_cast<double>(dev.PeakBytes() - base);
  }
  return t;
}

// Best of four square matmuls in the benchmark's dtype (2048³ on the CPU, 8192³ on a GPU).
double MatmulCeiling(const Device& dev) {
  const int64_t n = dev.cuda() ? 8192 : 2048;
  auto opts = torch::TensorOptions().dtype(dev.dtype).device(dev.device);
  torch::Tensor a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
  a.mm(b);  // warm-up (kernel selection, BLAS threads)
  double best = 1e30;
  for (int r = 0; r < 4; ++r) {
    dev.Sync();
    auto start = std::chrono::steady_clock::now();
    torch::Tensor c = a.mm(b);
    dev.Sync();
    best = std::min(best, Seconds(start));
  }
  return 2.0 * n * n * n / best / 1e9;
}

std::string Mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", bytes / (1024.0 * 1024.0));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  loom::ReexecWithBestBlasCore(argv);  // before any matmul (api/loom/blas_core.h)
  std::map<std::string, std::string> flags = {{"n", "256,512,1024,2048"},
                                              {"heads", "8"},
                                              {"dim", "64"},
                                              {"p", "2,4"},
                                              {"batch", "1"},
                                              {"reps", "2"},
                                              {"threads", "0"},
                                              {"naive-max-n", "2048"},
                                              {"tile", "0"},
                                              {"device", "cpu"},
                                              {"dtype", "fp32"},
                                              {"mask", "causal"},
                                              {"peer", ""}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a.rfind("--", 0) != 0 || i + 1 >= argc || !flags.count(a.substr(2))) {
      std::fprintf(stderr,
                   "usage: loom-bench-attention [--n 256,512,...] [--heads H] [--dim d] [--p 2,4] "
                   "[--batch B] [--reps R] [--threads T] [--naive-max-n N] [--tile TOKENS] "
                   "[--device cpu|cuda] [--dtype fp32|bf16] [--mask causal|none] "
                   "[--peer plugins/attention/bench/naive_peer.py]\n");
      return a == "--help" ? 0 : 2;
    }
    flags[a.substr(2)] = argv[++i];
  }
  c10::SetCPUAllocator(&g_allocator, /*priority=*/100);
  if (std::stoll(flags["threads"]) > 0) {
    torch::set_num_threads(static_cast<int>(std::stoll(flags["threads"])));
    // OpenBLAS's pthreads build keeps its own thread count (the OpenMP one follows LibTorch's):
    // set both, so every variant runs on as many threads.
    if (openblas_set_num_threads != nullptr &&
        std::string(loom::OpenBlasThreading()) == "pthreads") {
      openblas_set_num_threads(static_cast<int>(std::stoll(flags["threads"])));
    }
  }
  const int64_t h = std::stoll(flags["heads"]), d = std::stoll(flags["dim"]),
                b = std::stoll(flags["batch"]);
  loom::attention::iha::FusedOptions tiles;  // every fused variant's tile size (0: the default)
  tiles.tile_tokens = std::stoll(flags["tile"]);
  const int reps = static_cast<int>(std::stoll(flags["reps"]));
  const int64_t naive_max = std::stoll(flags["naive-max-n"]);
  Device dev;
  if (flags["device"] == "cuda") {
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr, "loom-bench-attention: --device cuda: no CUDA device visible\n");
      return 2;
    }
    dev.device = torch::Device(torch::kCUDA, 0);
  } else if (flags["device"] != "cpu") {
    std::fprintf(stderr, "loom-bench-attention: --device must be cpu or cuda\n");
    return 2;
  }
  if (flags["mask"] != "causal" && flags["mask"] != "none") {
    std::fprintf(stderr, "loom-bench-attention: --mask must be causal or none\n");
    return 2;
  }
  const bool causal = flags["mask"] == "causal";
  if (flags["dtype"] == "bf16") {
    dev.dtype = torch::kBFloat16;
  } else if (flags["dtype"] != "fp32") {
    std::fprintf(stderr, "loom-bench-attention: --dtype must be fp32 or bf16\n");
    return 2;
  }
  torch::manual_seed(0);
  double ceiling = MatmulCeiling(dev);
  const char* blas = openblas_get_corename != nullptr ? openblas_get_corename() : "not OpenBLAS";
  const std::string threading = loom::OpenBlasThreading();
  std::printf(
      "loom-bench-attention: %s, %d threads, %s, B=%lld H=%lld d=%lld, %s; BLAS core %s (%s); "
      "matmul ceiling %.1f GFLOP/s\n",
      dev.cuda() ? "cuda" : "cpu", torch::get_num_threads(), flags["dtype"].c_str(),
      static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(d),
      causal ? "causal" : "no mask (encoder)", dev.cuda() ? "-" : blas,
      threading.empty() ? "-" : threading.c_str(), ceiling);
  std::printf(
      "times: best of %d, seconds; fwd+bwd = forward and backward; extra = peak bytes allocated "
      "above the "
      "inputs during fwd+bwd\n\n",
      reps);
  std::printf("%5s %2s %-12s %9s %9s %9s %10s %9s %8s %9s\n", "N", "P", "variant", "fwd s",
              "fwd+bwd s", "x MHA", "x P2*MHA", "GFLOP/s", "%ceil", "extra MiB");
  for (int64_t n : ParseList(flags["n"])) {
    for (int64_t p : ParseList(flags["p"])) {
      // Activations in the benchmark's dtype; the mixing weights stay float32 (parameters).
      auto opts = torch::TensorOptions().dtype(dev.dtype).device(dev.device);
      auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(dev.device);
      torch::Tensor q = torch::randn({b, n, h, d}, opts).requires_grad_();
      torch::Tensor k = torch::randn({b, n, h, d}, opts).requires_grad_();
      torch::Tensor v = torch::randn({b, n, h, d}, opts).requires_grad_();
      torch::Tensor aq =
          (torch::eye(h, f32).unsqueeze(-1).repeat({1, 1, p}) + 0.02 * torch::randn({h, h, p}, f32))
              .requires_grad_();
      torch::Tensor ak = aq.detach().clone().requires_grad_(),
                    av = aq.detach().clone().requires_grad_();
      torch::Tensor r =
          (torch::randn({h, h * p}, f32) / std::sqrt(static_cast<double>(h * p))).requires_grad_();
      torch::Tensor positions = torch::arange(n, f32.dtype(torch::kInt64));
      const std::vector<torch::Tensor> inputs = {q, k, v, aq, ak, av, r};
      const int64_t w = std::max<int64_t>(1, n / (2 * p * p));  // the paper's local window
      // Shared machines drift: each (N, P) group is compared with a ceiling measured just before
      // it (the best of this and the previous measurement, so a busy moment cannot flatter).
      ceiling = std::max(ceiling, MatmulCeiling(dev));
      std::printf("# N=%lld P=%lld: matmul ceiling %.1f GFLOP/s\n", static_cast<long long>(n),
                  static_cast<long long>(p), ceiling);
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));

      // The mha plugin's kernels: dense (kernel: reference, materialised scores) and, on the
      // CPU, the flash kernel at P = 1 without mixing (kernel: fused, its default there).
      auto mha_dense = [&](int64_t window) {
        return [&, window] {
          torch::Tensor qh = q.transpose(1, 2), kh = k.transpose(1, 2), vh = v.transpose(1, 2);
          torch::Tensor allowed;
          if (causal || window > 0) {
            allowed = loom::attention::AllowedMask(n, causal, window, q.device());
          }
          return loom::attention::ReferenceAttention(qh, kh, vh, allowed, scale);
        };
      };
      auto mha = [&](int64_t window) -> std::function<torch::Tensor()> {
        if (dev.cuda()) return mha_dense(window);
        Options o;
        o.mask = causal ? Mask::kInterleaved : Mask::kNone;
        o.window = window;
        return [&, o] { return loom::attention::iha::FusedHeadAttention(q, k, v, o, tiles); };
      };
      Options global;
      global.p = p;
      global.mask = causal ? Mask::kInterleaved : Mask::kNone;
      Options local = global;
      local.window = w;
      auto naive = [&] {
        return loom::attention::iha::Forward(q, k, v, aq, ak, av, r, positions, global);
      };
      // The fast IHA path of the device: the fused CPU kernel or the CUDA kernels.
      auto fused = [&](const Options& o) -> std::function<torch::Tensor()> {
        if (dev.cuda()) {
          return [&, o] {
            return loom::attention::iha::Collapse(
                loom::attention::iha::CudaPseudoOutputs(q, k, v, aq, ak, av, positions, o), r);
          };
        }
        return [&, o] {
          return loom::attention::iha::FusedForward(q, k, v, aq, ak, av, r, positions, o, tiles);
        };
      };
      // Useful FLOPs of the attention core: 4·d per (query, attended key) pair and head; the
      // backward pass counts twice the forward.
      const double mha_flops =
          4.0 * d * h * b * n * loom::attention::AverageAttendedKeys(n, causal, 0);
      const double iha_flops =
          4.0 * d * h * b * n * p * loom::attention::iha::AverageAttendedKeys(n, p, global.mask, 0);
      const double local_flops =
          4.0 * d * h * b * n * p * loom::attention::iha::AverageAttendedKeys(n, p, global.mask, w);
      const double local_mha_flops =
          4.0 * d * h * b * n * loom::attention::AverageAttendedKeys(n, causal, w);

      Timing t_mha = Measure(dev, mha(0), inputs, reps);
      double mha_gflops = 0, iha_gflops = 0;
      auto row = [&](const char* name, const Timing& t, double flops, bool global_iha) {
        const double gflops = 3.0 * flops / t.total_s / 1e9;
        if (std::string(name) == "mha") mha_gflops = gflops;
        if (std::string(name) == "iha-fused" || std::string(name) == "iha-cuda") {
          iha_gflops = gflops;
        }
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
      if (!dev.cuda()) {
        row("mha-dense", Measure(dev, mha_dense(0), inputs, reps), mha_flops, false);
        // The IHA kernel at P = 1 with identity mixing: plain MHA that pays for the mixing the
        // mha plugin's path skips.
        Options flash_mha;
        flash_mha.p = 1;
        flash_mha.mask = global.mask;
        torch::Tensor eye = torch::eye(h).unsqueeze(-1);
        torch::Tensor eye_r = torch::eye(h);
        row("mha-fused",
            Measure(
                dev,
                [&] {
                  return loom::attention::iha::FusedForward(q, k, v, eye, eye, eye, eye_r,
                                                            positions, flash_mha);
                },
                inputs, reps),
            mha_flops, false);
      }
#if LOOM_TORCH_HAS_SDPA
      // LibTorch's own fused attention (FlashAttention on GPUs; a flash kernel on CPUs in 2.x).
      row("mha-sdpa",
          Measure(
              dev,
              [&] {
                return at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                        v.transpose(1, 2), {}, 0.0, causal);
              },
              inputs, reps),
          mha_flops, false);
#endif
      Timing t_local_mha = Measure(dev, mha(w), inputs, reps);
      row("local-mha", t_local_mha, local_mha_flops, false);
      if (n <= naive_max) row("iha-naive", Measure(dev, naive, inputs, reps), iha_flops, true);
      if (!flags["peer"].empty() && n <= naive_max && !dev.cuda()) {
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
      if (loom::attention::iha::StockSdpaUnsupportedReason(q, global).empty()) {
        // The paper's "FlashAttention-compatible" route: mix, interleave, then stock SDPA.
        row("iha-stock",
            Measure(
                dev,
                [&] {
                  return loom::attention::iha::Collapse(
                      loom::attention::iha::StockSdpaPseudoOutputs(q, k, v, aq, ak, av, positions,
                                                                   global),
                      r);
                },
                inputs, reps),
            iha_flops, true);
      }
      const std::string cuda_reason =
          dev.cuda() ? loom::attention::iha::CudaKernelUnsupportedReason(q, k, v, global) : "";
      if (!cuda_reason.empty()) {
        std::printf("# iha-cuda skipped: %s\n", cuda_reason.c_str());
        continue;
      }
      row(dev.cuda() ? "iha-cuda" : "iha-fused", Measure(dev, fused(global), inputs, reps),
          iha_flops, true);
      Timing t_local = Measure(dev, fused(local), inputs, reps);
      row("local-iha", t_local, local_flops, false);
      Timing hybrid;
      hybrid.forward_s = (4 * t_local.forward_s + t_mha.forward_s) / 5;
      hybrid.total_s = (4 * t_local.total_s + t_mha.total_s) / 5;
      hybrid.extra_bytes = std::max(t_local.extra_bytes, t_mha.extra_bytes);
      row("hybrid-4:1", hybrid, (4 * local_flops + mha_flops) / 5, false);
      std::printf("# iha GFLOP/s / mha GFLOP/s: %.2f\n", iha_gflops / mha_gflops);
    }
  }
  return 0;
}
