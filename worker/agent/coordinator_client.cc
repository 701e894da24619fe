#include "worker/agent/coordinator_client.h"

#include <grpcpp/grpcpp.h>

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

// The stub and its channel. A channel that has failed kUnavailableCallsBeforeNewChannel calls in
// a row with UNAVAILABLE is replaced by a fresh one: whatever state the old one's reconnection is
// in (backoff, a resolver waiting out its interval), the new one connects at its first call, so
// an agent is never kept from a coordinator that is back by more than a few beats.
class CoordinatorClient::Stub {
 public:
  static constexpr int kUnavailableCallsBeforeNewChannel = 3;

  Stub(std::string target, std::shared_ptr<grpc::ChannelCredentials> creds)
      : target_(std::move(target)), creds_(std::move(creds)) {
    Connect();
  }

  template <typename Req, typename Resp, typename Method>
  absl::Status Call(Method method, const std::string& token, const Req& req, Resp* resp,
                    int timeout_ms) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
    context.AddMetadata("authorization", "Bearer " + token);
    absl::Status s = FromGrpc((stub_.get()->*method)(&context, req, resp));
    unavailable_ = s.code() == absl::StatusCode::kUnavailable ? unavailable_ + 1 : 0;
    if (unavailable_ >= kUnavailableCallsBeforeNewChannel) Connect();
    return s;
  }

 private:
  void Connect() {
    stub_ = v1::Agent::NewStub(grpc::CreateCustomChannel(target_, creds_, ChannelArgs()));
    unavailable_ = 0;
  }

  const std::string target_;
  const std::shared_ptr<grpc::ChannelCredentials> creds_;
  std::unique_ptr<v1::Agent::Stub> stub_;
  int unavailable_ = 0;  // calls in a row that ended UNAVAILABLE on this channel
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
