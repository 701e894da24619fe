// GET /metrics (and GET /healthz) of a metrics::Registry on its own HttpServer: how trainer ranks
// and worker agents export their metrics (the coordinator and loom-serve route /metrics on their
// API servers instead).
#ifndef LOOM_NET_METRICS_ENDPOINT_H_
#define LOOM_NET_METRICS_ENDPOINT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "metrics/prometheus.h"
#include "net/http_server.h"

namespace loom::net {

class MetricsEndpoint {
 public:
  // Binds `address:port` (an IP address; port 0 = any free port) and serves `registry`, which
  // must outlive the endpoint. Errors name the field (metrics.bind).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const metrics::Registry* registry,
                                                                const std::string& address,
                                                                int port);
  ~MetricsEndpoint() { server_.Stop(); }

  int port() const { return port_; }

 private:
  explicit MetricsEndpoint(HttpServerOptions options) : server_(std::move(options)) {}
  HttpServer server_;
  int port_ = 0;
};

}  // namespace loom::net

#endif  // LOOM_NET_METRICS_ENDPOINT_H_
