// loom-coordinator: the control plane's only stateful process (docs/control-plane.md).
#include <httplib.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator.h"
#include "http_api.h"
#include "loom/cli_args.h"
#include "loom/status_macros.h"

namespace loom::coordinator {
namespace {

constexpr char kUsage[] = R"(usage: loom-coordinator [flags]
  --data-dir DIR          RocksDB state and job logs (required)
  --storage-root DIR      checkpoints and datasets live here (default DATA_DIR/storage)
  --bind ADDR             listen address (default 127.0.0.1)
  --port N                listen port (default 8470; 0 = any free port)
  --port-file F           write the bound port here once listening
  --local                 no tokens: only with a loopback --bind (one-box use, `loom up`)
  --user-tokens F         lines "<user> <token>": bearer tokens for the REST API
  --worker-token-file F   the token worker agents present
  --heartbeat-ms N        agents' heartbeat interval (default 1000)
  --lost-after-ms N       a silent worker is lost after this (default 10000)
  --aging-seconds S       a queued job gains one priority point per S seconds (default 60)
  --reserve-after-s S     a blocked job reserves slots after waiting S seconds (default 300)
  --max-body-bytes N      request size limit (default 1048576)
  --prometheus-sd-file F  write a Prometheus file_sd target list for this coordinator's /metrics
)";

bool IsLoopback(const std::string& addr) {
  return absl::StartsWith(addr, "127.") || addr == "::1" || addr == "localhost";
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(
      CliArgs args,
      CliArgs::Parse(argc, argv, 1,
                     {"data-dir", "storage-root", "bind", "port", "port-file", "user-tokens",
                      "worker-token-file", "heartbeat-ms", "lost-after-ms", "aging-seconds",
                      "reserve-after-s", "max-body-bytes", "prometheus-sd-file"},
                     {"local", "help"}));
  if (args.Has("help")) {
    std::cout << kUsage;
    return absl::OkStatus();
  }
  CoordinatorOptions options;
  LOOM_ASSIGN_OR_RETURN(options.data_dir, args.Require("data-dir"));
  options.storage_root =
      args.Get("storage-root", (std::filesystem::path(options.data_dir) / "storage").string());
  LOOM_ASSIGN_OR_RETURN(int64_t hb, args.GetInt("heartbeat-ms", 1000, 50, 600000));
  LOOM_ASSIGN_OR_RETURN(int64_t lost, args.GetInt("lost-after-ms", 10000, 200, 86400000));
  LOOM_ASSIGN_OR_RETURN(options.scheduler.aging_seconds,
                        args.GetDouble("aging-seconds", 60, 0.001, 1e9));
  LOOM_ASSIGN_OR_RETURN(int64_t reserve, args.GetInt("reserve-after-s", 300, 0, 1000000000));
  LOOM_ASSIGN_OR_RETURN(int64_t port, args.GetInt("port", 8470, 0, 65535));
  LOOM_ASSIGN_OR_RETURN(int64_t max_body, args.GetInt("max-body-bytes", 1 << 20, 1024, 1 << 30));
  if (lost <= hb) return absl::InvalidArgumentError("--lost-after-ms must exceed --heartbeat-ms");
  options.heartbeat_interval_ms = static_cast<int>(hb);
  options.lost_after_ms = static_cast<int>(lost);
  options.scheduler.reserve_after_ms = reserve * 1000;
  const std::string bind = args.Get("bind", "127.0.0.1");

  ApiOptions api;
  api.max_body_bytes = static_cast<size_t>(max_body);
  api.local_mode = args.Has("local");
  if (api.local_mode) {
    if (!IsLoopback(bind)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--local turns authentication off and needs a loopback --bind, not '", bind, "'"));
    }
  } else {
    if (!args.Has("user-tokens") || !args.Has("worker-token-file")) {
      return absl::InvalidArgumentError(
          "--user-tokens and --worker-token-file are required (or --local on a loopback address)");
    }
    LOOM_ASSIGN_OR_RETURN(api.user_tokens, ReadUserTokens(args.Get("user-tokens")));
    LOOM_ASSIGN_OR_RETURN(api.worker_token, ReadWorkerToken(args.Get("worker-token-file")));
    for (const auto& [token, user] : api.user_tokens) {
      if (token == api.worker_token) {
        return absl::InvalidArgumentError("the worker token must differ from every user token");
      }
    }
  }

  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator, Coordinator::Open(options));
  httplib::Server server;
  server.new_task_queue = [] { return new httplib::ThreadPool(32); };
  InstallRoutes(server, *coordinator, api);
  int bound = 0;
  if (port == 0) {
    bound = server.bind_to_any_port(bind);
  } else {
    bound = server.bind_to_port(bind, static_cast<int>(port)) ? static_cast<int>(port) : -1;
  }
  if (bound <= 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", bind, ":", port));
  if (args.Has("port-file")) {
    const std::string tmp = args.Get("port-file") + ".tmp";
    std::ofstream(tmp) << bound << "\n";
    std::filesystem::rename(tmp, args.Get("port-file"));
  }
  if (args.Has("prometheus-sd-file")) {
    char host[256] = "127.0.0.1";
    if (bind == "0.0.0.0" || bind == "::") ::gethostname(host, sizeof(host) - 1);
    const std::string sd = args.Get("prometheus-sd-file"), tmp = sd + ".tmp";
    std::ofstream(tmp) << "[{\"targets\": [\"" << (bind == "0.0.0.0" || bind == "::" ? host : bind)
                       << ":" << bound
                       << "\"], \"labels\": {\"service\": \"loom-coordinator\"}}]\n";
    std::filesystem::rename(tmp, sd);
  }
  coordinator->Start();
  std::cout << "loom-coordinator: listening on http://" << bind << ":" << bound
            << (api.local_mode ? " (local mode: no authentication)" : "") << "; state in "
            << options.data_dir << std::endl;

  // SIGINT/SIGTERM stop the server; the state is already on disk.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  std::thread signals([&] {
    int sig = 0;
    sigwait(&set, &sig);
    server.stop();
  });
  signals.detach();
  server.listen_after_bind();
  coordinator->Stop();
  std::cout << "loom-coordinator: stopped" << std::endl;
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::coordinator

int main(int argc, char** argv) {
  // Block the stop signals in every thread; one thread waits for them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  absl::Status s = loom::coordinator::Run(argc, argv);
  if (!s.ok()) {
    std::cerr << "loom-coordinator: " << s.message() << "\n";
    return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
