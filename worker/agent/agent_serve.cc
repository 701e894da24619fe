// The agent's side of kind: serve jobs: one rank, loom-serve instead of loom-train. The agent
// makes the attempt's bearer token, learns the port the server bound from its port file,
// probes its /healthz (ServeProbe, off the main loop) and stops an attempt whose server never
// came up or stopped answering; heartbeats carry port, token and readiness to the coordinator.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/host_port.h"
#include "base/random_token.h"
#include "base/read_file.h"
#include "loom/lease_clock.h"
#include "metrics/prometheus.h"
#include "worker/agent/agent.h"

namespace fs = std::filesystem;

namespace loom::agent {
namespace {

constexpr int64_t kDefaultStartupSeconds = 600;   // ServeConfig.startup_seconds = 0
constexpr int64_t kDefaultUnhealthySeconds = 30;  // ServeConfig.unhealthy_seconds = 0

// Only this node's user may read it: a fresh file (O_EXCL), mode 0600, or an error.
std::string WriteSecret(const std::string& path, const std::string& text) {
  ::unlink(path.c_str());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return absl::StrCat("cannot create '", path, "': ", std::strerror(errno));
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const int err = errno;
  ::close(fd);
  return ok ? "" : absl::StrCat("cannot write '", path, "': ", std::strerror(err));
}

// The port loom-serve wrote once listening (renamed into place whole), or 0.
int ReadPort(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path, "--port-file");
  int port = 0;
  if (!text.ok() || !absl::SimpleAtoi(absl::StripAsciiWhitespace(*text), &port)) return 0;
  return port >= 1 && port <= 65535 ? port : 0;
}

int64_t SecondsOr(int32_t seconds, int64_t fallback) { return seconds > 0 ? seconds : fallback; }

}  // namespace

std::string Agent::PrepareServe(const v1::Assignment& as, Attempt& a) {
  auto s = std::make_unique<Serve>();
  s->port_file = (fs::path(a.dir) / "serve.port").string();
  s->token_file = (fs::path(a.dir) / "serve.token").string();
  s->model = as.spec().serve().model_name();
  s->started_ms = LeaseClockMs();
  s->startup_ms = SecondsOr(as.spec().serve().startup_seconds(), kDefaultStartupSeconds) * 1000;
  s->unhealthy_ms =
      SecondsOr(as.spec().serve().unhealthy_seconds(), kDefaultUnhealthySeconds) * 1000;
  ::unlink(s->port_file.c_str());  // a stale one would name another server's port
  std::string why_not;
  if (::access(options_.loom_serve.c_str(), X_OK) != 0) {
    why_not = absl::StrCat("loom-serve '", options_.loom_serve,
                           "' is not an executable (loom-worker --loom-serve PATH)");
  } else if (absl::StatusOr<std::string> token = RandomHexToken(32); !token.ok()) {
    why_not = std::string(token.status().message());
  } else {
    s->token = *token;
    why_not = WriteSecret(s->token_file, s->token + "\n");
  }
  a.serve = std::move(s);
  return why_not;
}

// loom-serve's command line: the checkpoint the coordinator chose (init_from), any free port
// on this node's address, and the job's ServeConfig as the flags of the same names.
std::vector<std::string> Agent::ServeArgv(const v1::Assignment& as, const Attempt& a) const {
  const v1::JobSpec& spec = as.spec();
  const v1::ServeConfig& c = spec.serve();
  std::vector<std::string> argv = {
      options_.loom_serve,
      "--job",
      "--checkpoint",
      as.init_from(),
      "--bind",
      options_.address,
      "--port",
      "0",
      "--port-file",
      a.serve->port_file,
      "--token-file",
      a.serve->token_file,
      "--metric-labels",
      absl::StrCat(metrics::kJobLabel, "=", a.job_id, ",attempt=", a.attempt)};
  auto add = [&argv](const char* flag, const std::string& value) {
    argv.insert(argv.end(), {flag, value});
  };
  auto add_positive = [&add](const char* flag, int64_t value) {
    if (value > 0) add(flag, std::to_string(value));
  };
  if (!c.model_name().empty()) add("--model-name", c.model_name());
  add_positive("--max-batch", c.max_batch());
  add_positive("--max-queue", c.max_queue());
  add_positive("--max-tokens", c.max_tokens());
  add_positive("--max-n", c.max_n());
  if (c.has_share_prefill()) add("--share-prefill", c.share_prefill() ? "true" : "false");
  add_positive("--prefix-cache-mb", c.prefix_cache_mb());
  if (!spec.device().empty()) add("--device", spec.device());
  add_positive("--threads", spec.threads());
  if (!options_.plugin_dir.empty()) add("--plugin-dir", options_.plugin_dir);
  return argv;
}

void Agent::PollServe(Attempt& a) {
  Serve& s = *a.serve;
  bool running = false;
  for (const Rank& r : a.ranks) running |= r.running;
  if (!running) {
    if (s.probe) s.probe->Stop();  // joined when the attempt is forgotten, long done by then
    return;
  }
  if (s.port == 0 && (s.port = ReadPort(s.port_file)) != 0) {
    s.probe = std::make_unique<ServeProbe>(
        absl::StrCat("http://", JoinHostPort(options_.address, s.port)), ServeProbe::Options{});
  }
  if (s.probe && s.probe->ready() && !s.announced) {
    s.announced = true;
    AppendCombined(a, absl::StrCat("[agent ", options_.name, "] loom-serve ready on http://",
                                   JoinHostPort(options_.address, s.port), "/v1\n"));
  }
  CheckServeHealth(a);
}

// Stops (Cancel: SIGTERM, then SIGKILL) a server that never answered within startup_seconds of
// its start, or stopped answering for unhealthy_seconds; Reap turns its exit into a failure.
void Agent::CheckServeHealth(Attempt& a) {
  Serve& s = *a.serve;
  if (a.kill_at_ms != 0) return;  // stopping already (a cancel, the lease): not a health failure
  const int64_t now = LeaseClockMs();
  const int64_t last_ok = s.probe ? s.probe->last_ok_ms() : 0;
  if (last_ok == 0 && now - s.started_ms > s.startup_ms) {
    s.unhealthy = absl::StrCat("loom-serve did not answer /healthz within ", s.startup_ms / 1000,
                               " s of its start");
  } else if (last_ok > 0 && now - last_ok > s.unhealthy_ms) {
    s.unhealthy =
        absl::StrCat("loom-serve stopped answering /healthz for ", s.unhealthy_ms / 1000, " s");
  }
  if (!s.unhealthy.empty()) Cancel(a, s.unhealthy);
}

void Agent::ReportServe(const Attempt& a, v1::ServeReport* r) const {
  bool running = false;
  for (const Rank& rank : a.ranks) running |= rank.running;
  r->set_port(a.serve->port);
  r->set_token(a.serve->token);
  r->set_ready(running && a.serve->probe != nullptr && a.serve->probe->ready());
  r->set_model(a.serve->model);  // "" = the coordinator's default name
}

}  // namespace loom::agent
