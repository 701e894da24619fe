// ForwardRequest between two real servers on loopback: a front server whose route forwards to an
// upstream one. Status, body and headers are relayed, the client's credentials are replaced by
// the upstream's, a stream arrives piece by piece as it is produced, a client that goes away
// ends the upstream's stream, and an upstream that is down or silent is a 502 or a 504.
#include "net/http_proxy.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "net/test_sockets.h"

namespace loom::net {
namespace {

using std::chrono::milliseconds;

class HttpProxyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    upstream_ = std::make_unique<HttpServer>(HttpServerOptions{});
    upstream_->Route("POST", "/echo", "none", [](const HttpRequest& req, HttpResponse& res) {
      res.status = 201;
      res.content_type = "application/x-echo";
      res.body = absl::StrCat(req.Header("authorization"), "|", req.Header("content-type"), "|",
                              req.Header("cookie"), "|", req.body);
    });
    upstream_->Route("GET", "/busy", "none", [](const HttpRequest&, HttpResponse& res) {
      SetJsonError(res, 429, "queue full");
    });
    upstream_->Route("GET", "/slow", "none", [](const HttpRequest&, HttpResponse& res) {
      std::this_thread::sleep_for(milliseconds(1500));
      res.body = "late";
    });
    upstream_->Route("GET", "/events", "none", [this](const HttpRequest&, HttpResponse& res) {
      res.content_type = "text/event-stream";
      res.stream = [this](StreamSink& sink) {
        for (int i = 0; i < 200; ++i) {
          if (!sink.Write(absl::StrCat("data: ", i, "\n\n"))) break;
          sent_ = i + 1;
          std::this_thread::sleep_for(milliseconds(20));
        }
        upstream_done_ = true;
      };
    });
    upstream_port_ = Start(*upstream_);
    front_ = std::make_unique<HttpServer>(HttpServerOptions{});
    front_->Route("POST", "/p/echo", "none", Forward("/echo"));
    front_->Route("GET", "/p/busy", "none", Forward("/busy"));
    front_->Route("GET", "/p/slow", "none", Forward("/slow"));
    front_->Route("GET", "/p/events", "none", Forward("/events"));
    front_->Route("GET", "/p/down", "none", [](const HttpRequest& req, HttpResponse& res) {
      ProxyTarget t{"127.0.0.1", 1, "/", "", "the server"};  // nothing listens on port 1
      ForwardRequest(t, req, res);
    });
    front_port_ = Start(*front_);
  }
  void TearDown() override {
    front_->Stop();
    upstream_->Stop();
  }
  static int Start(HttpServer& s) {
    auto port = s.Listen("127.0.0.1", 0);
    EXPECT_TRUE(port.ok()) << port.status();
    s.Start();
    return port.ok() ? *port : 0;
  }
  HttpHandler Forward(const std::string& path) {
    return [this, path](const HttpRequest& req, HttpResponse& res) {
      ProxyTarget t{"127.0.0.1", upstream_port_, path, "upstream-secret", "the test server"};
      t.response_timeout_ms = 800;
      ForwardRequest(t, req, res);
    };
  }
  std::string Exchange(const std::string& request) {
    const int fd = Connect(front_port_);
    ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    std::string out = ReadAll(fd, 10000);
    ::close(fd);
    return out;
  }

  std::unique_ptr<HttpServer> upstream_, front_;
  int upstream_port_ = 0, front_port_ = 0;
  std::atomic<int> sent_{0};
  std::atomic<bool> upstream_done_{false};
};

TEST_F(HttpProxyTest, RelaysStatusBodyAndTypeWithTheUpstreamsToken) {
  const std::string out = Exchange(
      "POST /p/echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer "
      "client-token\r\n"
      "Cookie: session=1\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}");
  EXPECT_EQ(out.rfind("HTTP/1.1 201", 0), 0u) << out;
  EXPECT_NE(out.find("Content-Type: application/x-echo"), std::string::npos) << out;
  // The upstream saw its own token, the body and its type, and no cookie of the client's.
  EXPECT_NE(out.find("Bearer upstream-secret|application/json||{\"a\":1}"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("client-token"), std::string::npos) << out;
}

TEST_F(HttpProxyTest, RelaysRefusalsWithRetryAfter) {
  const std::string out = Exchange("GET /p/busy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(out.rfind("HTTP/1.1 429", 0), 0u) << out;
  EXPECT_NE(out.find("Retry-After: 1"), std::string::npos) << out;
  EXPECT_NE(out.find("queue full"), std::string::npos) << out;
}

TEST_F(HttpProxyTest, AnUpstreamDownIs502AndASilentOneIs504) {
  std::string out = Exchange("GET /p/down HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(out.rfind("HTTP/1.1 502", 0), 0u) << out;
  EXPECT_NE(out.find("the server at 127.0.0.1:1 failed (connect"), std::string::npos) << out;
  out = Exchange("GET /p/slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(out.rfind("HTTP/1.1 504", 0), 0u) << out;
  EXPECT_NE(out.find("did not answer in time"), std::string::npos) << out;
}

// The first events reach the client while the upstream is still producing the rest.
TEST_F(HttpProxyTest, StreamsArriveAsTheyAreProduced) {
  const int fd = Connect(front_port_);
  const std::string req = "GET /p/events HTTP/1.1\r\nHost: x\r\n\r\n";
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string got = ReadAll(fd, 600);
  EXPECT_NE(got.find("text/event-stream"), std::string::npos) << got;
  EXPECT_NE(got.find("data: 0\n\n"), std::string::npos) << got;
  EXPECT_FALSE(upstream_done_) << "the whole stream was buffered before the client saw any";
  // The client goes away: the proxy closes the upstream request, whose stream then stops.
  ::close(fd);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!upstream_done_ && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(milliseconds(20));
  EXPECT_TRUE(upstream_done_);
  EXPECT_LT(sent_.load(), 150) << "the upstream kept streaming to a client that left";
}

}  // namespace
}  // namespace loom::net
