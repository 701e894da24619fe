// An HttpServer's connection caps on /metrics (http_server.h, ConnectionStats): how many
// connections are open and waiting now, and how many were refused at the global cap, evicted
// for a waiting connection of their address, or closed after waiting a whole head timeout. What
// an operator watches for a slowloris or a client that opens too many connections.
#ifndef LOOM_NET_CONNECTION_METRICS_H_
#define LOOM_NET_CONNECTION_METRICS_H_

#include <mutex>
#include <string>

#include "metrics/prometheus.h"
#include "net/http_server.h"

namespace loom::net {

class ConnectionMetrics {
 public:
  // Declares <prefix>_connections_open and _waiting (gauges) and <prefix>_connections_refused,
  // _evicted and _expired _total (counters) in `registry`, which must outlive this.
  ConnectionMetrics(metrics::Registry& registry, std::string prefix);

  // Sets the gauges and advances the counters by what `now` counted since the last call (the
  // server counts from its start; the registry's counters only go up). Call before rendering.
  void Export(const ConnectionStats& now);

 private:
  metrics::Registry& registry_;
  const std::string prefix_;
  std::mutex mutex_;
  ConnectionStats last_;
};

}  // namespace loom::net

#endif  // LOOM_NET_CONNECTION_METRICS_H_
