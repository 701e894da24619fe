#include "prometheus.h"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <stdexcept>

namespace loom::metrics {
namespace {

bool ValidName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  for (char c : help) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string LabelText(const Labels& labels, const std::string& extra_key = "",
                      const std::string& extra_value = "") {
  if (labels.empty() && extra_key.empty()) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    out += (first ? "" : ",") + k + "=\"" + EscapeLabelValue(v) + "\"";
    first = false;
  }
  if (!extra_key.empty()) out += (first ? "" : ",") + extra_key + "=\"" + extra_value + "\"";
  return out + "}";
}

}  // namespace

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[32];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {  // integers in plain digits: le="10", not 1e+01
    std::snprintf(buf, sizeof(buf), "%.0f", v);
    return buf;
  }
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  // Prefer the shortest representation that round-trips.
  for (int precision = 1; precision < 17; ++precision) {
    char shorter[32];
    std::snprintf(shorter, sizeof(shorter), "%.*g", precision, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

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
  families_[name] = Family{type, help, std::move(bounds), {}};
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
  Get(name, Type::kCounter).series[labels].value += by;
}

void Registry::Set(const std::string& name, double value, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Get(name, Type::kGauge).series[labels].value = value;
}

void Registry::RemoveWhere(const std::string& label, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [name, family] : families_) {
    for (auto it = family.series.begin(); it != family.series.end();) {
      auto l = it->first.find(label);
      it = (l != it->first.end() && l->second == value) ? family.series.erase(it) : std::next(it);
    }
  }
}

void Registry::Clear(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = families_.find(name);
  if (it != families_.end()) it->second.series.clear();
}

void DeclareTrainMetrics(Registry& r) {
  r.DeclareGauge("loom_train_loss", "Training loss of the last optimizer step.");
  r.DeclareGauge("loom_train_eval_loss", "Held-out loss at the last evaluation.");
  r.DeclareGauge("loom_train_eval_accuracy_ratio", "Held-out accuracy over scored positions.");
  r.DeclareGauge("loom_train_eval_exact_match_ratio",
                 "Held-out share of examples with every scored position right.");
  r.DeclareGauge("loom_train_reasoning_pass_at_1_ratio",
                 "Reasoning eval: mean share of correct sampled answers per problem.");
  r.DeclareGauge("loom_train_reasoning_maj_at_k_ratio",
                 "Reasoning eval: share of problems whose majority answer is correct.");
  r.DeclareGauge("loom_train_learning_rate", "Learning rate of the last step.");
  r.DeclareGauge("loom_train_grad_norm", "Global gradient norm before clipping.");
  r.DeclareGauge("loom_train_tokens_per_second", "Training throughput of the last step.");
  r.DeclareGauge("loom_train_mfu_ratio", "Model FLOP utilisation against metrics.peak_flops.");
  r.DeclareGauge("loom_train_step", "Optimizer steps completed.");
  r.DeclareGauge("loom_train_total_steps", "Optimizer steps the job will run.");
  r.DeclareCounter("loom_train_tokens_total", "Training tokens processed.");
  r.DeclareCounter("loom_train_nan_skipped_steps_total",
                   "Steps skipped for a non-finite loss or gradient.");
  r.DeclareCounter("loom_train_checkpoint_bytes_total", "Bytes written to checkpoints.");
  r.DeclareHistogram("loom_train_step_seconds", "Wall time of one optimizer step.",
                     {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60});
  r.DeclareHistogram("loom_train_checkpoint_write_seconds",
                     "Wall time to write and commit a checkpoint.",
                     {0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300});
  r.DeclareHistogram("loom_train_checkpoint_load_seconds",
                     "Wall time to load and verify a checkpoint.",
                     {0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300});
}

std::vector<std::string> Registry::Names() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [name, family] : families_) out.push_back(name);
  return out;
}

void Registry::Observe(const std::string& name, double value, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& f = Get(name, Type::kHistogram);
  Series& s = f.series[labels];
  if (s.buckets.empty()) s.buckets.assign(f.bounds.size(), 0);
  for (size_t i = 0; i < f.bounds.size(); ++i) {
    if (value <= f.bounds[i]) ++s.buckets[i];
  }
  s.sum += value;
  ++s.count;
}

std::string Registry::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream out;
  for (const auto& [name, f] : families_) {
    const char* type = f.type == Type::kCounter ? "counter"
                       : f.type == Type::kGauge ? "gauge"
                                                : "histogram";
    out << "# HELP " << name << " " << EscapeHelp(f.help) << "\n";
    out << "# TYPE " << name << " " << type << "\n";
    for (const auto& [labels, s] : f.series) {
      if (f.type != Type::kHistogram) {
        out << name << LabelText(labels) << " " << FormatValue(s.value) << "\n";
        continue;
      }
      for (size_t i = 0; i < f.bounds.size(); ++i) {
        out << name << "_bucket" << LabelText(labels, "le", FormatValue(f.bounds[i])) << " "
            << s.buckets[i] << "\n";
      }
      out << name << "_bucket" << LabelText(labels, "le", "+Inf") << " " << s.count << "\n";
      out << name << "_sum" << LabelText(labels) << " " << FormatValue(s.sum) << "\n";
      out << name << "_count" << LabelText(labels) << " " << s.count << "\n";
    }
  }
  return out.str();
}

}  // namespace loom::metrics
