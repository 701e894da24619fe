#include "metrics/prometheus.h"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <stdexcept>

namespace loom::metrics {
namespace {

prometheus::Labels ToPrometheus(const Labels& labels) { return {labels.begin(), labels.end()}; }

// prometheus-cpp checks names when a family is built; Loom refuses earlier, with the name.
bool ValidName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

}  // namespace

Registry::Registry(const std::string& component)
    : registry_(std::make_unique<prometheus::Registry>()) {
  DeclareGauge("loom_build_info",
               "Loom's version, git commit and LibTorch version (value 1), per component.");
  const BuildInfo& b = GetBuildInfo();
  Labels l = {{"version", b.version}, {"commit", b.commit}, {"torch", b.torch}};
  if (!component.empty()) l["component"] = component;
  Set("loom_build_info", 1, l);
}

Registry::~Registry() = default;

void Registry::Declare(const std::string& name, const std::string& help, Type type,
                       std::vector<double> bounds) {
  if (!ValidName(name)) throw std::invalid_argument("invalid metric name '" + name + "'");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = families_.find(name);
  if (it != families_.end()) {
    if (it->second.type != type)
      throw std::invalid_argument("metric '" + name + "' redeclared with another type");
    return;
  }
  Family f{type, help, std::move(bounds), nullptr, nullptr, nullptr, {}};
  switch (type) {
    case Type::kCounter:
      f.counters = &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
      break;
    case Type::kGauge:
      f.gauges = &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
      break;
    case Type::kHistogram:
      f.histograms = &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_);
      break;
  }
  families_.emplace(name, std::move(f));
}

void Registry::DeclareCounter(const std::string& name, const std::string& help) {
  Declare(name, help, Type::kCounter, {});
}
void Registry::DeclareGauge(const std::string& name, const std::string& help) {
  Declare(name, help, Type::kGauge, {});
}
void Registry::DeclareHistogram(const std::string& name, const std::string& help,
                                std::vector<double> upper_bounds) {
  for (size_t i = 1; i < upper_bounds.size(); ++i) {
    if (!(upper_bounds[i] > upper_bounds[i - 1])) {
      throw std::invalid_argument("histogram '" + name + "' bounds must increase");
    }
  }
  Declare(name, help, Type::kHistogram, std::move(upper_bounds));
}

Registry::Family& Registry::Get(const std::string& name, Type type) {
  auto it = families_.find(name);
  if (it == families_.end()) throw std::invalid_argument("metric '" + name + "' not declared");
  if (it->second.type != type)
    throw std::invalid_argument("metric '" + name + "' used as another type");
  return it->second;
}

void Registry::Increment(const std::string& name, double by, const Labels& labels) {
  if (by < 0) throw std::invalid_argument("counter '" + name + "' cannot decrease");
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = Get(name, Type::kCounter);
  auto& c = f.counters->Add(ToPrometheus(labels));
  f.series[labels] = &c;
  c.Increment(by);
}

void Registry::Set(const std::string& name, double value, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = Get(name, Type::kGauge);
  auto& g = f.gauges->Add(ToPrometheus(labels));
  f.series[labels] = &g;
  g.Set(value);
}

void Registry::Observe(const std::string& name, double value, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = Get(name, Type::kHistogram);
  auto& h = f.histograms->Add(ToPrometheus(labels), f.bounds);
  f.series[labels] = &h;
  h.Observe(value);
}

void Registry::RemoveSeries(Family& f, void* metric) {
  if (f.counters) f.counters->Remove(static_cast<prometheus::Counter*>(metric));
  if (f.gauges) f.gauges->Remove(static_cast<prometheus::Gauge*>(metric));
  if (f.histograms) f.histograms->Remove(static_cast<prometheus::Histogram*>(metric));
}

void Registry::RemoveWhere(const std::string& label, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [name, family] : families_) {
    for (auto it = family.series.begin(); it != family.series.end();) {
      auto l = it->first.find(label);
      if (l == it->first.end() || l->second != value) {
        ++it;
        continue;
      }
      RemoveSeries(family, it->second);
      it = family.series.erase(it);
    }
  }
}

void Registry::Clear(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = families_.find(name);
  if (it == families_.end()) return;
  for (auto& [labels, metric] : it->second.series) RemoveSeries(it->second, metric);
  it->second.series.clear();
}

std::vector<std::string> Registry::Names() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [name, family] : families_) out.push_back(name);
  return out;
}

void Registry::SetConstantLabels(Labels labels) {
  std::lock_guard<std::mutex> lock(mu_);
  constant_labels_ = std::move(labels);
}

std::string Registry::Render() const {
  std::vector<prometheus::MetricFamily> families;
  Labels constant;
  {
    std::lock_guard<std::mutex> lock(mu_);
    families = registry_->Collect();
    constant = constant_labels_;
    for (const auto& [name, f] : families_) {
      if (!f.series.empty()) continue;
      prometheus::MetricFamily empty;
      empty.name = name;
      empty.help = f.help;
      empty.type = f.type == Type::kCounter ? prometheus::MetricType::Counter
                   : f.type == Type::kGauge ? prometheus::MetricType::Gauge
                                            : prometheus::MetricType::Histogram;
      families.push_back(std::move(empty));
    }
  }
  std::sort(families.begin(), families.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  for (auto& f : families) {
    for (auto& m : f.metric) {
      for (const auto& label : constant) {
        const bool has = std::any_of(m.label.begin(), m.label.end(),
                                     [&](const auto& l) { return l.name == label.first; });
        if (!has) m.label.push_back({label.first, label.second});
      }
      std::sort(m.label.begin(), m.label.end());
    }
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace loom::metrics
