// loom-bench-agents: the agent path under load. A real Coordinator (RocksDB on disk, synced
// commits as in production) behind the real gRPC AgentServer on loopback; N simulated agents
// register, then heartbeat as fast as the client threads let them (or at a target rate) for a
// fixed time. Prints heartbeats/s and the latency percentiles, against the target
// (>= 5 000 heartbeats/s, p99 < 50 ms). Client and server share this machine's cores.
// --running: every agent hosts a running one-rank job and each heartbeat reports it as a real
// agent does (rank status, progress, one step point), so each one writes job state to RocksDB.
// --checkpoint-every K: every K-th heartbeat of an agent also reports a checkpoint, a state change
// that must be fsynced before the answer (1: every heartbeat waits for the disk).
//
//   loom-bench-agents [--agents 512] [--threads 32] [--seconds 10] [--rate 0 (as fast as possible)]
//                     [--running [--checkpoint-every K]]
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/cli_args.h"
#include "base/status_macros.h"
#include "coordinator/agent_service.h"
#include "loom/v1/agent.grpc.pb.h"
#include "storage/checkpoint.h"

namespace fs = std::filesystem;

namespace loom::coordinator {
using SteadyClock = std::chrono::steady_clock;
namespace {

constexpr char kEnrolment[] = "bench-enrolment-token-0123456789";

struct Agent {
  std::string id, credential;
  std::string job;  // --running: the job placed on it (attempt 1)
  std::string checkpoint_dir;
  int64_t step = 0;
};

grpc::Status Call(v1::Agent::Stub& stub, const std::string& token, const v1::HeartbeatRequest& req,
                  v1::HeartbeatResponse* resp) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  context.AddMetadata("authorization", "Bearer " + token);
  return stub.Heartbeat(&context, req, resp);
}

absl::StatusOr<std::vector<Agent>> RegisterAgents(v1::Agent::Stub& stub, int n, int slots) {
  std::vector<Agent> agents;
  for (int i = 0; i < n; ++i) {
    v1::RegisterWorkerRequest req;
    req.set_name(absl::StrCat("bench-", i));
    req.set_address(absl::StrCat("10.0.", i / 256, ".", i % 256));
    req.set_slots(slots);
    v1::RegisterWorkerResponse resp;
    grpc::ClientContext context;
    context.AddMetadata("authorization", std::string("Bearer ") + kEnrolment);
    grpc::Status s = stub.Register(&context, req, &resp);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat("register: ", s.error_message()));
    Agent a;
    a.id = resp.worker_id();
    a.credential = resp.credential();
    agents.push_back(std::move(a));
  }
  return agents;
}

// One one-rank job per agent, placed by the coordinator's own scheduler.
absl::Status PlaceJobs(Coordinator& coordinator, std::vector<Agent>& agents) {
  std::map<std::string, Agent*> by_id;
  for (Agent& a : agents) by_id[a.id] = &a;
  std::vector<std::string> ids;
  for (size_t i = 0; i < agents.size(); ++i) {
    v1::SubmitJobRequest r;
    r.mutable_spec()->set_preset("micro");
    r.mutable_spec()->set_steps(1000000);
    r.set_world_size(1);
    LOOM_ASSIGN_OR_RETURN(v1::SubmitJobResponse job, coordinator.Submit(r, "bench"));
    ids.push_back(job.id());
  }
  coordinator.Tick();
  for (const std::string& id : ids) {
    LOOM_ASSIGN_OR_RETURN(v1::Job j, coordinator.GetJob(id));
    if (j.placement_size() != 1) return absl::InternalError(absl::StrCat(id, " not placed"));
    Agent* a = by_id.at(j.placement(0).worker_id());
    a->job = id;
    a->checkpoint_dir = j.spec().checkpoint().dir();
  }
  return absl::OkStatus();
}

// What a real agent reports for its running rank: status, progress and the new step point.
void ReportRunning(Agent& a, int checkpoint_every, v1::HeartbeatRequest& req) {
  if (a.job.empty()) return;
  v1::AttemptReport* r = req.add_attempts();
  r->set_job_id(a.job);
  r->set_attempt(1);
  r->set_master_port(30000);
  v1::RankStatus* rank = r->add_ranks();
  rank->set_rank(0);
  rank->set_running(true);
  ++a.step;
  r->mutable_progress()->set_step(a.step);
  r->mutable_progress()->set_total_steps(1000000);
  r->mutable_progress()->set_loss(3.0);
  r->mutable_progress()->set_update_time_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                std::chrono::system_clock::now().time_since_epoch())
                                                .count());
  r->set_steps_offset(a.step - 1);
  v1::StepPoint* p = r->add_steps();
  p->set_step(a.step);
  p->set_loss(3.0);
  if (checkpoint_every > 0 && a.step % checkpoint_every == 0) {
    v1::CheckpointReport* c = r->add_checkpoints();
    c->set_step(a.step);
    c->set_path((fs::path(a.checkpoint_dir) / storage::CheckpointDirName(a.step)).string());
  }
}

struct Result {
  std::vector<double> latencies_ms;
  int64_t failures = 0;
};

// One client thread: heartbeats for agents[first], agents[first + stride], ... in turn, each on
// its own channel (an agent keeps one connection), paced to `rate_per_thread` when > 0.
Result Drive(const std::string& target, std::vector<Agent>& agents, int first, int stride,
             SteadyClock::time_point end, double rate_per_thread, int checkpoint_every) {
  std::vector<std::unique_ptr<v1::Agent::Stub>> stubs;
  std::vector<Agent*> mine;
  for (size_t i = first; i < agents.size(); i += stride) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection per simulated agent
    stubs.push_back(v1::Agent::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args)));
    mine.push_back(&agents[i]);
  }
  Result r;
  auto next = SteadyClock::now();
  for (size_t k = 0; SteadyClock::now() < end && !mine.empty(); k = (k + 1) % mine.size()) {
    if (rate_per_thread > 0) {
      std::this_thread::sleep_until(next);
      next += std::chrono::duration_cast<SteadyClock::duration>(
          std::chrono::duration<double>(1.0 / rate_per_thread));
    }
    v1::HeartbeatRequest req;
    req.set_worker_id(mine[k]->id);
    ReportRunning(*mine[k], checkpoint_every, req);
    v1::HeartbeatResponse resp;
    const auto start = SteadyClock::now();
    grpc::Status s = Call(*stubs[k], mine[k]->credential, req, &resp);
    const double ms = std::chrono::duration<double, std::milli>(SteadyClock::now() - start).count();
    if (s.ok()) {
      r.latencies_ms.push_back(ms);
    } else {
      ++r.failures;
    }
  }
  return r;
}

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

struct Settings {
  int64_t agents = 512, threads = 32, seconds = 10, checkpoint_every = 0;
  double rate = 0;  // heartbeats/s over all threads; 0 = as fast as they go
  bool running = false;
};

absl::StatusOr<Settings> ParseSettings(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(
      CliArgs args,
      CliArgs::Parse(argc, argv, 1, {"agents", "threads", "seconds", "rate", "checkpoint-every"},
                     {"running"}));
  Settings s;
  LOOM_ASSIGN_OR_RETURN(s.agents, args.GetInt("agents", 512, 1, 100000));
  LOOM_ASSIGN_OR_RETURN(s.threads, args.GetInt("threads", 32, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(s.seconds, args.GetInt("seconds", 10, 1, 3600));
  LOOM_ASSIGN_OR_RETURN(s.rate, args.GetDouble("rate", 0, 0, 1e7));
  s.running = args.Has("running");
  LOOM_ASSIGN_OR_RETURN(s.checkpoint_every, args.GetInt("checkpoint-every", 0, 0, 1000000));
  return s;
}

// Every client thread's heartbeats until `end`, merged.
Result DriveAll(const std::string& target, std::vector<Agent>& agents, const Settings& s,
                SteadyClock::time_point end) {
  std::vector<Result> results(static_cast<size_t>(s.threads));
  std::vector<std::thread> pool;
  for (int t = 0; t < s.threads; ++t) {
    pool.emplace_back([&, t] {
      results[static_cast<size_t>(t)] =
          Drive(target, agents, t, static_cast<int>(s.threads), end,
                s.rate / static_cast<double>(s.threads), static_cast<int>(s.checkpoint_every));
    });
  }
  for (auto& t : pool) t.join();
  Result all;
  for (Result& r : results) {
    all.latencies_ms.insert(all.latencies_ms.end(), r.latencies_ms.begin(), r.latencies_ms.end());
    all.failures += r.failures;
  }
  return all;
}

// The rate, latencies and log fsyncs, against the target.
void PrintReport(Result& all, const Settings& s, const std::string& metrics) {
  const double per_second =
      static_cast<double>(all.latencies_ms.size()) / static_cast<double>(s.seconds);
  const double p50 = Percentile(all.latencies_ms, 0.50), p99 = Percentile(all.latencies_ms, 0.99);
  if (s.checkpoint_every > 0) {
    std::printf("a checkpoint (fsynced) every %lld heartbeats of an agent\n",
                static_cast<long long>(s.checkpoint_every));
  }
  std::printf("agents %lld%s, client threads %lld, %lld s, target rate %s\n",
              static_cast<long long>(s.agents), s.running ? " (each reporting a running job)" : "",
              static_cast<long long>(s.threads), static_cast<long long>(s.seconds),
              s.rate > 0 ? absl::StrCat(s.rate, "/s").c_str() : "max");
  std::printf("heartbeats/s %.0f (failures %lld); latency p50 %.2f ms, p99 %.2f ms\n", per_second,
              static_cast<long long>(all.failures), p50, p99);
  const size_t at = metrics.find("\nloom_coordinator_log_syncs_total ");
  if (at != std::string::npos) {
    const double syncs = std::strtod(metrics.c_str() + at + 34, nullptr);
    std::printf("log fsyncs waited for: %.0f", syncs);
    if (s.checkpoint_every > 0 && syncs > 0) {
      std::printf(", %.1f checkpoint heartbeats each", per_second * static_cast<double>(s.seconds) /
                                                           static_cast<double>(s.checkpoint_every) /
                                                           syncs);
    }
    std::printf("\n");
  }
  std::printf("against the target (>= 5000/s, p99 < 50 ms): rate x%.2f, p99 x%.2f\n",
              per_second / 5000.0, p99 / 50.0);
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(const Settings settings, ParseSettings(argc, argv));
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("loom-bench-agents-", ::getpid());
  fs::remove_all(dir);
  CoordinatorOptions options;
  options.data_dir = (dir / "data").string();
  options.storage_root = (dir / "storage").string();
  options.lost_after_ms = 600000;  // nobody is lost while a client thread waits its turn
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator, Coordinator::Open(options));
  ApiOptions tokens;
  tokens.enrolment_token = kEnrolment;
  AgentServerOptions server_options;
  server_options.port = 0;
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<AgentServer> server,
                        AgentServer::Start(*coordinator, tokens, server_options));
  const std::string target = absl::StrCat("127.0.0.1:", server->port());
  auto registrar =
      v1::Agent::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  LOOM_ASSIGN_OR_RETURN(
      std::vector<Agent> agents,
      RegisterAgents(*registrar, static_cast<int>(settings.agents), settings.running ? 1 : 8));
  if (settings.running) LOOM_RETURN_IF_ERROR(PlaceJobs(*coordinator, agents));
  Result all = DriveAll(target, agents, settings,
                        SteadyClock::now() + std::chrono::seconds(settings.seconds));
  PrintReport(all, settings, coordinator->RenderMetrics());
  server->Shutdown(std::chrono::milliseconds(1000));
  server.reset();
  coordinator.reset();
  fs::remove_all(dir);
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::coordinator

int main(int argc, char** argv) {
  loom::coordinator::QuietMutexDebugging();
  absl::Status s = loom::coordinator::Run(argc, argv);
  if (!s.ok()) {
    std::cerr << "loom-bench-agents: " << s.message() << std::endl;
    return 1;
  }
  return 0;
}
