// A small client for the coordinator's REST API (cpp-httplib), shared by the `loom` CLI and the
// worker agent: bearer token, JSON <-> protobuf, and non-2xx answers turned into a Status that
// carries the server's error message.
#ifndef LOOM_CLIENT_REST_CLIENT_H_
#define LOOM_CLIENT_REST_CLIENT_H_

#include <google/protobuf/message.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace httplib {
class Client;
}

namespace loom::client {

struct HttpResult {
  int status = 0;
  std::string body;
};

class RestClient {
 public:
  // url: http://host:port or https://host:port. Over https the server's certificate is verified
  // (chain and host name) against `ca_file` (PEM) when given, else the system's CA store.
  static absl::StatusOr<std::unique_ptr<RestClient>> Create(const std::string& url,
                                                            const std::string& token,
                                                            int timeout_ms = 10000,
                                                            const std::string& ca_file = "");
  ~RestClient();

  absl::StatusOr<HttpResult> Get(const std::string& path);
  absl::StatusOr<HttpResult> Post(const std::string& path, const std::string& json);
  // GET, POST, PUT or DELETE (a JSON body for POST and PUT).
  absl::StatusOr<HttpResult> Send(const std::string& method, const std::string& path,
                                  const std::string& json);
  // Streams a GET response body to `on_data` (return false to stop).
  absl::Status GetStream(const std::string& path,
                         const std::function<bool(const char*, size_t)>& on_data);

  // JSON request/response as messages; HTTP errors become Status with the server's message
  // (404 -> NotFound, 400 -> InvalidArgument, 401/403 -> Unauthenticated/PermissionDenied, ...).
  absl::Status Call(const std::string& method, const std::string& path,
                    const google::protobuf::Message* request, google::protobuf::Message* response);

  const std::string& url() const { return url_; }

 private:
  RestClient() = default;
  std::string url_;
  std::string token_;
  std::unique_ptr<httplib::Client> http_;
};

// Every page of a paged list: GET `path` (which has a query already), then again with each
// next_page_token, `merge(all, page)` appending a page's entries to the result.
template <typename List, typename Merge>
absl::StatusOr<List> AllPages(RestClient& client, const std::string& path, Merge merge) {
  List all;
  std::string token;
  do {
    List page;
    absl::Status s =
        client.Call("GET", token.empty() ? path : path + "&page_token=" + token, nullptr, &page);
    if (!s.ok()) return s;
    merge(all, page);
    token = page.next_page_token();
  } while (!token.empty());
  return all;
}

// Errors from the coordinator carry its HTTP status under this payload type URL ("404"), so
// callers can tell "the server refused" from "the input was bad" (the CLI's exit codes).
inline constexpr char kHttpStatusPayload[] = "type.loom.dev/http-status";

// with_defaults: also fields at their default values (0, "", false), as the coordinator prints.
std::string MessageToJson(const google::protobuf::Message& m, bool pretty = false,
                          bool with_defaults = false);
// A query parameter's value, percent-encoded (RFC 3986: all but unreserved characters; a sweep
// cell's name holds '=', ',', '[' and spaces).
std::string QueryValue(const std::string& value);
// The "error" field of an error body, or the body itself.
std::string ErrorMessage(const std::string& body);
absl::Status StatusFromHttp(int status, const std::string& body);

}  // namespace loom::client

#endif  // LOOM_CLIENT_REST_CLIENT_H_
