#include "coordinator/stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace loom::coordinator {
namespace {

// Continued fraction of the incomplete beta function (modified Lentz), valid for
// x < (a + 1) / (a + b + 2).
double BetaContinuedFraction(double a, double b, double x) {
  constexpr double kTiny = 1e-300, kEps = 1e-15;
  double c = 1, d = 1 - (a + b) * x / (a + 1);
  if (std::fabs(d) < kTiny) d = kTiny;
  d = 1 / d;
  double h = d;
  for (int m = 1; m <= 500; ++m) {
    const double m2 = 2.0 * m;
    double aa = m * (b - m) * x / ((a + m2 - 1) * (a + m2));
    d = 1 + aa * d;
    c = 1 + aa / c;
    d = 1 / (std::fabs(d) < kTiny ? kTiny : d);
    c = std::fabs(c) < kTiny ? kTiny : c;
    h *= d * c;
    aa = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1));
    d = 1 + aa * d;
    c = 1 + aa / c;
    d = 1 / (std::fabs(d) < kTiny ? kTiny : d);
    c = std::fabs(c) < kTiny ? kTiny : c;
    const double step = d * c;
    h *= step;
    if (std::fabs(step - 1) < kEps) break;
  }
  return h;
}

// The regularised incomplete beta function I_x(a, b).
double RegularizedBeta(double a, double b, double x) {
  if (x <= 0) return 0;
  if (x >= 1) return 1;
  const double front = std::exp(std::lgamma(a + b) - std::lgamma(a) - std::lgamma(b) +
                                a * std::log(x) + b * std::log1p(-x));
  if (x < (a + 1) / (a + b + 2)) return front * BetaContinuedFraction(a, b, x) / a;
  return 1 - front * BetaContinuedFraction(b, a, 1 - x) / b;
}

}  // namespace

double Mean(const std::vector<double>& x) {
  if (x.empty()) return std::numeric_limits<double>::quiet_NaN();
  double sum = 0;
  for (double v : x) sum += v;
  return sum / static_cast<double>(x.size());
}

double SampleSd(const std::vector<double>& x) {
  if (x.size() < 2) return 0;
  const double m = Mean(x);
  double ss = 0;
  for (double v : x) ss += (v - m) * (v - m);
  return std::sqrt(ss / static_cast<double>(x.size() - 1));
}

double StudentTCdf(double t, double df) {
  const double tail = 0.5 * RegularizedBeta(df / 2, 0.5, df / (df + t * t));
  return t >= 0 ? 1 - tail : tail;
}

double StudentTQuantile(double p, double df) {
  // Bisection on the CDF: monotone, and 200 halvings of [-1e6, 1e6] reach double precision.
  double lo = -1e6, hi = 1e6;
  for (int i = 0; i < 200 && hi - lo > 1e-12 * std::max(1.0, std::fabs(lo)); ++i) {
    const double mid = 0.5 * (lo + hi);
    (StudentTCdf(mid, df) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

Interval TInterval(const std::vector<double>& x, double level) {
  const double m = Mean(x);
  if (x.size() < 2) return {m, m};
  const double half = StudentTQuantile(0.5 + level / 2, static_cast<double>(x.size() - 1)) *
                      SampleSd(x) / std::sqrt(static_cast<double>(x.size()));
  return {m - half, m + half};
}

double TTestPValue(const std::vector<double>& x) {
  if (x.size() < 2) return 1;
  const double sd = SampleSd(x), m = Mean(x);
  if (sd == 0) return m == 0 ? 1 : 0;
  const double t = m / (sd / std::sqrt(static_cast<double>(x.size())));
  return 2 * (1 - StudentTCdf(std::fabs(t), static_cast<double>(x.size() - 1)));
}

double SignTestPValue(int wins, int losses) {
  const int n = wins + losses, k = std::min(wins, losses);
  if (n <= 0) return 1;
  // P(X <= k) = sum_i C(n, i) / 2^n, in logs so that large n does not overflow.
  double tail = 0;
  for (int i = 0; i <= k; ++i) {
    tail += std::exp(std::lgamma(n + 1.0) - std::lgamma(i + 1.0) - std::lgamma(n - i + 1.0) -
                     n * std::log(2.0));
  }
  return std::min(1.0, 2 * tail);
}

Interval BootstrapInterval(const std::vector<double>& x, int resamples, uint64_t seed,
                           double level) {
  if (x.empty()) return {Mean(x), Mean(x)};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, x.size() - 1);
  std::vector<double> means(static_cast<size_t>(resamples));
  for (double& m : means) {
    double sum = 0;
    for (size_t i = 0; i < x.size(); ++i) sum += x[pick(rng)];
    m = sum / static_cast<double>(x.size());
  }
  std::sort(means.begin(), means.end());
  auto at = [&](double q) {
    const double pos = q * static_cast<double>(means.size() - 1);
    const size_t i = static_cast<size_t>(pos);
    const double frac = pos - static_cast<double>(i);
    return i + 1 < means.size() ? means[i] * (1 - frac) + means[i + 1] * frac : means[i];
  };
  return {at((1 - level) / 2), at((1 + level) / 2)};
}

}  // namespace loom::coordinator
