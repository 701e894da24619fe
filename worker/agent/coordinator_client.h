// The agent's side of the agent protocol: gRPC stubs of loom.v1.Agent (api/loom/v1/agent.proto)
// on one channel to the coordinator's agent port. The token of each call goes as call metadata
// `authorization: Bearer <token>` (the enrolment token for Register, the worker's credential for
// Heartbeat); gRPC refuses call credentials on a plaintext channel, so plain metadata serves both.
#ifndef LOOM_WORKER_AGENT_COORDINATOR_CLIENT_H_
#define LOOM_WORKER_AGENT_COORDINATOR_CLIENT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "loom/v1/control.pb.h"

namespace grpc {
class Channel;
}

namespace loom::agent {

struct ConnectionOptions {
  // http://host:port: plaintext gRPC; https://host:port: TLS, the server's certificate verified
  // (chain and host name) against ca_file (PEM) when given, else the system's CAs.
  std::string url;
  std::string ca_file;
  std::string client_cert, client_key;  // PEM: a client certificate for mutual TLS (both or none)
};

class CoordinatorClient {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Create(
      const ConnectionOptions& options);
  ~CoordinatorClient();

  // Each call ends within timeout_ms, or within the probe timeout while the coordinator has not
  // been reached (see Stub). Errors carry the coordinator's code and message
  // (UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND, RESOURCE_EXHAUSTED, ...), or UNAVAILABLE /
  // DEADLINE_EXCEEDED when it cannot be reached in time.
  absl::Status Register(const std::string& enrolment_token, const v1::RegisterWorkerRequest& req,
                        v1::RegisterWorkerResponse* resp, int timeout_ms);
  absl::Status Heartbeat(const std::string& credential, const v1::HeartbeatRequest& req,
                         v1::HeartbeatResponse* resp, int timeout_ms);

  const std::string& url() const { return url_; }
  // The deadline of calls made while the coordinator is unreachable (default 1000 ms).
  void set_probe_timeout_ms(int ms);

 private:
  class Stub;
  CoordinatorClient() = default;
  std::string url_;
  std::unique_ptr<Stub> stub_;
};

}  // namespace loom::agent

#endif  // LOOM_WORKER_AGENT_COORDINATOR_CLIENT_H_
