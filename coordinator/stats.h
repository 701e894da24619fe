// The statistics of sweep reports (docs/sweeps.md): sample mean and standard deviation, Student t
// intervals and tests (the t distribution through the regularised incomplete beta function), and
// the percentile bootstrap. Plain doubles, no LibTorch.
#ifndef LOOM_COORDINATOR_STATS_H_
#define LOOM_COORDINATOR_STATS_H_

#include <cstdint>
#include <vector>

namespace loom::coordinator {

double Mean(const std::vector<double>& x);
// n - 1 in the denominator; 0 for fewer than two values.
double SampleSd(const std::vector<double>& x);

// P(T <= t) for Student's t with `df` degrees of freedom (df > 0).
double StudentTCdf(double t, double df);
// The t with P(T <= t) = p, 0 < p < 1.
double StudentTQuantile(double p, double df);

struct Interval {
  double low = 0, high = 0;
};

// Mean ± t_{(1+level)/2, n-1} · sd / sqrt(n); a point interval for n < 2.
Interval TInterval(const std::vector<double>& x, double level = 0.95);
// Two-sided p-value of a one-sample t test of mean 0 (1 for n < 2; 0 or 1 when sd is 0).
double TTestPValue(const std::vector<double>& x);
// Two-sided exact sign test (binomial, p = 1/2) of `wins` against `losses`, ties left out:
// min(1, 2 P(X <= min(wins, losses))) with X ~ Bin(wins + losses, 1/2); 1 when both are 0.
double SignTestPValue(int wins, int losses);
// Percentile bootstrap interval of the mean: `resamples` resamples with replacement from a
// generator seeded with `seed` (the same inputs give the same interval).
Interval BootstrapInterval(const std::vector<double>& x, int resamples = 10000, uint64_t seed = 1,
                           double level = 0.95);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_STATS_H_
