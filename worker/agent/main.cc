// loom-worker: the worker agent (docs/control-plane.md).
#include <signal.h>
#include <unistd.h>

#include <cctype>
#include <climits>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/cli_args.h"
#include "base/status_macros.h"
#include "worker/agent/agent.h"

namespace loom::agent {
namespace {

constexpr char kUsage[] = R"(usage: loom-worker [flags]
  --coordinator URL     the coordinator's agent port (gRPC): http://host:port (plaintext) or
                        https://host:port (TLS) (default $LOOM_COORDINATOR, then
                        http://127.0.0.1:8471)
  --ca-file F           PEM CA for an https:// coordinator (default $LOOM_CA_FILE, then the
                        system's CAs)
  --client-cert F --client-key F  PEM certificate and key this node shows an https://
                        coordinator that requires client certificates (--client-ca)
  --token-file F        the worker token (default $LOOM_WORKER_TOKEN; none for a --local coordinator)
  --work-dir DIR        per-attempt directories and rank logs (required)
  --slots N             trainer ranks this node runs at once (default: one per GPU, else 1)
  --gpus LIST           auto (default: NVML discovery), none, or device indices such as 0,1,2,3;
                        each rank gets a GPU of its own (CUDA_VISIBLE_DEVICES)
  --labels k=v,...      pool labels (e.g. pool=cpu,zone=a)
  --name NAME           display name (default host name)
  --address HOST        where other nodes reach this one's ranks (default 127.0.0.1)
  --loom-train PATH     trainer binary (default: next to loom-worker)
  --loom-serve PATH     server binary for kind: serve jobs (default: next to loom-worker; when
                        that one is missing, serve jobs placed here fail to start)
  --plugin-dir DIR      passed to the trainer and the server
  --term-grace-ms N     SIGTERM -> SIGKILL delay when stopping ranks (default 10000)
  --metrics-port P      Prometheus /metrics of this node and its jobs (0 = off (default), -1 = any free port)
  --metrics-bind ADDR   (default 127.0.0.1)
  --prometheus-sd-file F  write a Prometheus file_sd target list for this exporter
)";

// "NVIDIA H200" -> "nvidia-h200": a label value the coordinator accepts.
std::string LabelValue(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c))
      out += static_cast<char>(std::tolower(c));
    else if ((c == '-' || c == '.' || c == '_' || c == ' ') && !out.empty() && out.back() != '-')
      out += '-';
    if (out.size() == 63) break;
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "unknown" : out;
}

Agent* g_agent = nullptr;
void OnSignal(int) {
  if (g_agent != nullptr) g_agent->Stop();
}

// Where the coordinator is and the worker token to show it.
absl::Status ReadConnection(const CliArgs& args, AgentOptions* o) {
  const char* env_url = std::getenv("LOOM_COORDINATOR");
  o->coordinator_url = args.Get("coordinator", env_url ? env_url : "http://127.0.0.1:8471");
  const char* env_ca = std::getenv("LOOM_CA_FILE");
  o->ca_file = args.Get("ca-file", env_ca ? env_ca : "");
  o->client_cert = args.Get("client-cert");
  o->client_key = args.Get("client-key");
  if (args.Has("token-file")) {
    std::ifstream in(args.Get("token-file"));
    if (!in)
      return absl::NotFoundError(
          absl::StrCat("--token-file: cannot open '", args.Get("token-file"), "'"));
    std::getline(in, o->token);
    o->token = std::string(absl::StripAsciiWhitespace(o->token));
  } else if (const char* t = std::getenv("LOOM_WORKER_TOKEN")) {
    o->token = t;
  }
  return absl::OkStatus();
}

// GPUs, slots and pool labels (a gpu_model label when every GPU is the same model).
absl::Status ReadCapacity(const CliArgs& args, AgentOptions* o) {
  std::string no_gpus;
  LOOM_ASSIGN_OR_RETURN(o->gpus, GpusFromFlag(args.Get("gpus", "auto"), &no_gpus));
  const int64_t gpu_count = static_cast<int64_t>(o->gpus.size());
  LOOM_ASSIGN_OR_RETURN(int64_t slots,
                        args.GetInt("slots", gpu_count > 0 ? gpu_count : 1, 1, 4096));
  if (gpu_count > 0 && slots > gpu_count) {
    return absl::InvalidArgumentError(absl::StrCat("--slots: ", slots, " exceeds this node's ",
                                                   gpu_count, " GPUs (one GPU per rank)"));
  }
  o->slots = static_cast<int>(slots);
  for (absl::string_view kv : absl::StrSplit(args.Get("labels"), ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (p.first.empty() || p.second.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--labels: expected k=v, got '", kv, "'"));
    }
    o->labels[p.first] = p.second;
  }
  if (!o->gpus.empty() && !o->gpus[0].model().empty() && !o->labels.count("gpu_model")) {
    bool same = true;
    for (const auto& g : o->gpus) same &= g.model() == o->gpus[0].model();
    if (same) o->labels["gpu_model"] = LabelValue(o->gpus[0].model());
  }
  std::cerr << "loom-worker: "
            << (o->gpus.empty() ? absl::StrCat("CPU node (", no_gpus, ")")
                                : absl::StrCat(o->gpus.size(), " GPU(s), one per rank"))
            << ", " << o->slots << " slot(s)\n";
  return absl::OkStatus();
}

// Names, paths (absolute: ranks run in their attempt directory) and the trainer and server
// binaries. Only the trainer is required: a node without loom-serve still trains.
absl::Status ReadPaths(const CliArgs& args, AgentOptions* o) {
  char host[HOST_NAME_MAX + 1] = {};
  ::gethostname(host, sizeof(host) - 1);
  o->name = args.Get("name", host);
  o->address = args.Get("address", "127.0.0.1");
  o->plugin_dir = args.Get("plugin-dir");
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  o->loom_train = std::filesystem::absolute(
                      args.Get("loom-train", (self.parent_path() / "loom-train").string()))
                      .string();
  if (!o->plugin_dir.empty()) o->plugin_dir = std::filesystem::absolute(o->plugin_dir).string();
  o->work_dir = std::filesystem::absolute(o->work_dir).string();
  if (::access(o->loom_train.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("--loom-train: '", o->loom_train, "' is not an executable"));
  }
  o->loom_serve = std::filesystem::absolute(
                      args.Get("loom-serve", (self.parent_path() / "loom-serve").string()))
                      .string();
  if (::access(o->loom_serve.c_str(), X_OK) != 0) {
    if (args.Has("loom-serve")) {
      return absl::NotFoundError(
          absl::StrCat("--loom-serve: '", o->loom_serve, "' is not an executable"));
    }
    std::cerr << "loom-worker: no loom-serve at " << o->loom_serve
              << ": kind serve jobs placed here fail to start (--loom-serve)\n";
  }
  return absl::OkStatus();
}

absl::StatusOr<AgentOptions> OptionsFromArgs(const CliArgs& args) {
  AgentOptions o;
  LOOM_RETURN_IF_ERROR(ReadConnection(args, &o));
  LOOM_ASSIGN_OR_RETURN(o.work_dir, args.Require("work-dir"));
  LOOM_RETURN_IF_ERROR(ReadCapacity(args, &o));
  LOOM_ASSIGN_OR_RETURN(int64_t grace, args.GetInt("term-grace-ms", 10000, 0, 3600000));
  o.term_grace_ms = static_cast<int>(grace);
  LOOM_ASSIGN_OR_RETURN(int64_t metrics_port, args.GetInt("metrics-port", 0, -1, 65535));
  o.metrics_port = static_cast<int>(metrics_port);
  o.metrics_bind = args.Get("metrics-bind", "127.0.0.1");
  o.prometheus_sd_file = args.Get("prometheus-sd-file");
  LOOM_RETURN_IF_ERROR(ReadPaths(args, &o));
  return o;
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(
      CliArgs args,
      CliArgs::Parse(
          argc, argv, 1,
          {"coordinator", "ca-file", "client-cert", "client-key", "token-file", "work-dir", "slots",
           "gpus", "labels", "name", "address", "loom-train", "loom-serve", "plugin-dir",
           "term-grace-ms", "metrics-port", "metrics-bind", "prometheus-sd-file"},
          {"help"}));
  if (args.Has("help")) {
    std::cout << kUsage;
    return absl::OkStatus();
  }
  LOOM_ASSIGN_OR_RETURN(AgentOptions o, OptionsFromArgs(args));
  Agent agent(o);
  g_agent = &agent;
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return agent.Run();
}

}  // namespace
}  // namespace loom::agent

int main(int argc, char** argv) {
  absl::Status s = loom::agent::Run(argc, argv);
  if (!s.ok()) {
    std::cerr << "loom-worker: " << s.message() << "\n";
    return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
