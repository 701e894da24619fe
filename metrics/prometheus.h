// A minimal Prometheus registry and text-exposition writer (format 0.0.4). prometheus-cpp is
// not packaged in Debian, and Loom needs little: counters, gauges and histograms with labels,
// rendered on demand. Output is validated by `promtool check metrics` in tests.
//
// Thread-safe: metrics are updated from training or request threads while the exporter renders.
#ifndef LOOM_METRICS_PROMETHEUS_H_
#define LOOM_METRICS_PROMETHEUS_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace loom::metrics {

using Labels = std::map<std::string, std::string>;

class Registry {
 public:
  // Declares a family. Names must match [a-zA-Z_:][a-zA-Z0-9_:]*; counters should end in
  // _total. Redeclaring with the same type is a no-op.
  void DeclareCounter(const std::string& name, const std::string& help);
  void DeclareGauge(const std::string& name, const std::string& help);
  void DeclareHistogram(const std::string& name, const std::string& help,
                        std::vector<double> upper_bounds);

  void Increment(const std::string& name, double by = 1.0, const Labels& labels = {});
  void Set(const std::string& name, double value, const Labels& labels = {});
  void Observe(const std::string& name, double value, const Labels& labels = {});

  // Drops every series of every family whose labels have label = value (a finished job's
  // series, so per-job cardinality stays bounded by the jobs running now).
  void RemoveWhere(const std::string& label, const std::string& value);
  // Drops every series of one family (gauges rebuilt from scratch on each render).
  void Clear(const std::string& name);
  // Names of the declared families.
  std::vector<std::string> Names() const;

  // The whole registry in the text exposition format.
  std::string Render() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Series {
    double value = 0;               // counter / gauge
    std::vector<uint64_t> buckets;  // histogram: cumulative counts per upper bound
    double sum = 0;
    uint64_t count = 0;
  };
  struct Family {
    Type type;
    std::string help;
    std::vector<double> bounds;
    std::map<Labels, Series> series;
  };
  Family& Get(const std::string& name, Type type);
  void Declare(const std::string& name, const std::string& help, Type type,
               std::vector<double> bounds);

  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
};

// The trainer's metric families (loom_train_*), declared once for the two places that export
// them: trainer ranks and the worker agent that re-exports rank 0's numbers (docs/deploy.md).
void DeclareTrainMetrics(Registry& r);

// Formats a sample value the way Prometheus expects (+Inf, -Inf, NaN, shortest round-trip).
std::string FormatValue(double v);
// Escapes a label value (backslash, double quote, newline).
std::string EscapeLabelValue(const std::string& v);

}  // namespace loom::metrics

#endif  // LOOM_METRICS_PROMETHEUS_H_
