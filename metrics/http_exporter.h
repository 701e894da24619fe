// Serves a Registry at GET /metrics over HTTP/1.1 (one request per connection), plus GET
// /healthz. Deliberately tiny and dependency-free so trainer ranks can export metrics without
// linking an HTTP library: one background thread, bounded request size, per-connection timeout.
#ifndef LOOM_METRICS_HTTP_EXPORTER_H_
#define LOOM_METRICS_HTTP_EXPORTER_H_

#include <atomic>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "metrics/prometheus.h"

namespace loom::metrics {

class HttpExporter {
 public:
  // Binds `address:port` (port 0 = any free port) and starts serving `registry`, which must
  // outlive the exporter.
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const Registry* registry,
                                                             const std::string& address, int port);
  ~HttpExporter();  // stops the thread and closes the socket

  int port() const { return port_; }

 private:
  HttpExporter() = default;
  void Serve();
  void Handle(int fd);

  const Registry* registry_ = nullptr;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace loom::metrics

#endif  // LOOM_METRICS_HTTP_EXPORTER_H_
