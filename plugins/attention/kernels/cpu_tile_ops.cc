#include "plugins/attention/kernels/cpu_tile_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace loom::attention::kernels {
namespace {

constexpr int kLanes = 16;

// exp(x) for float: 2^k · e^r with r = x − k·ln2 (Cody–Waite), |r| ≤ ln2/2, degree-6 polynomial
// (relative error < 2e-7, about 2 ulp); x is clamped to [−87.3, 88.3], so masked scores must be
// zeroed by the caller, not exponentiated. Branch-free, so loops over it vectorise.
inline __attribute__((always_inline)) float ExpFloat(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float magic = 12582912.0f;  // 1.5·2^23: adding it rounds to an integer in the low bits
  const float t = x * 1.44269504088896341f + magic;
  const float kf = t - magic;
  int32_t t_bits;
  std::memcpy(&t_bits, &t, sizeof t_bits);
  int32_t magic_bits;
  std::memcpy(&magic_bits, &magic, sizeof magic_bits);
  const int32_t ki = t_bits - magic_bits;
  const float r = (x - kf * 0.693359375f) - kf * -2.12194440e-4f;
  float poly = 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const int32_t bits = (ki + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return poly * scale;
}

}  // namespace

#define LOOM_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))

LOOM_MULTIVERSION float RowMax(const float* x, int64_t n) {
  float lanes[kLanes];
  for (float& l : lanes) l = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] = x[i + j] > lanes[j] ? x[i + j] : lanes[j];
  }
  for (; i < n; ++i) lanes[0] = x[i] > lanes[0] ? x[i] : lanes[0];
  float m = lanes[0];
  for (int j = 1; j < kLanes; ++j) m = lanes[j] > m ? lanes[j] : m;
  return m;
}

// x[i] := exp(x[i] − shift); returns the sum of the new values.
LOOM_MULTIVERSION float ExpShiftSum(float* x, int64_t n, float shift) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      x[i + j] = ExpFloat(x[i + j] - shift);
      lanes[j] += x[i + j];
    }
  }
  for (; i < n; ++i) {
    x[i] = ExpFloat(x[i] - shift);
    lanes[0] += x[i];
  }
  float sum = 0;
  for (float l : lanes) sum += l;
  return sum;
}

// ds[i] := p[i] · (ds[i] − delta): the softmax backward of one score row.
LOOM_MULTIVERSION void SoftmaxGradRow(const float* p, float* ds, int64_t n, float delta) {
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - delta);
}

LOOM_MULTIVERSION void ExpShift(float* x, int64_t n, float shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = ExpFloat(x[i] - shift);
}

// y[i] += a · x[i]
LOOM_MULTIVERSION void AxpyLong(float* y, const float* x, int64_t n, float a) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// float64 (tests and references): plain loops with the C library's exp.
double RowMax(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}
double ExpShiftSum(double* x, int64_t n, double shift) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}
void SoftmaxGradRow(const double* p, double* ds, int64_t n, double delta) {
  for (int64_t i = 0; i < n; ++i) ds[i] = p[i] * (ds[i] - delta);
}
void ExpShift(double* x, int64_t n, double shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

}  // namespace loom::attention::kernels
