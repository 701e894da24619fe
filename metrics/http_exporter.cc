#include "metrics/http_exporter.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace loom::metrics {
namespace {

constexpr size_t kMaxRequest = 8192;
constexpr int kClientTimeoutMs = 2000;

void SendAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    ssize_t n = ::send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

std::string Response(int code, const char* reason, const std::string& content_type,
                     const std::string& body) {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(const Registry* registry,
                                                                  const std::string& address,
                                                                  int port) {
  std::unique_ptr<HttpExporter> e(new HttpExporter());
  e->registry_ = registry;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics.bind: '", address, "' is not an IPv4 address"));
  }
  e->listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (e->listen_fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  int one = 1;
  ::setsockopt(e->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(e->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(e->listen_fd_, 16) != 0) {
    const int err = errno;
    ::close(e->listen_fd_);
    e->listen_fd_ = -1;
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", address, ":", port, ": ", std::strerror(err)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(e->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  e->port_ = ntohs(addr.sin_port);
  e->thread_ = std::thread([raw = e.get()] { raw->Serve(); });
  return e;
}

HttpExporter::~HttpExporter() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void HttpExporter::Serve() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Handle(fd);
    ::close(fd);
  }
}

void HttpExporter::Handle(int fd) {
  std::string request;
  char buf[1024];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < kMaxRequest) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, kClientTimeoutMs) <= 0) return;  // slow or silent client: drop it
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  if (request.find("\r\n\r\n") == std::string::npos) {
    SendAll(fd,
            Response(431, "Request Header Fields Too Large", "text/plain", "request too large\n"));
    return;
  }
  const std::string line = request.substr(0, request.find("\r\n"));
  const size_t sp1 = line.find(' '), sp2 = line.find(' ', sp1 + 1);
  if (sp1 == std::string::npos || sp2 == std::string::npos) {
    SendAll(fd, Response(400, "Bad Request", "text/plain", "malformed request line\n"));
    return;
  }
  const std::string method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string path = target.substr(0, target.find('?'));
  if (method != "GET") {
    SendAll(fd, Response(405, "Method Not Allowed", "text/plain", "only GET is served\n"));
  } else if (path == "/metrics") {
    SendAll(fd,
            Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", registry_->Render()));
  } else if (path == "/healthz") {
    SendAll(fd, Response(200, "OK", "text/plain", "ok\n"));
  } else {
    SendAll(fd, Response(404, "Not Found", "text/plain", "not found: " + path + "\n"));
  }
}

}  // namespace loom::metrics
