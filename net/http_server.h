// The HTTP/1.1 server of every Loom program: the coordinator's user API and console, loom-serve,
// and each component's /metrics. Built on Boost.Beast over Asio (docs/control-plane.md, "The
// HTTP layer", says why Beast and not RESTinio): the parsing, the framing and TLS are the
// libraries'; this file holds the policy a shared service needs against hostile clients.
//
// What it promises (docs/control-plane.md, "Input limits"):
// * no thread per connection: sockets are driven by an event loop; only handlers (and the
//   streamed responses they start) run on a bounded pool, so slow clients hold no thread;
// * Beast's parser enforces the head limit (max_head_bytes, 431) and the body limit
//   (max_body_bytes, 413) as bytes arrive, chunked bodies included; Content-Length over the limit
//   is refused before a body byte is read;
// * the route, the Host/Origin filter and authentication are decided once the head is complete,
//   before any body is read (a refusal is answered and the connection closed);
// * strict framing: bare CR, LF or NUL in the head, non-token header names, versions other than
//   HTTP/1.0 and 1.1, chunk sizes that are not hex, Transfer-Encoding other than exactly
//   "chunked" and absolute-form targets are refused (400/501), an encoded '/' (%2F) in a path
//   names no route (404), and the connection is closed after each;
//   any Content-Encoding is 415 (nothing is decompressed, so nothing can expand);
// * timers per connection: the TLS handshake and the head within head_timeout_ms, the body
//   within body_timeout_ms, a kept-alive connection idle at most idle_timeout_ms, each write
//   within write_timeout_ms;
// * connection caps: at most max_connections_per_address connections of one client address are
//   served at once; a further one waits unread until one of them closes or, when one of them has
//   spent evict_after_ms still sending its request or idle between requests, takes its place
//   (that one is closed). One address cannot hold more than its share of buffers, and a
//   slow client cannot starve a well-behaved one behind the same NAT address. Beyond
//   max_connections in all, a new connection is closed at once;
// * Stop() ends everything: open streams (log follows, SSE) see their client as gone.
// After an error the connection is closed with a bounded lingering drain, so the client reads
// the error before the reset.
#ifndef LOOM_NET_HTTP_SERVER_H_
#define LOOM_NET_HTTP_SERVER_H_

#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace loom::net {

struct HttpRequest {
  std::string method;
  std::string path;  // percent-decoded, without the query
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // names in lower case
  std::multimap<std::string, std::string> params;            // query parameters, decoded
  std::vector<std::string> matches;                          // the route's regex groups
  // False once the client has closed its side (a handler that waits long, e.g. for generated
  // tokens, polls it to stop work nobody will read).
  std::function<bool()> client_connected = [] { return true; };

  // The first value of a header (lower-case name), "" when absent.
  std::string Header(absl::string_view lower_name) const;
  bool HasParam(const std::string& key) const { return params.count(key) > 0; }
  std::string Param(const std::string& key) const;
  size_t ParamCount(const std::string& key) const { return params.count(key); }
};

// Where a streamed response body goes (chunked transfer encoding).
class StreamSink {
 public:
  virtual ~StreamSink() = default;
  // False when the client is gone or too slow (the write deadline passed).
  virtual bool Write(absl::string_view data) = 0;
  // False once the client has closed its side.
  virtual bool ClientConnected() = 0;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  // When set, the body is produced by this callback (chunked) and the connection closes after.
  std::function<void(StreamSink&)> stream;

  void SetHeader(const std::string& name, const std::string& value) {
    headers.emplace_back(name, value);
  }
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponse&)>;

// The shape of every error the API returns, google.rpc.Status style:
//   {"error": {"code": 400, "status": "INVALID_ARGUMENT", "message": "spec.steps: must be > 0",
//              "details": [{"@type": "type.googleapis.com/google.rpc.BadRequest",
//                           "fieldViolations": [{"field": "spec.steps", "description": "..."}]}]}}
// `code` is the HTTP status; `status` the canonical code name (`rpc_status`, or derived from the
// HTTP status when empty). A message of the form "field.path: why" also yields a BadRequest
// field violation, so a client can put the error next to the field. 429 and 503 carry
// Retry-After (seconds) and a RetryInfo detail.
void SetJsonError(HttpResponse& res, int status, absl::string_view message,
                  absl::string_view rpc_status = "");
// The error body alone (for responses written before a handler runs).
std::string ErrorBody(int status, absl::string_view message, absl::string_view rpc_status = "");
// Seconds a client should wait before retrying a 429 or 503.
inline constexpr int kRetryAfterSeconds = 1;

// A TLS server context (TLS 1.2 or newer) from PEM files: the certificate chain and its private
// key. Errors name the flag (--tls-cert, --tls-key) and say what OpenSSL found wrong.
absl::StatusOr<std::shared_ptr<ssl_ctx_st>> LoadTlsContext(const std::string& cert_file,
                                                           const std::string& key_file);

// DNS rebinding and cross-site requests: a web page in the user's browser can reach a loopback
// server, but only with a foreign Host (rebinding) or a foreign Origin (CSRF). Returns why a
// request is refused ("" when it is fine): its Host must be one of `allowed_hosts` (empty = any),
// and an Origin, when sent, must name one of them (or, with none, the request's own Host).
std::string ForeignHostOrOrigin(const HttpRequest& req, const std::set<std::string>& allowed_hosts);
// The names a server bound to `bind` answers to by default: the loopback names on a loopback
// address, any otherwise.
std::set<std::string> DefaultAllowedHosts(const std::string& bind);

struct HttpServerOptions {
  // When set, every connection is TLS (LoadTlsContext); a plain-HTTP client gets nothing.
  std::shared_ptr<ssl_ctx_st> tls;
  int threads = 16;                      // the handler pool (handlers and streamed responses)
  int io_threads = 1;                    // the event loop (all socket I/O, parsing, timers)
  int max_queued_requests = 256;         // complete requests waiting for a handler; beyond: 503
  int max_connections = 512;             // open connections of all clients; beyond: closed at once
  int max_connections_per_address = 16;  // served at once per client address (see above)
  int evict_after_ms = 1000;             // a slower request of the same address may be displaced
  size_t max_head_bytes = 16 << 10;
  size_t max_body_bytes = 1 << 20;
  int head_timeout_ms = 10000;   // the TLS handshake, then the request head
  int body_timeout_ms = 30000;   // the whole body
  int idle_timeout_ms = 5000;    // keep-alive: wait for the next request
  int write_timeout_ms = 10000;  // each write of a response
  int max_requests_per_connection = 1000;
};

// What the connection caps are doing (the components export it on /metrics): gauges now, and
// counts since the server started.
struct ConnectionStats {
  int64_t open = 0;     // counted against max_connections: served, waiting or closing
  int64_t waiting = 0;  // over their address's cap, waiting for a place
  int64_t refused = 0;  // closed at once at max_connections
  int64_t evicted = 0;  // displaced while slow or idle by a waiting connection of their address
  int64_t expired = 0;  // closed after waiting a whole head timeout without a place
};

class HttpServer {
 public:
  explicit HttpServer(HttpServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // A documented route: `path` in OpenAPI form ("/v1/jobs/{id}": each {name} matches one path
  // segment, in order into request.matches) and who may call it (none | user | enrolment |
  // worker, as the document's security says). Routes() lists these, so the OpenAPI document is
  // checked against the router itself.
  void Route(const std::string& method, const std::string& path, const std::string& auth,
             HttpHandler handler);
  // An undocumented route: `pattern` is a regex matched against the whole decoded path (groups
  // go to request.matches), e.g. a refusal that points a client at the other listener.
  void RoutePattern(const std::string& method, const std::string& pattern, HttpHandler handler);

  struct RouteInfo {
    std::string method, path, auth;
  };
  // The documented routes, in the order they were added.
  std::vector<RouteInfo> Routes() const;
  // The documented path template a request matches, or "other" (a bounded metrics label).
  std::string RouteTemplate(const std::string& method, const std::string& path) const;
  // Runs on every request once its head is complete, before its body is read; returns true
  // when it answered (e.g. a 403). It sees the head only (request.body is empty).
  void SetFilter(std::function<bool(const HttpRequest&, HttpResponse&)> filter) {
    filter_ = std::move(filter);
  }
  // Runs once the head is complete, before the body is read, for a route whose auth is not
  // "none": returns true when it answered (401/403). The handler may check again.
  void SetAuthenticator(
      std::function<bool(const std::string& auth, const HttpRequest&, HttpResponse&)> check) {
    authenticator_ = std::move(check);
  }
  // After every answered request: the request, the response and the handling time in seconds.
  void SetLogger(std::function<void(const HttpRequest&, const HttpResponse&, double)> logger) {
    logger_ = std::move(logger);
  }

  // Answers a request as a connection does once its head is parsed: request target, head
  // checks, then the handler (a streamed response is returned, not run). Without a socket: the
  // router's fuzz harness (fuzz/rest_routes_fuzzer.cc) drives every route through it.
  HttpResponse Answer(const std::string& method, absl::string_view target,
                      std::vector<std::pair<std::string, std::string>> headers,
                      std::string body) const;

  // Binds and listens (port 0: any free port); returns the bound port.
  absl::StatusOr<int> Listen(const std::string& address, int port);
  // Starts the event loop and the handler pool.
  void Start();
  // Stops accepting, closes every connection (open streams end), joins every thread. Idempotent.
  void Stop();
  // The connection caps' state and counts (thread-safe).
  ConnectionStats Connections() const;

  class Impl;

 private:
  struct RouteEntry {
    std::string method;
    std::regex pattern;
    HttpHandler handler;
    std::string path, auth;  // empty for RoutePattern
  };
  friend class Impl;

  // The route for a request (method and path), or null.
  const RouteEntry* Find(const HttpRequest& request) const;
  // Runs the head checks (filter, route, authentication); true when they answered.
  bool AnswerHead(const HttpRequest& request, HttpResponse& response) const;
  void Dispatch(HttpRequest& request, HttpResponse& response) const;

  HttpServerOptions options_;
  std::vector<RouteEntry> routes_;
  std::function<bool(const HttpRequest&, HttpResponse&)> filter_;
  std::function<bool(const std::string&, const HttpRequest&, HttpResponse&)> authenticator_;
  std::function<void(const HttpRequest&, const HttpResponse&, double)> logger_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::net

#endif  // LOOM_NET_HTTP_SERVER_H_
