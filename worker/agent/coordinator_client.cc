#include "worker/agent/coordinator_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/read_file.h"
#include "loom/v1/agent.grpc.pb.h"

namespace loom::agent {
namespace {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsCredentials(
    const ConnectionOptions& o) {
  grpc::SslCredentialsOptions ssl;
  if (!o.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadNonEmptyFile(o.ca_file, "--ca-file");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  if (!o.client_cert.empty()) {
    absl::StatusOr<std::string> cert = ReadNonEmptyFile(o.client_cert, "--client-cert");
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadNonEmptyFile(o.client_key, "--client-key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

// The channel's arguments. Reconnect quickly: after a partition or a coordinator restart the
// agent must be back before the coordinator declares it lost (--lost-after-ms, 10 s by default),
// and gRPC's default backoff grows to two minutes.
grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // A fresh channel must mean a fresh connection, not the shared (perhaps stuck) one of the
  // process-wide subchannel pool.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // A failed connection makes the channel resolve the name again before it retries, and by
  // default at most once in 30 s: after a coordinator restart the agent would wait that long.
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 500);
  // Assignments carry whole job specs; the default 4 MiB is not a bound we want on answers.
  args.SetMaxReceiveMessageSize(64 << 20);
  return args;
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  // The canonical codes are numbered alike in gRPC and absl.
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace

// The stub and its channel, and how it comes back after a partition or a coordinator restart:
// - a call that did not reach the coordinator (UNAVAILABLE, or out of time) abandons its
//   channel, and the next call connects afresh: a connection cut mid-stream may hold TCP
//   retransmissions back for a minute and more after the link returns, and a channel that failed
//   to connect waits out its backoff (fail-fast calls on it end at once, unsent);
// - while the coordinator cannot be reached, calls are probes with a short deadline (about one
//   heartbeat), so the agent is back within about a beat of the link's return. A call that timed
//   out on a connected channel found a coordinator that is slow, not gone: it keeps the full
//   deadline.
class CoordinatorClient::Stub {
 public:
  Stub(std::string target, std::shared_ptr<grpc::ChannelCredentials> creds)
      : target_(std::move(target)), creds_(std::move(creds)) {
    Connect();
  }

  template <typename Req, typename Resp, typename Method>
  absl::Status Call(Method method, const std::string& token, const Req& req, Resp* resp,
                    int timeout_ms) {
    grpc::ClientContext context;
    const int deadline_ms = probing_ ? std::min(timeout_ms, probe_timeout_ms_) : timeout_ms;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
    context.AddMetadata("authorization", "Bearer " + token);
    absl::Status s = FromGrpc((stub_.get()->*method)(&context, req, resp));
    if (s.code() == absl::StatusCode::kDeadlineExceeded ||
        s.code() == absl::StatusCode::kUnavailable) {
      probing_ = s.code() == absl::StatusCode::kUnavailable ||
                 channel_->GetState(false) != GRPC_CHANNEL_READY;
      Connect();
    } else {
      probing_ = false;  // answered, whatever the answer
    }
    return s;
  }

  void set_probe_timeout_ms(int ms) { probe_timeout_ms_ = ms; }

 private:
  void Connect() {
    channel_ = grpc::CreateCustomChannel(target_, creds_, ChannelArgs());
    stub_ = v1::Agent::NewStub(channel_);
  }

  const std::string target_;
  const std::shared_ptr<grpc::ChannelCredentials> creds_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Agent::Stub> stub_;
  bool probing_ = false;  // the last call did not reach the coordinator
  int probe_timeout_ms_ = 1000;
};

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Create(
    const ConnectionOptions& options) {
  absl::string_view rest = options.url;
  const bool tls = absl::ConsumePrefix(&rest, "https://");
  if (!tls && !absl::ConsumePrefix(&rest, "http://")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--coordinator: expected http://host:port or https://host:port, got '", options.url, "'"));
  }
  absl::ConsumeSuffix(&rest, "/");
  if (rest.empty() || absl::StrContains(rest, "/")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--coordinator: expected scheme://host:port, got '", options.url, "'"));
  }
  if (options.client_cert.empty() != options.client_key.empty()) {
    return absl::InvalidArgumentError("--client-cert and --client-key go together");
  }
  if (!tls && !options.client_cert.empty()) {
    // A client certificate asks for TLS: refuse rather than send tokens in clear text.
    return absl::InvalidArgumentError("--client-cert needs an https:// coordinator");
  }
  // host:port, or host alone with the scheme's port.
  std::string target(rest);
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos || target.back() == ']') {
    absl::StrAppend(&target, tls ? ":443" : ":80");
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (tls) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> c = TlsCredentials(options);
    if (!c.ok()) return c.status();
    creds = *c;
  }
  std::unique_ptr<CoordinatorClient> client(new CoordinatorClient());
  client->url_ = options.url;
  client->stub_ = std::make_unique<Stub>(target, creds);
  return client;
}

CoordinatorClient::~CoordinatorClient() = default;

void CoordinatorClient::set_probe_timeout_ms(int ms) { stub_->set_probe_timeout_ms(ms); }

absl::Status CoordinatorClient::Register(const std::string& enrolment_token,
                                         const v1::RegisterWorkerRequest& req,
                                         v1::RegisterWorkerResponse* resp, int timeout_ms) {
  return stub_->Call(&v1::Agent::Stub::Register, enrolment_token, req, resp, timeout_ms);
}

absl::Status CoordinatorClient::Heartbeat(const std::string& credential,
                                          const v1::HeartbeatRequest& req,
                                          v1::HeartbeatResponse* resp, int timeout_ms) {
  return stub_->Call(&v1::Agent::Stub::Heartbeat, credential, req, resp, timeout_ms);
}

}  // namespace loom::agent
