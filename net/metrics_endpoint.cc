#include "net/metrics_endpoint.h"

#include <arpa/inet.h>

#include "absl/strings/str_cat.h"

namespace loom::net {
namespace {

bool IsIpAddress(const std::string& s) {
  unsigned char buf[sizeof(struct in6_addr)];
  return ::inet_pton(AF_INET, s.c_str(), buf) == 1 || ::inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const metrics::Registry* registry, const std::string& address, int port) {
  if (!IsIpAddress(address)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics.bind: '", address, "' is not an IP address"));
  }
  HttpServerOptions options;
  options.threads = 2;  // Prometheus scrapes; nothing here waits
  options.max_head_bytes = 8 << 10;
  options.max_body_bytes = 0;
  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint(options));
  e->server_.Route("GET", "/metrics", "none", [registry](const HttpRequest&, HttpResponse& res) {
    res.content_type = "text/plain; version=0.0.4";
    res.body = registry->Render();
  });
  e->server_.Route("GET", "/healthz", "none", [](const HttpRequest&, HttpResponse& res) {
    res.content_type = "text/plain";
    res.body = "ok\n";
  });
  auto bound = e->server_.Listen(address, port);
  if (!bound.ok()) {
    return absl::UnavailableError(absl::StrCat("metrics: ", bound.status().message()));
  }
  e->port_ = *bound;
  e->server_.Start();
  return e;
}

}  // namespace loom::net
