// LibTorch side of the CUDA IHA kernels (iha_cuda.h): checks, RoPE tables, the autograd
// function, the un-mixing of pseudo gradients, the CPU emulation used by the tests, and the
// stock SDPA baseline.
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "loom/torch_compat.h"
#include "plugins/attention/common/attention_common.h"
#include "plugins/attention/iha/cuda/iha_cuda.h"
#include "plugins/attention/iha/cuda/iha_cuda_tiles.h"
#include "plugins/attention/kernels/kernel_autograd.h"
#include "plugins/attention/kernels/rope.h"

// LOOM_TORCH_HAS_CUDA: the build system found a LibTorch with CUDA (TORCH_CUDA_LIBRARIES; ATen's
// own AT_CUDA_ENABLED() is gone from current LibTorch). LOOM_IHA_HAVE_CUDA_KERNELS: the .cu was
// built. Only with both does this file touch CUDA (c10_cuda headers and library).
#if defined(LOOM_TORCH_HAS_CUDA) && LOOM_TORCH_HAS_CUDA
#define LOOM_IHA_TORCH_CUDA 1
#else
#define LOOM_IHA_TORCH_CUDA 0
#endif
#if LOOM_IHA_TORCH_CUDA && defined(LOOM_IHA_HAVE_CUDA_KERNELS) && LOOM_IHA_HAVE_CUDA_KERNELS
#define LOOM_IHA_CUDA_LAUNCH 1
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "plugins/attention/iha/cuda/iha_cuda_kernels.h"
#else
#define LOOM_IHA_CUDA_LAUNCH 0
#endif

namespace loom::attention::iha {
namespace {

using torch::Tensor;
namespace k = cuda;

// Why the kernels cannot take these inputs, device aside.
std::string InputsReason(const Tensor& q, const Tensor& kk, const Tensor& v, const Options& o) {
  if (o.score != Score::kSoftmax) return "score=linear";
  if (q.dim() != 4 || kk.dim() != 4 || v.dim() != 4) return "q, k, v must be [B, N, H, d]";
  const auto t = q.scalar_type();
  if (t != torch::kFloat32 && t != torch::kBFloat16 && t != torch::kFloat16) {
    return std::string("dtype ") + c10::toString(t);
  }
  if (kk.scalar_type() != t || v.scalar_type() != t) return "q, k, v dtypes differ";
  for (int64_t d : {q.size(3), v.size(3)}) {
    if (d > k::kMaxHeadDim) {
      return "head dim " + std::to_string(d) + " > " + std::to_string(k::kMaxHeadDim);
    }
  }
  if (o.rope_theta > 0 && q.size(3) % 2 != 0) return "RoPE needs an even head width";
  if (q.size(0) * q.size(2) > 65535) return "B·H > 65535";
  return {};
}

// Host execution of a block program: each phase runs every thread in turn (in reverse order,
// so a phase that read another thread's row written in the same phase would see stale data).
struct HostRun {
  int threads;
  template <typename Phase>
  void operator()(const Phase& phase) const {
    for (int t = threads - 1; t >= 0; --t) phase(t);
  }
};

template <typename T>
void EmulateForward(const k::IhaCudaParams& p, int tile) {
  const k::IhaSmem layout = k::IhaSmemLayout(0, p.dk, p.dv, tile);
  std::vector<float> smem(layout.total);
  for (int64_t bh = 0; bh < p.b * p.h; ++bh) {
    for (int64_t qt = 0; qt < p.Tiles(tile); ++qt) {
      std::fill(smem.begin(), smem.end(), std::numeric_limits<float>::quiet_NaN());
      k::IhaForwardBlock<T>(p, qt, bh, smem.data(), layout, HostRun{tile});
    }
  }
}

template <typename T>
void EmulateBackward(const k::IhaCudaParams& p, int tile) {
  const k::IhaSmem keys = k::IhaSmemLayout(1, p.dk, p.dv, tile);
  const k::IhaSmem queries = k::IhaSmemLayout(2, p.dk, p.dv, tile);
  std::vector<float> smem(std::max(keys.total, queries.total));
  for (int64_t bh = 0; bh < p.b * p.h; ++bh) {
    for (int64_t kt = 0; kt < p.Tiles(tile); ++kt) {
      std::fill(smem.begin(), smem.end(), std::numeric_limits<float>::quiet_NaN());
      k::IhaBackwardKeyBlock<T>(p, kt, bh, smem.data(), keys, HostRun{tile});
    }
  }
  for (int64_t bh = 0; bh < p.b * p.h; ++bh) {
    for (int64_t qt = 0; qt < p.Tiles(tile); ++qt) {
      std::fill(smem.begin(), smem.end(), std::numeric_limits<float>::quiet_NaN());
      k::IhaBackwardQueryBlock<T>(p, qt, bh, smem.data(), queries, HostRun{tile});
    }
  }
}

template <typename Fn>
void DispatchElement(torch::ScalarType t, Fn fn) {
  if (t == torch::kFloat32) {
    fn(float{});
  } else if (t == torch::kBFloat16) {
    fn(k::IhaBf16{});
  } else if (t == torch::kFloat16) {
    fn(k::IhaHalf{});
  } else {
    TORCH_CHECK(false, "iha cuda: unsupported dtype ", t);
  }
}

// The raw view of one call (tensors must outlive it).
struct Call {
  Tensor q, k, v, aq, ak, av, cos, sin, segments;
  k::IhaCudaParams params;
};

Call MakeCall(const Tensor& q, const Tensor& kk, const Tensor& v, const Tensor& alpha_q,
              const Tensor& alpha_k, const Tensor& alpha_v, const Tensor& cos, const Tensor& sin,
              const Tensor& segments, const Options& o) {
  Call c;
  c.q = q.contiguous();
  c.k = kk.contiguous();
  c.v = v.contiguous();
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(q.device());
  c.aq = alpha_q.detach().to(f32).contiguous();
  c.ak = alpha_k.detach().to(f32).contiguous();
  c.av = alpha_v.detach().to(f32).contiguous();
  k::IhaCudaParams& pr = c.params;
  pr.b = q.size(0);
  pr.n = q.size(1);
  pr.h = q.size(2);
  pr.p = o.p;
  pr.dk = q.size(3);
  pr.dv = v.size(3);
  pr.q = c.q.data_ptr();
  pr.k = c.k.data_ptr();
  pr.v = c.v.data_ptr();
  pr.q_stride_b = c.q.stride(0);
  pr.q_stride_n = c.q.stride(1);
  pr.q_stride_h = c.q.stride(2);
  pr.k_stride_b = c.k.stride(0);
  pr.k_stride_n = c.k.stride(1);
  pr.k_stride_h = c.k.stride(2);
  pr.v_stride_b = c.v.stride(0);
  pr.v_stride_n = c.v.stride(1);
  pr.v_stride_h = c.v.stride(2);
  pr.alpha_q = c.aq.data_ptr<float>();
  pr.alpha_k = c.ak.data_ptr<float>();
  pr.alpha_v = c.av.data_ptr<float>();
  if (cos.numel() > 0) {
    c.cos = cos.contiguous();
    c.sin = sin.contiguous();
    pr.cos = c.cos.data_ptr<float>();
    pr.sin = c.sin.data_ptr<float>();
    pr.rope_stride_b = c.cos.size(0) == 1 ? 0 : c.cos.stride(0);
  }
  if (segments.numel() > 0) {
    c.segments = segments.contiguous();
    pr.segments = c.segments.data_ptr<int64_t>();
    pr.segments_stride_b = c.segments.size(0) == 1 ? 0 : c.segments.stride(0);
  }
  pr.mask = static_cast<int>(o.mask);
  pr.window = o.window;
  pr.scale = static_cast<float>(o.scale);
  return c;
}

#if LOOM_IHA_CUDA_LAUNCH
k::IhaDType DType(torch::ScalarType t) {
  if (t == torch::kBFloat16) return k::IhaDType::kBFloat16;
  if (t == torch::kFloat16) return k::IhaDType::kFloat16;
  return k::IhaDType::kFloat32;
}
void* Stream(const Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif

void RunForward(const Call& c, int64_t tile, bool emulate) {
  if (emulate) {
    DispatchElement(c.q.scalar_type(), [&](auto e) {
      EmulateForward<decltype(e)>(c.params, tile > 0 ? static_cast<int>(tile) : 64);
    });
    return;
  }
#if LOOM_IHA_CUDA_LAUNCH
  c10::cuda::CUDAGuard guard(c.q.device());
  const std::string err =
      k::LaunchIhaForward(c.params, DType(c.q.scalar_type()), static_cast<int>(tile), Stream(c.q));
  TORCH_CHECK(err.empty(), err);
#else
  TORCH_CHECK(false, "iha cuda: ", CudaKernelUnsupportedReason(c.q, c.k, c.v, Options{}));
#endif
}

void RunBackward(const Call& c, int64_t tile, bool emulate) {
  if (emulate) {
    DispatchElement(c.q.scalar_type(), [&](auto e) {
      EmulateBackward<decltype(e)>(c.params, tile > 0 ? static_cast<int>(tile) : 64);
    });
    return;
  }
#if LOOM_IHA_CUDA_LAUNCH
  c10::cuda::CUDAGuard guard(c.q.device());
  const std::string err =
      k::LaunchIhaBackward(c.params, DType(c.q.scalar_type()), static_cast<int>(tile), Stream(c.q));
  TORCH_CHECK(err.empty(), err);
#else
  TORCH_CHECK(false, "iha cuda: ", CudaKernelUnsupportedReason(c.q, c.k, c.v, Options{}));
#endif
}

class IhaCudaFunction : public torch::autograd::Function<IhaCudaFunction> {
 public:
  static constexpr size_t kInputs = 16;  // the arguments of forward() after ctx

  // scale is the resolved one (1/sqrt(dk) already applied when options.scale was 0).
  static Tensor forward(torch::autograd::AutogradContext* ctx, Tensor q, Tensor kk, Tensor v,
                        Tensor alpha_q, Tensor alpha_k, Tensor alpha_v, Tensor cos, Tensor sin,
                        Tensor segments, int64_t mask, int64_t window, int64_t p, double scale,
                        int64_t tile, bool poison, bool emulate) {
    const Options o =
        kernels::KernelOptions(p, mask, window, static_cast<int64_t>(Score::kSoftmax), scale);
    Call c = MakeCall(q, kk, v, alpha_q, alpha_k, alpha_v, cos, sin, segments, o);
    const int64_t b = q.size(0), n = q.size(1), h = q.size(2), dv = v.size(3);
    Tensor out = torch::empty({b, n, h, p, dv}, q.options());
    Tensor lse = torch::empty({b, h, n * p}, q.options().dtype(torch::kFloat32));
    if (poison) {
      out.fill_(std::numeric_limits<double>::quiet_NaN());
      lse.fill_(std::numeric_limits<double>::quiet_NaN());
    }
    c.params.out = out.data_ptr();
    c.params.lse = lse.data_ptr<float>();
    RunForward(c, tile, emulate);
    ctx->save_for_backward({q, kk, v, alpha_q, alpha_k, alpha_v, cos, sin, segments, out, lse});
    kernels::SaveKernelOptions(ctx, o);
    ctx->saved_data["tile"] = tile;
    ctx->saved_data["poison"] = poison;
    ctx->saved_data["emulate"] = emulate;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    const Tensor &q = s[0], &kk = s[1], &v = s[2], &out = s[9], &lse = s[10];
    const Options o = kernels::SavedKernelOptions(ctx);
    const bool poison = ctx->saved_data["poison"].toBool();
    const bool emulate = ctx->saved_data["emulate"].toBool();
    Call c = MakeCall(q, kk, v, s[3], s[4], s[5], s[6], s[7], s[8], o);
    const int64_t b = q.size(0), n = q.size(1), h = q.size(2), dk = q.size(3), dv = v.size(3),
                  p = o.p;
    Tensor go = grads[0].to(torch::kFloat32).contiguous();  // [B, N, H, P, dv]
    Tensor delta = kernels::PseudoRowDelta(go, out, torch::kFloat32);
    auto f32 = q.options().dtype(torch::kFloat32);
    Tensor dq = torch::empty({b, h, n * p, dk}, f32), dkp = torch::empty({b, h, n * p, dk}, f32),
           dvp = torch::empty({b, h, n * p, dv}, f32);
    if (poison) {
      for (Tensor* t : {&dq, &dkp, &dvp}) t->fill_(std::numeric_limits<double>::quiet_NaN());
    }
    c.params.out = out.data_ptr();
    c.params.lse = lse.data_ptr<float>();
    c.params.grad_out = go.data_ptr<float>();
    c.params.delta = delta.data_ptr<float>();
    c.params.dq_pseudo = dq.data_ptr<float>();
    c.params.dk_pseudo = dkp.data_ptr<float>();
    c.params.dv_pseudo = dvp.data_ptr<float>();
    RunBackward(c, ctx->saved_data["tile"].toInt(), emulate);
    auto [gq, gaq] = UnmixPseudoGradient(q, s[3], dq);
    auto [gk, gak] = UnmixPseudoGradient(kk, s[4], dkp);
    auto [gv, gav] = UnmixPseudoGradient(v, s[5], dvp);
    return kernels::LeadingGrads(
        {gq.to(q.scalar_type()), gk.to(kk.scalar_type()), gv.to(v.scalar_type()),
         gaq.to(s[3].options()), gak.to(s[4].options()), gav.to(s[5].options())},
        kInputs);
  }
};

}  // namespace

std::string CudaKernelUnsupportedReason(const torch::Tensor& q, const torch::Tensor& kk,
                                        const torch::Tensor& v, const Options& options) {
#if !LOOM_IHA_TORCH_CUDA
  (void)q, (void)kk, (void)v, (void)options;
  return "LibTorch built without CUDA";
#elif !LOOM_IHA_CUDA_LAUNCH
  (void)q, (void)kk, (void)v, (void)options;
  return "built without CUDA kernels";
#else
  if (!q.is_cuda() || !kk.is_cuda() || !v.is_cuda()) return "not a CUDA tensor";
  return InputsReason(q, kk, v, options);
#endif
}

std::pair<torch::Tensor, torch::Tensor> UnmixPseudoGradient(const torch::Tensor& x,
                                                            const torch::Tensor& alpha,
                                                            const torch::Tensor& g) {
  const int64_t b = x.size(0), n = x.size(1), h = x.size(2), d = x.size(3), p = alpha.size(2);
  Tensor g5 = g.to(torch::kFloat32).view({b, h, n, p, d});
  Tensor a = alpha.detach().to(g5.options());
  Tensor dx = torch::einsum("bhnjc,mhj->bnmc", {g5, a});
  Tensor dalpha = torch::einsum("bnmc,bhnjc->mhj", {x.detach().to(g5.options()), g5});
  return {dx, dalpha};
}

torch::Tensor CudaPseudoOutputs(const torch::Tensor& q, const torch::Tensor& kk,
                                const torch::Tensor& v, const torch::Tensor& alpha_q,
                                const torch::Tensor& alpha_k, const torch::Tensor& alpha_v,
                                const torch::Tensor& positions, const Options& o,
                                const CudaOptions& cuda) {
  const std::string reason =
      cuda.emulate ? InputsReason(q, kk, v, o) : CudaKernelUnsupportedReason(q, kk, v, o);
  TORCH_CHECK(reason.empty(), "iha cuda kernels: ", reason);
  kernels::CheckKernelInputs(q, kk, v, alpha_q, alpha_k, alpha_v, o);
  TORCH_CHECK(cuda.tile == 0 || cuda.tile == 16 || cuda.tile == 32 || cuda.tile == 64,
              "iha cuda: tile must be 0, 16, 32 or 64");
  const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  auto [cos, sin] = kernels::ExpandedRopeTables(q, positions, o, torch::kFloat32);
  torch::Tensor segments = kernels::KernelSegments(o, q.size(0), q.size(1), q.device());
  return IhaCudaFunction::apply(q, kk, v, alpha_q, alpha_k, alpha_v, cos, sin, segments,
                                static_cast<int64_t>(o.mask), o.window, o.p, scale, cuda.tile,
                                cuda.poison_output, cuda.emulate);
}

std::string StockSdpaUnsupportedReason(const torch::Tensor& q, const Options& o) {
  (void)q;
#if !LOOM_TORCH_HAS_SDPA
  (void)o;
  return "needs LibTorch >= 2.0";
#else
  if (o.score != Score::kSoftmax) return "score=linear";
  if (o.window > 0) return "window > 0";
  if (o.segments.defined()) return "segments (packed sequences)";
  return {};
#endif
}

torch::Tensor StockSdpaPseudoOutputs(const torch::Tensor& q, const torch::Tensor& kk,
                                     const torch::Tensor& v, const torch::Tensor& alpha_q,
                                     const torch::Tensor& alpha_k, const torch::Tensor& alpha_v,
                                     const torch::Tensor& positions, const Options& o) {
  const std::string reason = StockSdpaUnsupportedReason(q, o);
  TORCH_CHECK(reason.empty(), "iha stock sdpa: ", reason);
#if !LOOM_TORCH_HAS_SDPA
  (void)kk, (void)v, (void)alpha_q, (void)alpha_k, (void)alpha_v, (void)positions;
  return {};
#else
  const int64_t b = q.size(0), n = q.size(1), h = q.size(2), dk = q.size(3), dv = v.size(3);
  Tensor qi = MixAndInterleave(q, alpha_q);  // [B, H, N·P, dk]
  Tensor ki = MixAndInterleave(kk, alpha_k);
  Tensor vi = MixAndInterleave(v, alpha_v);
  std::tie(qi, ki) = kernels::RotatePseudoQueriesKeys(qi, ki, positions, o);
  // SDPA scales by 1/sqrt(dk) (LibTorch 2.0 has no scale argument): fold a custom scale into q.
  if (o.scale > 0) qi = qi * (o.scale * std::sqrt(static_cast<double>(dk)));
  c10::optional<Tensor> mask;
  if (o.mask == Mask::kBlock) mask = AllowedMask(n, o.p, Mask::kBlock, 0, q.device());
  Tensor out = at::scaled_dot_product_attention(qi, ki, vi, mask, 0.0,
                                                /*is_causal=*/o.mask == Mask::kInterleaved);
  return out.view({b, h, n, o.p, dv}).permute({0, 2, 1, 3, 4});
#endif
}

}  // namespace loom::attention::iha
