// The router of net/http_server.h: routes, the head checks that run before a body is read, and
// dispatch to a handler.
#include <exception>

#include "absl/strings/str_cat.h"
#include "net/http_server.h"
#include "net/request_target.h"

namespace loom::net {

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

const HttpServer::RouteEntry* HttpServer::Find(const HttpRequest& request) const {
  for (const RouteEntry& r : routes_) {
    if (r.method == request.method && std::regex_match(request.path, r.pattern)) return &r;
  }
  return nullptr;
}

bool HttpServer::AnswerHead(const HttpRequest& request, HttpResponse& response) const {
  try {
    if (filter_ && filter_(request, response)) return true;
    const RouteEntry* route = Find(request);
    if (route == nullptr) {
      SetJsonError(response, 404,
                   absl::StrCat("no route ", request.method.substr(0, 16), " ",
                                request.path.substr(0, 200)));
      return true;
    }
    if (authenticator_ && !route->auth.empty() && route->auth != "none") {
      return authenticator_(route->auth, request, response);
    }
    return false;
  } catch (const std::exception& e) {
    SetJsonError(response, 500, absl::StrCat("internal error: ", e.what()));
    return true;
  }
}

void HttpServer::Dispatch(HttpRequest& request, HttpResponse& response) const {
  try {
    const RouteEntry* route = Find(request);
    if (route == nullptr) {
      SetJsonError(response, 404,
                   absl::StrCat("no route ", request.method.substr(0, 16), " ",
                                request.path.substr(0, 200)));
      return;
    }
    std::smatch m;
    std::regex_match(request.path, m, route->pattern);
    for (size_t i = 1; i < m.size(); ++i) request.matches.push_back(m[i].str());
    route->handler(request, response);
  } catch (const std::exception& e) {
    SetJsonError(response, 500, absl::StrCat("internal error: ", e.what()));
  }
}

HttpResponse HttpServer::Answer(const std::string& method, absl::string_view target,
                                std::vector<std::pair<std::string, std::string>> headers,
                                std::string body) const {
  HttpRequest request;
  HttpResponse response;
  request.method = method;
  request.headers = std::move(headers);
  if (absl::Status s = ParseRequestTarget(target, &request); !s.ok()) {
    SetJsonError(response, s.code() == absl::StatusCode::kNotFound ? 404 : 400, s.message());
    return response;
  }
  if (AnswerHead(request, response)) return response;
  request.body = std::move(body);
  Dispatch(request, response);
  return response;
}

}  // namespace loom::net
