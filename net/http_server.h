// A strict HTTP/1.1 server for the coordinator's REST API. It exists because the API must hold
// its limits against hostile clients before anything is buffered, which cpp-httplib 0.11 (the
// Debian library) does not: it reads chunked and length-less request bodies to the end before
// any size check, and buffers a request line or header line of any length.
//
// What it promises (docs/control-plane.md, "Input limits"):
// * the request head (line + headers) is at most max_head_bytes and must arrive within
//   head_timeout_ms of its first byte (slowloris); the body within body_timeout_ms;
// * a body is at most max_body_bytes whatever its framing: Content-Length over the limit is
//   answered 413 before reading it, a chunked body as soon as it passes the limit; a POST with
//   neither Content-Length nor chunked framing is 411; any Content-Encoding is 415 (nothing is
//   decompressed, so nothing can expand);
// * responses are written with a per-write deadline (slow readers cannot hold a thread forever);
// * each listener has its own thread pool and a bounded accept queue (503 beyond it), so two
//   listeners (users, agents) cannot starve each other.
// After an error the connection is closed with a bounded lingering drain, so the client reads
// the error before the reset.
#ifndef LOOM_NET_HTTP_SERVER_H_
#define LOOM_NET_HTTP_SERVER_H_

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <set>
#include <string>
#include <thread>
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
  int threads = 16;
  int max_queued_connections = 256;  // accepted, waiting for a thread; beyond: 503 and close
  size_t max_head_bytes = 16 << 10;
  size_t max_body_bytes = 1 << 20;
  int head_timeout_ms = 10000;   // the whole request head, from its first byte
  int body_timeout_ms = 30000;   // the whole body
  int idle_timeout_ms = 5000;    // keep-alive: wait for the next request
  int write_timeout_ms = 10000;  // each write of a response
  int max_requests_per_connection = 1000;
};

class HttpServer {
 public:
  explicit HttpServer(HttpServerOptions options) : options_(std::move(options)) {}
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
  // Runs before routing on every request; returns true when it answered (e.g. a 403).
  void SetFilter(std::function<bool(const HttpRequest&, HttpResponse&)> filter) {
    filter_ = std::move(filter);
  }
  // After every answered request: the request, the response and the handling time in seconds.
  void SetLogger(std::function<void(const HttpRequest&, const HttpResponse&, double)> logger) {
    logger_ = std::move(logger);
  }

  // Binds and listens (port 0: any free port); returns the bound port.
  absl::StatusOr<int> Listen(const std::string& address, int port);
  // Starts the accept loop and the worker threads.
  void Start();
  // Stops accepting, finishes nothing more, joins every thread. Idempotent.
  void Stop();

 private:
  struct RouteEntry {
    std::string method;
    std::regex pattern;
    HttpHandler handler;
    std::string path, auth;  // empty for RoutePattern
  };
  class Connection;

  void AcceptLoop();
  void WorkerLoop();
  void Dispatch(HttpRequest& request, HttpResponse& response);

  HttpServerOptions options_;
  std::vector<RouteEntry> routes_;
  std::function<bool(const HttpRequest&, HttpResponse&)> filter_;
  std::function<void(const HttpRequest&, const HttpResponse&, double)> logger_;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<int> queue_;
};

}  // namespace loom::net

#endif  // LOOM_NET_HTTP_SERVER_H_
