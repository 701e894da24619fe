// The coordinator's agent port: the gRPC service `loom.v1.Agent` (api/loom/v1/agent.proto) that
// worker agents register and heartbeat with (docs/control-plane.md, "Agent protocol").
//
// Served with gRPC's callback API (no thread per connection). Every call is authenticated before
// it reaches a handler, by an auth metadata processor in gRPC's core: Register takes only the
// enrolment token, Heartbeat only a worker's own live credential (the handler then checks that
// the request's worker_id is that credential's worker before the coordinator sees anything).
// Limits: message size, concurrent streams per connection, keepalive, idle and maximum
// connection age (the bound on how long a stalled call can hold anything), a resource quota.
#ifndef LOOM_COORDINATOR_AGENT_SERVICE_H_
#define LOOM_COORDINATOR_AGENT_SERVICE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/coordinator.h"
#include "coordinator/http_api.h"

namespace grpc {
class Server;
}

namespace loom::coordinator {

struct AgentServerOptions {
  std::string bind = "127.0.0.1";
  int port = 8471;  // 0 = any free port (AgentServer::port() says which)
  // TLS (PEM file paths): both or neither. With client_ca, clients must present a certificate
  // that chains to it (mutual TLS).
  std::string tls_cert, tls_key, client_ca;
  // The largest message a client may send (a heartbeat with its log chunks): larger calls end
  // RESOURCE_EXHAUSTED before the handler. Agents learn it at registration (max_body_bytes).
  int64_t max_message_bytes = 1 << 20;
  int max_concurrent_streams = 8;  // per connection: an agent makes one call at a time
  // The server pings a connection with a call open after keepalive_time_ms of silence and closes
  // it when no answer comes within keepalive_timeout_ms (a peer that stopped reading).
  int keepalive_time_ms = 20000;
  int keepalive_timeout_ms = 10000;
  int max_connection_idle_ms = 300000;  // a connection with no call for this long is closed
  // Every connection is sent GOAWAY after max_connection_age_ms and cut max_connection_age_grace_ms
  // later: no call, stalled or not, outlives age + grace. Clients reconnect transparently.
  int max_connection_age_ms = 120000;
  int max_connection_age_grace_ms = 15000;
  int max_threads = 16;                  // gRPC's resource quota: threads ...
  int64_t max_memory_bytes = 256 << 20;  // ... and buffer memory of all connections together
};

class AgentServer {
 public:
  // Listens and serves; fails naming the address, or a TLS file that cannot be read.
  static absl::StatusOr<std::unique_ptr<AgentServer>> Start(Coordinator& coordinator,
                                                            const ApiOptions& tokens,
                                                            const AgentServerOptions& options);
  ~AgentServer();

  int port() const { return port_; }
  bool tls() const { return tls_; }
  // Stops accepting calls, lets those in flight finish until `grace` has passed, cancels the rest.
  void Shutdown(std::chrono::milliseconds grace);
  // Calls that reached a handler (a refusal before the handler leaves this unchanged).
  int64_t handled_calls() const;

  class Auth;
  class Service;

 private:
  AgentServer() = default;
  std::unique_ptr<Auth> auth_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool tls_ = false;
};

// Debian's abseil is built without NDEBUG, so every absl::Mutex that gRPC takes also runs
// deadlock detection (a process-wide graph behind a global lock): about 5 % of the CPU of a
// heartbeat in loom-bench-agents. Processes that serve the agent port turn it off at start.
void QuietMutexDebugging();

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_AGENT_SERVICE_H_
