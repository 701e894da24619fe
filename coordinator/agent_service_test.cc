// The agent port for real: a Coordinator on RocksDB in a temporary directory behind the gRPC
// AgentServer on a loopback port, called through generated stubs and a raw socket. Refusals
// happen before any handler runs (AgentServer::handled_calls stays put, the coordinator's state
// does not move); oversized and hostile messages get clear errors; a call that never completes
// is dropped within the server's bound while others are served; mutual TLS refuses a client
// certificate from another CA (certificates made with the openssl command).
#include "coordinator/agent_service.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "base/read_file.h"
#include "base/test_directory.h"
#include "loom/v1/agent.grpc.pb.h"

namespace fs = std::filesystem;
namespace loom::coordinator {
namespace {

constexpr char kEnrolment[] = "enrolment-token-0123456789";
constexpr char kUserToken[] = "user-token-0123456789abcdef";

class AgentServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshTestDirectory("loom-agent-service-test");
    CoordinatorOptions options;
    options.data_dir = (dir_ / "data").string();
    options.storage_root = (dir_ / "storage").string();
    auto c = Coordinator::Open(options);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = *std::move(c);
    tokens_.enrolment_token = kEnrolment;
    tokens_.user_tokens[kUserToken] = "alice";
  }
  void TearDown() override {
    server_.reset();
    coordinator_.reset();
    fs::remove_all(dir_);
  }

  void StartServer(AgentServerOptions options = {}) {
    options.port = 0;
    auto s = AgentServer::Start(*coordinator_, tokens_, options);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }

  std::unique_ptr<v1::Agent::Stub> Stub(std::shared_ptr<grpc::ChannelCredentials> creds = nullptr,
                                        const std::string& host = "127.0.0.1") {
    if (!creds) creds = grpc::InsecureChannelCredentials();
    return v1::Agent::NewStub(
        grpc::CreateChannel(host + ":" + std::to_string(server_->port()), creds));
  }

  template <typename Req, typename Resp>
  grpc::Status Call(v1::Agent::Stub& stub,
                    grpc::Status (v1::Agent::Stub::*method)(grpc::ClientContext*, const Req&,
                                                            Resp*),
                    const std::string& token, const Req& req, Resp* resp) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    return (stub.*method)(&context, req, resp);
  }

  grpc::Status Register(v1::Agent::Stub& stub, const std::string& token,
                        const v1::RegisterWorkerRequest& req, v1::RegisterWorkerResponse* resp) {
    return Call(stub, &v1::Agent::Stub::Register, token, req, resp);
  }
  grpc::Status Heartbeat(v1::Agent::Stub& stub, const std::string& token,
                         const v1::HeartbeatRequest& req) {
    v1::HeartbeatResponse resp;
    return Call(stub, &v1::Agent::Stub::Heartbeat, token, req, &resp);
  }

  static ::testing::AssertionResult Ok(const grpc::Status& s) {
    if (s.ok()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "status " << s.error_code() << ": " << s.error_message();
  }
  static v1::RegisterWorkerRequest Worker(const std::string& name) {
    v1::RegisterWorkerRequest r;
    r.set_name(name);
    r.set_address("127.0.0.1");
    r.set_slots(1);
    return r;
  }
  static v1::HeartbeatRequest Beat(const std::string& worker) {
    v1::HeartbeatRequest r;
    r.set_worker_id(worker);
    return r;
  }
  // The coordinator's record of a worker's last heartbeat (0 when unknown).
  int64_t LastHeartbeat(const std::string& worker) {
    auto list = coordinator_->ListWorkers();
    EXPECT_TRUE(list.ok()) << list.status();
    for (const auto& w : list->workers()) {
      if (w.id() == worker) return w.last_heartbeat_ms();
    }
    return 0;
  }

  fs::path dir_;
  ApiOptions tokens_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<AgentServer> server_;
};

TEST_F(AgentServiceTest, RefusedCallsNeverReachAHandler) {
  StartServer();
  auto stub = Stub();
  v1::RegisterWorkerResponse a, b;
  ASSERT_TRUE(Ok(Register(*stub, kEnrolment, Worker("a"), &a)));
  ASSERT_TRUE(Ok(Register(*stub, kEnrolment, Worker("b"), &b)));
  ASSERT_EQ(server_->handled_calls(), 2);
  // Re-registering a live worker with its credential revokes that credential.
  v1::RegisterWorkerRequest again = Worker("a");
  again.set_worker_id(a.worker_id());
  again.set_credential(a.credential());
  v1::RegisterWorkerResponse a2;
  ASSERT_TRUE(Ok(Register(*stub, kEnrolment, again, &a2)));
  ASSERT_NE(a2.credential(), a.credential());
  const int64_t handled = server_->handled_calls();
  const int64_t last_a = LastHeartbeat(a.worker_id());
  ASSERT_GT(last_a, 0);

  struct Case {
    std::string what, token;
    bool heartbeat;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"no token", "", false, grpc::UNAUTHENTICATED, "missing bearer token"},
      {"wrong token", "not-a-token-at-all", false, grpc::UNAUTHENTICATED, "invalid token"},
      {"user token", kUserToken, false, grpc::PERMISSION_DENIED, "not a user token"},
      {"a credential", a2.credential(), false, grpc::UNAUTHENTICATED, "invalid token"},
      {"no token", "", true, grpc::UNAUTHENTICATED, "missing bearer token"},
      {"wrong token", "0123456789abcdef0123", true, grpc::UNAUTHENTICATED,
       "invalid or revoked worker credential"},
      {"revoked credential", a.credential(), true, grpc::UNAUTHENTICATED,
       "invalid or revoked worker credential"},
      {"enrolment token", kEnrolment, true, grpc::PERMISSION_DENIED, "not the enrolment token"},
      {"user token", kUserToken, true, grpc::PERMISSION_DENIED, "not a user token"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE((c.heartbeat ? "Heartbeat with " : "Register with ") + c.what);
    v1::RegisterWorkerResponse ignored;
    grpc::Status s = c.heartbeat ? Heartbeat(*stub, c.token, Beat(a.worker_id()))
                                 : Register(*stub, c.token, Worker("x"), &ignored);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_NE(s.error_message().find(c.message), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(server_->handled_calls(), handled) << "a refused call reached a handler";
  // Refusals before the handler are counted all the same.
  const std::string metrics = coordinator_->RenderMetrics();
  EXPECT_NE(metrics.find("loom_coordinator_agent_calls_total{"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\"PERMISSION_DENIED\""), std::string::npos) << metrics;
  // Another worker's credential reaches the handler (the worker id is in the message) but not the
  // coordinator: worker a's heartbeat time does not move.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  grpc::Status s = Heartbeat(*stub, b.credential(), Beat(a.worker_id()));
  EXPECT_EQ(s.error_code(), grpc::PERMISSION_DENIED);
  EXPECT_NE(s.error_message().find("belongs to worker " + b.worker_id()), std::string::npos)
      << s.error_message();
  EXPECT_EQ(LastHeartbeat(a.worker_id()), last_a);
  // The worker's own, current credential works.
  EXPECT_TRUE(Ok(Heartbeat(*stub, a2.credential(), Beat(a.worker_id()))));
  EXPECT_GT(LastHeartbeat(a.worker_id()), last_a);
}

TEST_F(AgentServiceTest, OversizedAndHostileMessagesGetClearErrors) {
  AgentServerOptions options;
  options.max_message_bytes = 64 << 10;
  StartServer(options);
  auto stub = Stub();
  v1::RegisterWorkerResponse w;
  ASSERT_TRUE(Ok(Register(*stub, kEnrolment, Worker("a"), &w)));
  const int64_t handled = server_->handled_calls();
  v1::HeartbeatRequest big = Beat(w.worker_id());
  big.add_attempts()->set_log(std::string(100 << 10, 'x'));
  grpc::Status s = Heartbeat(*stub, w.credential(), big);
  EXPECT_EQ(s.error_code(), grpc::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_EQ(server_->handled_calls(), handled);
  // Under the limit, but a string over 4096 bytes: refused naming the field.
  v1::RegisterWorkerRequest long_name = Worker(std::string(5000, 'n'));
  v1::RegisterWorkerResponse ignored;
  s = Register(*stub, kEnrolment, long_name, &ignored);
  EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("name: longer than 4096 bytes"), std::string::npos)
      << s.error_message();
  // The worker is unharmed.
  EXPECT_TRUE(Ok(Heartbeat(*stub, w.credential(), Beat(w.worker_id()))));
}

// HTTP/2 by hand: the connection preface, an empty SETTINGS frame and a HEADERS frame that opens
// a Heartbeat call (literal header fields, no Huffman), then nothing more.
std::string StalledCallBytes(const std::string& credential) {
  auto field = [](const std::string& name, const std::string& value) {
    std::string f(1, '\0');  // literal header field without indexing, new name
    f += static_cast<char>(name.size());
    f += name;
    f += static_cast<char>(value.size());
    f += value;
    return f;
  };
  const std::string block = field(":method", "POST") + field(":scheme", "http") +
                            field(":path", "/loom.v1.Agent/Heartbeat") +
                            field(":authority", "127.0.0.1") +
                            field("content-type", "application/grpc") + field("te", "trailers") +
                            field("authorization", "Bearer " + credential);
  auto frame = [](uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload) {
    std::string f;
    f += static_cast<char>((payload.size() >> 16) & 0xff);
    f += static_cast<char>((payload.size() >> 8) & 0xff);
    f += static_cast<char>(payload.size() & 0xff);
    f += static_cast<char>(type);
    f += static_cast<char>(flags);
    for (int shift = 24; shift >= 0; shift -= 8) f += static_cast<char>((stream >> shift) & 0xff);
    return f + payload;
  };
  return std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + frame(4, 0, 0, "") +
         frame(1, 0x4 /* END_HEADERS, no END_STREAM */, 1, block);
}

TEST_F(AgentServiceTest, AStalledCallIsDroppedWithinTheBoundWhileOthersAreServed) {
  AgentServerOptions options;
  options.keepalive_time_ms = 1000;
  options.keepalive_timeout_ms = 1000;
  options.max_connection_age_ms = 2000;
  options.max_connection_age_grace_ms = 1000;
  StartServer(options);
  auto stub = Stub();
  v1::RegisterWorkerResponse w;
  ASSERT_TRUE(Ok(Register(*stub, kEnrolment, Worker("a"), &w)));
  const int64_t handled = server_->handled_calls();

  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server_->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const auto opened = std::chrono::steady_clock::now();
  const std::string bytes = StalledCallBytes(w.credential());
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));

  // The stalled client reads nothing and answers no ping; others are served meanwhile.
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(Ok(Heartbeat(*stub, w.credential(), Beat(w.worker_id()))));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  // Then it looks: the server has closed the connection (EOF or reset) within keepalive or
  // age + grace (3 s), with slack for a loaded machine.
  timeval tv{0, 200 * 1000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  bool closed = false;
  char buf[4096];
  while (!closed && std::chrono::steady_clock::now() - opened < std::chrono::seconds(8)) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - opened).count();
  ::close(fd);
  EXPECT_TRUE(closed) << "the stalled connection was still open after " << seconds << " s";
  EXPECT_EQ(server_->handled_calls(), handled + 5) << "the stalled call reached a handler";
  // The server still answers.
  EXPECT_TRUE(Ok(Heartbeat(*stub, w.credential(), Beat(w.worker_id()))));
}

std::string ReadFile(const fs::path& p) {
  return loom::ReadFile(p.string(), "test file").value_or("");
}

// A CA, a server certificate for 127.0.0.1 and a client certificate signed by it, and a client
// certificate of another CA (openssl command).
void MakeCertificates(const fs::path& d) {
  fs::create_directories(d);
  std::ofstream(d / "make.sh") << R"(set -e
for ca in ca other; do
  openssl req -x509 -newkey rsa:2048 -nodes -keyout $ca.key -out $ca.pem -days 2 -subj /CN=$ca
done
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > san.ext
for c in server:ca client:ca rogue:other; do
  n=${c%%:*}; ca=${c##*:}
  openssl req -newkey rsa:2048 -nodes -keyout $n.key -out $n.csr -subj /CN=$n
  openssl x509 -req -in $n.csr -CA $ca.pem -CAkey $ca.key -CAcreateserial -out $n.pem -days 2 \
    -extfile san.ext
done
)";
  const std::string cmd = "cd '" + d.string() + "' && bash make.sh > make.log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << ReadFile(d / "make.log");
}

TEST_F(AgentServiceTest, MutualTlsRefusesClientsWithoutACertificateOfTheClientCa) {
  const fs::path certs = dir_ / "certs";
  MakeCertificates(certs);
  AgentServerOptions options;
  options.tls_cert = (certs / "server.pem").string();
  options.tls_key = (certs / "server.key").string();
  options.client_ca = (certs / "ca.pem").string();
  StartServer(options);
  ASSERT_TRUE(server_->tls());
  auto creds = [&](const std::string& client) {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = ReadFile(certs / "ca.pem");
    if (!client.empty()) {
      o.pem_cert_chain = ReadFile(certs / (client + ".pem"));
      o.pem_private_key = ReadFile(certs / (client + ".key"));
    }
    return grpc::SslCredentials(o);
  };
  v1::RegisterWorkerResponse resp;
  for (const std::string client : {"rogue", ""}) {
    SCOPED_TRACE("client certificate: " + (client.empty() ? std::string("none") : client));
    grpc::Status s = Register(*Stub(creds(client)), kEnrolment, Worker("a"), &resp);
    EXPECT_EQ(s.error_code(), grpc::UNAVAILABLE) << s.error_message();
  }
  EXPECT_EQ(server_->handled_calls(), 0);
  auto stub = Stub(creds("client"));
  grpc::Status s = Register(*stub, kEnrolment, Worker("a"), &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // TLS does not replace the tokens: a wrong one is still refused before the handler.
  EXPECT_EQ(Heartbeat(*stub, kEnrolment, Beat(resp.worker_id())).error_code(),
            grpc::PERMISSION_DENIED);
  EXPECT_TRUE(Ok(Heartbeat(*stub, resp.credential(), Beat(resp.worker_id()))));
  EXPECT_EQ(server_->handled_calls(), 2);
}

}  // namespace
}  // namespace loom::coordinator
