// The agent's side of the agent protocol against the real coordinator's agent port: URLs it
// accepts and refuses, and the coordinator's codes and messages arriving intact (the agent's
// behaviour depends on them: register again on UNAUTHENTICATED, and so on).
#include "worker/agent/coordinator_client.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "coordinator/agent_service.h"

namespace fs = std::filesystem;
namespace loom::agent {
namespace {

ConnectionOptions At(const std::string& url) {
  ConnectionOptions o;
  o.url = url;
  return o;
}

TEST(CoordinatorClientTest, AcceptsHttpAndHttpsUrlsOnly) {
  for (const std::string url :
       {"http://127.0.0.1:8471", "http://coord:8471/", "https://[::1]:8471", "https://coord"}) {
    EXPECT_TRUE(CoordinatorClient::Create(At(url)).ok()) << url;
  }
  for (const std::string url :
       {"127.0.0.1:8471", "grpc://coord:8471", "http://", "http://c:1/v1"}) {
    auto c = CoordinatorClient::Create(At(url));
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << url;
  }
  ConnectionOptions cert_on_http{"http://127.0.0.1:8471", "", "node.pem", "node.key"};
  EXPECT_EQ(CoordinatorClient::Create(cert_on_http).status().code(),
            absl::StatusCode::kInvalidArgument);
  ConnectionOptions half{"https://127.0.0.1:8471", "", "node.pem", ""};
  EXPECT_EQ(CoordinatorClient::Create(half).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CoordinatorClientTest, CarriesTheCoordinatorsCodesAndMessages) {
  const fs::path dir =
      fs::temp_directory_path() / ("loom-coordinator-client-test-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  coordinator::CoordinatorOptions options;
  options.data_dir = (dir / "data").string();
  options.storage_root = (dir / "storage").string();
  auto c = coordinator::Coordinator::Open(options);
  ASSERT_TRUE(c.ok()) << c.status();
  coordinator::ApiOptions tokens;
  tokens.enrolment_token = "enrolment-token-0123456789";
  coordinator::AgentServerOptions server_options;
  server_options.port = 0;
  auto server = coordinator::AgentServer::Start(**c, tokens, server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client =
      CoordinatorClient::Create(At("http://127.0.0.1:" + std::to_string((*server)->port())));
  ASSERT_TRUE(client.ok()) << client.status();

  v1::RegisterWorkerRequest req;
  req.set_address("127.0.0.1");
  req.set_slots(1);
  v1::RegisterWorkerResponse resp;
  absl::Status s = (*client)->Register("wrong-token-0123456789", req, &resp, 5000);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  EXPECT_EQ(s.message(), "invalid token");
  ASSERT_TRUE((*client)->Register(tokens.enrolment_token, req, &resp, 5000).ok());
  v1::HeartbeatRequest beat;
  beat.set_worker_id(resp.worker_id());
  v1::HeartbeatResponse answer;
  EXPECT_TRUE((*client)->Heartbeat(resp.credential(), beat, &answer, 5000).ok());
  s = (*client)->Heartbeat(tokens.enrolment_token, beat, &answer, 5000);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  // The coordinator goes away and comes back on the same port: the agent is served again within
  // a few beats of its return (fresh channels after repeated UNAVAILABLE, short backoff).
  const int port = (*server)->port();
  server->reset();
  for (int i = 0; i < 5; ++i) (void)(*client)->Heartbeat(resp.credential(), beat, &answer, 500);
  server_options.port = port;
  server = coordinator::AgentServer::Start(**c, tokens, server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  const auto back = std::chrono::steady_clock::now();
  while (!(*client)->Heartbeat(resp.credential(), beat, &answer, 1000).ok() &&
         std::chrono::steady_clock::now() - back < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - back, std::chrono::seconds(3))
      << "the agent took this long to reach a coordinator that was back";
  // Nobody listening: UNAVAILABLE or DEADLINE_EXCEEDED within the deadline, never a hang.
  server->reset();
  const auto start = std::chrono::steady_clock::now();
  s = (*client)->Heartbeat(resp.credential(), beat, &answer, 1000);
  EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
              s.code() == absl::StatusCode::kDeadlineExceeded)
      << s << " (port " << port << ")";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  c->reset();
  fs::remove_all(dir);
}

// A peer whose kernel completes the TCP handshake but that never speaks (a listening socket that is
// never accepted from), as a coordinator behind a cut link or a dead process: no call waits out
// a 5 s deadline; each ends after a short connection attempt or the probe timeout.
TEST(CoordinatorClientTest, AnUnreachableCoordinatorCostsAShortAttemptNotTheDeadline) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(listen(fd, 64), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  auto client =
      CoordinatorClient::Create(At("http://127.0.0.1:" + std::to_string(ntohs(addr.sin_port))));
  ASSERT_TRUE(client.ok()) << client.status();
  (*client)->set_probe_timeout_ms(200);
  v1::HeartbeatRequest beat;
  v1::HeartbeatResponse answer;
  auto timed = [&] {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = (*client)->Heartbeat("credential", beat, &answer, 5000);
    EXPECT_TRUE(s.code() == absl::StatusCode::kUnavailable ||
                s.code() == absl::StatusCode::kDeadlineExceeded)
        << s;
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                 start)
        .count();
  };
  for (int i = 0; i < 6; ++i) EXPECT_LT(timed(), 1500) << "call " << i;
  close(fd);
}

}  // namespace
}  // namespace loom::agent
