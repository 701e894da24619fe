// loom-bench-dist: data-parallel scaling of the tiny preset from 1 to 2 ranks, and Gloo
// all-reduce bandwidth against message size, on this machine. Run without arguments: the program
// launches its own ranks (itself, with LOOM_RANK / LOOM_WORLD_SIZE set) on loopback and prints
// Markdown tables (docs/benchmarks.md records them).
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "loom/spec.h"
#include "worker/trainer/bench_main.h"
#include "worker/trainer/trainer.h"

namespace loom::trainer {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kSteps = 12, kWarmup = 2;

// Child: one rank. Prints "RESULT tokens_per_second" and, on rank 0, "BW bytes seconds" lines.
absl::Status RunRank() {
  torch::set_num_threads(1);
  LOOM_ASSIGN_OR_RETURN(DistributedConfig config,
                        DistributedConfigFromEnv("gloo", std::chrono::seconds(60)));
  {
    LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, Communicator::Create(config));
    if (config.world_size > 1) {
      for (int64_t bytes = 4 << 10; bytes <= (64 << 20); bytes *= 4) {
        torch::Tensor t = torch::ones({bytes / 4});
        for (int i = 0; i < 3; ++i)
          LOOM_RETURN_IF_ERROR(comm->AllReduceMean({t}, int64_t{1} << 40));
        const int iterations = bytes >= (16 << 20) ? 5 : 20;
        const auto t0 = Clock::now();
        for (int i = 0; i < iterations; ++i)
          LOOM_RETURN_IF_ERROR(comm->AllReduceMean({t}, int64_t{1} << 40));
        const double s = std::chrono::duration<double>(Clock::now() - t0).count() / iterations;
        if (config.rank == 0) std::cout << "BW " << bytes << " " << s << "\n";
      }
    }
  }
  PluginLoader loader;
  loader.LoadDirectories(PluginLoader::DefaultSearchPath());
  v1::JobSpec spec;
  LOOM_RETURN_IF_ERROR(ParseJsonMessage(absl::StrCat(R"({"preset": "tiny-cpu", "steps": )", kSteps,
                                                     R"(, "micro_batch": 8, "seq_len": 128,
                   "threads": 1, "eval": {"batches": 1}})"),
                                        "bench", &spec));
  LOOM_ASSIGN_OR_RETURN(v1::JobSpec resolved, ResolveJobSpec(spec));
  LOOM_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(resolved, loader, {}));
  LOOM_ASSIGN_OR_RETURN(TrainSummary summary, trainer->Run());
  double seconds = 0;
  for (int i = kWarmup; i < kSteps; ++i) seconds += summary.steps[i].seconds;
  if (config.rank == 0) {
    std::cout << "RESULT "
              << static_cast<double>((kSteps - kWarmup) * 8 * 128 * config.world_size) / seconds
              << "\n";
  }
  return absl::OkStatus();
}

// Parent: launches `world` copies of this program and returns rank 0's output.
absl::StatusOr<std::string> Launch(const char* self, int world) {
  const int port = 29000 + static_cast<int>(getpid() % 2000);
  int fds[2];
  if (pipe(fds) != 0) return absl::InternalError("pipe failed");
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      if (rank == 0) dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      setenv("LOOM_RANK", std::to_string(rank).c_str(), 1);
      setenv("LOOM_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOOM_MASTER_ADDR", "127.0.0.1", 1);
      setenv("LOOM_MASTER_PORT", std::to_string(port).c_str(), 1);
      execl(self, self, "--rank-child", static_cast<char*>(nullptr));
      _exit(127);
    }
    pids.push_back(pid);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return absl::InternalError("a rank failed");
  }
  return out;
}

absl::Status RunParent(const char* self) {
  std::map<int, double> tps;
  std::vector<std::pair<int64_t, double>> bandwidth;
  for (int world : {1, 2}) {
    LOOM_ASSIGN_OR_RETURN(std::string out, Launch(self, world));
    std::istringstream lines(out);
    std::string tag;
    while (lines >> tag) {
      if (tag == "RESULT") {
        lines >> tps[world];
      } else if (tag == "BW") {
        int64_t bytes;
        double s;
        lines >> bytes >> s;
        bandwidth.emplace_back(bytes, s);
      }
    }
  }
  std::cout << "Data-parallel scaling, tiny-cpu preset, micro-batch 8 x 128 tokens per rank, 1 "
               "thread per rank, "
               "Gloo on loopback:\n\n| ranks | tokens/s | speed-up | efficiency |\n| ---: | ---: | "
               "---: | ---: |\n";
  for (auto [world, t] : tps) {
    std::cout << absl::StrFormat("| %d | %.0f | %.2f | %.0f%% |\n", world, t, t / tps[1],
                                 100 * t / tps[1] / world);
  }
  std::cout << "\nGloo all-reduce (2 ranks, float32, loopback); bus bandwidth = 2(W-1)/W x bytes / "
               "time:\n\n"
               "| message | time | bus bandwidth |\n| ---: | ---: | ---: |\n";
  for (auto [bytes, s] : bandwidth) {
    std::cout << absl::StrFormat(
        "| %s | %.3f ms | %.2f GB/s |\n",
        bytes >= (1 << 20) ? absl::StrCat(bytes >> 20, " MiB") : absl::StrCat(bytes >> 10, " KiB"),
        1e3 * s, static_cast<double>(bytes) / s / 1e9);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::trainer

int main(int argc, char** argv) {
  const bool child = argc > 1 && std::string(argv[1]) == "--rank-child";
  return loom::trainer::BenchmarkMain("loom-bench-dist", argv, [&] {
    return child ? loom::trainer::RunRank() : loom::trainer::RunParent("/proc/self/exe");
  });
}
