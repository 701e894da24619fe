#include "net/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace loom::net {
namespace {

using Clock = std::chrono::steady_clock;

int MsLeft(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, left));
}

const char* Reason(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 201:
      return "Created";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 408:
      return "Request Timeout";
    case 409:
      return "Conflict";
    case 411:
      return "Length Required";
    case 413:
      return "Content Too Large";
    case 415:
      return "Unsupported Media Type";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    default:
      return "Status";
  }
}

std::string JsonEscape(absl::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Percent-decoding; '+' is a space only in query strings.
std::string Decode(absl::string_view s, bool plus_is_space) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && HexValue(s[i + 1]) >= 0 && HexValue(s[i + 2]) >= 0) {
      out += static_cast<char>(HexValue(s[i + 1]) * 16 + HexValue(s[i + 2]));
      i += 2;
    } else if (plus_is_space && s[i] == '+') {
      out += ' ';
    } else {
      out += s[i];
    }
  }
  return out;
}

// A request the connection cannot serve: the status and the message of the JSON error.
struct Refusal {
  int status = 0;
  std::string message;
  bool silent = false;  // close without answering (the client sent nothing at all)
};

}  // namespace

std::string HttpRequest::Header(absl::string_view lower_name) const {
  for (const auto& [k, v] : headers) {
    if (k == lower_name) return v;
  }
  return "";
}

std::string HttpRequest::Param(const std::string& key) const {
  auto it = params.find(key);
  return it == params.end() ? "" : it->second;
}

namespace {

absl::string_view CanonicalStatus(int http) {
  switch (http) {
    case 400:
    case 411:
    case 413:
    case 415:
    case 431:
      return "INVALID_ARGUMENT";
    case 401:
      return "UNAUTHENTICATED";
    case 403:
      return "PERMISSION_DENIED";
    case 404:
      return "NOT_FOUND";
    case 405:
    case 501:
      return "UNIMPLEMENTED";
    case 408:
      return "DEADLINE_EXCEEDED";
    case 409:
      return "ABORTED";
    case 429:
      return "RESOURCE_EXHAUSTED";
    case 503:
      return "UNAVAILABLE";
    default:
      return http >= 200 && http < 300 ? "OK" : "INTERNAL";
  }
}

// "spec.model.n_heads: must divide d_model" -> the field path before ": ", if it looks like one.
std::string FieldOf(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon == absl::string_view::npos || colon == 0 || colon > 200) return "";
  const absl::string_view field = message.substr(0, colon);
  for (char c : field) {
    const bool ok = absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' ||
                    c == '[' || c == ']' || c == '-';
    if (!ok) return "";
  }
  return std::string(field);
}

}  // namespace

std::string ErrorBody(int status, absl::string_view message, absl::string_view rpc_status) {
  std::vector<std::string> details;
  if (std::string field = FieldOf(message); !field.empty()) {
    details.push_back(absl::StrCat(
        R"({"@type":"type.googleapis.com/google.rpc.BadRequest","fieldViolations":[{"field":")",
        JsonEscape(field), R"(","description":")", JsonEscape(message.substr(field.size() + 2)),
        R"("}]})"));
  }
  if (status == 429 || status == 503) {
    details.push_back(
        absl::StrCat(R"({"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":")",
                     kRetryAfterSeconds, R"(s"})"));
  }
  return absl::StrCat(R"({"error":{"code":)", status, R"(,"status":")",
                      rpc_status.empty() ? CanonicalStatus(status) : rpc_status, R"(","message":")",
                      JsonEscape(message), R"(","details":[)", absl::StrJoin(details, ","),
                      "]}}\n");
}

void SetJsonError(HttpResponse& res, int status, absl::string_view message,
                  absl::string_view rpc_status) {
  res.status = status;
  res.content_type = "application/json";
  res.body = ErrorBody(status, message, rpc_status);
  res.stream = nullptr;
  if (status == 429 || status == 503)
    res.SetHeader("Retry-After", std::to_string(kRetryAfterSeconds));
}

absl::StatusOr<std::shared_ptr<ssl_ctx_st>> LoadTlsContext(const std::string& cert_file,
                                                           const std::string& key_file) {
  auto openssl_error = [] {
    char buf[256] = "unknown error";
    if (unsigned long e = ERR_get_error(); e != 0) ERR_error_string_n(e, buf, sizeof(buf));
    return std::string(buf);
  };
  std::shared_ptr<SSL_CTX> ctx(SSL_CTX_new(TLS_server_method()), SSL_CTX_free);
  if (!ctx) return absl::InternalError("TLS: cannot create a context: " + openssl_error());
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), cert_file.c_str()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-cert: cannot load '", cert_file, "': ", openssl_error()));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-key: cannot load '", key_file, "': ", openssl_error()));
  }
  if (SSL_CTX_check_private_key(ctx.get()) != 1) {
    return absl::InvalidArgumentError("--tls-key: does not match the certificate of --tls-cert");
  }
  return std::shared_ptr<ssl_ctx_st>(ctx);
}

// One client connection: buffered reads with deadlines, request parsing, response writing; in
// TLS mode the same over an SSL session on the non-blocking socket.
class HttpServer::Connection : public StreamSink {
 public:
  Connection(int fd, const HttpServerOptions& options) : fd_(fd), options_(options) {
    if (options_.tls) {
      ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) | O_NONBLOCK);
      ssl_ = SSL_new(options_.tls.get());
      if (ssl_ != nullptr) SSL_set_fd(ssl_, fd_);
    }
  }
  ~Connection() override {
    if (ssl_ != nullptr) SSL_free(ssl_);
    ::close(fd_);
  }

  // The TLS handshake, within head_timeout_ms (a client that never finishes it holds a thread
  // no longer than one that never sends a request head). Always true without TLS.
  bool Handshake() {
    if (!options_.tls) return true;
    if (ssl_ == nullptr) return false;
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.head_timeout_ms);
    for (;;) {
      ERR_clear_error();
      const int r = SSL_accept(ssl_);
      if (r == 1) return true;
      const int e = SSL_get_error(ssl_, r);
      if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) return false;
      if (!Wait(e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline)) return false;
    }
  }

  // Reads the next request. Returns false with `refusal` set when it cannot be served (or with a
  // silent refusal when the client went away or stayed idle).
  bool ReadRequest(HttpRequest& request, bool first, Refusal& refusal) {
    if (!ReadHead(first, refusal)) return false;
    if (!ParseHead(request, refusal)) return false;
    return ReadBody(request, refusal);
  }

  bool WriteAll(absl::string_view data) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.write_timeout_ms);
    while (!data.empty()) {
      const ssize_t n = Send(data.data(), data.size());
      if (n > 0) {
        data.remove_prefix(static_cast<size_t>(n));
      } else if (n == kWantRead || n == kWantWrite) {
        if (!Wait(n == kWantRead ? POLLIN : POLLOUT, deadline)) return false;
      } else {
        return false;
      }
    }
    return true;
  }

  bool WriteResponse(const HttpResponse& res, bool keep_alive) {
    std::string head = absl::StrCat("HTTP/1.1 ", res.status, " ", Reason(res.status), "\r\n");
    absl::StrAppend(&head, "Content-Type: ", res.content_type, "\r\n");
    for (const auto& [k, v] : res.headers) absl::StrAppend(&head, k, ": ", v, "\r\n");
    if (res.stream) {
      absl::StrAppend(&head, "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
      return WriteAll(head);
    }
    absl::StrAppend(&head, "Content-Length: ", res.body.size(),
                    "\r\nConnection: ", keep_alive ? "keep-alive" : "close", "\r\n\r\n");
    return WriteAll(head) && WriteAll(res.body);
  }

  // StreamSink: one chunk per write.
  bool Write(absl::string_view data) override {
    if (data.empty()) return true;
    char size[24];
    std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
    return WriteAll(size) && WriteAll(data) && WriteAll("\r\n");
  }
  bool ClientConnected() override {
    pollfd p{fd_, POLLIN | POLLRDHUP, 0};
    if (::poll(&p, 1, 0) <= 0) return true;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return false;
    char c;
    return ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT) != 0;
  }
  bool FinishStream() { return WriteAll("0\r\n\r\n"); }

  // After an error the client may still be sending: stop writing, drain for a bounded time so
  // the error reaches it before the reset that closing a socket with unread data causes.
  void LingerClose() {
    if (ssl_ != nullptr) SSL_shutdown(ssl_);  // close_notify; the peer's answer is not awaited
    ::shutdown(fd_, SHUT_WR);
    const auto deadline = Clock::now() + std::chrono::milliseconds(1000);
    char buf[16 << 10];
    size_t drained = 0;
    while (drained < (64u << 20)) {
      pollfd p{fd_, POLLIN, 0};
      const int left = MsLeft(deadline);
      if (left == 0 || ::poll(&p, 1, left) <= 0) break;
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), MSG_DONTWAIT);
      if (n <= 0 && !(n < 0 && (errno == EINTR || errno == EAGAIN))) break;
      if (n > 0) drained += static_cast<size_t>(n);
    }
  }

 private:
  // Results of Recv/Send besides a byte count (> 0), EOF (0) and a failure (-1): wait until the
  // socket is readable or writable and try again (a TLS record may need either).
  static constexpr ssize_t kWantRead = -2, kWantWrite = -3;

  ssize_t Recv(char* buf, size_t n) {
    if (ssl_ == nullptr) {
      const ssize_t r = ::recv(fd_, buf, n, MSG_DONTWAIT);
      if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return kWantRead;
      return r;
    }
    ERR_clear_error();
    const int r = SSL_read(ssl_, buf, static_cast<int>(std::min<size_t>(n, 1 << 30)));
    return r > 0 ? r : SslResult(r);
  }
  ssize_t Send(const char* buf, size_t n) {
    if (ssl_ == nullptr) {
      const ssize_t r = ::send(fd_, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return kWantWrite;
      return r;
    }
    ERR_clear_error();
    const int r = SSL_write(ssl_, buf, static_cast<int>(std::min<size_t>(n, 1 << 30)));
    return r > 0 ? r : SslResult(r);
  }
  ssize_t SslResult(int r) {
    switch (SSL_get_error(ssl_, r)) {
      case SSL_ERROR_WANT_READ:
        return kWantRead;
      case SSL_ERROR_WANT_WRITE:
        return kWantWrite;
      case SSL_ERROR_ZERO_RETURN:
        return 0;
      default:
        return -1;
    }
  }
  // Waits for `events` on the socket until the deadline; false when it passed.
  bool Wait(short events, Clock::time_point deadline) {
    for (;;) {
      pollfd p{fd_, events, 0};
      const int left = MsLeft(deadline);
      if (left == 0) return false;
      const int r = ::poll(&p, 1, left);
      if (r < 0 && errno == EINTR) continue;
      return r > 0;
    }
  }

  // Appends what the connection has (at most `max` bytes) to in_; false on EOF, error or
  // deadline. TLS may hold decrypted bytes the socket no longer signals: read those first.
  bool Fill(Clock::time_point deadline, size_t max) {
    for (;;) {
      const bool pending = ssl_ != nullptr && SSL_pending(ssl_) > 0;
      if (!pending && !Wait(POLLIN, deadline)) return false;
      char buf[16 << 10];
      const ssize_t n = Recv(buf, std::min(sizeof(buf), max));
      if (n == kWantRead) continue;
      if (n == kWantWrite) {
        if (!Wait(POLLOUT, deadline)) return false;
        continue;
      }
      if (n <= 0) {
        eof_ = true;
        return false;
      }
      in_.append(buf, static_cast<size_t>(n));
      return true;
    }
  }

  bool ReadHead(bool first, Refusal& refusal) {
    // Wait for the first byte (a kept-alive connection may simply stay idle), then give the
    // whole head head_timeout_ms.
    if (in_.empty()) {
      const int wait = first ? options_.head_timeout_ms : options_.idle_timeout_ms;
      if (!Fill(Clock::now() + std::chrono::milliseconds(wait), options_.max_head_bytes + 4)) {
        refusal.silent = true;
        return false;
      }
    }
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.head_timeout_ms);
    for (;;) {
      head_end_ = in_.find("\r\n\r\n");
      if (head_end_ != std::string::npos && head_end_ + 4 <= options_.max_head_bytes) return true;
      if (in_.size() > options_.max_head_bytes) {
        refusal = {431, absl::StrCat("request header too large (limit ", options_.max_head_bytes,
                                     " bytes)")};
        return false;
      }
      if (!Fill(deadline, options_.max_head_bytes + 4 - in_.size())) {
        if (eof_) {
          refusal.silent = true;
        } else {
          refusal = {408, absl::StrCat("request header timeout: the head must arrive within ",
                                       options_.head_timeout_ms, " ms")};
        }
        return false;
      }
    }
  }

  bool ParseHead(HttpRequest& request, Refusal& refusal) {
    const std::string head = in_.substr(0, head_end_);
    in_.erase(0, head_end_ + 4);
    std::vector<absl::string_view> lines = absl::StrSplit(head, "\r\n");
    std::vector<absl::string_view> parts = absl::StrSplit(lines[0], ' ');
    if (parts.size() != 3 || parts[0].empty() || parts[1].empty() || parts[1][0] != '/' ||
        !absl::StartsWith(parts[2], "HTTP/1.")) {
      refusal = {400, "malformed request line"};
      return false;
    }
    request.method = std::string(parts[0]);
    http10_ = parts[2] == "HTTP/1.0";
    const absl::string_view target = parts[1];
    const size_t q = target.find('?');
    request.path = Decode(target.substr(0, q), false);
    if (q != absl::string_view::npos) {
      for (absl::string_view kv : absl::StrSplit(target.substr(q + 1), '&', absl::SkipEmpty())) {
        const size_t eq = kv.find('=');
        request.params.emplace(
            Decode(kv.substr(0, eq), true),
            eq == absl::string_view::npos ? "" : Decode(kv.substr(eq + 1), true));
      }
    }
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      if (colon == absl::string_view::npos || colon == 0 || lines[i][0] == ' ' ||
          lines[i][0] == '\t') {
        refusal = {400, "malformed header line"};
        return false;
      }
      std::string name = absl::AsciiStrToLower(lines[i].substr(0, colon));
      if (name.find_first_of(" \t") != std::string::npos) {
        refusal = {400, "malformed header name"};
        return false;
      }
      request.headers.emplace_back(
          std::move(name), std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1))));
    }
    return true;
  }

  bool ReadBody(HttpRequest& request, Refusal& refusal) {
    std::vector<std::string> lengths, encodings;
    for (const auto& [k, v] : request.headers) {
      if (k == "content-length") lengths.push_back(v);
      if (k == "transfer-encoding") encodings.push_back(absl::AsciiStrToLower(v));
    }
    const std::string content_encoding = absl::AsciiStrToLower(request.Header("content-encoding"));
    const bool compressed = !content_encoding.empty() && content_encoding != "identity";
    const size_t max = options_.max_body_bytes;
    const std::string too_large = absl::StrCat("request body too large (limit ", max, " bytes)");
    if (!encodings.empty()) {
      if (!lengths.empty()) {
        refusal = {400, "both Content-Length and Transfer-Encoding given"};
        return false;
      }
      if (encodings.size() != 1 || encodings[0] != "chunked") {
        refusal = {501, "Transfer-Encoding: only chunked is supported"};
        return false;
      }
      if (compressed) return RefuseEncoding(content_encoding, refusal);
      Continue(request);
      return ReadChunked(request, too_large, refusal);
    }
    if (lengths.empty()) {
      if (request.method == "POST" || request.method == "PUT" || request.method == "PATCH") {
        refusal = {411, "Content-Length required (or Transfer-Encoding: chunked)"};
        return false;
      }
      return true;
    }
    uint64_t length = 0;
    for (const std::string& l : lengths) {
      uint64_t v = 0;
      if (l.empty() || l.size() > 19 || !absl::SimpleAtoi(l, &v) || (l != lengths[0]) ||
          l.find_first_not_of("0123456789") != std::string::npos) {
        refusal = {400, "malformed Content-Length"};
        return false;
      }
      length = v;
    }
    if (length > max) {
      refusal = {413, too_large};
      return false;
    }
    if (compressed) return RefuseEncoding(content_encoding, refusal);
    Continue(request);
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.body_timeout_ms);
    while (in_.size() < length) {
      if (!Fill(deadline, length - in_.size())) {
        refusal = {408, "request body timeout"};
        return false;
      }
    }
    request.body = in_.substr(0, length);
    in_.erase(0, length);
    return true;
  }

  bool RefuseEncoding(const std::string& encoding, Refusal& refusal) {
    refusal = {415, absl::StrCat("Content-Encoding '", encoding.substr(0, 40),
                                 "' is not supported: send the body uncompressed")};
    return false;
  }

  // "Expect: 100-continue": the client waits for this before it sends the body.
  void Continue(const HttpRequest& request) {
    if (absl::AsciiStrToLower(request.Header("expect")) == "100-continue") {
      WriteAll("HTTP/1.1 100 Continue\r\n\r\n");
    }
  }

  // A line of at most `max_line` bytes from the buffered stream (CRLF stripped).
  bool ReadLine(std::string& line, size_t max_line, Clock::time_point deadline) {
    for (;;) {
      const size_t nl = in_.find("\r\n");
      if (nl != std::string::npos && nl <= max_line) {
        line = in_.substr(0, nl);
        in_.erase(0, nl + 2);
        return true;
      }
      if (in_.size() > max_line + 2) return false;
      if (!Fill(deadline, max_line + 2 - in_.size())) return false;
    }
  }

  bool ReadChunked(HttpRequest& request, const std::string& too_large, Refusal& refusal) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.body_timeout_ms);
    const Refusal malformed = {400, "malformed chunked body"};
    for (;;) {
      std::string line;
      if (!ReadLine(line, 1024, deadline)) {
        refusal = Clock::now() >= deadline ? Refusal{408, "request body timeout"} : malformed;
        return false;
      }
      const absl::string_view hex = absl::string_view(line).substr(0, line.find(';'));
      uint64_t size = 0;
      if (hex.empty() || hex.size() > 15) {
        refusal = malformed;
        return false;
      }
      for (char c : absl::StripAsciiWhitespace(hex)) {
        if (HexValue(c) < 0) {
          refusal = malformed;
          return false;
        }
        size = size * 16 + static_cast<uint64_t>(HexValue(c));
      }
      if (size == 0) break;
      if (request.body.size() + size > options_.max_body_bytes) {
        refusal = {413, too_large};
        return false;
      }
      while (in_.size() < size + 2) {
        if (!Fill(deadline, size + 2 - in_.size())) {
          refusal = {408, "request body timeout"};
          return false;
        }
      }
      if (in_.compare(size, 2, "\r\n") != 0) {
        refusal = malformed;
        return false;
      }
      request.body.append(in_, 0, size);
      in_.erase(0, size + 2);
    }
    // Trailers, up to the empty line, bounded like the head.
    size_t trailer_bytes = 0;
    for (;;) {
      std::string line;
      if (!ReadLine(line, options_.max_head_bytes, deadline)) {
        refusal = malformed;
        return false;
      }
      if (line.empty()) return true;
      trailer_bytes += line.size();
      if (trailer_bytes > options_.max_head_bytes) {
        refusal = {431, "chunked trailers too large"};
        return false;
      }
    }
  }

 public:
  bool http10() const { return http10_; }

 private:
  int fd_;
  const HttpServerOptions& options_;
  std::string in_;
  size_t head_end_ = 0;
  bool eof_ = false;
  bool http10_ = false;
  SSL* ssl_ = nullptr;  // TLS session (options_.tls), else plain TCP
};

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Route(const std::string& method, const std::string& path, const std::string& auth,
                       HttpHandler handler) {
  const std::string pattern = std::regex_replace(path, std::regex(R"(\{[a-z_]+\})"), "([^/]+)");
  routes_.push_back({method, std::regex(pattern), std::move(handler), path, auth});
}

void HttpServer::RoutePattern(const std::string& method, const std::string& pattern,
                              HttpHandler handler) {
  routes_.push_back({method, std::regex(pattern), std::move(handler), "", ""});
}

std::vector<HttpServer::RouteInfo> HttpServer::Routes() const {
  std::vector<RouteInfo> out;
  for (const RouteEntry& r : routes_) {
    if (!r.path.empty()) out.push_back({r.method, r.path, r.auth});
  }
  return out;
}

std::string HttpServer::RouteTemplate(const std::string& method, const std::string& path) const {
  for (const RouteEntry& r : routes_) {
    if (!r.path.empty() && r.method == method && std::regex_match(path, r.pattern)) return r.path;
  }
  return "other";
}

absl::StatusOr<int> HttpServer::Listen(const std::string& address, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(address.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", address, "': ", ::gai_strerror(rc)));
  }
  int fd = -1;
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 512) != 0) {
      error = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", address, ":", port, ": ", error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  listen_fd_ = fd;
  if (bound.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
}

void HttpServer::Start() {
  for (int i = 0; i < options_.threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

void HttpServer::Stop() {
  if (stop_.exchange(true)) return;
  ready_.notify_all();
  if (acceptor_.joinable()) acceptor_.join();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (int fd : queue_) ::close(fd);
  queue_.clear();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

void HttpServer::AcceptLoop() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::unique_lock<std::mutex> lock(mutex_);
    if (static_cast<int>(queue_.size()) >= options_.max_queued_connections) {
      lock.unlock();
      static const std::string busy = [] {
        const std::string body = ErrorBody(503, "server busy: try again later");
        return absl::StrCat(
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            "Retry-After: ",
            kRetryAfterSeconds, "\r\nContent-Length: ", body.size(),
            "\r\nConnection: close\r\n\r\n", body);
      }();
      // A TLS client cannot read a plain answer before its handshake: it just sees the close.
      if (!options_.tls) (void)!::send(fd, busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ::close(fd);
      continue;
    }
    queue_.push_back(fd);
    lock.unlock();
    ready_.notify_one();
  }
}

void HttpServer::WorkerLoop() {
  for (;;) {
    int fd = -1;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      fd = queue_.front();
      queue_.pop_front();
    }
    Connection conn(fd, options_);
    if (!conn.Handshake()) continue;  // not TLS, or too slow: closed without an answer
    for (int n = 0; n < options_.max_requests_per_connection && !stop_; ++n) {
      HttpRequest request;
      HttpResponse response;
      Refusal refusal;
      const auto start = Clock::now();
      if (!conn.ReadRequest(request, n == 0, refusal)) {
        if (!refusal.silent) {
          SetJsonError(response, refusal.status, refusal.message);
          conn.WriteResponse(response, false);
          if (logger_) logger_(request, response, 0);
          conn.LingerClose();
        }
        break;
      }
      request.client_connected = [&conn] { return conn.ClientConnected(); };
      Dispatch(request, response);
      const std::string connection = absl::AsciiStrToLower(request.Header("connection"));
      const bool keep_alive = !response.stream && connection != "close" &&
                              !(conn.http10() && connection != "keep-alive") &&
                              n + 1 < options_.max_requests_per_connection;
      bool ok = conn.WriteResponse(response, keep_alive);
      if (ok && response.stream) {
        response.stream(conn);
        ok = conn.FinishStream();
      }
      if (logger_) {
        logger_(request, response, std::chrono::duration<double>(Clock::now() - start).count());
      }
      if (!ok || !keep_alive) break;
    }
  }
}

void HttpServer::Dispatch(HttpRequest& request, HttpResponse& response) {
  try {
    if (filter_ && filter_(request, response)) return;
    for (const RouteEntry& r : routes_) {
      std::smatch m;
      if (r.method != request.method || !std::regex_match(request.path, m, r.pattern)) continue;
      for (size_t i = 1; i < m.size(); ++i) request.matches.push_back(m[i].str());
      r.handler(request, response);
      return;
    }
    SetJsonError(
        response, 404,
        absl::StrCat("no route ", request.method.substr(0, 16), " ", request.path.substr(0, 200)));
  } catch (const std::exception& e) {
    SetJsonError(response, 500, absl::StrCat("internal error: ", e.what()));
  }
}

namespace {

// "host:port", "[v6]:port" or "host" -> the host, lower case.
std::string HostPart(absl::string_view authority) {
  if (absl::StartsWith(authority, "[")) {
    const size_t end = authority.find(']');
    return absl::AsciiStrToLower(
        authority.substr(0, end == absl::string_view::npos ? end : end + 1));
  }
  return absl::AsciiStrToLower(authority.substr(0, authority.find(':')));
}

}  // namespace

std::set<std::string> DefaultAllowedHosts(const std::string& bind) {
  if (absl::StartsWith(bind, "127.") || bind == "::1" || bind == "localhost")
    return {"localhost", "127.0.0.1", "[::1]", "::1"};
  return {};
}

std::string ForeignHostOrOrigin(const HttpRequest& req,
                                const std::set<std::string>& allowed_hosts) {
  const std::string host_header = req.Header("host");
  if (!allowed_hosts.empty() && !allowed_hosts.count(HostPart(host_header))) {
    return absl::StrCat("Host header '", host_header.substr(0, 100),
                        "' is not a name this server answers to (--allowed-hosts)");
  }
  const std::string origin = req.Header("origin");
  if (origin.empty()) return "";
  absl::string_view rest(origin);
  const bool web = absl::ConsumePrefix(&rest, "http://") || absl::ConsumePrefix(&rest, "https://");
  const bool ok = web && (allowed_hosts.empty()
                              ? absl::AsciiStrToLower(rest) == absl::AsciiStrToLower(host_header)
                              : allowed_hosts.count(HostPart(rest)) > 0);
  if (ok) return "";
  return absl::StrCat("Origin '", origin.substr(0, 100),
                      "' is not allowed: cross-site requests are refused");
}

}  // namespace loom::net
