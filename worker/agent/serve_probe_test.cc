// ServeProbe against real loopback servers: ready once /healthz answers 200, not ready (and its
// last OK time frozen) once the server is gone, never ready on a 503, and prompt to stop even
// while a probe waits on a server that accepts connections but never answers (SIGSTOPped).
#include "worker/agent/serve_probe.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "net/http_server.h"

namespace loom::agent {
namespace {

using Clock = std::chrono::steady_clock;
constexpr ServeProbe::Options kFast = {/*period_ms=*/50, /*timeout_ms=*/500};

// A server answering GET /healthz with `status`, on a free loopback port.
std::unique_ptr<net::HttpServer> HealthServer(int status, int* port) {
  auto http = std::make_unique<net::HttpServer>(net::HttpServerOptions{});
  http->Route("GET", "/healthz", "none", [status](const net::HttpRequest&, net::HttpResponse& res) {
    res.status = status;
    res.body = R"({"status":"ok"})";
  });
  absl::StatusOr<int> bound = http->Listen("127.0.0.1", 0);
  EXPECT_TRUE(bound.ok()) << bound.status();
  *port = bound.value_or(0);
  http->Start();
  return http;
}

std::string Url(int port) { return absl::StrCat("http://127.0.0.1:", port); }

// Whether `done` holds within `ms`.
bool Within(int ms, const std::function<bool()>& done) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

TEST(ServeProbeTest, ReadyWhileTheServerAnswersThenNot) {
  int port = 0;
  auto http = HealthServer(200, &port);
  ServeProbe probe(Url(port), kFast);
  ASSERT_TRUE(Within(10000, [&] { return probe.ready(); }));
  const int64_t first_ok = probe.last_ok_ms();
  EXPECT_GT(first_ok, 0);
  ASSERT_TRUE(Within(10000, [&] { return probe.last_ok_ms() > first_ok; }));  // it goes on
  http->Stop();
  ASSERT_TRUE(Within(10000, [&] { return !probe.ready(); }));
  const int64_t last_ok = probe.last_ok_ms();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // several periods
  EXPECT_FALSE(probe.ready());
  EXPECT_EQ(probe.last_ok_ms(), last_ok);
}

TEST(ServeProbeTest, AnErrorStatusIsNotReady) {
  int port = 0;
  auto http = HealthServer(503, &port);
  ServeProbe probe(Url(port), kFast);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(probe.ready());
  EXPECT_EQ(probe.last_ok_ms(), 0);
}

// A listening socket nobody accepts from: connections complete (the kernel's backlog) and the
// request is never answered, as with a SIGSTOPped server.
TEST(ServeProbeTest, AHungServerIsNotReadyAndStoppingIsPrompt) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 16), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  auto probe = std::make_unique<ServeProbe>(Url(ntohs(addr.sin_port)), kFast);
  std::this_thread::sleep_for(std::chrono::milliseconds(700));  // at least one timeout
  EXPECT_FALSE(probe->ready());
  EXPECT_EQ(probe->last_ok_ms(), 0);
  const auto start = Clock::now();
  probe.reset();  // waits for the probe in flight: bounded by its timeout
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(2000));
  ::close(fd);
}

TEST(ServeProbeTest, StopsWithoutWaitingOutItsPeriod) {
  auto probe = std::make_unique<ServeProbe>("http://127.0.0.1:1", ServeProbe::Options{60000, 500});
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // now between probes
  const auto start = Clock::now();
  probe.reset();
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(1000));
}

}  // namespace
}  // namespace loom::agent
