#include "net/connection_metrics.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace loom::net {

ConnectionMetrics::ConnectionMetrics(metrics::Registry& registry, std::string prefix)
    : registry_(registry), prefix_(std::move(prefix)) {
  registry_.DeclareGauge(
      prefix_ + "_connections_open",
      "Connections counted against the server's cap: served, waiting or closing");
  registry_.DeclareGauge(prefix_ + "_connections_waiting",
                         "Connections over their client address's cap, waiting for a place");
  registry_.DeclareCounter(prefix_ + "_connections_refused_total",
                           "Connections closed at once at the server's connection cap");
  registry_.DeclareCounter(
      prefix_ + "_connections_evicted_total",
      "Slow or idle connections displaced by a waiting connection of the same address");
  registry_.DeclareCounter(prefix_ + "_connections_expired_total",
                           "Connections closed after waiting a whole head timeout for a place");
}

void ConnectionMetrics::Export(const ConnectionStats& now) {
  std::lock_guard<std::mutex> lock(mutex_);
  registry_.Set(prefix_ + "_connections_open", static_cast<double>(now.open));
  registry_.Set(prefix_ + "_connections_waiting", static_cast<double>(now.waiting));
  const std::pair<const char*, int64_t> counts[] = {
      {"_connections_refused_total", now.refused - last_.refused},
      {"_connections_evicted_total", now.evicted - last_.evicted},
      {"_connections_expired_total", now.expired - last_.expired}};
  for (const auto& [name, delta] : counts) {
    registry_.Increment(prefix_ + name, static_cast<double>(std::max<int64_t>(0, delta)));
  }
  last_ = now;
}

}  // namespace loom::net
