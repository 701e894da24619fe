// Loom's metric registry: a thin layer over prometheus-cpp (core) that keeps the call sites
// simple — families declared once by name, series addressed by a label map — and adds what
// Loom needs on top: dropping every series of a finished job, labels stamped on every series at
// render time (the worker id, known only after registration) and `loom_build_info`.
// Exposition is prometheus-cpp's text serializer (format 0.0.4), validated by `promtool check
// metrics` in tests and served by net::MetricsEndpoint (the trainer, the agent) or the coordinator's API.
//
// Thread-safe: metrics are updated from training or request threads while the exporter renders.
#ifndef LOOM_METRICS_PROMETHEUS_H_
#define LOOM_METRICS_PROMETHEUS_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace loom::metrics {

using Labels = std::map<std::string, std::string>;

class Registry {
 public:
  // Declares `loom_build_info{version,commit,torch,component}` = 1.
  explicit Registry(const std::string& component = "");
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Declares a family. Names must match [a-zA-Z_:][a-zA-Z0-9_:]*; counters should end in
  // _total. Redeclaring with the same type is a no-op. Misuse throws std::invalid_argument.
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
  // Names of the declared families, sorted.
  std::vector<std::string> Names() const;

  // Labels added to every series when rendering (e.g. worker="w-1a2b"), so targets found by
  // any discovery mechanism carry them. A series' own label of the same name wins.
  void SetConstantLabels(Labels labels);

  // The whole registry in the text exposition format. Declared families without series are
  // listed too (HELP and TYPE only), so a scrape shows every name a dashboard may ask for.
  std::string Render() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    std::vector<double> bounds;
    prometheus::Family<prometheus::Counter>* counters = nullptr;
    prometheus::Family<prometheus::Gauge>* gauges = nullptr;
    prometheus::Family<prometheus::Histogram>* histograms = nullptr;
    std::map<Labels, void*> series;  // the metric object of each label set, for removal
  };
  Family& Get(const std::string& name, Type type);
  void Declare(const std::string& name, const std::string& help, Type type,
               std::vector<double> bounds);
  void RemoveSeries(Family& f, void* metric);

  mutable std::mutex mu_;
  std::unique_ptr<prometheus::Registry> registry_;
  std::map<std::string, Family> families_;
  Labels constant_labels_;
};

// The label that names a Loom job on every series. Not `job`: Prometheus reserves that for the
// scrape job, and would rename ours to exported_job without honor_labels.
inline constexpr char kJobLabel[] = "job_id";

// What loom_build_info reports, fixed at configure time (cmake/LoomBuildInfo.cmake).
struct BuildInfo {
  std::string version, commit, torch;
};
const BuildInfo& GetBuildInfo();

}  // namespace loom::metrics

#endif  // LOOM_METRICS_PROMETHEUS_H_
