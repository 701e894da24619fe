#include "coordinator/agent_service.h"

#include <grpc/grpc_security.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/security/server_credentials.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "base/host_port.h"
#include "base/read_file.h"
#include "loom/v1/agent.grpc.pb.h"

namespace loom::coordinator {
namespace {

constexpr char kRegisterPath[] = "/loom.v1.Agent/Register";
constexpr char kHeartbeatPath[] = "/loom.v1.Agent/Heartbeat";

// absl and gRPC number their canonical codes alike; the agent acts on them (NOT_FOUND and
// UNAUTHENTICATED: register again; RESOURCE_EXHAUSTED: send less log), so they must survive.
static_assert(static_cast<int>(absl::StatusCode::kNotFound) == grpc::StatusCode::NOT_FOUND);
static_assert(static_cast<int>(absl::StatusCode::kFailedPrecondition) ==
              grpc::StatusCode::FAILED_PRECONDITION);
static_assert(static_cast<int>(absl::StatusCode::kUnauthenticated) ==
              grpc::StatusCode::UNAUTHENTICATED);
static_assert(static_cast<int>(absl::StatusCode::kResourceExhausted) ==
              grpc::StatusCode::RESOURCE_EXHAUSTED);

constexpr char kCallsMetric[] = "loom_coordinator_agent_calls_total";

// One call counted by method (Register, Heartbeat or other) and status code name.
void CountCall(Coordinator& coordinator, const std::string& path, absl::StatusCode code) {
  const std::string method = path == kRegisterPath    ? "Register"
                             : path == kHeartbeatPath ? "Heartbeat"
                                                      : "other";
  coordinator.registry().Increment(kCallsMetric, 1,
                                   {{"method", method}, {"code", absl::StatusCodeToString(code)}});
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

std::string SliceString(const grpc_slice& s) {
  return std::string(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(s)), GRPC_SLICE_LENGTH(s));
}

// A listening port whose core credentials (plaintext or TLS) carry our auth metadata processor.
// Why not grpc::InsecureServerCredentials() + SetAuthMetadataProcessor: in gRPC 1.51 the C++
// insecure credentials abort on SetAuthMetadataProcessor (a GPR_ASSERT), although the core's
// server auth filter runs the processor for insecure credentials too. Building the core
// credentials here gives plaintext and TLS one path: every call is authenticated in the core,
// before its message is read or any handler runs. (A server interceptor cannot refuse a call in
// 1.51, and a check inside the handlers would come after the message is parsed.)
class CoreServerCredentials final : public grpc::ServerCredentials {
 public:
  // Takes ownership of `creds`.
  CoreServerCredentials(grpc_server_credentials* creds, grpc_auth_metadata_processor processor)
      : creds_(creds) {
    grpc_server_credentials_set_auth_metadata_processor(creds_, processor);
  }
  ~CoreServerCredentials() override { grpc_server_credentials_release(creds_); }
  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {}

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    return grpc_server_add_http2_port(server, addr.c_str(), creds_);
  }
  grpc_server_credentials* creds_;
};

}  // namespace

// Decides each call from its metadata (:path, authorization) in gRPC's core, before the call
// reaches a handler; the messages are those the HTTP agent routes gave.
class AgentServer::Auth {
 public:
  Auth(Coordinator& coordinator, const ApiOptions& tokens)
      : coordinator_(coordinator), tokens_(tokens) {}

  grpc_auth_metadata_processor Processor() { return {&Auth::Process, nullptr, this}; }

  struct Verdict {
    grpc_status_code code = GRPC_STATUS_OK;
    std::string message;
    std::string worker;  // Heartbeat: the worker the credential is bound to
  };

  // The decision for a call to `path` with this authorization metadata value.
  Verdict Decide(const std::string& path, const std::string& authorization) const {
    absl::string_view token = authorization;
    if (!absl::ConsumePrefix(&token, "Bearer ")) token = "";
    return DecideToken(path, std::string(token));
  }

 private:
  static Verdict Refuse(grpc_status_code code, std::string message) {
    Verdict v;
    v.code = code;
    v.message = std::move(message);
    return v;
  }
  static Verdict Allow(std::string worker) {
    Verdict v;
    v.worker = std::move(worker);
    return v;
  }

  // The core's hook: every call's metadata, before the call is handed to the service.
  static void Process(void* state, grpc_auth_context*, const grpc_metadata* md, size_t num_md,
                      grpc_process_auth_metadata_done_cb done, void* user_data) {
    std::string path, authorization;
    for (size_t i = 0; i < num_md; ++i) {
      const std::string key = SliceString(md[i].key);
      if (key == ":path") path = SliceString(md[i].value);
      if (key == "authorization") authorization = SliceString(md[i].value);
    }
    Auth* auth = static_cast<Auth*>(state);
    const Verdict v = auth->Decide(path, authorization);
    // Refusals are counted here (they never reach the service); the service counts the rest.
    if (v.code != GRPC_STATUS_OK) {
      CountCall(auth->coordinator_, path, static_cast<absl::StatusCode>(v.code));
    }
    done(user_data, nullptr, 0, nullptr, 0, v.code,
         v.code == GRPC_STATUS_OK ? nullptr : v.message.c_str());
  }

  Verdict DecideToken(const std::string& path, const std::string& token) const {
    if (path != kRegisterPath && path != kHeartbeatPath) {
      return Refuse(GRPC_STATUS_UNIMPLEMENTED, absl::StrCat("no method ", path.substr(0, 100)));
    }
    if (token.empty()) {
      return Refuse(GRPC_STATUS_UNAUTHENTICATED,
                    "missing bearer token (metadata authorization: Bearer <token>)");
    }
    const bool enrolment = ConstantTimeEquals(token, tokens_.enrolment_token);
    const bool user = !UserForToken(tokens_, token).empty();
    if (path == kRegisterPath) {
      if (enrolment) return Allow("");
      if (user) {
        return Refuse(GRPC_STATUS_PERMISSION_DENIED,
                      "Register needs the worker enrolment token, not a user token");
      }
      return Refuse(GRPC_STATUS_UNAUTHENTICATED, "invalid token");
    }
    if (enrolment) {
      return Refuse(
          GRPC_STATUS_PERMISSION_DENIED,
          "heartbeats need the worker's own credential (from Register), not the enrolment "
          "token");
    }
    if (user) {
      return Refuse(GRPC_STATUS_PERMISSION_DENIED,
                    "Heartbeat needs a worker credential, not a user token");
    }
    absl::StatusOr<std::string> worker = coordinator_.WorkerForCredential(token);
    if (!worker.ok()) {
      return Refuse(static_cast<grpc_status_code>(worker.status().code()),
                    std::string(worker.status().message()));
    }
    return Allow(*worker);
  }

  Coordinator& coordinator_;
  const ApiOptions tokens_;
};

// The handlers. They run on gRPC's callback threads and never wait for the disk there: Register
// is one lock and one synced batch; a heartbeat that changed state finishes from the
// coordinator's log syncer once the change is on disk (group commit).
class AgentServer::Service final : public v1::Agent::CallbackService {
 public:
  Service(Coordinator& coordinator, const Auth& auth) : coordinator_(coordinator), auth_(auth) {}

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const v1::RegisterWorkerRequest* request,
                                     v1::RegisterWorkerResponse* response) override {
    return Finish(context, kRegisterPath, DoRegister(*context, *request, response));
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override {
    absl::StatusOr<std::string> worker = CheckHeartbeat(*context, *request);
    if (!worker.ok()) return Finish(context, kHeartbeatPath, worker.status());
    ++handled_;
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    // The response and the reactor stay valid until Finish: the call is not done before.
    coordinator_.HeartbeatThen(*request, *worker,
                               [this, reactor, response](absl::StatusOr<v1::HeartbeatResponse> r) {
                                 if (r.ok()) *response = *std::move(r);
                                 CountCall(coordinator_, kHeartbeatPath, r.status().code());
                                 reactor->Finish(ToGrpc(r.status()));
                               });
    return reactor;
  }

  int64_t handled() const { return handled_.load(); }

 private:
  // The handlers compute their answer at once: the default reactor finishes the call with it.
  grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, const char* path,
                                   const absl::Status& status) {
    ++handled_;
    CountCall(coordinator_, path, status.code());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(ToGrpc(status));
    return reactor;
  }

  // Who the caller is. The processor already let this call through, but gRPC gives it the
  // connection's auth context, shared by every call on the connection, so it cannot hand a
  // per-call identity to the handler: the handler decides again from the same metadata (a
  // credential revoked in between is refused here).
  absl::StatusOr<std::string> Caller(const grpc::CallbackServerContext& context,
                                     const char* path) const {
    std::string authorization;
    const auto& md = context.client_metadata();
    if (auto it = md.find("authorization"); it != md.end()) {
      authorization.assign(it->second.data(), it->second.size());
    }
    const Auth::Verdict v = auth_.Decide(path, authorization);
    if (v.code != GRPC_STATUS_OK) {
      return absl::Status(static_cast<absl::StatusCode>(v.code), v.message);
    }
    return v.worker;
  }

  absl::Status DoRegister(const grpc::CallbackServerContext& context,
                          const v1::RegisterWorkerRequest& request,
                          v1::RegisterWorkerResponse* response) {
    if (absl::Status s = Caller(context, kRegisterPath).status(); !s.ok()) return s;
    if (absl::Status s = CheckMessageLimits(request); !s.ok()) return s;
    absl::StatusOr<v1::RegisterWorkerResponse> r = coordinator_.Register(request);
    if (!r.ok()) return r.status();
    *response = *std::move(r);
    return absl::OkStatus();
  }

  // The caller's worker id, once the credential, the report's worker id and the message limits
  // are checked: another worker's credential is refused before the coordinator sees the report.
  absl::StatusOr<std::string> CheckHeartbeat(const grpc::CallbackServerContext& context,
                                             const v1::HeartbeatRequest& request) {
    absl::StatusOr<std::string> worker = Caller(context, kHeartbeatPath);
    if (!worker.ok()) return worker.status();
    if (request.worker_id() != *worker) {
      return absl::PermissionDeniedError(absl::StrCat("this credential belongs to worker ", *worker,
                                                      ", not '", request.worker_id().substr(0, 64),
                                                      "'"));
    }
    if (absl::Status s = CheckMessageLimits(request); !s.ok()) return s;
    return worker;
  }

  Coordinator& coordinator_;
  const Auth& auth_;
  std::atomic<int64_t> handled_{0};
};

namespace {

// The core credentials for the options: TLS with the given files (client certificates required
// and verified against client_ca when given), else plaintext.
absl::StatusOr<grpc_server_credentials*> MakeCoreCredentials(const AgentServerOptions& o) {
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (o.tls_cert.empty()) {
    if (!o.client_ca.empty()) {
      return absl::InvalidArgumentError("--client-ca needs --tls-cert and --tls-key");
    }
    return grpc_insecure_server_credentials_create();
  }
  absl::StatusOr<std::string> cert = ReadNonEmptyFile(o.tls_cert, "--tls-cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadNonEmptyFile(o.tls_key, "--tls-key");
  if (!key.ok()) return key.status();
  std::string client_ca;
  if (!o.client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadNonEmptyFile(o.client_ca, "--client-ca");
    if (!ca.ok()) return ca.status();
    client_ca = *ca;
  }
  grpc_ssl_pem_key_cert_pair pair{key->c_str(), cert->c_str()};
  // The core copies the PEM strings.
  grpc_server_credentials* creds = grpc_ssl_server_credentials_create_ex(
      client_ca.empty() ? nullptr : client_ca.c_str(), &pair, 1,
      client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                        : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY,
      nullptr);
  if (creds == nullptr) return absl::InvalidArgumentError("--tls-cert/--tls-key: not usable");
  return creds;
}

void SetLimits(grpc::ServerBuilder& b, const AgentServerOptions& o) {
  b.SetMaxReceiveMessageSize(static_cast<int>(o.max_message_bytes));
  b.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, o.max_concurrent_streams);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, o.keepalive_time_ms);
  b.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, o.keepalive_timeout_ms);
  b.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, o.max_connection_idle_ms);
  b.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, o.max_connection_age_ms);
  b.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, o.max_connection_age_grace_ms);
  // gRPC sets SO_REUSEPORT by default: a second coordinator could then share the agent port.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // A TLS or HTTP/2 handshake that does not finish is dropped as fast as a slow HTTP head was.
  b.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, 10000);
  grpc::ResourceQuota quota("loom-agent-port");
  quota.SetMaxThreads(o.max_threads);
  quota.Resize(static_cast<size_t>(o.max_memory_bytes));
  b.SetResourceQuota(quota);
}

std::string ListenAddress(const std::string& bind, int port) { return JoinHostPort(bind, port); }

}  // namespace

absl::StatusOr<std::unique_ptr<AgentServer>> AgentServer::Start(Coordinator& coordinator,
                                                                const ApiOptions& tokens,
                                                                const AgentServerOptions& options) {
  coordinator.registry().DeclareCounter(
      kCallsMetric, "Agent port calls by method and gRPC status, refusals before the handler too");
  std::unique_ptr<AgentServer> server(new AgentServer());
  server->auth_ = std::make_unique<Auth>(coordinator, tokens);
  server->service_ = std::make_unique<Service>(coordinator, *server->auth_);
  absl::StatusOr<grpc_server_credentials*> core = MakeCoreCredentials(options);
  if (!core.ok()) return core.status();
  server->tls_ = !options.tls_cert.empty();
  auto creds = std::make_shared<CoreServerCredentials>(*core, server->auth_->Processor());
  grpc::ServerBuilder builder;
  const std::string address = ListenAddress(options.bind, options.port);
  builder.AddListeningPort(address, creds, &server->port_);
  builder.RegisterService(server->service_.get());
  SetLimits(builder, options);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("agent port: cannot listen on ", address));
  }
  return server;
}

AgentServer::~AgentServer() { Shutdown(std::chrono::milliseconds(0)); }

void AgentServer::Shutdown(std::chrono::milliseconds grace) {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() + grace);
  server_->Wait();
  server_.reset();
}

int64_t AgentServer::handled_calls() const { return service_ ? service_->handled() : 0; }

void QuietMutexDebugging() { absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore); }

}  // namespace loom::coordinator
