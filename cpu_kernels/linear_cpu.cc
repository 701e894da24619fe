#include "cpu_kernels/linear_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "base/blas_core.h"
#include "loom/torch_compat.h"

namespace loom::cpu_kernels {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Below these a split costs more (a parallel region, GEMMs on thin blocks) than it gains.
constexpr int64_t kMinRowsPerThread = 32;
constexpr double kMinMultiplyAdds = 1 << 20;

// Block `i` of `parts` near-equal blocks of [0, n), boundaries on multiples of 8 rows so every
// block but the last feeds the GEMM kernel whole register tiles.
std::pair<int64_t, int64_t> Block(int64_t n, int64_t parts, int64_t i) {
  auto edge = [&](int64_t k) { return k == parts ? n : std::min(n, (n * k / parts) / 8 * 8); };
  return {edge(i), edge(i + 1)};
}

// Runs body(begin, end) for `parts` blocks of [0, n), one per thread of LibTorch's pool. A GEMM
// inside an OpenMP parallel region runs single-threaded in OpenBLAS's OpenMP build (and in MKL).
// The pool's threads do not inherit the caller's autograd state, so each steps below autograd
// itself: these GEMMs are the inside of a custom function.
template <typename Body>
void ForEachBlock(int64_t n, int64_t parts, const Body& body) {
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t p = p0; p < p1; ++p) {
      auto [begin, end] = Block(n, parts, p);
      if (end > begin) body(begin, end);
    }
  });
}

// Threads to split `rows` over: 1 where a split does not pay.
int64_t SplitThreads(int64_t rows) {
  if (at::in_parallel_region()) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / kMinRowsPerThread));
}

// y[rows] = x[rows]·Wᵀ + b, one block of rows per thread.
Tensor ForwardRows(const Tensor& x, const Tensor& w, const Tensor& b) {
  RECORD_FUNCTION("loom::row_split_linear_forward", std::vector<c10::IValue>());
  Tensor y = torch::empty({x.size(0), w.size(0)}, x.options());
  const Tensor wt = w.t();
  ForEachBlock(x.size(0), SplitThreads(x.size(0)), [&](int64_t r0, int64_t r1) {
    Tensor out = y.narrow(0, r0, r1 - r0), in = x.narrow(0, r0, r1 - r0);
    if (b.defined()) {
      at::addmm_out(out, b, in, wt);
    } else {
      at::mm_out(out, in, wt);
    }
  });
  return y;
}

// dx = g·W split over rows, dW = gᵀ·x split over output features; each only where asked for.
std::pair<Tensor, Tensor> InputAndWeightGradients(AutogradContext* ctx, const Tensor& g) {
  const auto saved = ctx->get_saved_variables();
  const Tensor &x = saved[0], &w = saved[1];
  Tensor dx, dw;
  if (ctx->needs_input_grad(0)) {
    dx = torch::empty_like(x);
    ForEachBlock(x.size(0), SplitThreads(x.size(0)), [&](int64_t r0, int64_t r1) {
      Tensor out = dx.narrow(0, r0, r1 - r0);
      at::mm_out(out, g.narrow(0, r0, r1 - r0), w);
    });
  }
  if (ctx->needs_input_grad(1)) {
    dw = torch::empty_like(w);
    ForEachBlock(w.size(0), SplitThreads(w.size(0)), [&](int64_t o0, int64_t o1) {
      Tensor out = dw.narrow(0, o0, o1 - o0);
      at::mm_out(out, g.narrow(1, o0, o1 - o0).t(), x);
    });
  }
  return {dx, dw};
}

// x2 [rows, in] contiguous (the caller reshapes). LibTorch 1.13's custom functions take no
// undefined tensor arguments, hence one function without a bias and one with.
class RowSplitLinearFunction : public torch::autograd::Function<RowSplitLinearFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x2, const Tensor& weight) {
    const Tensor w = weight.contiguous();
    ctx->save_for_backward({x2, w});
    return ForwardRows(x2, w, Tensor());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [dx, dw] = InputAndWeightGradients(ctx, grads[0].contiguous());
    return {dx, dw};
  }
};

class RowSplitAffineFunction : public torch::autograd::Function<RowSplitAffineFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x2, const Tensor& weight,
                        const Tensor& bias) {
    const Tensor w = weight.contiguous();
    ctx->save_for_backward({x2, w});
    return ForwardRows(x2, w, bias.contiguous());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor g = grads[0].contiguous();
    auto [dx, dw] = InputAndWeightGradients(ctx, g);
    return {dx, dw, ctx->needs_input_grad(2) ? g.sum(0) : Tensor()};
  }
};

// OpenBLAS's pthreads build would start its own pool from every OpenMP thread; and
// LOOM_CPU_LINEAR=torch keeps torch::linear everywhere (a way out, and what loom-bench-train
// --linear compares against; read at each call, so that one process can measure both).
bool SplitAllowed() {
  static const bool blas_ok = std::strcmp(OpenBlasThreading(), "pthreads") != 0;
  const char* choice = std::getenv("LOOM_CPU_LINEAR");
  return blas_ok && (choice == nullptr || std::strcmp(choice, "torch") != 0);
}

// Under CPU autocast torch::linear runs in bf16; the split's GEMMs (out= variants, below
// autocast) would quietly run in float32.
bool CpuAutocastOn() {
#if LOOM_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(at::kCPU);
#else
  return at::autocast::is_cpu_enabled();
#endif
}

}  // namespace

bool RowSplitLinearApplies(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  const auto type = x.scalar_type();
  if (CpuAutocastOn() || !x.is_cpu() || !weight.is_cpu() || weight.scalar_type() != type ||
      (type != torch::kFloat32 && type != torch::kFloat64)) {
    return false;
  }
  if (bias.defined() && (!bias.is_cpu() || bias.scalar_type() != type)) return false;
  if (x.dim() < 1 || weight.dim() != 2 || x.size(-1) != weight.size(1)) return false;
  const int64_t rows = x.numel() / std::max<int64_t>(1, x.size(-1));
  return SplitAllowed() && SplitThreads(rows) > 1 &&
         static_cast<double>(rows) * weight.size(0) * weight.size(1) >= kMinMultiplyAdds;
}

Tensor RowSplitLinear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1) &&
                  (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0))),
              "linear: x [..., in], weight [out, in], bias [out]; got x ", x.sizes(), ", weight ",
              weight.sizes(), ", bias ", bias.defined() ? bias.sizes() : torch::IntArrayRef{});
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = weight.size(0);
  const Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  Tensor y = bias.defined() ? RowSplitAffineFunction::apply(x2, weight, bias)
                            : RowSplitLinearFunction::apply(x2, weight);
  return y.view(shape);
}

Tensor Linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  if (RowSplitLinearApplies(x, weight, bias)) return RowSplitLinear(x, weight, bias);
  return torch::linear(x, weight, bias);
}

Tensor Linear(const torch::nn::Linear& module, const Tensor& x) {
  return Linear(x, module->weight, module->bias);
}

}  // namespace loom::cpu_kernels
