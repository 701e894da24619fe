#include "client/rest_client.h"

#include <google/protobuf/util/json_util.h>
#include <httplib.h>
#include <unistd.h>

#include <cctype>
#include <nlohmann/json.hpp>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "loom/proto_json.h"
#include "loom/spec.h"

namespace loom::client {

std::string MessageToJson(const google::protobuf::Message& m, bool pretty, bool with_defaults) {
  return MessageToJsonText(m, pretty, with_defaults);
}

std::string QueryValue(const std::string& value) {
  std::string out;
  for (unsigned char c : value) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "%%%02X", c);
    }
  }
  return out;
}

std::string ErrorMessage(const std::string& body) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (!j.is_object() || !j.contains("error")) return body.substr(0, 500);
  const auto& e = j["error"];  // {"error": {"message": ...}}; older coordinators: a string
  if (e.is_object() && e.contains("message") && e["message"].is_string()) return e["message"];
  if (e.is_string()) return e;
  return body.substr(0, 500);
}

namespace {
// The absl code for an HTTP error status.
absl::StatusCode CodeOfHttpStatus(int status) {
  switch (status) {
    case 400:
      return absl::StatusCode::kInvalidArgument;
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 403:
      return absl::StatusCode::kPermissionDenied;
    case 404:
      return absl::StatusCode::kNotFound;
    case 409:
      return absl::StatusCode::kFailedPrecondition;
    case 413:
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 503:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::Status StatusFromHttp(int status, const std::string& body) {
  if (status >= 200 && status < 300) return absl::OkStatus();
  absl::Status s(CodeOfHttpStatus(status), absl::StrCat("HTTP ", status, ": ", ErrorMessage(body)));
  s.SetPayload(kHttpStatusPayload, absl::Cord(std::to_string(status)));
  return s;
}

absl::StatusOr<std::unique_ptr<RestClient>> RestClient::Create(const std::string& url,
                                                               const std::string& token,
                                                               int timeout_ms,
                                                               const std::string& ca_file) {
  const bool https = absl::StartsWith(url, "https://");
  if (!https && !absl::StartsWith(url, "http://")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "coordinator URL '", url, "': expected http://host:port or https://host:port"));
  }
  if (!ca_file.empty() && !https) {
    return absl::InvalidArgumentError("--ca-file: only for an https:// coordinator URL");
  }
  if (!ca_file.empty() && ::access(ca_file.c_str(), R_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--ca-file: cannot read '", ca_file, "'"));
  }
  std::unique_ptr<RestClient> c(new RestClient());
  c->url_ = url;
  c->token_ = token;
  c->http_ = std::make_unique<httplib::Client>(url);
  if (!c->http_->is_valid())
    return absl::InvalidArgumentError(absl::StrCat("bad coordinator URL '", url, "'"));
  const time_t sec = timeout_ms / 1000;
  const time_t usec = (timeout_ms % 1000) * 1000;
  c->http_->set_connection_timeout(sec, usec);
  c->http_->set_read_timeout(sec, usec);
  c->http_->set_write_timeout(sec, usec);
  if (!token.empty()) c->http_->set_bearer_token_auth(token.c_str());
  if (https) {
    c->http_->enable_server_certificate_verification(true);
    if (!ca_file.empty()) c->http_->set_ca_cert_path(ca_file.c_str());
  }
  return c;
}

RestClient::~RestClient() = default;

namespace {
absl::Status Unreachable(const std::string& url, httplib::Error e) {
  if (e == httplib::Error::SSLServerVerification) {
    return absl::UnavailableError(
        absl::StrCat("coordinator ", url,
                     ": its TLS certificate is not trusted (or not for this host name); "
                     "--ca-file names the CA that signed it"));
  }
  return absl::UnavailableError(
      absl::StrCat("coordinator ", url, " unreachable: ", httplib::to_string(e)));
}
}  // namespace

absl::StatusOr<HttpResult> RestClient::Get(const std::string& path) {
  auto r = http_->Get(path.c_str());
  if (!r) return Unreachable(url_, r.error());
  return HttpResult{r->status, r->body};
}

absl::StatusOr<HttpResult> RestClient::Post(const std::string& path, const std::string& json) {
  auto r = http_->Post(path.c_str(), json, "application/json");
  if (!r) return Unreachable(url_, r.error());
  return HttpResult{r->status, r->body};
}

absl::StatusOr<HttpResult> RestClient::Send(const std::string& method, const std::string& path,
                                            const std::string& json) {
  if (method == "GET") return Get(path);
  if (method == "POST") return Post(path, json);
  if (method != "PUT" && method != "PATCH" && method != "DELETE")
    return absl::InvalidArgumentError(absl::StrCat("method ", method, ": not one the API uses"));
  httplib::Result r = method == "PUT"     ? http_->Put(path.c_str(), json, "application/json")
                      : method == "PATCH" ? http_->Patch(path.c_str(), json, "application/json")
                                          : http_->Delete(path.c_str());
  if (!r) return Unreachable(url_, r.error());
  return HttpResult{r->status, r->body};
}

absl::Status RestClient::GetStream(const std::string& path,
                                   const std::function<bool(const char*, size_t)>& on_data) {
  int status = 0;
  std::string error_body;
  auto r = http_->Get(
      path.c_str(), httplib::Headers{},
      [&](const httplib::Response& res) {
        status = res.status;
        return true;
      },
      [&](const char* data, size_t n) {
        if (status >= 300) {
          error_body.append(data, n);
          return true;
        }
        return on_data(data, n);
      });
  if (!r && r.error() != httplib::Error::Canceled) return Unreachable(url_, r.error());
  return StatusFromHttp(status == 0 ? 200 : status, error_body);
}

absl::Status RestClient::Call(const std::string& method, const std::string& path,
                              const google::protobuf::Message* request,
                              google::protobuf::Message* response) {
  absl::StatusOr<HttpResult> r = Send(method, path, request ? MessageToJson(*request) : "{}");
  if (!r.ok()) return r.status();
  if (auto s = StatusFromHttp(r->status, r->body); !s.ok()) return s;
  if (response == nullptr) return absl::OkStatus();
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;  // a newer coordinator may add fields
  auto s = google::protobuf::util::JsonStringToMessage(r->body, response, options);
  if (!s.ok())
    return absl::InternalError(absl::StrCat("bad response from ", path, ": ", s.ToString()));
  return absl::OkStatus();
}

}  // namespace loom::client
