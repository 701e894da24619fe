// A registry's /metrics over real loopback HTTP: live values, refusals, the bind check.
#include "net/metrics_endpoint.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "net/connection_metrics.h"

namespace loom::net {
namespace {

// Everything the server sends for `request` until it closes.
std::string Fetch(int port, const std::string& request) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "connect failed";
  }
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

TEST(MetricsEndpoint, ServesALiveRegistryOverRealHttp) {
  metrics::Registry r;
  r.DeclareGauge("loom_train_loss", "Training loss of the last step.");
  r.Set("loom_train_loss", 2.5, {{"job_id", "demo"}, {"rank", "0"}});
  auto e = MetricsEndpoint::Start(&r, "127.0.0.1", 0);
  ASSERT_TRUE(e.ok()) << e.status();
  const int port = (*e)->port();
  ASSERT_GT(port, 0);
  const std::string close = "Connection: close\r\n\r\n";
  std::string ok = Fetch(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n" + close);
  EXPECT_EQ(ok.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << ok;
  EXPECT_NE(ok.find("text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(ok.find("loom_train_loss{job_id=\"demo\",rank=\"0\"} 2.5"), std::string::npos) << ok;
  r.Set("loom_train_loss", 1.25, {{"job_id", "demo"}, {"rank", "0"}});  // live updates show
  EXPECT_NE(Fetch(port, "GET /metrics HTTP/1.0\r\n\r\n").find("} 1.25"), std::string::npos);
  EXPECT_EQ(Fetch(port, "GET /nope HTTP/1.1\r\n" + close).rfind("HTTP/1.1 404", 0), 0u);
  EXPECT_EQ(Fetch(port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n" + close)
                .rfind("HTTP/1.1 404", 0),
            0u);
  EXPECT_EQ(Fetch(port, "garbage\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  EXPECT_EQ(Fetch(port, "GET /metrics HTTP/1.1\r\nX: " + std::string(10000, 'a'))
                .rfind("HTTP/1.1 431", 0),
            0u);
  EXPECT_NE(Fetch(port, "GET /healthz HTTP/1.1\r\n" + close).find("ok\n"), std::string::npos);
  // A bad bind address is an error naming the field.
  auto bad = MetricsEndpoint::Start(&r, "localhost", 0);
  EXPECT_NE(bad.status().message().find("metrics.bind"), std::string::npos);
}

// An HttpServer's connection counts become gauges and counters; the counters advance by the
// server's change between exports, so they keep counting across scrapes and never go back.
TEST(ConnectionMetrics, GaugesNowCountersByTheChange) {
  metrics::Registry registry;
  ConnectionMetrics exported(registry, "x_http");
  exported.Export({/*open=*/3, /*waiting=*/1, /*refused=*/2, /*evicted=*/5, /*expired=*/0});
  exported.Export({/*open=*/1, /*waiting=*/0, /*refused=*/4, /*evicted=*/5, /*expired=*/7});
  const std::string text = registry.Render();
  for (const char* line :
       {"x_http_connections_open 1\n", "x_http_connections_waiting 0\n",
        "x_http_connections_refused_total 4\n", "x_http_connections_evicted_total 5\n",
        "x_http_connections_expired_total 7\n", "# TYPE x_http_connections_evicted_total counter",
        "# TYPE x_http_connections_open gauge"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " not in\n" << text;
  }
}

}  // namespace
}  // namespace loom::net
