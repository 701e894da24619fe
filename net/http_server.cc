// The event-driven HTTP/1.1 server on Boost.Beast (http_server.h says what it promises). One
// io_context runs every socket, parser and timer; complete requests go to a bounded handler pool.
// A connection is a small state machine: handshake -> head -> (checks) -> body -> handler ->
// response -> head again, each step an asynchronous Beast call with its own timer.
#include "net/http_server.h"

#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <chrono>
#include <deque>
#include <future>
#include <list>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "net/request_target.h"

namespace loom::net {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using Ms = std::chrono::milliseconds;

namespace {

// Where a connection is; what may be evicted for a waiting connection of the same address.
// kFresh: a new connection's first byte; kIdle: kept alive between requests.
enum class Phase { kWaiting, kHandshake, kFresh, kIdle, kHead, kBody, kBusy, kClosed };

bool Evictable(Phase p) {
  return p == Phase::kHandshake || p == Phase::kFresh || p == Phase::kIdle || p == Phase::kHead ||
         p == Phase::kBody;
}

// A request refused before its handler: the status and message of the JSON error.
struct Refusal {
  int status = 0;
  std::string message;
};

// What a parse error means to the client.
Refusal RefusalFor(const beast::error_code& ec, const HttpServerOptions& o, bool in_body) {
  if (ec == http::error::header_limit) {
    return {431, absl::StrCat("request header too large (limit ", o.max_head_bytes, " bytes)")};
  }
  if (ec == http::error::body_limit) {
    return {413, absl::StrCat("request body too large (limit ", o.max_body_bytes, " bytes)")};
  }
  if (ec == beast::error::timeout) {
    return in_body
               ? Refusal{408, "request body timeout"}
               : Refusal{408, absl::StrCat("request header timeout: the head must arrive within ",
                                           o.head_timeout_ms, " ms")};
  }
  if (ec == http::error::bad_transfer_encoding) {
    return {400,
            "malformed request: both Content-Length and Transfer-Encoding given, or chunked "
            "not the last transfer coding"};
  }
  if (in_body) return {400, absl::StrCat("malformed request body: ", ec.message())};
  const bool line = ec == http::error::bad_method || ec == http::error::bad_target ||
                    ec == http::error::bad_version;
  return {400, absl::StrCat(line ? "malformed request line (" : "malformed header line (",
                            ec.message(), ")")};
}

// The head checks Beast leaves to the application. `has_body`: the client sends a body.
std::optional<Refusal> CheckHead(const http::request_parser<http::string_body>& parser,
                                 const HttpRequest& request) {
  const auto& h = parser.get();
  if (h.version() != 10 && h.version() != 11) return Refusal{505, "only HTTP/1.0 and 1.1"};
  int encodings = 0;
  for (const auto& f : h) {
    if (f.name() == http::field::transfer_encoding) ++encodings;
  }
  if (encodings > 0) {
    const std::string te = absl::AsciiStrToLower(std::string(h[http::field::transfer_encoding]));
    if (encodings != 1 || te != "chunked") {
      return Refusal{501, "Transfer-Encoding: only chunked is supported"};
    }
  }
  const std::string ce = absl::AsciiStrToLower(request.Header("content-encoding"));
  if (!ce.empty() && ce != "identity") {
    return Refusal{415, absl::StrCat("Content-Encoding '", ce.substr(0, 40),
                                     "' is not supported: send the body uncompressed")};
  }
  const bool framed = encodings > 0 || h.count(http::field::content_length) > 0;
  if (!framed &&
      (request.method == "POST" || request.method == "PUT" || request.method == "PATCH")) {
    return Refusal{411, "Content-Length required (or Transfer-Encoding: chunked)"};
  }
  return std::nullopt;
}

http::response<http::string_body> ToBeast(const HttpResponse& res, bool keep_alive) {
  http::response<http::string_body> out{static_cast<http::status>(res.status), 11};
  out.set(http::field::content_type, res.content_type);
  for (const auto& [k, v] : res.headers) out.insert(k, v);
  out.body() = res.body;
  out.keep_alive(keep_alive);
  out.prepare_payload();
  return out;
}

}  // namespace

// A connection as the registry sees it, whatever its stream type.
class Connection : public StreamSink, public std::enable_shared_from_this<Connection> {
 public:
  explicit Connection(std::string address) : address_(std::move(address)) {}
  virtual void Begin() = 0;  // leaves kWaiting: handshake or first head
  virtual void Abort() = 0;  // closes the socket from any thread
  const std::string& address() const { return address_; }
  bool counted = false;  // holds a place in the registry (under its mutex)
  Phase phase() const { return phase_.load(); }
  Clock::time_point phase_since() const {
    std::lock_guard<std::mutex> lock(phase_mutex_);
    return phase_since_;
  }

 protected:
  void SetPhase(Phase p) {
    std::lock_guard<std::mutex> lock(phase_mutex_);
    phase_ = p;
    phase_since_ = Clock::now();
  }

 private:
  const std::string address_;
  std::atomic<Phase> phase_{Phase::kWaiting};
  mutable std::mutex phase_mutex_;
  Clock::time_point phase_since_ = Clock::now();
};

// The server's shared state: the event loop, the pool, the connection registry and its caps.
class HttpServer::Impl {
 public:
  Impl(HttpServer* server, const HttpServerOptions& o)
      : server_(server),
        options_(o),
        acceptor_(asio::make_strand(io_)),
        sweeper_(asio::make_strand(io_)) {
    if (o.tls) {
      SSL_CTX_up_ref(o.tls.get());  // asio's context frees its handle; the caller keeps theirs
      tls_.emplace(o.tls.get());
    }
  }

  ~Impl() {
    // Waiting connections release their places while the registry is still whole.
    std::vector<std::shared_ptr<Connection>> waiting;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [address, a] : addresses_) {
        waiting.insert(waiting.end(), a.waiting.begin(), a.waiting.end());
        a.waiting.clear();
      }
    }
  }

  absl::StatusOr<int> Listen(const std::string& address, int port);
  void Start();
  void Stop();
  ConnectionStats Connections();

  // Registry: a connection closing frees its address's slot for a waiting one.
  void Release(Connection* c);
  // Runs a handler job on the pool; false when the queue is full.
  bool Submit(std::function<void()> job);
  // The HttpServer's router and logger, for the connections.
  bool AnswerHead(const HttpRequest& req, HttpResponse& res) {
    return server_->AnswerHead(req, res);
  }
  void Dispatch(HttpRequest& req, HttpResponse& res) { server_->Dispatch(req, res); }
  void Log(const HttpRequest& req, const HttpResponse& res, double seconds) {
    if (server_->logger_) server_->logger_(req, res, seconds);
  }

  HttpServer* server_;
  const HttpServerOptions& options_;
  std::atomic<bool> stopping_{false};

 private:
  struct Address {
    std::list<std::weak_ptr<Connection>> active;
    std::deque<std::shared_ptr<Connection>> waiting;
  };
  void Accept();
  void Admit(tcp::socket socket);
  void Sweep();
  // Under mutex_: displaces one stale connection of `a` for its newest waiter; true if it did.
  // The connections it looked at go to `keep`, which the caller destroys after unlocking (the
  // last reference may be there, and a connection's destructor takes mutex_).
  bool EvictFor(Address& a, std::vector<std::shared_ptr<Connection>>& keep);

  // Declared before the event loop: connections that die with it still release their places.
  std::mutex mutex_;
  std::map<std::string, Address> addresses_;
  int open_ = 0;            // connections admitted or waiting
  ConnectionStats counts_;  // refused, evicted, expired
  std::vector<std::weak_ptr<Connection>> all_;
  std::atomic<int> queued_{0};
  std::optional<asio::ssl::context> tls_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  asio::steady_timer sweeper_;
  std::unique_ptr<asio::thread_pool> pool_;
  std::vector<std::thread> io_threads_;
};

namespace {

template <class Stream>
class ConnectionOn final : public Connection {
 public:
  ConnectionOn(HttpServer::Impl* server, std::string address, Stream stream)
      : Connection(std::move(address)),
        server_(server),
        o_(server->options_),
        stream_(std::move(stream)),
        timer_(Lowest().get_executor()) {}

  ~ConnectionOn() override { server_->Release(this); }

  void Begin() override {
    asio::post(Lowest().get_executor(), [self = Self()] { self->Handshake(); });
  }

  void Abort() override {
    asio::post(Lowest().get_executor(), [self = Self()] { self->Close(); });
  }

  // StreamSink, called from a pool thread while the handler streams: one chunk per write.
  bool Write(absl::string_view data) override {
    if (data.empty()) return true;
    auto chunk = std::make_shared<std::string>(data);
    return WaitForWrite([self = Self(), chunk](std::function<void(beast::error_code)> done) {
      asio::async_write(self->stream_, http::make_chunk(asio::buffer(*chunk)),
                        [chunk, done](beast::error_code ec, size_t) { done(ec); });
    });
  }
  bool ClientConnected() override {
    if (server_->stopping_ || closed_) return false;
    const int fd = Lowest().socket().native_handle();
    pollfd p{fd, POLLIN | POLLRDHUP, 0};
    if (::poll(&p, 1, 0) <= 0) return true;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return false;
    char c;
    return ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) != 0;
  }

 private:
  std::shared_ptr<ConnectionOn> Self() {
    return std::static_pointer_cast<ConnectionOn>(shared_from_this());
  }
  beast::tcp_stream& Lowest() { return beast::get_lowest_layer(stream_); }

  void Handshake() {
    SetPhase(Phase::kHandshake);
    if constexpr (std::is_same_v<Stream, beast::tcp_stream>) {
      ReadHead();
    } else {
      Lowest().expires_after(Ms(o_.head_timeout_ms));
      stream_.async_handshake(asio::ssl::stream_base::server,
                              [self = Self()](beast::error_code ec) {
                                if (ec) return self->Close();  // not TLS, or too slow
                                self->ReadHead();
                              });
    }
  }

  // The next request: its first byte within idle_timeout_ms (head_timeout_ms for the first
  // request), then the whole head within head_timeout_ms.
  void ReadHead() {
    if (server_->stopping_ || served_ >= o_.max_requests_per_connection) return Close();
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(o_.max_head_bytes));
    parser_->body_limit(o_.max_body_bytes);
    request_ = HttpRequest{};
    if (buffer_.size() == 0) {
      SetPhase(served_ == 0 ? Phase::kFresh : Phase::kIdle);
      Lowest().expires_after(Ms(served_ == 0 ? o_.head_timeout_ms : o_.idle_timeout_ms));
      stream_.async_read_some(buffer_.prepare(o_.max_head_bytes + 1),
                              [self = Self()](beast::error_code ec, size_t n) {
                                if (ec) return self->Close();  // gone or idle: no answer
                                self->buffer_.commit(n);
                                self->ReadHeadRest();
                              });
      return;
    }
    ReadHeadRest();
  }

  void ReadHeadRest() {
    SetPhase(Phase::kHead);
    started_ = Clock::now();
    Arm(o_.head_timeout_ms);
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = Self()](beast::error_code ec, size_t) { self->OnHead(ec); });
  }

  void OnHead(beast::error_code ec) {
    if (Disarm(ec)) return Refuse(RefusalFor(beast::error::timeout, o_, false));
    if (ec == http::error::end_of_stream || ec == asio::error::eof ||
        ec == asio::error::connection_reset || ec == asio::error::operation_aborted) {
      return Close();
    }
    if (ec) return Refuse(RefusalFor(ec, o_, false));
    const auto& h = parser_->get();
    request_.method = std::string(h.method_string());
    for (const auto& f : h) {
      request_.headers.emplace_back(absl::AsciiStrToLower(std::string(f.name_string())),
                                    std::string(f.value()));
    }
    if (absl::Status s =
            ParseRequestTarget(absl::string_view(h.target().data(), h.target().size()), &request_);
        !s.ok()) {
      return Refuse(
          {s.code() == absl::StatusCode::kNotFound ? 404 : 400, std::string(s.message())});
    }
    if (auto refusal = CheckHead(*parser_, request_)) return Refuse(*refusal);
    keep_alive_ = h.keep_alive();
    HttpResponse early;
    if (server_->AnswerHead(request_, early)) {
      // No body is read after a refusal: the connection cannot be reused unless it has none.
      if (!parser_->is_done()) keep_alive_ = false;
      return Respond(std::move(early));
    }
    ReadBody();
  }

  void ReadBody() {
    SetPhase(Phase::kBody);
    if (parser_->is_done()) {
      request_.body = std::move(parser_->get().body());
      return Handle();
    }
    if (absl::AsciiStrToLower(request_.Header("expect")) == "100-continue") {
      auto cont = std::make_shared<http::response<http::empty_body>>(http::status::continue_, 11);
      Lowest().expires_after(Ms(o_.write_timeout_ms));
      return http::async_write(stream_, *cont, [self = Self(), cont](beast::error_code ec, size_t) {
        if (ec) return self->Close();
        self->ReadBodyRest();
      });
    }
    ReadBodyRest();
  }

  void ReadBodyRest() {
    Arm(o_.body_timeout_ms);
    http::async_read(stream_, buffer_, *parser_, [self = Self()](beast::error_code ec, size_t) {
      if (self->Disarm(ec)) return self->Refuse(RefusalFor(beast::error::timeout, self->o_, true));
      if (ec == http::error::end_of_stream || ec == asio::error::eof ||
          ec == asio::error::operation_aborted) {
        return self->Close();
      }
      if (ec) return self->Refuse(RefusalFor(ec, self->o_, true));
      self->request_.body = std::move(self->parser_->get().body());
      self->Handle();
    });
  }

  // The handler on the pool; its answer is written back on the event loop.
  void Handle() {
    SetPhase(Phase::kBusy);
    Lowest().expires_never();
    auto self = Self();
    request_.client_connected = [weak = std::weak_ptr<ConnectionOn>(self)] {
      auto c = weak.lock();
      return c != nullptr && c->ClientConnected();
    };
    const bool queued = server_->Submit([self] {
      HttpResponse response;
      self->server_->Dispatch(self->request_, response);
      if (response.stream) return self->StreamResponse(std::move(response));
      asio::post(self->Lowest().get_executor(), [self, response = std::move(response)]() mutable {
        self->Respond(std::move(response));
      });
    });
    if (!queued) {
      HttpResponse busy;
      SetJsonError(busy, 503, "server busy: try again later");
      keep_alive_ = false;
      Respond(std::move(busy));
    }
  }

  // A plain response, then the next request or the close.
  void Respond(HttpResponse response) {
    SetPhase(Phase::kBusy);
    ++served_;
    const bool keep_alive =
        keep_alive_ && !server_->stopping_ && served_ < o_.max_requests_per_connection;
    auto msg = std::make_shared<http::response<http::string_body>>(ToBeast(response, keep_alive));
    auto logged = std::make_shared<HttpResponse>(std::move(response));
    Lowest().expires_after(Ms(o_.write_timeout_ms));
    http::async_write(stream_, *msg,
                      [self = Self(), msg, logged, keep_alive](beast::error_code ec, size_t) {
                        self->Log(*logged);
                        if (ec) return self->Close();
                        if (logged->status >= 400 && !keep_alive) return self->LingerClose();
                        if (!keep_alive) return self->Close();
                        self->ReadHead();
                      });
  }

  // A streamed response (chunked), run on the pool thread that ran the handler.
  void StreamResponse(HttpResponse response) {
    auto head = std::make_shared<http::response<http::empty_body>>(
        static_cast<http::status>(response.status), 11);
    head->set(http::field::content_type, response.content_type);
    for (const auto& [k, v] : response.headers) head->insert(k, v);
    head->chunked(true);
    head->keep_alive(false);
    auto serializer = std::make_shared<http::response_serializer<http::empty_body>>(*head);
    bool ok = WaitForWrite([self = Self(), head, serializer](auto done) {
      http::async_write_header(
          self->stream_, *serializer,
          [head, serializer, done](beast::error_code ec, size_t) { done(ec); });
    });
    if (ok) response.stream(*this);
    if (ok) {
      WaitForWrite([self = Self()](auto done) {
        asio::async_write(self->stream_, http::make_chunk_last(),
                          [done](beast::error_code ec, size_t) { done(ec); });
      });
    }
    Log(response);
    Abort();
  }

  // Starts a write on the event loop and waits for it (at most write_timeout_ms, the timer of
  // the stream); false when it failed, timed out or the server is stopping.
  template <class StartWrite>
  bool WaitForWrite(StartWrite start) {
    if (server_->stopping_ || closed_) return false;
    auto done = std::make_shared<std::promise<bool>>();
    std::future<bool> result = done->get_future();
    asio::post(Lowest().get_executor(), [self = Self(), start, done] {
      if (self->closed_) return done->set_value(false);
      self->Lowest().expires_after(Ms(self->o_.write_timeout_ms));
      start([self, done](beast::error_code ec) {
        if (ec) self->Close();
        done->set_value(!ec);
      });
    });
    return result.get();
  }

  // The head and body timers: on expiry the pending read is cancelled, so the connection is
  // still open to answer 408 (the stream's own timeout would close it).
  void Arm(int ms) {
    Lowest().expires_never();
    timed_out_ = false;
    const uint64_t armed = ++armed_;
    timer_.expires_after(Ms(ms));
    timer_.async_wait([self = Self(), armed](beast::error_code ec) {
      if (ec || armed != self->armed_) return;  // disarmed (or a late expiry of an older read)
      self->timed_out_ = true;
      beast::error_code ignored;
      self->Lowest().socket().cancel(ignored);
    });
  }
  // True when the read ended because its timer expired.
  bool Disarm(const beast::error_code& ec) {
    ++armed_;
    timer_.cancel();
    return timed_out_ && ec == asio::error::operation_aborted;
  }

  void Refuse(const Refusal& refusal) {
    HttpResponse response;
    SetJsonError(response, refusal.status, refusal.message);
    keep_alive_ = false;
    Respond(std::move(response));
  }

  void Log(const HttpResponse& response) {
    const double seconds = std::chrono::duration<double>(Clock::now() - started_).count();
    server_->Log(request_, response, seconds);
  }

  // After an error the client may still be sending: stop writing, drain a bounded time so the
  // error reaches it before the reset that closing a socket with unread data causes.
  void LingerClose() {
    beast::error_code ignored;
    Lowest().socket().shutdown(tcp::socket::shutdown_send, ignored);
    linger_until_ = Clock::now() + Ms(1000);
    Drain();
  }
  void Drain() {
    if (Clock::now() >= linger_until_ || drained_ > (64u << 20)) return Close();
    Lowest().expires_at(linger_until_);
    Lowest().async_read_some(asio::buffer(drain_buffer_),
                             [self = Self()](beast::error_code ec, size_t n) {
                               if (ec) return self->Close();
                               self->drained_ += n;
                               self->Drain();
                             });
  }

  void Close() {
    if (closed_.exchange(true)) return;
    SetPhase(Phase::kClosed);
    beast::error_code ignored;
    Lowest().socket().shutdown(tcp::socket::shutdown_both, ignored);
    Lowest().close();
  }

  HttpServer::Impl* server_;
  const HttpServerOptions& o_;
  Stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  HttpRequest request_;
  bool keep_alive_ = false;
  int served_ = 0;
  Clock::time_point started_ = Clock::now();
  Clock::time_point linger_until_;
  size_t drained_ = 0;
  std::array<char, 16 << 10> drain_buffer_;
  asio::steady_timer timer_;
  bool timed_out_ = false;
  uint64_t armed_ = 0;  // which read the timer belongs to
  std::atomic<bool> closed_{false};
};

}  // namespace

absl::StatusOr<int> HttpServer::Impl::Listen(const std::string& address, int port) {
  beast::error_code ec;
  tcp::resolver resolver(io_);
  auto found = resolver.resolve(address, std::to_string(port), tcp::resolver::passive, ec);
  if (ec)
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve '", address, "': ", ec.message()));
  std::string error = "no address";
  for (const auto& entry : found) {
    acceptor_.open(entry.endpoint().protocol(), ec);
    if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(entry.endpoint(), ec);
    if (!ec) acceptor_.listen(512, ec);
    if (!ec) return acceptor_.local_endpoint().port();
    error = ec.message();
    beast::error_code ignored;
    acceptor_.close(ignored);
  }
  return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ":", port, ": ", error));
}

void HttpServer::Impl::Start() {
  pool_ = std::make_unique<asio::thread_pool>(std::max(1, options_.threads));
  Accept();
  Sweep();
  for (int i = 0; i < std::max(1, options_.io_threads); ++i) {
    io_threads_.emplace_back([this] { io_.run(); });
  }
}

void HttpServer::Impl::Accept() {
  acceptor_.async_accept(asio::make_strand(io_), [this](beast::error_code ec, tcp::socket s) {
    if (stopping_ || !acceptor_.is_open()) return;
    if (!ec) Admit(std::move(s));
    Accept();
  });
}

void HttpServer::Impl::Admit(tcp::socket socket) {
  beast::error_code ec;
  const auto peer = socket.remote_endpoint(ec);
  if (ec) return;
  socket.set_option(tcp::no_delay(true), ec);
  const std::string address = peer.address().to_string();
  std::shared_ptr<Connection> c;
  if (tls_) {
    c = std::make_shared<ConnectionOn<beast::ssl_stream<beast::tcp_stream>>>(
        this, address,
        beast::ssl_stream<beast::tcp_stream>(beast::tcp_stream(std::move(socket)), *tls_));
  } else {
    c = std::make_shared<ConnectionOn<beast::tcp_stream>>(this, address,
                                                          beast::tcp_stream(std::move(socket)));
  }
  std::vector<std::shared_ptr<Connection>> keep;  // destroyed after the lock below
  std::unique_lock<std::mutex> lock(mutex_);
  if (open_ >= options_.max_connections) {
    ++counts_.refused;
    lock.unlock();
    c->Abort();  // its destructor must not release a slot it never had: see Release
    return;
  }
  ++open_;
  c->counted = true;
  all_.push_back(c);
  Address& a = addresses_[address];
  if (static_cast<int>(a.active.size()) < options_.max_connections_per_address) {
    a.active.push_back(c);
    lock.unlock();
    return c->Begin();
  }
  a.waiting.push_back(c);
  EvictFor(a, keep);
}

bool HttpServer::Impl::EvictFor(Address& a, std::vector<std::shared_ptr<Connection>>& keep) {
  if (a.waiting.empty()) return false;
  const auto stale = Clock::now() - Ms(options_.evict_after_ms);
  for (auto it = a.active.begin(); it != a.active.end(); ++it) {
    auto c = it->lock();
    if (!c) continue;
    keep.push_back(c);
    const Phase p = c->phase();
    // Idle ones too only once stale: a busy keep-alive client is idle for microseconds between
    // its requests, and must not lose its connection to its own next one.
    if (!Evictable(p) || c->phase_since() > stale) continue;
    c->Abort();
    a.active.erase(it);
    ++counts_.evicted;
    // The newest waiter: a client that just arrived gets its turn before a pile of older ones
    // (the oldest are, under attack, the attacker's); they leave after head_timeout_ms.
    auto next = a.waiting.back();
    a.waiting.pop_back();
    a.active.push_back(next);
    next->Begin();
    return true;
  }
  return false;
}

void HttpServer::Impl::Release(Connection* c) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!c->counted) return;  // refused at the global cap
  --open_;
  auto it = addresses_.find(c->address());
  if (it == addresses_.end()) return;
  Address& a = it->second;
  // `c` is being destroyed, so its entry has expired (nothing is locked here: a lock could
  // hold the last reference of another connection, whose destructor takes mutex_ again).
  a.active.remove_if([](const std::weak_ptr<Connection>& w) { return w.expired(); });
  while (!a.waiting.empty() &&
         static_cast<int>(a.active.size()) < options_.max_connections_per_address) {
    auto next = a.waiting.back();
    a.waiting.pop_back();
    a.active.push_back(next);
    next->Begin();
  }
  if (a.active.empty() && a.waiting.empty()) addresses_.erase(it);
}

// Every 250 ms: displace stale connections for waiting ones, drop waiters that waited a whole
// head timeout, forget closed connections.
void HttpServer::Impl::Sweep() {
  if (stopping_) return;
  {
    std::vector<std::shared_ptr<Connection>> keep;  // destroyed after the lock below
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [address, a] : addresses_) {
      while (EvictFor(a, keep)) {
      }
      const auto expired = Clock::now() - Ms(options_.head_timeout_ms);
      while (!a.waiting.empty() && a.waiting.front()->phase_since() < expired) {
        a.waiting.front()->Abort();
        a.waiting.pop_front();
        ++counts_.expired;
      }
    }
    all_.erase(std::remove_if(all_.begin(), all_.end(),
                              [](const std::weak_ptr<Connection>& w) { return w.expired(); }),
               all_.end());
  }
  sweeper_.expires_after(Ms(250));
  sweeper_.async_wait([this](beast::error_code ec) {
    if (!ec) Sweep();
  });
}

ConnectionStats HttpServer::Impl::Connections() {
  std::lock_guard<std::mutex> lock(mutex_);
  ConnectionStats s = counts_;
  s.open = open_;
  for (const auto& [address, a] : addresses_) s.waiting += static_cast<int64_t>(a.waiting.size());
  return s;
}

bool HttpServer::Impl::Submit(std::function<void()> job) {
  if (queued_.fetch_add(1) >= options_.threads + options_.max_queued_requests) {
    --queued_;
    return false;
  }
  asio::post(*pool_, [this, job = std::move(job)] {
    job();
    --queued_;
  });
  return true;
}

void HttpServer::Impl::Stop() {
  if (stopping_.exchange(true)) return;
  asio::post(acceptor_.get_executor(), [this] {
    beast::error_code ignored;
    acceptor_.close(ignored);
  });
  asio::post(sweeper_.get_executor(), [this] { sweeper_.cancel(); });
  std::vector<std::shared_ptr<Connection>> open;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& w : all_) {
      if (auto c = w.lock()) open.push_back(c);
    }
  }
  for (auto& c : open) c->Abort();
  open.clear();
  // Streams and handlers end once their writes fail; the loop runs until they have.
  if (pool_) pool_->join();
  io_.stop();
  for (auto& t : io_threads_) {
    if (t.joinable()) t.join();
  }
}

HttpServer::HttpServer(HttpServerOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>(this, options_)) {}

HttpServer::~HttpServer() { Stop(); }

absl::StatusOr<int> HttpServer::Listen(const std::string& address, int port) {
  return impl_->Listen(address, port);
}

void HttpServer::Start() { impl_->Start(); }

void HttpServer::Stop() { impl_->Stop(); }

ConnectionStats HttpServer::Connections() const { return impl_->Connections(); }

}  // namespace loom::net
