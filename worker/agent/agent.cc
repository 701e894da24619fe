#include "worker/agent/agent.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "client/rest_client.h"
#include "loom/exit_codes.h"
#include "loom/lease_clock.h"
#include "loom/trainer_events.h"
#include "worker/train_metrics/train_metrics.h"

namespace fs = std::filesystem;

namespace loom::agent {
namespace {

// Step points per attempt per heartbeat (~50 bytes each), and the most kept unacknowledged
// while the coordinator is unreachable (the oldest go first).
constexpr size_t kStepsPerHeartbeat = 2000;
// Deadline of each Register and Heartbeat call: a lost reply costs one beat, not a lease.
constexpr int kCallTimeoutMs = 5000;
// How soon after reporting an exited rank the agent asks for what the freed slots now run (the
// coordinator schedules on that report at once); at most a third of a heartbeat.
constexpr int64_t kFollowUpMs = 100;
constexpr size_t kMaxPendingSteps = 200000;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int PickFreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

bool SafeName(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_')) return false;
  }
  return true;
}

// New bytes of a growing file from `offset`.
std::string ReadFrom(const std::string& path, int64_t offset, int64_t max) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  in.seekg(0, std::ios::end);
  const int64_t size = in.tellg();
  if (size <= offset) return "";
  const int64_t n = std::min(size - offset, max);
  std::string buf(static_cast<size_t>(n), '\0');
  in.seekg(offset);
  in.read(buf.data(), n);
  buf.resize(static_cast<size_t>(in.gcount()));
  return buf;
}

void Log(const std::string& line) { std::cout << "loom-worker: " << line << std::endl; }

// Written whole or not at all (rename), readable by the ranks at any moment.
void WriteFileAtomically(const std::string& path, const std::string& text, mode_t mode) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return;
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (ok) ::rename(tmp.c_str(), path.c_str());
}

// Where a rank on a GPU writes its CUDA allocator's numbers (worker/trainer/gpu_stats.h).
std::string GpuStatsPath(const std::string& attempt_dir, int rank) {
  return (fs::path(attempt_dir) / absl::StrFormat("gpu-rank-%d.json", rank)).string();
}

// The child side of a fork: becomes the rank (never returns).
[[noreturn]] void ExecRank(pid_t parent, int log_fd, const std::string& dir,
                           const std::vector<std::pair<std::string, std::string>>& env,
                           std::vector<std::string> argv) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) _exit(126);
  ::dup2(log_fd, STDOUT_FILENO);
  ::dup2(log_fd, STDERR_FILENO);
  for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
  if (::chdir(dir.c_str()) != 0) _exit(126);
  std::vector<char*> cargv;
  for (auto& s : argv) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  ::execv(cargv[0], cargv.data());
  const std::string msg = absl::StrCat("exec ", argv[0], ": ", std::strerror(errno), "\n");
  (void)!::write(STDERR_FILENO, msg.data(), msg.size());
  _exit(127);
}

}  // namespace

Agent::Agent(AgentOptions options) : options_(std::move(options)), gpu_pool_(options_.gpus) {
  if (!options_.gpus.empty()) nvml_ = NvmlSampler::Open();
  DeclareMetrics();
  // Every series says which node and pool it comes from, whatever discovers the target.
  metrics::Labels node = {{"worker", options_.name}};
  if (auto pool = options_.labels.find("pool"); pool != options_.labels.end()) {
    node["pool"] = pool->second;
  }
  registry_.SetConstantLabels(node);
}

// The trainer's own metric names and types (worker/train_metrics), re-exported from rank
// 0's JSON lines with labels {job_id, rank}: one scrape target per node sees every job it runs.
// Series of a job disappear when its last attempt on this node is forgotten, so cardinality is
// bounded by the jobs running here (at most --slots) times the ~16 families.
void Agent::DeclareMetrics() {
  auto& r = registry_;
  r.DeclareGauge("loom_worker_slots", "Trainer ranks this node runs at once");
  r.DeclareGauge("loom_worker_ranks_running", "Trainer ranks running now");
  r.DeclareCounter("loom_worker_attempts_started_total", "Job attempts started on this node");
  r.DeclareCounter("loom_worker_rank_exits_total",
                   "Trainer rank exits by result (ok, failed, killed)");
  r.DeclareCounter("loom_worker_heartbeat_failures_total",
                   "Heartbeats that did not reach the coordinator");
  r.DeclareHistogram("loom_worker_heartbeat_seconds", "Heartbeat round-trip time",
                     {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5});
  // Counters start at 0, so rate() and increase() see their first events.
  r.Increment("loom_worker_attempts_started_total", 0);
  r.Increment("loom_worker_heartbeat_failures_total", 0);
  for (const char* result : {"ok", "failed", "killed"}) {
    r.Increment("loom_worker_rank_exits_total", 0, {{"result", result}});
  }
  worker::DeclareTrainMetrics(r);
  r.Set("loom_worker_slots", options_.slots);
  // The node's GPUs and which rank holds each: labels as dcgm-exporter's (gpu, UUID,
  // modelName), so its device series join Loom's jobs on(UUID) (docs/deploy.md).
  r.DeclareGauge("loom_worker_gpu_info", "1 per GPU of this node (index, UUID, model)");
  r.DeclareGauge("loom_worker_gpu_assigned",
                 "1 per GPU a running rank is bound to, with its job_id and rank");
  for (const v1::Gpu& g : options_.gpus) {
    r.Set("loom_worker_gpu_info", 1,
          {{"gpu", std::to_string(g.index())}, {"UUID", g.uuid()}, {"modelName", g.model()}});
  }
  r.Increment("loom_worker_attempts_started_total", 0);
  r.Increment("loom_worker_heartbeat_failures_total", 0);
  r.Set("loom_worker_ranks_running", 0);
}

Agent::~Agent() = default;

std::string Agent::Key(const std::string& job, int attempt) {
  return absl::StrCat(job, "#", attempt);
}

absl::Status Agent::Register() {
  v1::RegisterWorkerRequest req;
  req.set_worker_id(worker_id_);
  req.set_name(options_.name);
  req.set_address(options_.address);
  req.set_slots(options_.slots);
  *req.mutable_gpus() = {options_.gpus.begin(), options_.gpus.end()};
  req.set_credential(credential_);
  req.mutable_labels()->insert(options_.labels.begin(), options_.labels.end());
  v1::RegisterWorkerResponse resp;
  const int64_t sent = LeaseClockMs();
  LOOM_RETURN_IF_ERROR(coordinator_->Register(options_.token, req, &resp, kCallTimeoutMs));
  if (resp.credential().empty()) {
    return absl::InternalError("the coordinator returned no worker credential");
  }
  worker_id_ = resp.worker_id();
  credential_ = resp.credential();
  // Kept so that a restarted agent can take its id back while the coordinator still sees it
  // alive; readable by this user only.
  WriteFileAtomically((fs::path(options_.work_dir) / "worker-id").string(), worker_id_ + "\n",
                      0644);
  WriteFileAtomically((fs::path(options_.work_dir) / "worker-credential").string(),
                      credential_ + "\n", 0600);
  heartbeat_ms_ = std::max(50, resp.heartbeat_interval_ms());
  // While unreachable, a call lasts about a beat, at least 1 s (a loaded machine's reply).
  coordinator_->set_probe_timeout_ms(std::clamp(heartbeat_ms_, 1000, kCallTimeoutMs));
  lease_ms_ = std::max(4 * heartbeat_ms_, resp.lease_ms());
  if (resp.max_body_bytes() > 0) max_body_bytes_ = resp.max_body_bytes();
  RenewLease(sent + lease_ms_);
  Log(absl::StrCat("registered as ", worker_id_, " with ", options_.slots, " slots at ",
                   coordinator_->url(), " (lease ", lease_ms_, " ms)"));
  return absl::OkStatus();
}

void Agent::RenewLease(int64_t expiry_ms) {
  lease_expiry_ms_ = std::max(lease_expiry_ms_, expiry_ms);
  for (auto& [key, a] : attempts_) {
    if (a.kill_at_ms == 0) WriteLease(a);
  }
}

void Agent::WriteLease(const Attempt& a) const {
  WriteFileAtomically(a.lease_path, absl::StrCat(lease_expiry_ms_, "\n"), 0644);
}

void Agent::AppendCombined(Attempt& a, const std::string& text) {
  std::ofstream out(a.combined_log, std::ios::app | std::ios::binary);
  out << text;
  a.log_written += static_cast<int64_t>(text.size());
}

// The attempt's directory (jobs/ID/attempt-NNN) with its combined log, lease and spec.json.
Agent::Attempt Agent::PrepareAttempt(const v1::Assignment& as) {
  Attempt a;
  a.job_id = as.job_id();
  a.attempt = as.attempt();
  a.dir = (fs::path(options_.work_dir) / "jobs" / as.job_id() /
           absl::StrFormat("attempt-%03d", as.attempt()))
              .string();
  std::error_code ec;
  fs::create_directories(a.dir, ec);
  a.combined_log = (fs::path(a.dir) / "combined.log").string();
  { std::ofstream(a.combined_log, std::ios::trunc); }
  a.metrics_path = (fs::path(a.dir) / "metrics.jsonl").string();
  a.lease_path = (fs::path(a.dir) / "lease").string();
  WriteLease(a);
  a.total_steps = as.spec().steps();
  bool hosts_rank0 = false;
  for (int r : as.ranks()) hosts_rank0 |= r == 0;
  a.master_port = as.master_port();
  if (a.master_port == 0 && hosts_rank0) a.master_port = PickFreePort();
  return a;
}

// loom-train's command line for the attempt; writes the spec it runs.
std::vector<std::string> Agent::TrainerArgv(const v1::Assignment& as, const Attempt& a) const {
  v1::JobSpec spec = as.spec();
  spec.clear_preset();  // already resolved: the trainer must not re-apply preset values
  spec.mutable_metrics()->set_jsonl(a.metrics_path);
  const std::string spec_path = (fs::path(a.dir) / "spec.json").string();
  std::ofstream(spec_path, std::ios::trunc) << client::MessageToJson(spec, true) << "\n";
  // Retention is the coordinator's (it knows which checkpoints other jobs start from); the
  // trainer resumes from the newest intact checkpoint of the job's directory, if any.
  std::vector<std::string> argv = {options_.loom_train, "train", "--spec", spec_path,
                                   "--no-retention"};
  if (!as.resume_from().empty()) argv.insert(argv.end(), {"--resume-if-any", as.resume_from()});
  if (!as.init_from().empty()) argv.insert(argv.end(), {"--init-from", as.init_from()});
  if (!as.storage_root().empty()) argv.insert(argv.end(), {"--storage-root", as.storage_root()});
  if (!options_.plugin_dir.empty()) argv.insert(argv.end(), {"--plugin-dir", options_.plugin_dir});
  return argv;
}

// The rank's environment: its place in the job (LOOM_* and torchrun's names), its GPU, the
// rendezvous, and the files it shares with this agent.
std::vector<std::pair<std::string, std::string>> Agent::RankEnvironment(
    const v1::Assignment& as, const Attempt& a, const RankPlace& place) const {
  const std::string ranks = std::to_string(as.world_size());
  std::vector<std::pair<std::string, std::string>> env = {
      {"LOOM_RANK", std::to_string(place.rank)},
      {"LOOM_WORLD_SIZE", ranks},
      // This job's ranks on this node count 0, 1, ...: a CUDA rank takes GPU LOCAL_RANK.
      {"LOCAL_RANK", std::to_string(place.local)},
      {"LOCAL_WORLD_SIZE", std::to_string(place.local_world)},
      {"RANK", std::to_string(place.rank)},
      {"WORLD_SIZE", ranks},
      {"MASTER_ADDR", as.master_addr()},
      {"LOOM_NODE_ADDR", options_.address},  // Gloo binds to this node's own
      {"MASTER_PORT", std::to_string(a.master_port)},
      {"LOOM_JOB_ID", as.job_id()},
      {"LOOM_WORKER_NAME", options_.name},
      {"LOOM_ATTEMPT", std::to_string(as.attempt())},
      {"LOOM_LEASE_FILE", a.lease_path},
      // Object-store checkpoints are committed here first, then uploaded (per job: a step
      // staged by one attempt is never mixed with another job's).
      {"LOOM_STAGING_DIR", (fs::path(options_.work_dir) / "staging" / as.job_id()).string()}};
  // Downloads (checkpoints on an object store) are cached per node unless the node says where.
  if (std::getenv("LOOM_CACHE_DIR") == nullptr) {
    env.emplace_back("LOOM_CACHE_DIR", (fs::path(options_.work_dir) / "cache").string());
  }
  if (!place.visible_devices.empty()) {
    env.emplace_back("CUDA_VISIBLE_DEVICES", place.visible_devices);
    env.emplace_back("LOOM_GPU_STATS_FILE", GpuStatsPath(a.dir, place.rank));  // ExportGpuSeries
  }
  // OpenMP threads that spin at barriers lose most of their time when the cores are shared
  // (other ranks, other sessions' work, niced or not: autogroup scheduling): two-thread steps
  // beside two one-thread jobs ran 2-10x slower spinning than sleeping, and alone about 10 %
  // faster (scripts/bench-omp-wait, docs/benchmarks.md). The node's own setting wins.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) env.emplace_back("OMP_WAIT_POLICY", "passive");
  if (as.spec().threads() == 0 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env.emplace_back(
        "OMP_NUM_THREADS",
        std::to_string(std::max(1u, cores / static_cast<unsigned>(std::max(1, options_.slots)))));
  }
  return env;
}

void Agent::StartAttempt(const v1::Assignment& as) {
  if (!SafeName(as.job_id()) || as.attempt() < 1 || as.ranks().empty()) {
    Log(absl::StrCat("ignoring a malformed assignment for '", as.job_id().substr(0, 64), "'"));
    return;
  }
  Attempt a = PrepareAttempt(as);
  registry_.Increment("loom_worker_attempts_started_total");
  const bool serve = as.spec().kind() == "serve";
  const std::string why_not = serve ? PrepareServe(as, a) : "";
  const std::vector<std::string> argv = serve ? ServeArgv(as, a) : TrainerArgv(as, a);
  std::vector<int> ranks(as.ranks().begin(), as.ranks().end());
  AppendCombined(
      a,
      absl::StrCat("[agent ", options_.name, "] attempt ", a.attempt, ": ranks ",
                   absl::StrJoin(ranks, ","), " of ", as.world_size(), ", rendezvous ",
                   as.master_addr(), ":", a.master_port,
                   as.resume_from().empty() ? "" : ", checkpoints in " + as.resume_from(), "\n"));
  for (size_t local = 0; local < ranks.size(); ++local) {
    a.ranks.push_back(LaunchRank(
        as, a, argv, {ranks[local], static_cast<int>(local), static_cast<int>(ranks.size()), ""},
        why_not));
  }
  Log(absl::StrCat("started ", a.job_id, " attempt ", a.attempt, " ranks ",
                   absl::StrJoin(ranks, ","), " in ", a.dir));
  attempts_[Key(a.job_id, a.attempt)] = std::move(a);
}

// One rank process: its own process group (a cancel kills the whole rank), stdout and stderr to
// its log, dead with the agent. A GPU node binds each rank to a GPU of its own; none free means
// an earlier attempt's processes still hold it, and the rank fails to start rather than share it.
Agent::Rank Agent::LaunchRank(const v1::Assignment& as, Attempt& a,
                              const std::vector<std::string>& argv, RankPlace place,
                              std::string why_not) {
  Rank rank;
  rank.rank = place.rank;
  rank.log_path = (fs::path(a.dir) / absl::StrFormat("rank-%d.log", place.rank)).string();
  if (why_not.empty() && !gpu_pool_.empty()) {
    absl::StatusOr<int> gpu = gpu_pool_.Take();
    if (gpu.ok())
      rank.gpu = *gpu;
    else
      why_not = std::string(gpu.status().message());
  }
  if (rank.gpu >= 0) place.visible_devices = VisibleDeviceName(gpu_pool_.gpu(rank.gpu));
  const int log_fd = !why_not.empty() ? -1
                                      : ::open(rank.log_path.c_str(),
                                               O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const auto env = RankEnvironment(as, a, place);
  const pid_t parent = ::getpid();
  const pid_t pid = log_fd < 0 ? -1 : ::fork();
  if (pid == 0) ExecRank(parent, log_fd, a.dir, env, argv);
  if (log_fd >= 0) ::close(log_fd);
  if (pid < 0) {
    rank.exit_code = 127;
    rank.detail =
        absl::StrCat("failed to start: ", why_not.empty() ? std::strerror(errno) : why_not.c_str());
    gpu_pool_.Give(rank.gpu);
    rank.gpu = -1;
    return rank;
  }
  ::setpgid(pid, pid);  // also from the parent, so a cancel right away finds the group
  rank.pid = pid;
  rank.running = true;
  if (!place.visible_devices.empty()) {
    AppendCombined(
        a, absl::StrCat("[agent ", options_.name, "] rank ", place.rank, " (local ", place.local,
                        "): CUDA_VISIBLE_DEVICES=", place.visible_devices, "\n"));
  }
  return rank;
}

void Agent::Cancel(Attempt& a, const std::string& why) {
  if (a.kill_at_ms != 0) return;
  bool any = false;
  for (Rank& r : a.ranks) {
    if (r.running) {
      ::kill(-r.pid, SIGTERM);
      any = true;
    }
  }
  a.kill_at_ms = NowMs() + options_.term_grace_ms;
  if (any) {
    AppendCombined(a, absl::StrCat("[agent ", options_.name, "] stopping attempt ", a.attempt, ": ",
                                   why, "\n"));
    Log(absl::StrCat("stopping ", a.job_id, " attempt ", a.attempt, ": ", why));
  }
}

void Agent::Poll() {
  const int64_t now = NowMs();
  int running_ranks = 0;
  for (auto& [key, a] : attempts_) {
    for (Rank& r : a.ranks) TailRank(a, r);
    ReadEvents(a, now);  // rank 0's event log: progress, checkpoint commits, evaluations
    if (a.serve) PollServe(a);
    for (const Rank& r : a.ranks) running_ranks += r.running ? 1 : 0;
    if (a.kill_at_ms != 0 && now >= a.kill_at_ms) {
      for (Rank& r : a.ranks) {
        if (r.running) ::kill(-r.pid, SIGKILL);
      }
    }
  }
  registry_.Set("loom_worker_ranks_running", running_ranks);
  // Lease expired: the coordinator may declare this worker lost soon and run its jobs
  // elsewhere, so the ranks stop now (they also stop themselves: LOOM_LEASE_FILE).
  if (lease_expiry_ms_ > 0 && LeaseClockMs() > lease_expiry_ms_) {
    for (auto& [key, a] : attempts_) {
      bool running = false;
      for (const Rank& r : a.ranks) running |= r.running;
      if (running && a.kill_at_ms == 0) {
        a.lease_expired = true;
        Cancel(a, "lease expired: no heartbeat reached the coordinator");
      }
    }
  }
}

// The rank's new log lines into the combined log; its exit once it has exited. Log lines first,
// then the exit, so a rank's last words precede its exit line.
void Agent::TailRank(Attempt& a, Rank& r) {
  std::string data = ReadFrom(r.log_path, r.log_read, 1 << 20);
  r.log_read += static_cast<int64_t>(data.size());
  r.partial += data;
  const bool exited = r.running && Reap(a, r);
  std::string lines;
  size_t start = 0, nl;
  while ((nl = r.partial.find('\n', start)) != std::string::npos) {
    absl::StrAppend(&lines, "[rank ", r.rank, "] ", r.partial.substr(start, nl - start), "\n");
    start = nl + 1;
  }
  r.partial.erase(0, start);
  if (exited && !r.partial.empty()) {
    absl::StrAppend(&lines, "[rank ", r.rank, "] ", r.partial, "\n");
    r.partial.clear();
  }
  if (exited)
    absl::StrAppend(&lines, "[agent ", options_.name, "] rank ", r.rank, " ", r.detail, "\n");
  if (!lines.empty()) AppendCombined(a, lines);
}

// Whether the rank has exited (then its exit code, detail, freed GPU and remaining log).
bool Agent::Reap(Attempt& a, Rank& r) {
  int st = 0;
  if (::waitpid(r.pid, &st, WNOHANG) != r.pid) return false;
  rank_exited_ = true;  // report it now: the slot is free for the next job
  r.running = false;
  gpu_pool_.Give(r.gpu);  // the process is gone: its GPU is free for the next attempt
  r.gpu = -1;
  if (WIFEXITED(st)) {
    r.exit_code = WEXITSTATUS(st);
    r.detail = absl::StrCat("exited ", r.exit_code);
    registry_.Increment("loom_worker_rank_exits_total", 1,
                        {{"result", r.exit_code == 0 ? "ok" : "failed"}});
  } else if (WIFSIGNALED(st)) {
    registry_.Increment("loom_worker_rank_exits_total", 1, {{"result", "killed"}});
    r.exit_code = 128 + WTERMSIG(st);
    r.detail = absl::StrCat("killed by signal ", WTERMSIG(st), " (", strsignal(WTERMSIG(st)), ")");
  }
  if (a.lease_expired && r.exit_code != 0) {
    // An infrastructure failure, not the job's: reported like the rank's own lease stop.
    r.detail = absl::StrCat("stopped: lease expired (", r.detail, ")");
    r.exit_code = kExitLeaseExpired;
  }
  if (a.serve && !a.serve->unhealthy.empty()) {
    // Stopped for its health: the attempt failed (and is restarted within max_restarts), so
    // neither success nor "stopped" (76, what loom-serve --job exits with on SIGTERM).
    r.detail = absl::StrCat(a.serve->unhealthy, " (", r.detail, ")");
    if (r.exit_code == 0 || r.exit_code == kExitStopped) r.exit_code = 1;
  }
  // Whatever it wrote after the last read.
  std::string rest = ReadFrom(r.log_path, r.log_read, 64 << 20);
  r.log_read += static_cast<int64_t>(rest.size());
  r.partial += rest;
  return true;
}

// New lines of the attempt's event log (api/loom/v1/events.proto). A line that does not parse
// (a torn or hostile write) is skipped.
void Agent::ReadEvents(Attempt& a, int64_t now) {
  std::string m = ReadFrom(a.metrics_path, a.metrics_read, 4 << 20);
  a.metrics_read += static_cast<int64_t>(m.size());
  a.metrics_partial += m;
  size_t start = 0, nl;
  while ((nl = a.metrics_partial.find('\n', start)) != std::string::npos) {
    auto event =
        ParseTrainerEventLine(std::string_view(a.metrics_partial).substr(start, nl - start));
    start = nl + 1;
    if (event.ok()) ApplyEvent(a, *event, now);
  }
  a.metrics_partial.erase(0, start);
}

void Agent::ApplyEvent(Attempt& a, const v1::TrainerEvent& e, int64_t now) {
  const metrics::Labels labels = {{metrics::kJobLabel, a.job_id}, {"rank", "0"}};
  switch (e.kind_case()) {
    case v1::TrainerEvent::kStep:
      return OnStep(a, e.step(), labels, now);
    case v1::TrainerEvent::kEval:
      return OnEval(a, e.eval(), labels);
    case v1::TrainerEvent::kCheckpoint: {
      const v1::CheckpointEvent& c = e.checkpoint();
      if (c.dir().empty()) return;
      v1::CheckpointReport& report = a.checkpoints.emplace_back();
      report.set_step(c.step());
      report.set_path(c.dir());
      registry_.Observe("loom_train_checkpoint_write_seconds", c.seconds(), labels);
      registry_.Increment("loom_train_checkpoint_bytes_total", static_cast<double>(c.bytes()),
                          labels);
      if (c.upload_seconds() > 0) {  // an object store's step (storage/checkpoint_uploader.h)
        registry_.Observe("loom_train_checkpoint_upload_seconds", c.upload_seconds(), labels);
        registry_.Observe("loom_train_checkpoint_upload_wait_seconds", c.upload_wait_seconds(),
                          labels);
        registry_.Increment("loom_train_checkpoint_upload_retries_total",
                            static_cast<double>(c.upload_retries()), labels);
      }
      return;
    }
    case v1::TrainerEvent::kCheckpointSkipped: {
      const v1::CheckpointSkippedEvent& c = e.checkpoint_skipped();
      if (c.dir().empty()) return;
      v1::SkippedCheckpoint& skipped = a.skipped.emplace_back();
      skipped.set_step(c.step());
      skipped.set_path(c.dir());
      skipped.set_reason(c.reason());
      return;
    }
    case v1::TrainerEvent::kResumed:
      a.resumed.set_restored(true);
      a.resumed.set_step(e.resumed().step());
      a.resumed.set_path(e.resumed().dir());
      return;
    case v1::TrainerEvent::kReasoningEval:
      return OnReasoningEval(a, e.reasoning_eval(), labels);
    case v1::TrainerEvent::KIND_NOT_SET:
      return;
  }
}

void Agent::OnStep(Attempt& a, const v1::StepEvent& s, const metrics::Labels& labels, int64_t now) {
  registry_.Set("loom_train_loss", s.loss(), labels);
  registry_.Set("loom_train_learning_rate", s.lr(), labels);
  registry_.Set("loom_train_grad_norm", s.grad_norm(), labels);
  registry_.Set("loom_train_tokens_per_second", s.tokens_per_second(), labels);
  registry_.Set("loom_train_mfu_ratio", s.mfu(), labels);
  registry_.Set("loom_train_step", static_cast<double>(s.step()), labels);
  registry_.Set("loom_train_total_steps", static_cast<double>(a.total_steps), labels);
  registry_.Observe("loom_train_step_seconds", s.step_seconds(), labels);
  if (a.tokens_seen >= 0 && s.tokens_seen() > a.tokens_seen) {
    registry_.Increment("loom_train_tokens_total",
                        static_cast<double>(s.tokens_seen() - a.tokens_seen), labels);
  }
  a.tokens_seen = s.tokens_seen();
  // Created at 0 with the job's first step, so increase() sees the first skip too. A step the
  // loss scaler skipped (an fp16 overflow) is not a divergence.
  registry_.Increment("loom_train_nan_skipped_steps_total", s.skipped() && !s.overflowed() ? 1 : 0,
                      labels);
  if (s.has_loss_scale()) {
    registry_.Set("loom_train_loss_scale", s.loss_scale(), labels);
    registry_.Increment("loom_train_loss_scale_overflows_total", s.overflowed() ? 1 : 0, labels);
  }
  a.progress.set_step(s.step());
  a.progress.set_loss(s.loss());
  a.progress.set_tokens_per_second(s.tokens_per_second());
  a.progress.set_tokens_seen(s.tokens_seen());
  a.progress.set_update_time_ms(now);
  v1::StepPoint& p = a.steps.emplace_back();
  p.set_step(std::max<int64_t>(0, s.step()));
  p.set_loss(s.loss());
  p.set_learning_rate(s.lr());
  p.set_tokens_per_second(s.tokens_per_second());
  p.set_grad_norm(s.grad_norm());
  p.set_time_ms(std::max<int64_t>(0, now));
  p.set_tokens_seen(std::max<int64_t>(0, s.tokens_seen()));
  p.set_train_flops(s.train_flops());
  if (a.steps.size() > kMaxPendingSteps) {
    a.steps.pop_front();
    ++a.steps_acked;
  }
}

void Agent::OnEval(Attempt& a, const v1::EvalEvent& ev, const metrics::Labels& labels) {
  v1::EvalResult& e = a.evals.emplace_back();
  e.set_step(ev.step());
  e.set_eval_loss(ev.eval_loss());
  e.set_accuracy(ev.accuracy());
  e.set_exact_match(ev.exact_match());
  // data.splits: "validation" (every epoch) or "test" (at each new best validation loss);
  // eval.lengths: "length" (the end-of-run evaluation at another sequence length); absent: the
  // fresh-sample held-out evaluation. The gauges follow the held-out/validation ones only.
  if (ev.has_split()) e.set_kind(ev.split());
  if (ev.has_length()) {
    e.set_kind("length");
    e.set_length(ev.length());
    return;
  }
  if (ev.split() == "test") return;
  registry_.Set("loom_train_eval_loss", ev.eval_loss(), labels);
  registry_.Set("loom_train_eval_accuracy_ratio", ev.accuracy(), labels);
  registry_.Set("loom_train_eval_exact_match_ratio", ev.exact_match(), labels);
}

void Agent::OnReasoningEval(Attempt& a, const v1::ReasoningEvalEvent& r,
                            const metrics::Labels& labels) {
  v1::EvalResult& e = a.evals.emplace_back();
  e.set_kind("reasoning");
  e.set_step(r.step());
  e.set_task(r.task());
  e.set_problems(r.problems());
  e.set_samples(r.samples());
  e.set_pass_at_1(r.pass_at_1());
  e.set_maj_at_k(r.maj_at_k());
  e.set_answered(r.answered());
  e.set_details(r.details());
  *e.mutable_problem_samples() = r.problem_samples();
  *e.mutable_problem_correct() = r.problem_correct();
  *e.mutable_problem_answered() = r.problem_answered();
  *e.mutable_problem_majority_correct() = r.problem_majority_correct();
  e.set_problem_set(r.problem_set());
  registry_.Set("loom_train_reasoning_pass_at_1_ratio", r.pass_at_1(), labels);
  registry_.Set("loom_train_reasoning_maj_at_k_ratio", r.maj_at_k(), labels);
}

void Agent::ExportGpuSeries() {
  if (options_.gpus.empty()) return;
  static const char* const kFamilies[] = {"loom_worker_gpu_assigned",
                                          "loom_train_gpu_utilization_ratio",
                                          "loom_train_gpu_memory_used_bytes",
                                          "loom_train_gpu_memory_allocated_bytes",
                                          "loom_train_gpu_memory_reserved_bytes",
                                          "loom_train_gpu_memory_peak_bytes"};
  for (const char* f : kFamilies) registry_.Clear(f);
  for (const auto& [key, a] : attempts_) {
    for (const Rank& r : a.ranks) {
      if (!r.running || r.gpu < 0) continue;
      const v1::Gpu& g = gpu_pool_.gpu(r.gpu);
      const metrics::Labels labels = {{metrics::kJobLabel, a.job_id},
                                      {"rank", std::to_string(r.rank)},
                                      {"gpu", std::to_string(g.index())},
                                      {"UUID", g.uuid()}};
      registry_.Set("loom_worker_gpu_assigned", 1, labels);
      if (nvml_) {
        if (auto reading = nvml_->Read(g)) {
          registry_.Set("loom_train_gpu_utilization_ratio", reading->utilization, labels);
          registry_.Set("loom_train_gpu_memory_used_bytes",
                        static_cast<double>(reading->memory_used_bytes), labels);
        }
      }
      // The rank's own file: one JSON object, rewritten atomically at every logged step.
      auto j =
          nlohmann::json::parse(ReadFrom(GpuStatsPath(a.dir, r.rank), 0, 4096), nullptr, false);
      if (!j.is_object()) continue;
      for (const char* field : {"allocated", "reserved", "peak"}) {
        const std::string k = absl::StrCat(field, "_bytes");
        if (j.contains(k) && j[k].is_number() && j[k].get<double>() >= 0)
          registry_.Set(absl::StrCat("loom_train_gpu_memory_", field, "_bytes"), j[k].get<double>(),
                        labels);
      }
    }
  }
}

v1::HeartbeatRequest Agent::BuildHeartbeat(std::map<std::string, int64_t>* log_ends) {
  v1::HeartbeatRequest req;
  req.set_worker_id(worker_id_);
  for (auto& [key, a] : attempts_) {
    v1::AttemptReport* r = req.add_attempts();
    r->set_job_id(a.job_id);
    r->set_attempt(a.attempt);
    bool finished = true;
    for (const Rank& rank : a.ranks) {
      v1::RankStatus* s = r->add_ranks();
      s->set_rank(rank.rank);
      s->set_running(rank.running);
      s->set_exit_code(rank.exit_code);
      s->set_detail(rank.detail);
      finished &= !rank.running;
    }
    r->set_finished(finished);
    *r->mutable_progress() = a.progress;
    for (const auto& c : a.checkpoints) *r->add_checkpoints() = c;
    for (const auto& e : a.evals) *r->add_evals() = e;
    for (const auto& c : a.skipped) *r->add_skipped() = c;
    *r->mutable_resumed() = a.resumed;
    r->set_master_port(a.master_port);
    if (a.serve) ReportServe(a, r->mutable_serve());
    // Curves: the oldest unacknowledged points, a bounded number per heartbeat.
    r->set_steps_offset(a.steps_acked);
    const size_t n = std::min<size_t>(a.steps.size(), kStepsPerHeartbeat);
    for (size_t i = 0; i < n; ++i) *r->add_steps() = a.steps[i];
    // Logs are what can grow: together they take at most half of the coordinator's body limit.
    const int64_t budget = std::max<int64_t>(
        1024, std::min<int64_t>(options_.max_log_chunk,
                                max_body_bytes_ / 2 / static_cast<int64_t>(attempts_.size())));
    std::string chunk = ReadFrom(a.combined_log, a.log_sent, budget);
    // Whole lines only, so chunks from several workers interleave cleanly in the job's log.
    if (const size_t nl = chunk.rfind('\n'); nl != std::string::npos) chunk.resize(nl + 1);
    r->set_log_offset(a.log_sent);
    (*log_ends)[key] = a.log_sent + static_cast<int64_t>(chunk.size());
    r->set_log(std::move(chunk));
  }
  return req;
}

// One heartbeat: reports out, assignments, cancels and acknowledgements in. A credential the
// coordinator no longer accepts (this worker was declared lost) means registering again.
absl::Status Agent::Heartbeat(bool* registered) {
  just_assigned_ = false;
  std::map<std::string, int64_t> log_ends;
  v1::HeartbeatRequest req = BuildHeartbeat(&log_ends);
  v1::HeartbeatResponse resp;
  const int64_t sent = LeaseClockMs();
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = coordinator_->Heartbeat(credential_, req, &resp, kCallTimeoutMs);
  if (!s.ok()) {
    registry_.Increment("loom_worker_heartbeat_failures_total");
    if (s.code() == absl::StatusCode::kNotFound || s.code() == absl::StatusCode::kUnauthenticated) {
      *registered = false;  // forgotten (new state dir) or declared lost: register again
    } else if (s.code() == absl::StatusCode::kResourceExhausted) {
      max_body_bytes_ = std::max<int64_t>(16 << 10, max_body_bytes_ / 2);  // send less log
    } else if (s.code() == absl::StatusCode::kInvalidArgument ||
               s.code() == absl::StatusCode::kPermissionDenied) {
      // A report the coordinator refuses would be refused forever: drop what it may object to.
      Log(absl::StrCat("the coordinator refused a heartbeat; dropping its reports: ", s.message()));
      for (auto& [key, a] : attempts_) {
        a.checkpoints.clear();
        a.skipped.clear();
        a.resumed.Clear();
        a.steps_acked += static_cast<int64_t>(a.steps.size());
        a.steps.clear();
      }
    }
    return s;
  }
  registry_.Observe(
      "loom_worker_heartbeat_seconds",
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  RenewLease(sent + lease_ms_);
  Acknowledge(req, log_ends, resp);
  return absl::OkStatus();
}

void Agent::Acknowledge(const v1::HeartbeatRequest& sent,
                        const std::map<std::string, int64_t>& ends,
                        const v1::HeartbeatResponse& resp) {
  for (const auto& r : sent.attempts()) {
    if (resp.not_recorded()) break;  // the coordinator's disk is full: everything is sent again
    auto it = attempts_.find(Key(r.job_id(), r.attempt()));
    if (it == attempts_.end()) continue;
    Attempt& a = it->second;
    a.log_sent = ends.at(it->first);
    a.checkpoints.erase(a.checkpoints.begin(), a.checkpoints.begin() + r.checkpoints_size());
    a.evals.erase(a.evals.begin(), a.evals.begin() + r.evals_size());
    a.skipped.erase(a.skipped.begin(), a.skipped.begin() + r.skipped_size());
    a.steps.erase(a.steps.begin(), a.steps.begin() + r.steps_size());
    a.steps_acked += r.steps_size();
  }
  for (const auto& c : resp.cancels()) {
    auto it = attempts_.find(Key(c.job_id(), c.attempt()));
    if (it != attempts_.end()) Cancel(it->second, "cancelled by the coordinator");
  }
  for (const auto& f : resp.forget()) {
    auto it = attempts_.find(Key(f.job_id(), f.attempt()));
    if (it == attempts_.end()) continue;
    bool finished = true;
    for (const Rank& r : it->second.ranks) finished &= !r.running;
    if (finished && it->second.log_sent >= it->second.log_written &&
        it->second.checkpoints.empty() && it->second.steps.empty()) {
      const std::string job = it->second.job_id;
      attempts_.erase(it);
      bool other = false;
      for (const auto& [k, a] : attempts_) other |= a.job_id == job;
      if (!other) {
        registry_.RemoveWhere(metrics::kJobLabel, job);  // keep cardinality bounded
        // Steps staged for an object store: uploaded by now, or lost with the attempt (its
        // next attempt resumes from the store and empties the directory anyway).
        std::error_code ec;
        fs::remove_all(fs::path(options_.work_dir) / "staging" / job, ec);
      }
    }
  }
  for (const auto& as : resp.assignments()) {
    if (!attempts_.count(Key(as.job_id(), as.attempt()))) StartAttempt(as);
  }
  just_assigned_ = !resp.assignments().empty();  // report the port / start at once
}

// The worker id and credential of an earlier registration from this work directory, if any.
void Agent::LoadIdentity() {
  std::ifstream in(fs::path(options_.work_dir) / "worker-id");
  std::string id;
  if (in >> id && SafeName(id)) worker_id_ = id;
  std::ifstream cred(fs::path(options_.work_dir) / "worker-credential");
  std::string token;
  if (cred >> token && SafeName(token)) credential_ = token;
}

absl::Status Agent::StartExporter() {
  if (options_.metrics_port == 0) return absl::OkStatus();
  LOOM_ASSIGN_OR_RETURN(exporter_, net::MetricsEndpoint::Start(&registry_, options_.metrics_bind,
                                                               std::max(0, options_.metrics_port)));
  Log(absl::StrCat("metrics on http://", options_.metrics_bind, ":", exporter_->port(),
                   "/metrics"));
  if (options_.prometheus_sd_file.empty()) return absl::OkStatus();
  // Prometheus file-based service discovery: one target, this node's exporter.
  const std::string host =
      options_.metrics_bind == "0.0.0.0" ? options_.address : options_.metrics_bind;
  const std::string tmp = options_.prometheus_sd_file + ".tmp";
  // Target label: the service. The node's name and pool are on every series already.
  nlohmann::json target = {{"targets", {absl::StrCat(host, ":", exporter_->port())}},
                           {"labels", {{"service", "loom-worker"}}}};
  std::ofstream(tmp) << nlohmann::json::array({target}).dump() << "\n";
  std::error_code ec;
  fs::rename(tmp, options_.prometheus_sd_file, ec);
  return absl::OkStatus();
}

absl::Status Agent::Run() {
  std::error_code ec;
  fs::create_directories(options_.work_dir, ec);
  if (ec)
    return absl::UnavailableError(
        absl::StrCat("--work-dir '", options_.work_dir, "': ", ec.message()));
  LoadIdentity();
  LOOM_ASSIGN_OR_RETURN(coordinator_,
                        CoordinatorClient::Create({options_.coordinator_url, options_.ca_file,
                                                   options_.client_cert, options_.client_key}));
  LOOM_RETURN_IF_ERROR(StartExporter());
  LoopState loop;
  while (!stop_) {
    Poll();
    if (NowMs() >= loop.next_heartbeat) LOOM_RETURN_IF_ERROR(Beat(loop));
    // A rank exited: report it at once, and ask again shortly after: the report wakes the
    // coordinator's scheduling pass, which places what waited for the freed slot.
    if (loop.registered && rank_exited_) {
      rank_exited_ = false;
      loop.next_heartbeat = 0;
      loop.follow_up_at = NowMs() + std::min<int64_t>(heartbeat_ms_ / 3, kFollowUpMs);
    } else if (loop.follow_up_at != 0 && NowMs() >= loop.follow_up_at) {
      loop.follow_up_at = 0;
      loop.next_heartbeat = std::min(loop.next_heartbeat, NowMs());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  Shutdown(loop.registered);
  return absl::OkStatus();
}

// One beat: register when not registered yet, refresh GPU series, send a heartbeat. Errors only
// for what retrying cannot fix (a bad token or a refused registration).
absl::Status Agent::Beat(LoopState& loop) {
  loop.next_heartbeat = NowMs() + heartbeat_ms_;
  if (!loop.registered) {
    absl::Status s = Register();
    loop.registered = s.ok();
    if (s.code() == absl::StatusCode::kUnauthenticated ||
        s.code() == absl::StatusCode::kPermissionDenied ||
        s.code() == absl::StatusCode::kInvalidArgument) {
      return s;
    }
    if (!s.ok() && loop.reachable) Log(absl::StrCat("cannot register yet: ", s.message()));
    loop.reachable = s.ok();
  }
  ExportGpuSeries();
  if (!loop.registered) return absl::OkStatus();
  absl::Status s = Heartbeat(&loop.registered);
  if (!s.ok() && (loop.reachable || s.code() != loop.last_failure)) {
    Log(absl::StrCat("heartbeat failed (will retry): ", absl::StatusCodeToString(s.code()), ": ",
                     s.message()));
  }
  loop.last_failure = s.code();
  if (s.ok() && !loop.reachable) Log("coordinator reachable again");
  loop.reachable = s.ok();
  if (!loop.registered) loop.next_heartbeat = 0;  // register again right away
  if (s.ok() && !attempts_.empty() && just_assigned_) loop.next_heartbeat = 0;
  return absl::OkStatus();
}

// Stops every rank (SIGTERM, then SIGKILL after the grace period) and reports the exits.
void Agent::Shutdown(bool registered) {
  for (auto& [key, a] : attempts_) Cancel(a, "worker agent stopping");
  const int64_t deadline = NowMs() + options_.term_grace_ms + 1000;
  for (;;) {
    Poll();
    bool any = false;
    for (auto& [key, a] : attempts_) {
      for (const Rank& r : a.ranks) any |= r.running;
    }
    if (!any || NowMs() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (registered) (void)Heartbeat(&registered);  // best effort: the final exits
  Log("stopped");
}

}  // namespace loom::agent
