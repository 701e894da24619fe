// The coordinator's HTTP server on real loopback sockets: limits hold whatever the framing
// (Content-Length, chunked, none, compressed), slow clients are cut off, keep-alive and
// streamed responses work, and two servers do not share threads.
#include "net/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "net/request_target.h"
#include "net/test_sockets.h"

namespace loom::net {
namespace {

using Clock = std::chrono::steady_clock;

class HttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HttpServerOptions o;
    o.threads = 2;
    o.max_body_bytes = 1024;
    o.max_head_bytes = 2048;
    o.head_timeout_ms = 500;
    o.body_timeout_ms = 500;
    server_ = std::make_unique<HttpServer>(o);
    server_->Route("POST", "/echo", "none",
                   [](const HttpRequest& req, HttpResponse& res) { res.body = req.body; });
    server_->RoutePattern("GET", R"(/items/([a-z]+))",
                          [](const HttpRequest& req, HttpResponse& res) {
                            res.body = absl::StrCat(req.matches[0], ":", req.Param("q"));
                          });
    server_->Route("GET", "/stream", "none", [](const HttpRequest&, HttpResponse& res) {
      res.stream = [](StreamSink& sink) {
        for (int i = 0; i < 3; ++i) sink.Write(absl::StrCat("part", i, "\n"));
      };
    });
    auto port = server_->Listen("127.0.0.1", 0);
    ASSERT_TRUE(port.ok()) << port.status();
    port_ = *port;
    server_->Start();
  }
  void TearDown() override { server_->Stop(); }

  std::string Exchange(const std::string& request, int timeout_ms = 5000) {
    const int fd = Connect(port_);
    ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    std::string out = ReadAll(fd, timeout_ms);
    ::close(fd);
    return out;
  }

  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
};

TEST_F(HttpServerTest, ServesRoutesWithKeepAliveAndDecodedPaths) {
  const std::string r1 = "GET /items/abc?q=a%20b HTTP/1.1\r\nHost: x\r\n\r\n";
  const std::string r2 = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello";
  const std::string r3 = "GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  const std::string out = Exchange(r1 + r2 + r3);  // pipelined on one connection
  EXPECT_NE(out.find("abc:a b"), std::string::npos) << out;
  EXPECT_NE(out.find("\r\n\r\nhello"), std::string::npos) << out;
  EXPECT_NE(out.find("404 Not Found"), std::string::npos) << out;
  EXPECT_NE(out.find("no route GET /nothing"), std::string::npos) << out;
}

TEST_F(HttpServerTest, ChunkedBodiesAreDecodedAndCapped) {
  std::string ok =
      "POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n";
  ok += "3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\n\r\n";
  EXPECT_NE(Exchange(ok).find("\r\n\r\nabcde"), std::string::npos);
  // An endless chunked body: answered 413 once it passes the limit, without reading it all.
  const int fd = Connect(port_);
  const std::string head = "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  ::send(fd, head.data(), head.size(), MSG_NOSIGNAL);
  const std::string chunk = "100\r\n" + std::string(256, 'x') + "\r\n";
  std::string answer;
  for (int i = 0; i < 4096 && answer.empty(); ++i) {  // up to 1 MiB
    if (::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL) < 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) answer = ReadAll(fd, 1000);
  }
  if (answer.empty()) answer = ReadAll(fd, 2000);
  ::close(fd);
  EXPECT_NE(answer.find("413"), std::string::npos) << answer;
  EXPECT_NE(answer.find("request body too large"), std::string::npos) << answer;
}

TEST_F(HttpServerTest, RefusesWhatItWillNotBuffer) {
  struct Case {
    std::string request, status, message;
  };
  const std::vector<Case> cases = {
      {"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n", "413", "too large"},
      {"POST /echo HTTP/1.1\r\nHost: x\r\n\r\nnot framed", "411", "Content-Length required"},
      {"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nContent-Encoding: gzip\r\n\r\nabcd",
       "415", "Content-Encoding"},
      {"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
       "400", "both Content-Length"},
      {"GET /items/a HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(4096, 'a') + "\r\n\r\n", "431",
       "header too large"},
      {"GARBAGE\r\n\r\n", "400", "malformed request line"},
      {"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "501",
       "only chunked"},
  };
  for (const Case& c : cases) {
    const std::string out = Exchange(c.request);
    EXPECT_NE(out.find("HTTP/1.1 " + c.status), std::string::npos)
        << c.request.substr(0, 80) << "\n"
        << out;
    EXPECT_NE(out.find(c.message), std::string::npos) << out;
  }
}

TEST_F(HttpServerTest, SlowClientsAreCutOff) {
  // A head that never completes (slowloris) and a body that never arrives.
  const auto start = Clock::now();
  const int fd = Connect(port_);
  for (char c : std::string("GET /items/a HTTP/1.1\r\nHost")) {
    if (::send(fd, &c, 1, MSG_NOSIGNAL) < 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
  }
  const std::string out = ReadAll(fd, 3000);
  ::close(fd);
  EXPECT_NE(out.find("408"), std::string::npos) << out;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(3));
  const std::string body =
      Exchange("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab");
  EXPECT_NE(body.find("408"), std::string::npos) << body;
  // Meanwhile, and after, the server answers others.
  EXPECT_NE(Exchange("GET /items/ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").find("ok:"),
            std::string::npos);
}

TEST_F(HttpServerTest, StreamsChunkedResponses) {
  const std::string out = Exchange("GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_NE(out.find("Transfer-Encoding: chunked"), std::string::npos) << out;
  EXPECT_NE(out.find("6\r\npart0\n\r\n6\r\npart1\n\r\n6\r\npart2\n\r\n0\r\n\r\n"),
            std::string::npos)
      << out;
}

// Heads a proxy in front could read differently: each refused and the connection closed, nothing
// after it served; a request on a new connection works.
TEST_F(HttpServerTest, RefusesMalformedAndAmbiguousHeads) {
  struct Case {
    std::string what, request, status;
  };
  const std::string ok = "GET /items/ok HTTP/1.1\r\nHost: x\r\n\r\n";
  const std::string chunked = "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n";
  const std::vector<Case> cases = {
      {"bare LF inside a header value", "GET /items/a HTTP/1.1\r\nHost: x\nX-Evil: 1\r\n\r\n",
       "400"},
      {"bare LF line ends", "GET /items/a HTTP/1.1\nHost: x\n\n", "400"},
      {"bare CR in a header", "GET /items/a HTTP/1.1\r\nHost: x\ry\r\n\r\n", "400"},
      {"NUL in a header", std::string("GET /items/a HTTP/1.1\r\nHost: x\0y\r\n\r\n", 36), "400"},
      {"a header name that is not a token", "GET /items/a HTTP/1.1\r\nHo(st: x\r\n\r\n", "400"},
      {"space before the colon", "GET /items/a HTTP/1.1\r\nHost : x\r\n\r\n", "400"},
      {"HTTP/1.2", "GET /items/a HTTP/1.2\r\nHost: x\r\n\r\n", "400"},
      {"HTTP/2.0 in an HTTP/1 head", "GET /items/a HTTP/2.0\r\nHost: x\r\n\r\n", "400"},
      {"HTTP/0.9", "GET /items/a HTTP/0.9\r\nHost: x\r\n\r\n", "400"},
      {"an absolute-form target", "GET http://evil/items/a HTTP/1.1\r\nHost: x\r\n\r\n", "400"},
      {"an encoded slash in a segment", "GET /items/a%2Fb HTTP/1.1\r\nHost: x\r\n\r\n", "404"},
      {"an encoded NUL in the path", "GET /items/a%00 HTTP/1.1\r\nHost: x\r\n\r\n", "400"},
      {"a chunk size of whitespace, then a second request",
       chunked + "\r\n \r\n\r\n" + "GET /items/smuggled HTTP/1.1\r\nHost: x\r\n\r\n", "400"},
      {"a chunk size with trailing whitespace", chunked + "\r\n3 \r\nabc\r\n0\r\n\r\n" + ok, "400"},
      {"a chunk size that is not hex", chunked + "\r\nzz\r\nabc\r\n0\r\n\r\n" + ok, "400"},
      {"chunked, then identity",
       chunked + "Transfer-Encoding: identity\r\n\r\n3\r\nabc\r\n0\r\n\r\n", "400"},
      {"chunked not last",
       "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity"
       "\r\n\r\n3\r\nabc\r\n0\r\n\r\n" +
           ok,
       "501"},
      {"two different Content-Lengths",
       "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd" + ok,
       "400"},
      {"Content-Length and chunked",
       "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n" +
           chunked.substr(chunked.find("Tr")) + "\r\n3\r\nabc\r\n0\r\n\r\n" + ok,
       "400"},
      {"a negative Content-Length", "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
       "400"},
  };
  for (const Case& c : cases) {
    const auto start = Clock::now();
    const std::string out = Exchange(c.request + ok, 3000);
    EXPECT_EQ(out.rfind("HTTP/1.1 " + c.status, 0), 0u) << c.what << "\n" << out;
    // One answer, then the close: nothing after the refused head was read as a request.
    EXPECT_EQ(out.find("HTTP/1.1", 1), std::string::npos) << c.what << "\n" << out;
    EXPECT_NE(out.find("Connection: close"), std::string::npos) << c.what << "\n" << out;
    EXPECT_EQ(out.find("smuggled"), std::string::npos) << c.what;
    EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(2500)) << c.what;
  }
  EXPECT_NE(
      Exchange("GET /items/fine HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").find("fine:"),
      std::string::npos);
}

TEST_F(HttpServerTest, WrongMethodIsNoRoute) {
  const std::string out = Exchange("DELETE /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(out.rfind("HTTP/1.1 404", 0), 0u) << out;
  EXPECT_NE(out.find("no route DELETE /echo"), std::string::npos) << out;
}

// Credentials are checked on the head: a client without one is answered 401 and cut off before
// it sends its (announced) body.
TEST(HttpServerAuthTest, RefusesBeforeTheBody) {
  HttpServerOptions o;
  o.body_timeout_ms = 5000;
  HttpServer server(o);
  std::atomic<int> handled{0};
  server.Route("POST", "/secret", "user", [&](const HttpRequest&, HttpResponse& res) {
    ++handled;
    res.body = "in";
  });
  server.SetAuthenticator([](const std::string& auth, const HttpRequest& req, HttpResponse& res) {
    if (auth == "user" && req.Header("authorization") == "Bearer good") return false;
    SetJsonError(res, 401, "invalid token");
    return true;
  });
  auto port = server.Listen("127.0.0.1", 0);
  ASSERT_TRUE(port.ok());
  server.Start();
  const auto start = Clock::now();
  const int fd = Connect(*port);
  const std::string head =
      "POST /secret HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer bad\r\nContent-Length: "
      "1000\r\n\r\n";
  ::send(fd, head.data(), head.size(), MSG_NOSIGNAL);
  const std::string out = ReadAll(fd, 3000);  // the body never comes
  ::close(fd);
  EXPECT_EQ(out.rfind("HTTP/1.1 401", 0), 0u) << out;
  EXPECT_NE(out.find("Connection: close"), std::string::npos) << out;
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(1500));
  EXPECT_EQ(handled.load(), 0);
  const int good = Connect(*port);
  const std::string req =
      "POST /secret HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer good\r\nContent-Length: 2\r\n"
      "Connection: close\r\n\r\nhi";
  ::send(good, req.data(), req.size(), MSG_NOSIGNAL);
  EXPECT_NE(ReadAll(good).find("\r\n\r\nin"), std::string::npos);
  ::close(good);
  EXPECT_EQ(handled.load(), 1);
  server.Stop();
}

// Routes GET /hi (answers "hi"), listens on a free loopback port and starts: the caps tests'
// server.
absl::StatusOr<int> StartHiServer(HttpServer& server) {
  server.Route("GET", "/hi", "none",
               [](const HttpRequest&, HttpResponse& res) { res.body = "hi"; });
  absl::StatusOr<int> port = server.Listen("127.0.0.1", 0);
  if (port.ok()) server.Start();
  return port;
}

// One address with many slow connections holds at most its share; a client at another address
// is answered at once, and a well-behaved client at the same address within about evict_after.
TEST(HttpServerCapsTest, OneAddressCannotStarveOthers) {
  HttpServerOptions o;
  o.threads = 2;
  o.max_connections_per_address = 4;
  o.evict_after_ms = 300;
  o.head_timeout_ms = 20000;
  HttpServer server(o);
  const absl::StatusOr<int> port = StartHiServer(server);
  ASSERT_TRUE(port.ok()) << port.status();
  std::vector<int> slow;
  for (int i = 0; i < 64; ++i) {
    slow.push_back(Connect(*port, "127.0.0.2"));
    ::send(slow.back(), "GET /hi HTTP/1.1\r\nHo", 20, MSG_NOSIGNAL);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  const std::string req = "GET /hi HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  for (const char* source : {"127.0.0.1", "127.0.0.2"}) {
    const auto start = Clock::now();
    const int fd = Connect(*port, source);
    ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
    const std::string out = ReadAll(fd, 3000);
    ::close(fd);
    const auto took = Clock::now() - start;
    EXPECT_NE(out.find("\r\n\r\nhi"), std::string::npos) << source << ": " << out;
    EXPECT_LT(took, std::chrono::milliseconds(std::string(source) == "127.0.0.1" ? 300 : 1200))
        << source;
  }
  const ConnectionStats stats = server.Connections();
  EXPECT_GE(stats.evicted, 1);  // 127.0.0.2's own request displaced a slow one
  EXPECT_GT(stats.waiting, 40);
  EXPECT_EQ(stats.refused, 0);
  for (int fd : slow) ::close(fd);
  server.Stop();
}

// Connections() says what the caps did: over the global cap closed at once, over the address's
// cap waiting, and waiters closed after a head timeout when no place frees (idle keep-alive
// connections are displaced only once stale: not within evict_after_ms).
TEST(HttpServerCapsTest, ConnectionStatsCountRefusedWaitingAndExpired) {
  HttpServerOptions o;
  o.max_connections = 6;
  o.max_connections_per_address = 2;
  o.evict_after_ms = 60000;
  o.idle_timeout_ms = 60000;
  o.head_timeout_ms = 600;
  HttpServer server(o);
  const absl::StatusOr<int> port = StartHiServer(server);
  ASSERT_TRUE(port.ok()) << port.status();
  auto wait_for = [&](auto done) {
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (!done(server.Connections()) && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return server.Connections();
  };
  std::vector<int> fds;
  const std::string req = "GET /hi HTTP/1.1\r\nHost: x\r\n\r\n";
  for (int i = 0; i < 2; ++i) {  // served, then idle on keep-alive
    fds.push_back(Connect(*port, "127.0.0.2"));
    ::send(fds.back(), req.data(), req.size(), MSG_NOSIGNAL);
    EXPECT_NE(ReadAll(fds.back(), 300).find("\r\n\r\nhi"), std::string::npos);
  }
  for (int i = 0; i < 4; ++i) fds.push_back(Connect(*port, "127.0.0.2"));
  wait_for([](const ConnectionStats& s) { return s.waiting == 4; });
  for (int i = 0; i < 2; ++i) fds.push_back(Connect(*port, "127.0.0.3"));
  ConnectionStats s = wait_for([](const ConnectionStats& s) { return s.refused == 2; });
  EXPECT_EQ(s.open, 6);
  EXPECT_EQ(s.waiting, 4);
  EXPECT_EQ(s.refused, 2);
  EXPECT_EQ(s.evicted, 0);
  EXPECT_EQ(s.expired, 0);
  s = wait_for([](const ConnectionStats& s) { return s.expired == 4; });
  EXPECT_EQ(s.expired, 4);
  EXPECT_EQ(s.waiting, 0);
  EXPECT_EQ(s.evicted, 0);
  for (int fd : fds) ::close(fd);
  s = wait_for([](const ConnectionStats& s) { return s.open == 0; });
  EXPECT_EQ(s.open, 0);
  server.Stop();
}

// Stop() ends what is still streaming: the stream sees its client as gone.
TEST(HttpServerStopTest, StopEndsOpenStreams) {
  HttpServer server{HttpServerOptions{}};
  std::atomic<bool> streaming{false};
  server.Route("GET", "/follow", "none", [&](const HttpRequest&, HttpResponse& res) {
    res.stream = [&](StreamSink& sink) {
      streaming = true;
      while (sink.ClientConnected() && sink.Write("tick\n")) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    };
  });
  auto port = server.Listen("127.0.0.1", 0);
  ASSERT_TRUE(port.ok());
  server.Start();
  const int fd = Connect(*port);
  const std::string req = "GET /follow HTTP/1.1\r\nHost: x\r\n\r\n";
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  for (int i = 0; i < 100 && !streaming; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(streaming);
  const auto start = Clock::now();
  server.Stop();
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2));
  ::close(fd);
}

TEST(HttpServerIsolationTest, BusyServerDoesNotStarveAnother) {
  HttpServerOptions o;
  o.threads = 1;
  o.head_timeout_ms = 5000;
  HttpServer users(o), agents(o);
  agents.Route("GET", "/healthz", "none",
               [](const HttpRequest&, HttpResponse& res) { res.body = "ok"; });
  auto up = users.Listen("127.0.0.1", 0);
  auto ap = agents.Listen("127.0.0.1", 0);
  ASSERT_TRUE(up.ok() && ap.ok());
  users.Start();
  agents.Start();
  const int hog = Connect(*up);  // holds the user server's only thread with a half head
  ::send(hog, "GET /", 5, MSG_NOSIGNAL);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const int fd = Connect(*ap);
  const std::string req = "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  const auto start = Clock::now();
  const std::string out = ReadAll(fd, 2000);
  EXPECT_NE(out.find("\r\n\r\nok"), std::string::npos) << out;
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  ::close(fd);
  ::close(hog);
  users.Stop();
  agents.Stop();
}

// The target as the router sees it: path and query decoded (libcurl), '+' a space in the query
// only, an encoded '+' kept, a bad escape left as it came, %2F and control characters refused.
TEST(RequestTargetTest, DecodesPathAndQuery) {
  HttpRequest r;
  ASSERT_TRUE(ParseRequestTarget("/items/a%20b+c?q=x+y%2Bz&k%3D=%E2%9C%93&bad=%zz&flag", &r).ok());
  EXPECT_EQ(r.path, "/items/a b+c");
  EXPECT_EQ(r.Param("q"), "x y+z");
  EXPECT_EQ(r.Param("k="), "\xE2\x9C\x93");
  EXPECT_EQ(r.Param("bad"), "%zz");
  EXPECT_TRUE(r.params.count("flag"));
  HttpRequest refused;
  EXPECT_EQ(ParseRequestTarget("/items/a%2fb", &refused).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ParseRequestTarget("/items/a%0Ab", &refused).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRequestTarget("/items/a%00", &refused).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRequestTarget("items", &refused).code(), absl::StatusCode::kInvalidArgument);
}

// Whatever a message holds (quotes, control bytes, invalid UTF-8 from a client's field name),
// the error body is JSON in the documented shape.
TEST(ErrorBodyTest, IsJsonWhateverTheMessage) {
  const std::string body = ErrorBody(400, "spec.name: bad \"quote\" \x01 and \xff\xfe bytes", "");
  EXPECT_EQ(body.back(), '\n');
  EXPECT_EQ(
      body.rfind(
          R"({"error":{"code":400,"status":"INVALID_ARGUMENT","message":"spec.name: bad \"quote\" \u0001 and )",
          0),
      0u)
      << body;
  EXPECT_NE(
      body.find(
          R"("details":[{"@type":"type.googleapis.com/google.rpc.BadRequest","fieldViolations":[{"field":"spec.name","description":"bad \"quote\")"),
      std::string::npos)
      << body;
  EXPECT_EQ(body.find('\xff'), std::string::npos) << "invalid UTF-8 passed through";
  EXPECT_NE(ErrorBody(503, "busy", "")
                .find(R"({"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":")"),
            std::string::npos);
}

}  // namespace
}  // namespace loom::net
