#include "worker/trainer/rms_norm_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace loom::trainer {
namespace {

using torch::Tensor;

// Rows per chunk of work: fixed, so that the gradient of w adds the same partial sums in the same
// order at any thread count.
constexpr int64_t kRowsPerChunk = 64;

struct Shape {
  int64_t rows = 0, dim = 0;
  int64_t Chunks() const { return (rows + kRowsPerChunk - 1) / kRowsPerChunk; }
  int64_t ChunkEnd(int64_t chunk) const { return std::min(rows, (chunk + 1) * kRowsPerChunk); }
};

// y[r] = x[r] · rstd[r] · w, rstd[r] = 1 / sqrt(mean(x[r]²) + eps); sums in double.
template <typename T>
void NormRows(const T* x, const T* w, double eps, const Shape& s, int64_t r0, int64_t r1, T* y,
              T* rstd) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * s.dim;
    double squares = 0;
    for (int64_t i = 0; i < s.dim; ++i) squares += static_cast<double>(xr[i]) * xr[i];
    const T rs = static_cast<T>(1.0 / std::sqrt(squares / static_cast<double>(s.dim) + eps));
    rstd[r] = rs;
    T* yr = y + r * s.dim;
    for (int64_t i = 0; i < s.dim; ++i) yr[i] = xr[i] * rs * w[i];
  }
}

// With u = g · w and c = Σ u · x: dx = rstd · u − x · rstd³ · c / D; partial_dw += g · x · rstd.
template <typename T>
void NormGradRows(const T* g, const T* x, const T* w, const T* rstd, const Shape& s, int64_t r0,
                  int64_t r1, T* dx, T* partial_dw) {
  for (int64_t r = r0; r < r1; ++r) {
    const T *gr = g + r * s.dim, *xr = x + r * s.dim;
    const T rs = rstd[r];
    double c = 0;
    for (int64_t i = 0; i < s.dim; ++i) c += static_cast<double>(gr[i]) * w[i] * xr[i];
    const T k = static_cast<T>(static_cast<double>(rs) * rs * rs * c / static_cast<double>(s.dim));
    T* dr = dx + r * s.dim;
    for (int64_t i = 0; i < s.dim; ++i) {
      dr[i] = rs * (gr[i] * w[i]) - xr[i] * k;
      partial_dw[i] += gr[i] * xr[i] * rs;
    }
  }
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& input,
                        const Tensor& weight, double eps) {
    const Shape s{input.numel() / std::max<int64_t>(1, input.size(-1)), input.size(-1)};
    Tensor x = input.contiguous(), w = weight.contiguous();
    Tensor y = torch::empty_like(x), rstd = torch::empty({s.rows}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms norm", [&] {
      at::parallel_for(0, s.Chunks(), 1, [&](int64_t c0, int64_t c1) {
        for (int64_t chunk = c0; chunk < c1; ++chunk) {
          NormRows(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), eps, s, chunk * kRowsPerChunk,
                   s.ChunkEnd(chunk), y.data_ptr<scalar_t>(), rstd.data_ptr<scalar_t>());
        }
      });
    });
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const Tensor g = grads[0].contiguous();
    const Shape s{rstd.size(0), w.size(0)};
    Tensor dx = torch::empty_like(x);
    Tensor partials = torch::zeros({s.Chunks(), s.dim}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms norm backward", [&] {
      at::parallel_for(0, s.Chunks(), 1, [&](int64_t c0, int64_t c1) {
        for (int64_t chunk = c0; chunk < c1; ++chunk) {
          NormGradRows(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                       rstd.data_ptr<scalar_t>(), s, chunk * kRowsPerChunk, s.ChunkEnd(chunk),
                       dx.data_ptr<scalar_t>(), partials.data_ptr<scalar_t>() + chunk * s.dim);
        }
      });
    });
    return {dx, partials.sum(0), Tensor()};
  }
};

}  // namespace

bool CpuRmsNormApplies(const Tensor& x, const Tensor& weight) {
  const auto type = x.scalar_type();
  return x.is_cpu() && weight.is_cpu() && weight.scalar_type() == type &&
         (type == torch::kFloat32 || type == torch::kFloat64);
}

Tensor CpuRmsNorm(const Tensor& x, const Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0) &&
                  CpuRmsNormApplies(x, weight),
              "rms norm: CPU float32/float64 x [..., D] and weight [D] of one dtype; got x ",
              x.sizes(), " ", x.scalar_type(), ", weight ", weight.sizes(), " ",
              weight.scalar_type());
  return RmsNormFunction::apply(x, weight, eps);
}

Tensor CompositeRmsNorm(const Tensor& x, const Tensor& weight, double eps) {
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
}

}  // namespace loom::trainer
