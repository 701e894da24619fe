// loom-worker: the agent on each node. Registers its slots and labels with the coordinator,
// heartbeats, launches the trainer ranks it is assigned as child processes (their own process
// groups, killed if the agent dies), tails their logs and rank 0's metrics JSONL, and reports
// progress, checkpoint commits and exits until the coordinator acknowledges them. A kind: serve
// job's one rank is loom-serve instead, whose port, token and health it reports
// (agent_serve.cc). Never links LibTorch.
#ifndef LOOM_WORKER_AGENT_AGENT_H_
#define LOOM_WORKER_AGENT_AGENT_H_

#include <sys/types.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "loom/v1/control.pb.h"
#include "loom/v1/events.pb.h"
#include "metrics/prometheus.h"
#include "net/metrics_endpoint.h"
#include "worker/agent/coordinator_client.h"
#include "worker/agent/gpus.h"
#include "worker/agent/serve_probe.h"

namespace loom::agent {

struct AgentOptions {
  std::string coordinator_url;          // the coordinator's agent port (gRPC): http:// or https://
  std::string ca_file;                  // PEM CA for an https:// coordinator ("" = the system's)
  std::string client_cert, client_key;  // PEM: this node's certificate for mutual TLS
  std::string token;                    // enrolment token: registration only
  std::string name;
  std::string address = "127.0.0.1";
  int slots = 1;
  std::vector<v1::Gpu> gpus;  // empty: a CPU node; else each rank is bound to one of them
  std::map<std::string, std::string> labels;
  std::string work_dir;       // per-attempt directories, the worker id file
  std::string loom_train;     // trainer binary
  std::string loom_serve;     // server binary (kind: serve jobs)
  std::string plugin_dir;     // passed to the trainer as --plugin-dir ("" = its default)
  int term_grace_ms = 10000;  // SIGTERM -> SIGKILL
  int max_log_chunk = 256 << 10;
  int metrics_port = 0;  // Prometheus /metrics: 0 = off, -1 = any free port
  std::string metrics_bind = "127.0.0.1";
  std::string prometheus_sd_file;  // write a file_sd target list here once serving
};

class Agent {
 public:
  explicit Agent(AgentOptions options);
  ~Agent();
  // Runs until Stop(); then terminates its ranks.
  absl::Status Run();
  void Stop() { stop_ = true; }

 private:
  struct Rank {
    int rank = 0;
    pid_t pid = -1;
    bool running = false;
    int exit_code = 0;
    std::string detail;
    std::string log_path;
    int64_t log_read = 0;
    std::string partial;
    int gpu = -1;  // its GPU in the node's pool, held until the process is reaped
  };
  // A kind: serve attempt's server (agent_serve.cc).
  struct Serve {
    std::string port_file, token_file, token, model;
    int port = 0;                              // 0 until its port file names one
    int64_t started_ms = 0;                    // LeaseClockMs() at launch
    int64_t startup_ms = 0, unhealthy_ms = 0;  // ServeConfig's limits
    bool announced = false;                    // its first ready probe is in the combined log
    std::string unhealthy;                     // why the agent stopped it ("" = it did not)
    std::unique_ptr<ServeProbe> probe;         // once the port is known; stopped when it exits
  };
  struct Attempt {
    std::string job_id;
    int attempt = 0;
    std::string dir;
    std::vector<Rank> ranks;
    int master_port = 0;
    std::string metrics_path;
    int64_t metrics_read = 0;
    std::string metrics_partial;
    v1::Progress progress;
    std::vector<v1::CheckpointReport> checkpoints;  // not yet acknowledged
    std::vector<v1::EvalResult> evals;              // not yet acknowledged
    std::vector<v1::SkippedCheckpoint> skipped;     // not yet acknowledged
    v1::ResumeReport resumed;                       // sent until the attempt is forgotten
    std::deque<v1::StepPoint> steps;                // not yet acknowledged, from steps_acked
    int64_t steps_acked = 0;                        // index of steps.front() in the attempt
    std::string lease_path;                         // the ranks' lease (LOOM_LEASE_FILE)
    bool lease_expired = false;  // stopped for that: exits are reported as kExitLeaseExpired
    std::string combined_log;    // path of the combined log of all ranks
    int64_t log_written = 0;
    int64_t log_sent = 0;
    int64_t kill_at_ms = 0;    // SIGKILL deadline after a cancel (0 = not cancelled)
    int64_t tokens_seen = -1;  // for loom_train_tokens_total
    int64_t total_steps = 0;
    std::unique_ptr<Serve> serve;  // kind: serve only
  };

  struct LoopState {
    bool registered = false, reachable = true;
    int64_t next_heartbeat = 0, follow_up_at = 0;
    absl::StatusCode last_failure = absl::StatusCode::kOk;  // logged again when it changes
  };
  void LoadIdentity();
  absl::Status StartExporter();
  absl::Status Beat(LoopState& loop);
  void Shutdown(bool registered);
  absl::Status Register();
  absl::Status Heartbeat(bool* registered);
  void Acknowledge(const v1::HeartbeatRequest& sent, const std::map<std::string, int64_t>& ends,
                   const v1::HeartbeatResponse& resp);
  // Lease: ranks may run until this steady-clock time (ms) unless a heartbeat renews it.
  void RenewLease(int64_t expiry_ms);
  void WriteLease(const Attempt& a) const;
  // Where a rank runs: its rank, its index among this job's ranks here, and its GPU (if any).
  struct RankPlace {
    int rank = 0, local = 0, local_world = 1;
    std::string visible_devices;  // CUDA_VISIBLE_DEVICES; "" without a GPU
  };
  void StartAttempt(const v1::Assignment& a);
  Attempt PrepareAttempt(const v1::Assignment& as);
  std::vector<std::string> TrainerArgv(const v1::Assignment& as, const Attempt& a) const;
  // Serve attempts: the token and its file; why the rank cannot start ("" = it can).
  std::string PrepareServe(const v1::Assignment& as, Attempt& a);
  std::vector<std::string> ServeArgv(const v1::Assignment& as, const Attempt& a) const;
  void PollServe(Attempt& a);  // the port, the first ready probe, the health policy
  void CheckServeHealth(Attempt& a);
  void ReportServe(const Attempt& a, v1::ServeReport* r) const;
  std::vector<std::pair<std::string, std::string>> RankEnvironment(const v1::Assignment& as,
                                                                   const Attempt& a,
                                                                   const RankPlace& place) const;
  // why_not: the rank fails to start with this detail instead.
  Rank LaunchRank(const v1::Assignment& as, Attempt& a, const std::vector<std::string>& argv,
                  RankPlace place, std::string why_not);
  void Cancel(Attempt& a, const std::string& why);
  void Poll();  // reap children, tail logs and events, escalate kills
  void TailRank(Attempt& a, Rank& r);
  bool Reap(Attempt& a, Rank& r);
  void ReadEvents(Attempt& a, int64_t now);
  void ApplyEvent(Attempt& a, const v1::TrainerEvent& e, int64_t now);
  void OnStep(Attempt& a, const v1::StepEvent& s, const metrics::Labels& labels, int64_t now);
  void OnEval(Attempt& a, const v1::EvalEvent& ev, const metrics::Labels& labels);
  void OnReasoningEval(Attempt& a, const v1::ReasoningEvalEvent& r, const metrics::Labels& labels);
  void AppendCombined(Attempt& a, const std::string& text);
  v1::HeartbeatRequest BuildHeartbeat(std::map<std::string, int64_t>* log_ends);
  static std::string Key(const std::string& job, int attempt);

  void DeclareMetrics();
  // Per-rank GPU series (binding, NVML readings, the rank's CUDA allocator file), rebuilt from
  // the ranks running now so a reaped rank's series go with it.
  void ExportGpuSeries();

  AgentOptions options_;
  GpuPool gpu_pool_;
  std::unique_ptr<NvmlSampler> nvml_;  // null without a driver
  metrics::Registry registry_{"worker"};
  std::unique_ptr<net::MetricsEndpoint> exporter_;
  std::unique_ptr<CoordinatorClient> coordinator_;  // Register and Heartbeat (agent.proto)
  std::string worker_id_;
  std::string credential_;
  int heartbeat_ms_ = 1000;
  int lease_ms_ = 5000;
  int64_t lease_expiry_ms_ = 0;  // steady clock; 0 until the first successful registration
  int64_t max_body_bytes_ = 1 << 20;
  bool just_assigned_ = false;
  bool rank_exited_ = false;                 // since the last heartbeat: send the next one at once
  std::map<std::string, Attempt> attempts_;  // Key(job, attempt)
  std::atomic<bool> stop_{false};
};

}  // namespace loom::agent

#endif  // LOOM_WORKER_AGENT_AGENT_H_
