// loom-serve: serves one checkpoint over an OpenAI-compatible HTTP API (docs/serve.md).
// `loom serve` resolves a catalogue id through the coordinator and runs this program.
#include <signal.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/cli_args.h"
#include "base/cpu_process.h"
#include "base/status_macros.h"
#include "loom/exit_codes.h"
#include "metrics/prometheus.h"
#include "net/http_server.h"
#include "serve/server.h"
#include "worker/trainer/checkpoint_model.h"
#include "worker/trainer/plugin_loader.h"

namespace loom::serve {
namespace {

constexpr char kUsage[] = R"(usage: loom-serve --checkpoint DIR [flags]

Serves a checkpoint (a step directory, or a checkpoint root: its newest intact checkpoint) over
an OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions, /tokenize,
/detokenize, /healthz, /metrics (docs/serve.md).

flags:
  --bind ADDR          listen address (default 127.0.0.1)
  --port P             port (default 8000; 0 = any free port, see --port-file)
  --port-file F        write the bound port to F once listening
  --token-file F       clients must send "Authorization: Bearer <first line of F>"
  --model-name NAME    the model id clients name (default: the checkpoint's job and step)
  --max-batch N        rows decoded together (default 32)
  --max-queue N        sequences waiting for a row before 429 (default 256)
  --max-tokens N       most tokens one sequence may generate (default 1024)
  --max-n N            most choices per prompt (default 16)
  --share-prefill B    true: the n choices of a prompt share one prefill (default); false:
                       prefill each choice (the same outputs, n times the prefill work)
  --prefix-cache-mb N  keep the KV caches of prompt prefixes across requests in up to N MiB
                       (default 0: off; e.g. 1024 for shared contexts); a prompt starting
                       with a cached prefix prefills only the rest
  --device cpu|cuda|auto  (default auto)   --threads T (LibTorch threads; default all cores)
  --allowed-hosts H,...  Host names it answers to (default: the loopback names on a loopback
                       --bind, else any); an Origin header must name one of them
  --tls-cert F --tls-key F   serve HTTPS
  --plugin-dir DIR[:DIR]
  --metric-labels k=v,...  constant labels on every series of /metrics (e.g. job_id=J,attempt=1)
  --job                run as a job's rank under loom-worker: SIGTERM or SIGINT stops it with
                       exit code 76 (stopped), as a trainer's, instead of 0
)";

absl::StatusOr<std::string> ReadToken(const std::string& path) {
  std::ifstream in(path);
  std::string token;
  if (!in || !std::getline(in, token))
    return absl::InvalidArgumentError(absl::StrCat("--token-file: cannot read '", path, "'"));
  token = std::string(absl::StripAsciiWhitespace(token));
  if (token.empty()) return absl::InvalidArgumentError("--token-file: the file is empty");
  return token;
}

// "job-000002.150" for <root>/.../step-00000150 of a job's checkpoint directory, else the name.
std::string DefaultModelName(const trainer::CheckpointModel& m) {
  const std::string job = m.spec.name().empty() ? "loom" : m.spec.name();
  return absl::StrCat(job, ".", m.step);
}

absl::StatusOr<ServeOptions> OptionsFromArgs(const CliArgs& args,
                                             const trainer::CheckpointModel& m) {
  ServeOptions o;
  o.model_name = args.Get("model-name", DefaultModelName(m));
  o.model_root = DefaultModelName(m);  // the checkpoint's name: /v1/models shows no host path
  if (args.Has("token-file")) {
    LOOM_ASSIGN_OR_RETURN(o.token, ReadToken(args.Get("token-file")));
  }
  LOOM_ASSIGN_OR_RETURN(int64_t max_batch, args.GetInt("max-batch", 32, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t max_queue, args.GetInt("max-queue", 256, 1, 100000));
  LOOM_ASSIGN_OR_RETURN(o.limits.max_tokens, args.GetInt("max-tokens", 1024, 1, 1 << 24));
  LOOM_ASSIGN_OR_RETURN(int64_t max_n, args.GetInt("max-n", 16, 1, 1024));
  o.engine.max_batch = static_cast<int>(max_batch);
  o.engine.max_queue = static_cast<int>(max_queue);
  o.limits.max_n = static_cast<int>(max_n);
  o.limits.max_sequences = static_cast<int>(std::min<int64_t>(max_queue, 1024));
  const std::string share = args.Get("share-prefill", "true");
  if (share != "true" && share != "false")
    return absl::InvalidArgumentError("--share-prefill: want true | false");
  o.engine.share_prefill = share == "true";
  LOOM_ASSIGN_OR_RETURN(int64_t prefix_mb, args.GetInt("prefix-cache-mb", 0, 0, 1 << 20));
  o.engine.prefix_cache_bytes = prefix_mb << 20;
  return o;
}

// Prometheus label names: [a-zA-Z_][a-zA-Z0-9_]*, and "__" prefixes are reserved.
bool LabelName(absl::string_view name) {
  if (name.empty() || absl::StartsWith(name, "__") || absl::ascii_isdigit(name[0])) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '_') return false;
  }
  return true;
}

// --metric-labels k=v,k=v: what the agent stamps on a job's server (its job_id and attempt).
absl::StatusOr<metrics::Labels> MetricLabels(const std::string& flag) {
  metrics::Labels labels;
  for (absl::string_view kv : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (!LabelName(p.first) || p.second.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metric-labels: '", kv,
                       "' is not name=value with a label name of [a-zA-Z_][a-zA-Z0-9_]*"));
    }
    labels[p.first] = p.second;
  }
  return labels;
}

absl::StatusOr<torch::Device> PickDevice(const std::string& flag) {
  const bool cuda = torch::cuda::is_available();
  if (flag == "cpu" || (flag == "auto" && !cuda)) return torch::Device(torch::kCPU);
  if (flag == "cuda" || flag == "auto") {
    if (!cuda) return absl::FailedPreconditionError("--device cuda: no GPU is visible");
    return torch::Device(torch::kCUDA);
  }
  return absl::InvalidArgumentError("--device: want cpu | cuda | auto");
}

// The model's one-line summary and the prefix cache setting, before serving.
void PrintModel(const trainer::CheckpointModel& model, const ServeOptions& options) {
  std::cout << "loom-serve: " << model.dir << " (step " << model.step << ", "
            << model.model->NumParameters() << " parameters, context "
            << model.model->config().max_seq_len() << ", "
            << (model.objective ? "chat template" : "no chat template") << ") as '"
            << options.model_name << "'" << std::endl;
  std::cout << "loom-serve: prefix cache "
            << (options.engine.prefix_cache_bytes > 0
                    ? absl::StrCat(options.engine.prefix_cache_bytes >> 20, " MiB, blocks of ",
                                   options.engine.prefix_block, " tokens")
                    : std::string("off (--prefix-cache-mb 0)"))
            << std::endl;
}

absl::StatusOr<net::HttpServerOptions> HttpOptions(const CliArgs& args,
                                                   const ServeOptions& options) {
  net::HttpServerOptions http_options;
  if (args.Has("tls-cert") || args.Has("tls-key")) {
    LOOM_ASSIGN_OR_RETURN(http_options.tls,
                          net::LoadTlsContext(args.Get("tls-cert"), args.Get("tls-key")));
  }
  // A thread per waiting request: every row and every queued sequence can have its client.
  http_options.threads = options.engine.max_batch + std::min(options.engine.max_queue, 256) + 4;
  http_options.max_body_bytes = 8 << 20;
  http_options.write_timeout_ms = 30000;
  // An evaluation harness sends its whole batch from one address: let it use every row.
  http_options.max_connections_per_address = http_options.threads;
  return http_options;
}

// A web page in the user's browser can reach a loopback server: refuse foreign Host and Origin
// headers (DNS rebinding, cross-site requests), as the coordinator does.
void AddFilters(const CliArgs& args, Server& server, net::HttpServer& http) {
  std::set<std::string> allowed_hosts = net::DefaultAllowedHosts(args.Get("bind", "127.0.0.1"));
  if (args.Has("allowed-hosts")) {
    allowed_hosts.clear();
    for (absl::string_view h : absl::StrSplit(args.Get("allowed-hosts"), ',', absl::SkipEmpty()))
      allowed_hosts.insert(absl::AsciiStrToLower(h));
  }
  http.SetFilter([allowed_hosts](const net::HttpRequest& req, net::HttpResponse& res) {
    const std::string refusal = net::ForeignHostOrOrigin(req, allowed_hosts);
    if (refusal.empty()) return false;
    WriteError(res, {403, refusal, "invalid_request_error", "", ""});
    return true;
  });
  http.SetLogger([&](const net::HttpRequest& req, const net::HttpResponse& res, double seconds) {
    server.LogRequest(req, res, seconds, http.RouteTemplate(req.method, req.path));
  });
}

// Listens, serves until SIGINT or SIGTERM, and returns the exit code: 0, or kExitStopped for a
// job's rank (--job), which the coordinator reads as "asked to stop", not as success.
absl::StatusOr<int> ServeUntilSignal(const CliArgs& args, net::HttpServer& http, bool tls,
                                     const ServeOptions& options) {
  LOOM_ASSIGN_OR_RETURN(int64_t port, args.GetInt("port", 8000, 0, 65535));
  const std::string bind = args.Get("bind", "127.0.0.1");
  LOOM_ASSIGN_OR_RETURN(int bound, http.Listen(bind, static_cast<int>(port)));
  if (args.Has("port-file")) {
    const std::string file = args.Get("port-file"), tmp = file + ".tmp";
    std::ofstream(tmp) << bound << "\n";
    std::filesystem::rename(tmp, file);
  }
  http.Start();
  std::cout << "loom-serve: listening on " << (tls ? "https" : "http") << "://" << bind << ":"
            << bound << "/v1"
            << (options.token.empty() ? " (no --token-file: open to every user of this host, so "
                                        "loopback only)"
                                      : "")
            << std::endl;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
  http.Stop();
  std::cout << "loom-serve: stopped (" << strsignal(sig) << ")" << std::endl;
  return args.Has("job") ? kExitStopped : 0;
}

// Checks what needs no model first, so a bad command line fails before a long load.
absl::StatusOr<int> Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(
      CliArgs args,
      CliArgs::Parse(
          argc, argv, 1,
          {"checkpoint", "bind", "allowed-hosts", "port", "port-file", "token-file", "model-name",
           "max-batch", "max-queue", "max-tokens", "max-n", "share-prefill", "prefix-cache-mb",
           "device", "threads", "tls-cert", "tls-key", "plugin-dir", "metric-labels"},
          {"job"}));
  LOOM_ASSIGN_OR_RETURN(std::string where, args.Require("checkpoint"));
  // Without a token the server answers anyone who reaches it: only this host's users, then.
  if (const std::string bind = args.Get("bind", "127.0.0.1");
      !args.Has("token-file") && net::DefaultAllowedHosts(bind).empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--bind ", bind, " without --token-file: anyone who can reach ", bind,
                     " could use this server; give --token-file, or bind a loopback address"));
  }
  LOOM_ASSIGN_OR_RETURN(metrics::Labels labels, MetricLabels(args.Get("metric-labels")));
  LOOM_ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", 0, 0, 1024));
  if (threads > 0) torch::set_num_threads(static_cast<int>(threads));
  LOOM_ASSIGN_OR_RETURN(torch::Device device, PickDevice(args.Get("device", "auto")));
  trainer::PluginLoader loader;
  LOOM_RETURN_IF_ERROR(trainer::LoadPluginDirectories(args.Get("plugin-dir"), loader, false));
  LOOM_ASSIGN_OR_RETURN(trainer::CheckpointModel model,
                        trainer::LoadCheckpointModel(where, loader, device, torch::kFloat32));
  LOOM_ASSIGN_OR_RETURN(ServeOptions options, OptionsFromArgs(args, model));
  PrintModel(model, options);
  LOOM_ASSIGN_OR_RETURN(net::HttpServerOptions http_options, HttpOptions(args, options));
  const bool tls = http_options.tls != nullptr;
  Server server(std::move(model), options);
  server.registry().SetConstantLabels(std::move(labels));
  net::HttpServer http(http_options);
  server.AddRoutes(http);
  AddFilters(args, server, http);
  return ServeUntilSignal(args, http, tls, options);
}

}  // namespace
}  // namespace loom::serve

int main(int argc, char** argv) {
  loom::SetUpCpuProcess(argv);  // before any matmul or large allocation (base/cpu_process.h)
  if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::cout << loom::serve::kUsage;
    return 0;
  }
  sigset_t set;  // the stop signals are taken by sigwait in Run, in every thread blocked
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);
  absl::StatusOr<int> code;
  try {
    code = loom::serve::Run(argc, argv);
  } catch (const std::exception& e) {
    code = absl::InternalError(e.what());
  }
  if (!code.ok()) {
    std::cerr << "loom-serve: " << code.status().message() << "\n";
    return absl::IsInvalidArgument(code.status()) || absl::IsNotFound(code.status())
               ? loom::kExitBadInput
               : 1;
  }
  return *code;
}
