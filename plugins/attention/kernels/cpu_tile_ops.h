// The raw-buffer building blocks of Loom's fused CPU attention kernels (fused_attention.cc, the
// simplicial kernel): row-major GEMMs straight into BLAS, and vectorised softmax row loops. No
// tensor objects per tile: the kernels call these on scratch buffers many thousand times a step.
#ifndef LOOM_PLUGINS_ATTENTION_KERNELS_CPU_TILE_OPS_H_
#define LOOM_PLUGINS_ATTENTION_KERNELS_CPU_TILE_OPS_H_

#include <torch/torch.h>

#include <cstdint>
#include <type_traits>

// The Fortran BLAS GEMMs, weak: Debian's LibTorch calls them from libblas (OpenBLAS), so they
// are in the process whenever LibTorch is; where they are not (LibTorch with a statically linked
// MKL), the tile products go through LibTorch's mm instead.
extern "C" {
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc) __attribute__((weak));
}

namespace loom::attention::kernels {

// ---- Row kernels. The float versions are compiled for AVX-512, AVX2 and baseline x86-64 and
// picked at load time (GCC function multiversioning), so one binary runs everywhere and uses
// the widest vectors the CPU has. The float64 versions (tests and references) are plain loops
// with the C library's exp. exp is clamped below (float: at −87.3), so masked scores must be
// zeroed by the caller, not exponentiated.

float RowMax(const float* x, int64_t n);
double RowMax(const double* x, int64_t n);
// x[i] := exp(x[i] − shift); returns the sum of the new values.
float ExpShiftSum(float* x, int64_t n, float shift);
double ExpShiftSum(double* x, int64_t n, double shift);
// x[i] := exp(x[i] − shift).
void ExpShift(float* x, int64_t n, float shift);
void ExpShift(double* x, int64_t n, double shift);
// ds[i] := p[i] · (ds[i] − delta): the softmax backward of one score row.
void SoftmaxGradRow(const float* p, float* ds, int64_t n, float delta);
void SoftmaxGradRow(const double* p, double* ds, int64_t n, double delta);
// y[i] += a · x[i], long rows.
void AxpyLong(float* y, const float* x, int64_t n, float a);

// y[i] += a · x[i]. Rows of one head's d values (8–64 in practice) stay inline: the
// multiversioned loop is an indirect call, and the IHA mixing calls it H·P times per token,
// which cost more than the FMAs at d = 8 (8 % of a relation-composition IHA step).
inline void Axpy(float* y, const float* x, int64_t n, float a) {
  if (n >= 64) return AxpyLong(y, x, n, a);
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
inline void Axpy(double* y, const double* x, int64_t n, double a) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

template <typename T>
bool HaveBlas() {
  if constexpr (std::is_same_v<T, float>) return sgemm_ != nullptr;
  return dgemm_ != nullptr;
}

// Row-major C[m×n] = op(A)[m×k] · op(B)[k×n] + beta · C (beta 0 or 1) on raw buffers. A is
// stored m×k (k×m when ta) with row stride lda; B likewise. The column-major BLAS computes
// Cᵀ = op(B)ᵀ · op(A)ᵀ, which is the same memory.
template <typename T>
void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc) {
  if (HaveBlas<T>()) {
    const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    const T one = 1;
    if constexpr (std::is_same_v<T, float>) {
      sgemm_(tb ? "T" : "N", ta ? "T" : "N", &mi, &ni, &ki, &one, b, &la, a, &lb, &beta, c, &lc);
    } else {
      dgemm_(tb ? "T" : "N", ta ? "T" : "N", &mi, &ni, &ki, &one, b, &la, a, &lb, &beta, c, &lc);
    }
    return;
  }
  auto opts = torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto view = [&](const T* x, int64_t rows, int64_t cols, int64_t ld, bool t) {
    torch::Tensor v = torch::from_blob(const_cast<T*>(x), {rows, cols}, {ld, 1}, opts);
    return t ? v.t() : v;
  };
  torch::Tensor out = torch::from_blob(c, {m, n}, {ldc, 1}, opts);
  torch::Tensor prod =
      view(a, ta ? k : m, ta ? m : k, lda, ta).mm(view(b, tb ? n : k, tb ? k : n, ldb, tb));
  if (beta == T(0)) {
    out.copy_(prod);
  } else {
    out.add_(prod);
  }
}

}  // namespace loom::attention::kernels

#endif  // LOOM_PLUGINS_ATTENTION_KERNELS_CPU_TILE_OPS_H_
