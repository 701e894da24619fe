#include "net/http_proxy.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <functional>
#include <limits>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/host_port.h"

namespace loom::net {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using Ms = std::chrono::milliseconds;

namespace {

// One upstream connection. Each operation runs asynchronously on its own io_context, in slices,
// so that a timeout (Beast's stream timers work on asynchronous operations only) and a client
// that went away both end it.
struct Upstream {
  asio::io_context ioc;
  beast::tcp_stream stream{ioc};
  beast::flat_buffer buffer;
  http::response_parser<http::buffer_body> parser;
  int timeout_ms = 0;

  // Runs `start(handler)` to completion; `gone()` true cancels it.
  beast::error_code Run(const std::function<void(std::function<void(beast::error_code)>)>& start,
                        const std::function<bool()>& gone) {
    beast::error_code result = asio::error::would_block;
    stream.expires_after(Ms(timeout_ms));
    start([&result](beast::error_code ec) { result = ec; });
    ioc.restart();
    while (result == asio::error::would_block) {
      ioc.run_for(Ms(250));
      if (result == asio::error::would_block && gone()) stream.cancel();
    }
    return result;
  }

  // The next piece of the body into `buf`: its size in *n (0 at the end).
  beast::error_code ReadPiece(char* buf, size_t size, size_t* n,
                              const std::function<bool()>& gone) {
    *n = 0;
    if (parser.is_done()) return {};
    parser.get().body().data = buf;
    parser.get().body().size = size;
    beast::error_code ec = Run(
        [this](auto done) {
          http::async_read_some(stream, buffer, parser,
                                [done](beast::error_code e, size_t) { done(e); });
        },
        gone);
    if (ec == http::error::need_buffer) ec = {};
    *n = size - parser.get().body().size;
    return ec;
  }
};

std::string HostHeader(const ProxyTarget& t) { return JoinHostPort(t.host, t.port); }

void Fail(HttpResponse& res, const ProxyTarget& t, beast::error_code ec, absl::string_view when) {
  const bool timeout = ec == beast::error::timeout;
  SetJsonError(res, timeout ? 504 : 502,
               absl::StrCat(t.what, " at ", HostHeader(t), " ",
                            timeout ? "did not answer in time" : "failed", " (", when, ": ",
                            ec.message(), ")"));
}

beast::error_code Connect(Upstream& u, const ProxyTarget& t, const std::function<bool()>& gone) {
  tcp::resolver resolver(u.ioc);
  tcp::resolver::results_type endpoints;
  beast::error_code ec = u.Run(
      [&](auto done) {
        resolver.async_resolve(t.host, std::to_string(t.port),
                               [&endpoints, done](beast::error_code e, auto results) {
                                 endpoints = results;
                                 done(e);
                               });
      },
      gone);
  if (ec) return ec;
  return u.Run(
      [&](auto done) {
        u.stream.async_connect(endpoints, [done](beast::error_code e, auto) { done(e); });
      },
      gone);
}

http::request<http::string_body> UpstreamRequest(const ProxyTarget& t, const HttpRequest& req) {
  http::request<http::string_body> out{http::string_to_verb(req.method), t.path, 11};
  out.set(http::field::host, HostHeader(t));
  out.set(http::field::user_agent, "loom-coordinator");
  if (!t.bearer_token.empty()) out.set(http::field::authorization, "Bearer " + t.bearer_token);
  for (const char* name : {"content-type", "accept"}) {
    if (const std::string v = req.Header(name); !v.empty()) out.set(name, v);
  }
  out.keep_alive(false);
  out.body() = req.body;
  out.prepare_payload();
  return out;
}

// The rest of a body that is not streamed, within max_body_bytes.
bool ReadWholeBody(Upstream& u, const ProxyTarget& t, const std::function<bool()>& gone,
                   HttpResponse& res) {
  std::string body;
  char buf[64 << 10];
  for (;;) {
    size_t n = 0;
    if (beast::error_code ec = u.ReadPiece(buf, sizeof(buf), &n, gone)) {
      Fail(res, t, ec, "reading the answer");
      return false;
    }
    body.append(buf, n);
    if (body.size() > t.max_body_bytes) {
      SetJsonError(res, 502,
                   absl::StrCat(t.what, "'s answer is longer than ", t.max_body_bytes,
                                " bytes; ask for a streamed one"));
      return false;
    }
    if (u.parser.is_done()) break;
  }
  res.body = std::move(body);
  return true;
}

// Relays the body piece by piece; ends when the upstream ends, fails, or the client is gone.
void RelayStream(const std::shared_ptr<Upstream>& u, StreamSink& sink) {
  std::function<bool()> gone = [&sink] { return !sink.ClientConnected(); };
  char buf[16 << 10];
  for (;;) {
    size_t n = 0;
    const beast::error_code ec = u->ReadPiece(buf, sizeof(buf), &n, gone);
    if (n > 0 && !sink.Write(absl::string_view(buf, n))) break;
    if (ec || u->parser.is_done()) break;
  }
  beast::error_code ignored;
  u->stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
}

}  // namespace

void ForwardRequest(const ProxyTarget& target, const HttpRequest& request, HttpResponse& response) {
  auto u = std::make_shared<Upstream>();
  // Counted here: a stream may run long. (Not boost::none: Boost 1.74 compares a Content-Length
  // against an empty optional as larger than it, and refuses every such body.)
  u->parser.body_limit(std::numeric_limits<std::uint64_t>::max());
  const std::function<bool()> gone = [&request] { return !request.client_connected(); };
  u->timeout_ms = target.connect_timeout_ms;
  if (beast::error_code ec = Connect(*u, target, gone))
    return Fail(response, target, ec, "connect");
  u->timeout_ms = target.response_timeout_ms;
  http::request<http::string_body> out = UpstreamRequest(target, request);
  beast::error_code ec = u->Run(
      [&](auto done) {
        http::async_write(u->stream, out, [done](beast::error_code e, size_t) { done(e); });
      },
      gone);
  if (!ec) {
    ec = u->Run(
        [&](auto done) {
          http::async_read_header(u->stream, u->buffer, u->parser,
                                  [done](beast::error_code e, size_t) { done(e); });
        },
        gone);
  }
  if (ec) return Fail(response, target, ec, "sending the request");
  const auto& head = u->parser.get();
  response.status = head.result_int();
  response.content_type = std::string(head[http::field::content_type]);
  if (response.content_type.empty()) response.content_type = "application/octet-stream";
  if (auto retry = head.find(http::field::retry_after); retry != head.end())
    response.SetHeader("Retry-After", std::string(retry->value()));
  const bool streamed =
      u->parser.chunked() || absl::StartsWith(response.content_type, "text/event-stream");
  if (!streamed) {
    ReadWholeBody(*u, target, gone, response);
    return;
  }
  response.stream = [u](StreamSink& sink) { RelayStream(u, sink); };
}

}  // namespace loom::net
