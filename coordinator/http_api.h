// The coordinator's REST API for users (net/http_server.h), bearer user tokens; the agents have
// their own port and protocol (gRPC, coordinator/agent_service.h), so users cannot starve the
// agents' heartbeats. Also the request checks every route shares: Host/Origin, JSON content
// type, nesting and string limits, the JSON mapping of the control.proto messages, and the
// token checks the agent port shares. api/openapi.yaml documents exactly the routes
// InstallUserRoutes registers (HttpServer::Routes(); coordinator_test compares the two).
#ifndef LOOM_COORDINATOR_HTTP_API_H_
#define LOOM_COORDINATOR_HTTP_API_H_

#include <google/protobuf/message.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/coordinator.h"
#include "net/http_server.h"

namespace loom::coordinator {

// The HTTP layer (net/) the API is served on.
using net::DefaultAllowedHosts;
using net::ForeignHostOrOrigin;
using net::HttpHandler;
using net::HttpRequest;
using net::HttpResponse;
using net::HttpServer;
using net::HttpServerOptions;
using net::LoadTlsContext;
using net::SetJsonError;
using net::StreamSink;

// Limits on what a JSON body may hold (checked before and after parsing).
inline constexpr int kMaxJsonDepth = 32;         // nesting of the whole body
inline constexpr int kMaxFreeFormDepth = 8;      // nesting inside free-form (Struct) fields
inline constexpr size_t kMaxStringBytes = 4096;  // any string, map key or Struct value
// Except the log chunk of an agent's report: it goes to the job's log file, never into a stored
// message, and only the body limit bounds it (agents fit it to that limit).
inline constexpr char kUnboundedStringField[] = "loom.v1.AttemptReport.log";

// Fails when JSON text nests objects/arrays deeper than max_depth (a scan, no parse).
absl::Status CheckJsonDepth(absl::string_view json, int max_depth);
// Fails naming the field when a string is too long or a free-form object too deep.
absl::Status CheckMessageLimits(const google::protobuf::Message& message);

struct ApiOptions {
  std::map<std::string, std::string> user_tokens;  // token -> user name
  std::set<std::string> admins;                    // users who may act on anyone's jobs
  // --private-jobs: users other than admins read only their own jobs, sweeps and checkpoints.
  bool private_jobs = false;
  // --max-user-priority: the highest priority a user other than an admin may give a job (on
  // submission, in a sweep's base, or by PATCH); a higher one is 403. The default allows all.
  int max_user_priority = 1000;
  std::string enrolment_token;  // the agent port's Register only
  // Host names (no port) the API answers to; empty = any. Origin headers must name one of them
  // (or, when empty, the request's own Host).
  std::set<std::string> allowed_hosts;
  int max_followers_per_user = 4;  // concurrent ?follow=true log streams of one user
  int max_followers = 16;          // of everyone (each holds a thread of the user listener)
  // Concurrent requests proxied to serve jobs, per user and in all (each holds a thread of the
  // user listener while it waits for its answer).
  int max_proxied = 32;
};

// The --user-tokens file: "<name> <token> [admin]" lines (# comments, blank lines ignored);
// tokens need >= 16 characters. An admin may cancel anyone's jobs and sweeps; other users only
// their own.
struct UserTokens {
  std::map<std::string, std::string> tokens;  // token -> user name
  std::set<std::string> admins;
};
absl::StatusOr<UserTokens> ReadUserTokens(const std::string& path);
absl::StatusOr<std::string> ReadWorkerToken(const std::string& path);

// Tokens: equal in time independent of where they differ; false when `b` is empty.
bool ConstantTimeEquals(const std::string& a, const std::string& b);
// The user a token belongs to, or "".
std::string UserForToken(const ApiOptions& options, const std::string& token);

void InstallUserRoutes(HttpServer& server, Coordinator& coordinator, const ApiOptions& options);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_HTTP_API_H_
