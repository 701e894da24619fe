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
#include <optional>
#include <string>
#include <vector>

#include "loom/torch_compat.h"
#include "plugins/attention/common/attention_common.h"
#include "plugins/attention/iha/cuda/iha_cuda.h"
#include "plugins/attention/iha/iha_core.h"
#include "plugins/attention/kernels/fused_attention.h"

#ifdef LOOM_TORCH_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif
#include "base/blas_core.h"
#include "base/cpu_process.h"
#include "plugins/attention/bench/bench_flags.h"

namespace {

using loom::attention::kernels::Mask;
using loom::attention::kernels::Options;

// Counts live and peak bytes of every CPU tensor allocation: the measured memory.
class TrackingAllocator final : public c10::Allocator {
 public:
  static constexpr size_t kHeader = 64;  // keeps the 64-byte alignment of the payload
  c10::DataPtr allocate(size_t n) LOOM_TORCH_ALLOCATE_CONST override {
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
#if LOOM_TORCH_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
#endif
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

// The command line, checked: errors name the flag (bench/bench_flags.h).
struct Settings {
  std::vector<int64_t> n, p;
  int64_t heads = 8, dim = 64, batch = 1, reps = 2, threads = 0, naive_max = 2048, tile = 0;
  std::string device, dtype, peer;
  bool causal = true;
};

constexpr char kUsage[] =
    "usage: loom-bench-attention [--n 256,512,...] [--heads H] [--dim d] [--p 2,4] [--batch B] "
    "[--reps R] [--threads T] [--naive-max-n N] [--tile TOKENS] [--device cpu|cuda] "
    "[--dtype fp32|bf16] [--mask causal|none] [--peer plugins/attention/bench/naive_peer.py]";

// The settings; nullopt after printing the usage (*exit_code 0 on --help, else 2 and the error).
std::optional<Settings> ParseSettings(int argc, char** argv, int* exit_code) {
  loom::attention::bench::BenchFlags flags({{"n", "256,512,1024,2048"},
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
                                            {"peer", ""}});
  Settings s;
  if (flags.Parse(argc, argv)) {
    s.n = flags.IntList("n", 1, 1 << 20);
    s.p = flags.IntList("p", 1, 64);
    s.heads = flags.Int("heads", 1, 1024);
    s.dim = flags.Int("dim", 1, 4096);
    s.batch = flags.Int("batch", 1, 4096);
    s.reps = flags.Int("reps", 1, 1000);
    s.threads = flags.Int("threads", 0, 1024);  // 0: LibTorch's default
    s.naive_max = flags.Int("naive-max-n", 0, 1 << 20);
    s.tile = flags.Int("tile", 0, 1 << 20);  // every fused variant's (0: the default)
    s.device = flags.Choice("device", {"cpu", "cuda"});
    s.dtype = flags.Choice("dtype", {"fp32", "bf16"});
    s.causal = flags.Choice("mask", {"causal", "none"}) == "causal";
    s.peer = flags.Get("peer");
  }
  if (flags.Exit("loom-bench-attention", kUsage, exit_code)) return std::nullopt;
  return s;
}

// The device of --device and --dtype; false (after a message) when CUDA is asked for and absent.
bool OpenDevice(const Settings& s, Device* dev) {
  if (s.device == "cuda" && !torch::cuda::is_available()) {
    std::fprintf(stderr, "loom-bench-attention: --device cuda: no CUDA device visible\n");
    return false;
  }
  if (s.device == "cuda") dev->device = torch::Device(torch::kCUDA, 0);
  if (s.dtype == "bf16") dev->dtype = torch::kBFloat16;
  return true;
}

void SetThreads(int64_t threads) {
  if (threads <= 0) return;
  torch::set_num_threads(static_cast<int>(threads));
  // OpenBLAS's pthreads build keeps its own thread count (the OpenMP one follows LibTorch's):
  // set both, so every variant runs on as many threads.
  if (openblas_set_num_threads != nullptr && std::string(loom::OpenBlasThreading()) == "pthreads") {
    openblas_set_num_threads(static_cast<int>(threads));
  }
}

// One (N, P) group's inputs: activations in the benchmark's dtype, mixing weights in float32
// (parameters) near the identity.
struct GroupInputs {
  int64_t n = 0, p = 0, w = 0;  // w: the paper's local window N / (2P²)
  torch::Tensor q, k, v, aq, ak, av, r, positions;
  std::vector<torch::Tensor> all() const { return {q, k, v, aq, ak, av, r}; }
};

GroupInputs MakeInputs(const Device& dev, int64_t b, int64_t n, int64_t h, int64_t d, int64_t p) {
  auto opts = torch::TensorOptions().dtype(dev.dtype).device(dev.device);
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(dev.device);
  GroupInputs g;
  g.n = n;
  g.p = p;
  g.w = std::max<int64_t>(1, n / (2 * p * p));
  g.q = torch::randn({b, n, h, d}, opts).requires_grad_();
  g.k = torch::randn({b, n, h, d}, opts).requires_grad_();
  g.v = torch::randn({b, n, h, d}, opts).requires_grad_();
  g.aq = (torch::eye(h, f32).unsqueeze(-1).repeat({1, 1, p}) + 0.02 * torch::randn({h, h, p}, f32))
             .requires_grad_();
  g.ak = g.aq.detach().clone().requires_grad_();
  g.av = g.aq.detach().clone().requires_grad_();
  g.r = (torch::randn({h, h * p}, f32) / std::sqrt(static_cast<double>(h * p))).requires_grad_();
  g.positions = torch::arange(n, f32.dtype(torch::kInt64));
  return g;
}

class AttentionBench {
 public:
  AttentionBench(const Settings& s, Device dev)
      : settings_(s),
        dev_(dev),
        causal_(s.causal),
        h_(s.heads),
        d_(s.dim),
        b_(s.batch),
        reps_(static_cast<int>(s.reps)),
        naive_max_(s.naive_max) {
    tiles_.tile_tokens = s.tile;
  }

  void PrintHeader();
  void RunGroup(int64_t n, int64_t p);

 private:
  using Variant = std::function<torch::Tensor()>;
  Variant MhaDense(int64_t window) const;
  Variant Mha(int64_t window) const;    // the mha plugin's kernel on this device
  Variant Iha(const Options& o) const;  // the fast IHA path: the fused CPU or the CUDA kernels
  Options IhaOptions(int64_t window) const;
  double Flops(bool iha, int64_t window) const;
  void Row(const char* name, const Timing& t, double flops, bool global_iha);
  void MhaRows();
  void PeerRow();
  void IhaRows();

  const Settings& settings_;
  Device dev_;
  bool causal_;
  int64_t h_, d_, b_;
  int reps_;
  int64_t naive_max_;
  loom::attention::kernels::FusedOptions tiles_;
  double ceiling_ = 0;
  // The group being measured, and what its rows are compared with.
  GroupInputs g_;
  Timing t_mha_;
  double mha_gflops_ = 0, iha_gflops_ = 0;
};

void AttentionBench::PrintHeader() {
  ceiling_ = MatmulCeiling(dev_);
  const char* blas = openblas_get_corename != nullptr ? openblas_get_corename() : "not OpenBLAS";
  const std::string threading = loom::OpenBlasThreading();
  std::printf(
      "loom-bench-attention: %s, %d threads, %s, B=%lld H=%lld d=%lld, %s; BLAS core %s (%s); "
      "matmul ceiling %.1f GFLOP/s\n",
      dev_.cuda() ? "cuda" : "cpu", torch::get_num_threads(), settings_.dtype.c_str(),
      static_cast<long long>(b_), static_cast<long long>(h_), static_cast<long long>(d_),
      causal_ ? "causal" : "no mask (encoder)", dev_.cuda() ? "-" : blas,
      threading.empty() ? "-" : threading.c_str(), ceiling_);
  std::printf(
      "times: best of %d, seconds; fwd+bwd = forward and backward; extra = peak bytes allocated "
      "above the inputs during fwd+bwd\n\n",
      reps_);
  std::printf("%5s %2s %-12s %9s %9s %9s %10s %9s %8s %9s\n", "N", "P", "variant", "fwd s",
              "fwd+bwd s", "x MHA", "x P2*MHA", "GFLOP/s", "%ceil", "extra MiB");
}

// The mha plugin's dense kernel (kernel: reference, materialised scores).
AttentionBench::Variant AttentionBench::MhaDense(int64_t window) const {
  return [this, window] {
    const GroupInputs& g = g_;
    torch::Tensor allowed;
    if (causal_ || window > 0) {
      allowed = loom::attention::AllowedMask(g.n, causal_, window, g.q.device());
    }
    return loom::attention::ReferenceAttention(g.q.transpose(1, 2), g.k.transpose(1, 2),
                                               g.v.transpose(1, 2), allowed,
                                               1.0 / std::sqrt(static_cast<double>(d_)));
  };
}

// On the CPU the flash kernel at P = 1 without mixing (kernel: fused, its default there).
AttentionBench::Variant AttentionBench::Mha(int64_t window) const {
  if (dev_.cuda()) return MhaDense(window);
  Options o;
  o.mask = causal_ ? Mask::kInterleaved : Mask::kNone;
  o.window = window;
  return [this, o] {
    return loom::attention::kernels::FusedHeadAttention(g_.q, g_.k, g_.v, torch::Tensor(), o,
                                                        tiles_);
  };
}

Options AttentionBench::IhaOptions(int64_t window) const {
  Options o;
  o.p = g_.p;
  o.mask = causal_ ? Mask::kInterleaved : Mask::kNone;
  o.window = window;
  return o;
}

AttentionBench::Variant AttentionBench::Iha(const Options& o) const {
  namespace iha = loom::attention::iha;
  if (dev_.cuda()) {
    return [this, o] {
      const GroupInputs& g = g_;
      return iha::Collapse(iha::CudaPseudoOutputs(g.q, g.k, g.v, g.aq, g.ak, g.av, g.positions, o),
                           g.r);
    };
  }
  return [this, o] {
    const GroupInputs& g = g_;
    return iha::FusedForward(g.q, g.k, g.v, g.aq, g.ak, g.av, g.r, g.positions, o, tiles_);
  };
}

// Useful FLOPs of the attention core: 4·d per (query, attended key) pair and head.
double AttentionBench::Flops(bool iha, int64_t window) const {
  const double per_query = 4.0 * d_ * h_ * b_ * g_.n;
  if (!iha) return per_query * loom::attention::AverageAttendedKeys(g_.n, causal_, window);
  const Mask mask = causal_ ? Mask::kInterleaved : Mask::kNone;
  return per_query * g_.p * loom::attention::iha::AverageAttendedKeys(g_.n, g_.p, mask, window);
}

// One table row; the backward pass counts twice the forward's FLOPs.
void AttentionBench::Row(const char* name, const Timing& t, double flops, bool global_iha) {
  const double gflops = 3.0 * flops / t.total_s / 1e9;
  const std::string variant = name;
  if (variant == "mha") mha_gflops_ = gflops;
  if (variant == "iha-fused" || variant == "iha-cuda") iha_gflops_ = gflops;
  char floor_ratio[16] = "-";
  if (global_iha) {
    std::snprintf(floor_ratio, sizeof(floor_ratio), "%.2f",
                  t.total_s / (g_.p * g_.p * t_mha_.total_s));
  }
  std::printf("%5lld %2lld %-12s %9.4f %9.4f %9.2f %10s %9.1f %7.0f%% %9s\n",
              static_cast<long long>(g_.n), static_cast<long long>(g_.p), name, t.forward_s,
              t.total_s, t.total_s / t_mha_.total_s, floor_ratio, gflops, 100.0 * gflops / ceiling_,
              Mib(t.extra_bytes).c_str());
  std::fflush(stdout);
}

void AttentionBench::RunGroup(int64_t n, int64_t p) {
  g_ = MakeInputs(dev_, b_, n, h_, d_, p);
  // Shared machines drift: each (N, P) group is compared with a ceiling measured just before it
  // (the best of this and the previous measurement, so a busy moment cannot flatter).
  ceiling_ = std::max(ceiling_, MatmulCeiling(dev_));
  std::printf("# N=%lld P=%lld: matmul ceiling %.1f GFLOP/s\n", static_cast<long long>(n),
              static_cast<long long>(p), ceiling_);
  MhaRows();
  if (n <= naive_max_) {
    const Options global = IhaOptions(0);
    Row("iha-naive",
        Measure(
            dev_,
            [this, global] {
              const GroupInputs& g = g_;
              return loom::attention::iha::Forward(g.q, g.k, g.v, g.aq, g.ak, g.av, g.r,
                                                   g.positions, global);
            },
            g_.all(), reps_),
        Flops(true, 0), true);
  }
  if (!settings_.peer.empty() && n <= naive_max_ && !dev_.cuda()) PeerRow();
  IhaRows();
}

// MHA and its variants: the yardstick every other row is compared with.
void AttentionBench::MhaRows() {
  t_mha_ = Measure(dev_, Mha(0), g_.all(), reps_);
  Row("mha", t_mha_, Flops(false, 0), false);
  if (!dev_.cuda()) {
    Row("mha-dense", Measure(dev_, MhaDense(0), g_.all(), reps_), Flops(false, 0), false);
    // The IHA kernel at P = 1 with identity mixing: plain MHA that pays for the mixing the mha
    // plugin's path skips.
    Options flash_mha;
    flash_mha.p = 1;
    flash_mha.mask = causal_ ? Mask::kInterleaved : Mask::kNone;
    const torch::Tensor eye = torch::eye(h_).unsqueeze(-1), eye_r = torch::eye(h_);
    Row("mha-fused",
        Measure(
            dev_,
            [&] {
              return loom::attention::iha::FusedForward(g_.q, g_.k, g_.v, eye, eye, eye, eye_r,
                                                        g_.positions, flash_mha);
            },
            g_.all(), reps_),
        Flops(false, 0), false);
  }
#if LOOM_TORCH_HAS_SDPA
  // LibTorch's own fused attention (FlashAttention on GPUs; a flash kernel on CPUs in 2.x).
  Row("mha-sdpa",
      Measure(
          dev_,
          [&] {
            return at::scaled_dot_product_attention(g_.q.transpose(1, 2), g_.k.transpose(1, 2),
                                                    g_.v.transpose(1, 2), {}, 0.0, causal_);
          },
          g_.all(), reps_),
      Flops(false, 0), false);
#endif
  Row("local-mha", Measure(dev_, Mha(g_.w), g_.all(), reps_), Flops(false, g_.w), false);
}

// The naive peer: a straightforward PyTorch IHA under Debian's python3-torch, run as a child
// process at the same shape; its time is compared with our MHA of this run.
void AttentionBench::PeerRow() {
  const std::string command = settings_.peer + " --n " + std::to_string(g_.n) + " --p " +
                              std::to_string(g_.p) + " --heads " + std::to_string(h_) + " --dim " +
                              std::to_string(d_) + " --batch " + std::to_string(b_) + " --reps " +
                              std::to_string(reps_);
  FILE* pipe = popen(command.c_str(), "r");
  double fwd = 0, total = 0, bytes = 0;
  const bool ok = pipe != nullptr && std::fscanf(pipe, "%lf %lf %lf", &fwd, &total, &bytes) == 3;
  if (pipe != nullptr) pclose(pipe);
  if (!ok) {
    std::fprintf(stderr, "loom-bench-attention: peer command failed: %s\n", command.c_str());
    return;
  }
  Timing peer;
  peer.forward_s = fwd;
  peer.total_s = total;
  peer.extra_bytes = bytes;  // peak RSS growth of the child
  Row("py-peer", peer, Flops(true, 0), true);
}

// IHA: the stock SDPA route, the device's fast kernel, local IHA and the 4:1 hybrid.
void AttentionBench::IhaRows() {
  namespace iha = loom::attention::iha;
  const Options global = IhaOptions(0);
  if (iha::StockSdpaUnsupportedReason(g_.q, global).empty()) {
    // The paper's "FlashAttention-compatible" route: mix, interleave, then stock SDPA.
    Row("iha-stock",
        Measure(
            dev_,
            [&] {
              const GroupInputs& g = g_;
              return iha::Collapse(
                  iha::StockSdpaPseudoOutputs(g.q, g.k, g.v, g.aq, g.ak, g.av, g.positions, global),
                  g.r);
            },
            g_.all(), reps_),
        Flops(true, 0), true);
  }
  const std::string cuda_reason =
      dev_.cuda() ? iha::CudaKernelUnsupportedReason(g_.q, g_.k, g_.v, global) : "";
  if (!cuda_reason.empty()) {
    std::printf("# iha-cuda skipped: %s\n", cuda_reason.c_str());
    return;
  }
  Row(dev_.cuda() ? "iha-cuda" : "iha-fused", Measure(dev_, Iha(global), g_.all(), reps_),
      Flops(true, 0), true);
  const Timing t_local = Measure(dev_, Iha(IhaOptions(g_.w)), g_.all(), reps_);
  Row("local-iha", t_local, Flops(true, g_.w), false);
  Timing hybrid;
  hybrid.forward_s = (4 * t_local.forward_s + t_mha_.forward_s) / 5;
  hybrid.total_s = (4 * t_local.total_s + t_mha_.total_s) / 5;
  hybrid.extra_bytes = std::max(t_local.extra_bytes, t_mha_.extra_bytes);
  Row("hybrid-4:1", hybrid, (4 * Flops(true, g_.w) + Flops(false, 0)) / 5, false);
  std::printf("# iha GFLOP/s / mha GFLOP/s: %.2f\n", iha_gflops_ / mha_gflops_);
}

}  // namespace

int main(int argc, char** argv) {
  loom::SetUpCpuProcess(argv);  // before any matmul or large allocation (base/cpu_process.h)
  int exit_code = 0;
  const std::optional<Settings> settings = ParseSettings(argc, argv, &exit_code);
  if (!settings) return exit_code;
  c10::SetCPUAllocator(&g_allocator, /*priority=*/100);
  SetThreads(settings->threads);
  Device dev;
  if (!OpenDevice(*settings, &dev)) return 2;
  torch::manual_seed(0);
  AttentionBench bench(*settings, dev);
  bench.PrintHeader();
  for (int64_t n : settings->n) {
    for (int64_t p : settings->p) bench.RunGroup(n, p);
  }
  return 0;
}
