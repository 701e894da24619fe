// The request, error and host helpers of net/http_server.h that are not the server itself:
// query and path decoding, the JSON error shape, TLS contexts, the Host/Origin check.
#include <curl/curl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "net/http_server.h"
#include "net/request_target.h"

namespace loom::net {
namespace {

// Percent-decoding by libcurl ('+' is a space only in query strings, made one before decoding so
// that an encoded '+' stays one). Boost.URL (1.81) is newer than Debian 12's Boost 1.74.
std::string Decode(absl::string_view s, bool plus_is_space) {
  std::string in(s);
  if (plus_is_space) std::replace(in.begin(), in.end(), '+', ' ');
  int length = 0;
  char* out = curl_easy_unescape(nullptr, in.data(), static_cast<int>(in.size()), &length);
  if (out == nullptr) return in;  // out of memory: the caller sees the undecoded text
  std::string decoded(out, static_cast<size_t>(length));
  curl_free(out);
  return decoded;
}

}  // namespace

// Beast's parser has framed and checked the target; it is split at '?', '&' and '=' and each part
// percent-decoded by libcurl.
absl::Status ParseRequestTarget(absl::string_view target, HttpRequest* request) {
  if (target.empty() || target[0] != '/') {
    return absl::InvalidArgumentError("request target: expected a path starting with '/'");
  }
  const size_t q = target.find('?');
  const absl::string_view path = target.substr(0, q);
  // Decoded before routing, %2F would turn one segment into two: it names no route.
  if (absl::StrContains(absl::AsciiStrToLower(path), "%2f")) {
    return absl::NotFoundError(absl::StrCat("no route for ", path.substr(0, 200),
                                            ": an encoded '/' (%2F) in a path segment"));
  }
  request->path = Decode(path, false);
  for (unsigned char c : request->path) {
    if (c < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError("request target: a control character in the path");
    }
  }
  if (q == absl::string_view::npos) return absl::OkStatus();
  for (absl::string_view kv : absl::StrSplit(target.substr(q + 1), '&', absl::SkipEmpty())) {
    const size_t eq = kv.find('=');
    request->params.emplace(Decode(kv.substr(0, eq), true),
                            eq == absl::string_view::npos ? "" : Decode(kv.substr(eq + 1), true));
  }
  return absl::OkStatus();
}

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

// By nlohmann::json: any bytes in the message (a client's field name, invalid UTF-8) come out as
// valid JSON; ordered_json keeps the documented key order.
std::string ErrorBody(int status, absl::string_view message, absl::string_view rpc_status) {
  using Json = nlohmann::ordered_json;
  Json details = Json::array();
  if (std::string field = FieldOf(message); !field.empty()) {
    details.push_back(
        {{"@type", "type.googleapis.com/google.rpc.BadRequest"},
         {"fieldViolations",
          Json::array({{{"field", field},
                        {"description", std::string(message.substr(field.size() + 2))}}})}});
  }
  if (status == 429 || status == 503) {
    details.push_back({{"@type", "type.googleapis.com/google.rpc.RetryInfo"},
                       {"retryDelay", absl::StrCat(kRetryAfterSeconds, "s")}});
  }
  const Json body = {
      {"error",
       {{"code", status},
        {"status", std::string(rpc_status.empty() ? CanonicalStatus(status) : rpc_status)},
        {"message", std::string(message)},
        {"details", std::move(details)}}}};
  return body.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
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