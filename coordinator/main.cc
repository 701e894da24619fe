// loom-coordinator: the control plane's only stateful process (docs/control-plane.md).
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/cli_args.h"
#include "base/status_macros.h"
#include "coordinator/agent_service.h"
#include "coordinator/coordinator.h"
#include "coordinator/http_api.h"
#include "storage/checkpoint_store.h"

namespace loom::coordinator {
namespace {

constexpr char kUsage[] = R"(usage: loom-coordinator [flags]
  --data-dir DIR          RocksDB state and job logs (required)
  --storage-root DIR      checkpoints and datasets live here (default DATA_DIR/storage)
  --checkpoint-store URL  job checkpoints in an S3-compatible object store instead,
                          s3://bucket/prefix (endpoint, region and credentials from the
                          environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...; docs/storage.md)
  --bind ADDR             listen address of both listeners (default 127.0.0.1)
  --port N                user REST API port (default 8470; 0 = any free port)
  --port-file F           write the bound user port here once listening
  --agent-port N          agent port (gRPC, loom.v1.Agent): registration and heartbeats
                          (default 8471; 0 = any)
  --agent-port-file F     write the bound agent port here once listening
  --user-tokens F         lines "<user> <token>": bearer tokens for the REST API (required)
  --worker-token-file F   the enrolment token agents register with (required); each worker then
                          heartbeats with its own credential
  --allowed-hosts H,...   Host names the API answers to (default: the loopback names when
                          --bind is loopback, else any); Origin headers must name one of them
  --heartbeat-ms N        agents' heartbeat interval (default 1000)
  --lost-after-ms N       a silent worker is lost after this (default 10000): nothing new is
                          placed on it
  --lease-ms N            its ranks keep running this long without reaching the coordinator
                          (default 90000): a coordinator outage shorter than this costs no work;
                          a lost worker's jobs run elsewhere only once it has passed
  --all-silent-min-workers N   when at least N alive workers (default 2) are all silent at
                          once, none is marked lost until the lease lapses: the silence is
                          more likely this coordinator's partition (0 = never hold)
  --term-grace-ms N       after a worker is lost, wait this long more before its jobs run
                          elsewhere (default 5000)
  --max-infra-restarts N  attempts a job may lose to lost or restarted workers (default 20)
  --checkpoint-interval-seconds S   jobs whose spec leaves checkpoint.interval_seconds 0
                          checkpoint at least this often (default 600)
  --aging-seconds S       a queued job gains one priority point per S seconds (default 86400)
  --reserve-after-s S     a blocked job reserves slots after waiting S seconds (default 300)
  --preempt-after-s S     a job that has waited S seconds (default 600) may preempt running
                          jobs of lower priority: they checkpoint, exit and are requeued with
                          their place kept (-1 = never preempt)
  --min-run-s S           a preempted job's next attempt is not preempted again for S seconds
                          (default 600)
  --fair-share-half-life-s S   how fast the usage fair share counts is forgotten (default 86400)
  --max-body-bytes N      request size limit (default 1048576)
  --max-job-log-bytes N   a job's log keeps its first N bytes (default 268435456); later lines
                          are dropped, which the log and the job's events say
  --max-connections N     open HTTP connections of all clients (default 512)
  --max-connections-per-address N   HTTP connections one client address is served at once
                          (default 16; more wait, or displace its slow or idle ones)
  --max-log-followers-per-user N   concurrent log streams per user (default 4)
  --webhook-retry-base-ms N   a failed webhook delivery is tried again after N ms (default
                          1000), doubling each time up to --webhook-retry-max-ms (default 300000)
  --webhook-max-attempts N   tries before a delivery is dropped (default 30), or once it is
                          older than --webhook-max-age-s (default 86400)
  --webhook-timeout-ms N  one webhook POST, connecting included (default 10000)
  --max-user-priority N   the highest priority a user other than an admin may give a job
                          (default 1000: any); a higher one is refused with 403. A high
                          priority preempts other people's jobs: e.g. 0 keeps that to admins
  --private-jobs          users other than admins (--user-tokens roles) see only their own jobs,
                          sweeps, logs, curves and checkpoints (default: every user sees all)
  --prometheus-sd-file F  write a Prometheus file_sd target list for this coordinator's /metrics
  --tls-cert F --tls-key F  serve both ports over TLS (PEM certificate chain and key); clients
                          then use https:// (and --ca-file for a private CA)
  --client-ca F           agent port: require client certificates signed by this CA (mutual
                          TLS; agents use --client-cert/--client-key)
)";

void WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << port << "\n";
  std::filesystem::rename(tmp, path);
}

absl::StatusOr<ApiOptions> ReadApiOptions(const CliArgs& args, const std::string& bind) {
  ApiOptions api;
  if (!args.Has("user-tokens") || !args.Has("worker-token-file")) {
    return absl::InvalidArgumentError(
        "--user-tokens and --worker-token-file are required (`loom up` generates both for one "
        "box)");
  }
  LOOM_ASSIGN_OR_RETURN(UserTokens users, ReadUserTokens(args.Get("user-tokens")));
  api.user_tokens = std::move(users.tokens);
  api.admins = std::move(users.admins);
  LOOM_ASSIGN_OR_RETURN(api.enrolment_token, ReadWorkerToken(args.Get("worker-token-file")));
  for (const auto& [token, user] : api.user_tokens) {
    if (token == api.enrolment_token) {
      return absl::InvalidArgumentError("the worker token must differ from every user token");
    }
  }
  if (args.Has("allowed-hosts")) {
    for (absl::string_view h : absl::StrSplit(args.Get("allowed-hosts"), ',', absl::SkipEmpty())) {
      api.allowed_hosts.insert(absl::AsciiStrToLower(h));
    }
  } else {
    api.allowed_hosts = DefaultAllowedHosts(bind);
  }
  LOOM_ASSIGN_OR_RETURN(int64_t followers, args.GetInt("max-log-followers-per-user", 4, 1, 1000));
  api.max_followers_per_user = static_cast<int>(followers);
  api.private_jobs = args.Has("private-jobs");
  LOOM_ASSIGN_OR_RETURN(int64_t max_priority, args.GetInt("max-user-priority", 1000, -1000, 1000));
  api.max_user_priority = static_cast<int>(max_priority);
  return api;
}

absl::StatusOr<CliArgs> ParseArgs(int argc, char** argv) {
  return CliArgs::Parse(argc, argv, 1,
                        {"data-dir",
                         "storage-root",
                         "checkpoint-store",
                         "bind",
                         "port",
                         "port-file",
                         "agent-port",
                         "agent-port-file",
                         "user-tokens",
                         "worker-token-file",
                         "allowed-hosts",
                         "heartbeat-ms",
                         "lost-after-ms",
                         "lease-ms",
                         "all-silent-min-workers",
                         "max-job-log-bytes",
                         "term-grace-ms",
                         "max-infra-restarts",
                         "checkpoint-interval-seconds",
                         "aging-seconds",
                         "reserve-after-s",
                         "preempt-after-s",
                         "min-run-s",
                         "fair-share-half-life-s",
                         "max-body-bytes",
                         "max-connections",
                         "max-connections-per-address",
                         "max-log-followers-per-user",
                         "max-user-priority",
                         "webhook-retry-base-ms",
                         "webhook-retry-max-ms",
                         "webhook-max-attempts",
                         "webhook-max-age-s",
                         "webhook-timeout-ms",
                         "prometheus-sd-file",
                         "tls-cert",
                         "tls-key",
                         "client-ca"},
                        {"help", "private-jobs"});
}

// The coordinator's options and the two listeners' ports, checked in the order of the usage.
struct Settings {
  CoordinatorOptions coordinator;
  int64_t port = 0, agent_port = 0;
};

// --checkpoint-store: an s3:// URL, normalised, that this process can reach with its
// environment (checked now: a coordinator that cannot delete what retention decides should not
// start).
absl::StatusOr<std::string> CheckpointStoreFlag(const CliArgs& args) {
  if (!args.Has("checkpoint-store")) return std::string();
  const std::string url = args.Get("checkpoint-store");
  if (!storage::IsRemoteLocation(url)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint-store '", url, "': an s3://bucket/prefix URL (POSIX: --storage-root)"));
  }
  LOOM_ASSIGN_OR_RETURN(auto store, storage::OpenCheckpointStore(url));
  if (auto listed = store->List(); !listed.ok()) {
    return absl::Status(listed.status().code(),
                        absl::StrCat("--checkpoint-store: ", listed.status().message()));
  }
  std::string root = store->root();
  while (!root.empty() && root.back() == '/') root.pop_back();
  return root;
}

// Webhook retries (webhooks.h): the first after base ms, doubling up to max ms; a delivery is
// dropped after the attempts or the age allowed.
absl::Status ReadWebhookOptions(const CliArgs& args, WebhookOptions& w) {
  LOOM_ASSIGN_OR_RETURN(w.retry_base_ms, args.GetInt("webhook-retry-base-ms", 1000, 10, 3600000));
  LOOM_ASSIGN_OR_RETURN(w.retry_max_ms,
                        args.GetInt("webhook-retry-max-ms", 300000, w.retry_base_ms, 86400000));
  LOOM_ASSIGN_OR_RETURN(int64_t attempts, args.GetInt("webhook-max-attempts", 30, 1, 100000));
  LOOM_ASSIGN_OR_RETURN(int64_t age_s, args.GetInt("webhook-max-age-s", 86400, 1, 31536000));
  LOOM_ASSIGN_OR_RETURN(w.timeout_ms, args.GetInt("webhook-timeout-ms", 10000, 100, 600000));
  w.max_attempts = static_cast<int>(attempts);
  w.max_age_ms = age_s * 1000;
  return absl::OkStatus();
}

absl::StatusOr<Settings> ReadSettings(const CliArgs& args) {
  Settings settings;
  CoordinatorOptions& options = settings.coordinator;
  LOOM_ASSIGN_OR_RETURN(options.data_dir, args.Require("data-dir"));
  options.storage_root =
      args.Get("storage-root", (std::filesystem::path(options.data_dir) / "storage").string());
  LOOM_ASSIGN_OR_RETURN(options.checkpoint_store, CheckpointStoreFlag(args));
  LOOM_ASSIGN_OR_RETURN(int64_t hb, args.GetInt("heartbeat-ms", 1000, 50, 600000));
  LOOM_ASSIGN_OR_RETURN(int64_t lost, args.GetInt("lost-after-ms", 10000, 200, 86400000));
  LOOM_ASSIGN_OR_RETURN(int64_t lease, args.GetInt("lease-ms", 90000, 200, 86400000));
  LOOM_ASSIGN_OR_RETURN(int64_t all_silent, args.GetInt("all-silent-min-workers", 2, 0, 1000000));
  LOOM_ASSIGN_OR_RETURN(int64_t grace, args.GetInt("term-grace-ms", 5000, 0, 3600000));
  LOOM_ASSIGN_OR_RETURN(int64_t infra, args.GetInt("max-infra-restarts", 20, 0, 100000));
  LOOM_ASSIGN_OR_RETURN(options.checkpoint_interval_seconds,
                        args.GetInt("checkpoint-interval-seconds", 600, 1, 31536000));
  LOOM_ASSIGN_OR_RETURN(options.scheduler.aging_seconds,
                        args.GetDouble("aging-seconds", 86400, 0.001, 1e9));
  LOOM_ASSIGN_OR_RETURN(int64_t reserve, args.GetInt("reserve-after-s", 300, 0, 1000000000));
  LOOM_ASSIGN_OR_RETURN(int64_t preempt, args.GetInt("preempt-after-s", 600, -1, 1000000000));
  LOOM_ASSIGN_OR_RETURN(int64_t min_run, args.GetInt("min-run-s", 600, 0, 1000000000));
  LOOM_ASSIGN_OR_RETURN(options.fair_share_half_life_s,
                        args.GetDouble("fair-share-half-life-s", 86400, 1, 1e9));
  LOOM_ASSIGN_OR_RETURN(settings.port, args.GetInt("port", 8470, 0, 65535));
  LOOM_ASSIGN_OR_RETURN(settings.agent_port, args.GetInt("agent-port", 8471, 0, 65535));
  LOOM_ASSIGN_OR_RETURN(
      options.max_job_log_bytes,
      args.GetInt("max-job-log-bytes", int64_t{256} << 20, 4096, int64_t{1} << 40));
  LOOM_ASSIGN_OR_RETURN(options.max_body_bytes,
                        args.GetInt("max-body-bytes", 1 << 20, 1024, 1 << 30));
  // Loss detection and the lease must outlast a few heartbeat intervals, or a slow reply marks a
  // healthy worker lost or stops its ranks.
  if (lost < 4 * hb) {
    return absl::InvalidArgumentError("--lost-after-ms must be at least 4 x --heartbeat-ms");
  }
  if (lease < 4 * hb) {
    return absl::InvalidArgumentError("--lease-ms must be at least 4 x --heartbeat-ms");
  }
  options.lease_ms = static_cast<int>(lease);
  options.heartbeat_interval_ms = static_cast<int>(hb);
  options.lost_after_ms = static_cast<int>(lost);
  options.term_grace_ms = static_cast<int>(grace);
  options.all_silent_min_workers = static_cast<int>(all_silent);
  options.max_infra_restarts = static_cast<int>(infra);
  options.scheduler.reserve_after_ms = reserve * 1000;
  options.scheduler.preempt_after_ms = preempt < 0 ? -1 : preempt * 1000;
  options.scheduler.min_run_ms = min_run * 1000;
  LOOM_RETURN_IF_ERROR(ReadWebhookOptions(args, options.webhooks));
  return settings;
}

// Both listeners' options: TLS when --tls-cert and --tls-key are given; 32 user threads.
absl::StatusOr<HttpServerOptions> ReadServerOptions(const CliArgs& args, int64_t max_body) {
  HttpServerOptions options;
  if (args.Has("tls-cert") != args.Has("tls-key")) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (args.Has("tls-cert")) {
    LOOM_ASSIGN_OR_RETURN(options.tls, LoadTlsContext(args.Get("tls-cert"), args.Get("tls-key")));
  }
  options.threads = 32;
  options.max_body_bytes = static_cast<size_t>(max_body);
  LOOM_ASSIGN_OR_RETURN(int64_t total, args.GetInt("max-connections", 512, 16, 1 << 20));
  LOOM_ASSIGN_OR_RETURN(int64_t per_address,
                        args.GetInt("max-connections-per-address", 16, 1, 1 << 20));
  options.max_connections = static_cast<int>(total);
  options.max_connections_per_address = static_cast<int>(per_address);
  return options;
}

// The agent port: --bind, --agent-port, the TLS files, messages up to --max-body-bytes.
AgentServerOptions AgentOptions(const CliArgs& args, const Settings& settings) {
  AgentServerOptions options;
  options.bind = args.Get("bind", "127.0.0.1");
  options.port = static_cast<int>(settings.agent_port);
  options.tls_cert = args.Get("tls-cert");
  options.tls_key = args.Get("tls-key");
  options.client_ca = args.Get("client-ca");
  options.max_message_bytes = settings.coordinator.max_body_bytes;
  return options;
}

// A Prometheus file_sd target list naming this coordinator's /metrics.
void WritePrometheusSdFile(const std::string& path, const std::string& bind, int port) {
  char host[256] = "127.0.0.1";
  if (bind == "0.0.0.0" || bind == "::") ::gethostname(host, sizeof(host) - 1);
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << "[{\"targets\": [\"" << (bind == "0.0.0.0" || bind == "::" ? host : bind)
                     << ":" << port << "\"], \"labels\": {\"service\": \"loom-coordinator\"}}]\n";
  std::filesystem::rename(tmp, path);
}

// SIGINT and SIGTERM: blocked in every thread (main), awaited by one (WaitForStopSignal).
sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

void WaitForStopSignal() {
  const sigset_t set = StopSignals();
  int sig = 0;
  sigwait(&set, &sig);
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, ParseArgs(argc, argv));
  if (args.Has("help")) {
    std::cout << kUsage;
    return absl::OkStatus();
  }
  LOOM_ASSIGN_OR_RETURN(const Settings settings, ReadSettings(args));
  const CoordinatorOptions& options = settings.coordinator;
  const std::string bind = args.Get("bind", "127.0.0.1");
  LOOM_ASSIGN_OR_RETURN(ApiOptions api, ReadApiOptions(args, bind));

  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator, Coordinator::Open(options));
  LOOM_ASSIGN_OR_RETURN(HttpServerOptions user_options,
                        ReadServerOptions(args, options.max_body_bytes));
  const std::string scheme = user_options.tls ? "https" : "http";
  api.max_followers = user_options.threads / 2;
  user_options.threads += api.max_proxied;  // requests to serve jobs have threads of their own
  HttpServer user_server(user_options);
  InstallUserRoutes(user_server, *coordinator, api);
  LOOM_ASSIGN_OR_RETURN(int bound, user_server.Listen(bind, static_cast<int>(settings.port)));
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<AgentServer> agent_server,
                        AgentServer::Start(*coordinator, api, AgentOptions(args, settings)));
  if (args.Has("port-file")) WritePortFile(args.Get("port-file"), bound);
  if (args.Has("agent-port-file")) WritePortFile(args.Get("agent-port-file"), agent_server->port());
  if (args.Has("prometheus-sd-file")) {
    WritePrometheusSdFile(args.Get("prometheus-sd-file"), bind, bound);
  }
  coordinator->Start();
  user_server.Start();
  std::cout << "loom-coordinator: listening on " << scheme << "://" << bind << ":" << bound
            << " (users) and " << scheme << "://" << bind << ":" << agent_server->port()
            << " (agents, gRPC" << (args.Has("client-ca") ? ", client certificates" : "")
            << "); state in " << options.data_dir << std::endl;

  // The servers stop on a signal; the state is already on disk. Agent calls in flight get a
  // second to finish (each is short; an agent retries a lost one).
  WaitForStopSignal();
  user_server.Stop();
  agent_server->Shutdown(std::chrono::seconds(1));
  coordinator->Stop();
  std::cout << "loom-coordinator: stopped" << std::endl;
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::coordinator

int main(int argc, char** argv) {
  // Block the stop signals in every thread; one thread waits for them.
  const sigset_t set = loom::coordinator::StopSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  loom::coordinator::QuietMutexDebugging();
  absl::Status s = loom::coordinator::Run(argc, argv);
  if (!s.ok()) {
    std::cerr << "loom-coordinator: " << s.message() << "\n";
    return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
