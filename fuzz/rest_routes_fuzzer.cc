// Every route of the coordinator's REST API, through its router (HttpServer::Answer: request
// target, head checks, authentication, handler) on a real coordinator whose state is RocksDB in
// a temporary directory. Input: "METHOD TARGET" on the first line, the body after it; the
// request carries a user's bearer token. A handler that throws (the router turns it into a 500
// "internal error") or any other 5xx is a finding.
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "coordinator/coordinator.h"
#include "coordinator/http_api.h"
#include "fuzz/fuzz_input.h"

namespace {

namespace fs = std::filesystem;
using loom::coordinator::Coordinator;

constexpr char kToken[] = "fuzz-user-token-0123456789";

struct Api {
  std::unique_ptr<Coordinator> coordinator;
  std::unique_ptr<loom::net::HttpServer> server;
};

Api& TheApi() {
  static Api* api = [] {
    char dir_template[] = "/tmp/loom-rest-fuzz-XXXXXX";
    static const fs::path dir = ::mkdtemp(dir_template);
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(dir, ec);
    });
    loom::coordinator::CoordinatorOptions options;
    options.data_dir = (dir / "data").string();
    options.storage_root = (dir / "storage").string();
    fs::create_directories(options.storage_root);
    auto* a = new Api;
    auto c = Coordinator::Open(options);
    LOOM_FUZZ_CHECK(c.ok(), std::string(c.status().message()));
    a->coordinator = *std::move(c);
    // Something for the routes to find: a job, its sweep-less peers, a worker.
    loom::v1::SubmitJobRequest job;
    job.mutable_spec()->set_preset("micro");
    job.mutable_spec()->set_steps(40);
    LOOM_FUZZ_CHECK(a->coordinator->Submit(job, "alice").ok(), "submit");
    loom::v1::RegisterWorkerRequest worker;
    worker.set_name("w1");
    worker.set_address("127.0.0.1");
    worker.set_slots(2);
    LOOM_FUZZ_CHECK(a->coordinator->Register(worker).ok(), "register");
    a->server = std::make_unique<loom::net::HttpServer>(loom::net::HttpServerOptions{});
    loom::coordinator::ApiOptions api;
    api.user_tokens = {{kToken, "alice"}};
    api.admins = {"alice"};  // so that the admin routes (quotas) run past their check
    loom::coordinator::InstallUserRoutes(*a->server, *a->coordinator, api);
    return a;
  }();
  return *api;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Api& api = TheApi();
  const std::string input = loom::fuzz::AsString(data, size);
  const size_t eol = input.find('\n');
  const std::string head = input.substr(0, eol);
  const std::string body = eol == std::string::npos ? "" : input.substr(eol + 1);
  const size_t space = head.find(' ');
  if (space == std::string::npos) return 0;
  const std::string method = head.substr(0, space), target = head.substr(space + 1);
  auto res = api.server->Answer(method, target,
                                {{"host", "127.0.0.1"},
                                 {"authorization", std::string("Bearer ") + kToken},
                                 {"content-type", "application/json"}},
                                body);
  LOOM_FUZZ_CHECK(res.status < 500, std::to_string(res.status) + " " + res.body);
  return 0;
}
