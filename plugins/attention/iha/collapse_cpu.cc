#include "plugins/attention/iha/collapse_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace loom::attention::iha {
namespace {

using torch::Tensor;

// Rows (b, n) per chunk of work: fixed, so that the gradient of R sums the same partial sums in
// the same order at any thread count.
constexpr int64_t kRowsPerChunk = 64;

struct Shape {
  int64_t rows = 0, h = 0, g = 0, d = 0;  // rows = B·N, g = H·P
  int64_t Chunks() const { return (rows + kRowsPerChunk - 1) / kRowsPerChunk; }
  int64_t ChunkEnd(int64_t chunk) const { return std::min(rows, (chunk + 1) * kRowsPerChunk); }
};

// out[r, i, :] = Σ_j c[i, j] · x[r, j, :] (the forward: i over H, j over H·P; the backward's dx
// is the same with cᵀ).
template <typename T>
void MixRows(const T* x, const T* c, bool transposed, T* out, int64_t r0, int64_t r1,
             int64_t in_rows, int64_t out_rows, int64_t d) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * in_rows * d;
    for (int64_t i = 0; i < out_rows; ++i) {
      T* o = out + (r * out_rows + i) * d;
      std::fill(o, o + d, T(0));
      for (int64_t j = 0; j < in_rows; ++j) {
        const T w = transposed ? c[j * out_rows + i] : c[i * in_rows + j];
        const T* src = xr + j * d;
        for (int64_t e = 0; e < d; ++e) o[e] += w * src[e];
      }
    }
  }
}

// partial[h·g + j] += Σ_{r in [r0, r1)} Σ_e gout[r, h, e] · x[r, j, e]
template <typename T>
void CollapseGradRows(const T* gout, const T* x, const Shape& s, int64_t r0, int64_t r1,
                      T* partial) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t i = 0; i < s.h; ++i) {
      const T* go = gout + (r * s.h + i) * s.d;
      for (int64_t j = 0; j < s.g; ++j) {
        const T* xr = x + (r * s.g + j) * s.d;
        T dot = 0;
        for (int64_t e = 0; e < s.d; ++e) dot += go[e] * xr[e];
        partial[i * s.g + j] += dot;
      }
    }
  }
}

Shape ShapeOf(const Tensor& pseudo) {
  return {pseudo.size(0) * pseudo.size(1), pseudo.size(2), pseudo.size(2) * pseudo.size(3),
          pseudo.size(4)};
}

class CollapseFunction : public torch::autograd::Function<CollapseFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& pseudo,
                        const Tensor& collapse) {
    Tensor x = pseudo.contiguous(), c = collapse.contiguous();
    ctx->save_for_backward({x, c});
    const Shape s = ShapeOf(x);
    Tensor out = torch::empty({x.size(0), x.size(1), s.h, s.d}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "iha collapse", [&] {
      at::parallel_for(0, s.Chunks(), 1, [&](int64_t c0, int64_t c1) {
        for (int64_t chunk = c0; chunk < c1; ++chunk) {
          MixRows(x.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), false, out.data_ptr<scalar_t>(),
                  chunk * kRowsPerChunk, s.ChunkEnd(chunk), s.g, s.h, s.d);
        }
      });
    });
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &c = saved[1];
    const Tensor gout = grads[0].contiguous();
    const Shape s = ShapeOf(x);
    Tensor dx = torch::empty_like(x);
    Tensor partials = torch::zeros({s.Chunks(), s.h * s.g}, x.options());
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "iha collapse backward", [&] {
      at::parallel_for(0, s.Chunks(), 1, [&](int64_t c0, int64_t c1) {
        for (int64_t chunk = c0; chunk < c1; ++chunk) {
          const int64_t r0 = chunk * kRowsPerChunk, r1 = s.ChunkEnd(chunk);
          MixRows(gout.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), true, dx.data_ptr<scalar_t>(),
                  r0, r1, s.h, s.g, s.d);
          CollapseGradRows(gout.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), s, r0, r1,
                           partials.data_ptr<scalar_t>() + chunk * s.h * s.g);
        }
      });
    });
    return {dx, partials.sum(0).view({s.h, s.g})};
  }
};

}  // namespace

bool CpuCollapseApplies(const Tensor& pseudo, const Tensor& collapse) {
  const auto type = pseudo.scalar_type();
  return pseudo.is_cpu() && collapse.is_cpu() && collapse.scalar_type() == type &&
         (type == torch::kFloat32 || type == torch::kFloat64);
}

Tensor CpuCollapse(const Tensor& pseudo, const Tensor& collapse) {
  TORCH_CHECK(pseudo.dim() == 5 && CpuCollapseApplies(pseudo, collapse),
              "iha collapse: CPU float32/float64 pseudo outputs [B, N, H, P, dv]");
  return CollapseFunction::apply(pseudo, collapse);
}

}  // namespace loom::attention::iha
