// The coordinator's REST API over cpp-httplib: routes, bearer-token authentication, request
// limits and the JSON mapping of the control.proto messages. api/openapi.yaml documents exactly
// the routes in Routes(); a test keeps the two in sync.
#ifndef LOOM_COORDINATOR_HTTP_API_H_
#define LOOM_COORDINATOR_HTTP_API_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator.h"

namespace httplib {
class Server;
}

namespace loom::coordinator {

struct Route {
  const char* method;  // GET | POST
  const char* path;    // OpenAPI form: /v1/jobs/{id}
  const char* auth;    // none | user | worker
};
const std::vector<Route>& Routes();
// The route template a request path matches ("other" if none): the metrics label.
std::string RouteLabel(const std::string& method, const std::string& path);

struct ApiOptions {
  std::map<std::string, std::string> user_tokens;  // token -> user name
  std::string worker_token;
  // Local mode: no tokens; only allowed when the server binds a loopback address.
  bool local_mode = false;
  size_t max_body_bytes = 1 << 20;
};

// Reads "<name> <token>" lines (# comments, blank lines ignored); tokens need >= 16 characters.
absl::StatusOr<std::map<std::string, std::string>> ReadUserTokens(const std::string& path);
absl::StatusOr<std::string> ReadWorkerToken(const std::string& path);

void InstallRoutes(httplib::Server& server, Coordinator& coordinator, const ApiOptions& options);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_HTTP_API_H_
