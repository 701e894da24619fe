// loom-bench-memory: peak memory of one training step (forward, loss, backward) against sequence
// length, measured — not estimated — for global MHA, global IHA and the paper's hybrid stack,
// with and without activation checkpointing. Each (model, length, checkpointing) runs in a
// fresh child process: the model is built, the kernel's peak-RSS counter is reset
// (/proc/self/clear_refs), one step runs, and VmHWM − RSS before the step is the step's peak.
// A variant stops growing once a step takes longer than --max-seconds; --only NAME runs the
// variants whose name contains NAME. Prints Markdown.
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/cli_args.h"
#include "base/status_macros.h"
#include "loom/spec.h"
#include "worker/trainer/bench_main.h"
#include "worker/trainer/model.h"

namespace loom::trainer {
namespace {

int64_t StatusKib(const char* field) {  // a "Vm...:  N kB" line of /proc/self/status
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::string(field).size()));
  }
  return -1;
}

struct Variant {
  std::string name, schedule;
};

struct Measurement {
  double peak_mib = -1, seconds = 0;
};

// In the child: build the model, reset the peak, run one step; "peak_mib seconds" on `out`.
absl::Status MeasureInChild(const Variant& v, int64_t length, const std::string& checkpointing,
                            int64_t d_model, int64_t layers, int64_t threads, FILE* out) {
  torch::set_num_threads(static_cast<int>(threads));
  PluginLoader loader;
  LOOM_RETURN_IF_ERROR(LoadPluginDirectories("", loader, false));
  v1::ModelConfig c;
  LOOM_RETURN_IF_ERROR(ParseJsonMessage(
      absl::StrFormat(R"({"d_model": %d, "n_layers": %d, "n_heads": 8, "vocab_size": 256,
                          "max_seq_len": %d, "rope_theta": 10000, "tie_embeddings": true,
                          "activation_checkpointing": "%s", %s})",
                      d_model, layers, length, checkpointing, v.schedule),
      v.name, &c));
  LOOM_ASSIGN_OR_RETURN(auto model, Transformer::Create(c, loader));
  torch::Tensor tokens = torch::randint(0, 256, {1, length}, torch::kInt64);
  std::ofstream("/proc/self/clear_refs") << "5";  // VmHWM := VmRSS
  const int64_t before = StatusKib("VmRSS:");
  const auto start = std::chrono::steady_clock::now();
  torch::Tensor logits = model->forward(ModelInputs{tokens, {}, {}, {}, {}});
  torch::Tensor loss = torch::nn::functional::cross_entropy(logits.view({length, 256}),
                                                            torch::roll(tokens, -1, 1).view({-1}));
  logits = torch::Tensor();
  loss.backward();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(out, "%.1f %.3f\n", (StatusKib("VmHWM:") - before) / 1024.0, seconds);
  return absl::OkStatus();
}

Measurement Measure(const Variant& v, int64_t length, const std::string& checkpointing,
                    int64_t d_model, int64_t layers, int64_t threads) {
  int fds[2];
  if (::pipe(fds) != 0) return {};
  const pid_t pid = ::fork();
  if (pid == 0) {  // the parent never ran LibTorch, so the child may (OpenMP after fork)
    ::close(fds[0]);
    FILE* out = ::fdopen(fds[1], "w");
    const absl::Status s = MeasureInChild(v, length, checkpointing, d_model, layers, threads, out);
    if (!s.ok()) std::cerr << v.name << " @" << length << ": " << s.message() << "\n";
    std::fclose(out);
    ::_exit(s.ok() ? 0 : 1);
  }
  ::close(fds[1]);
  FILE* in = ::fdopen(fds[0], "r");
  Measurement m;
  if (std::fscanf(in, "%lf %lf", &m.peak_mib, &m.seconds) != 2) m.peak_mib = -1;
  std::fclose(in);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return m;
}

absl::Status Run(int argc, char** argv) {
  LOOM_ASSIGN_OR_RETURN(CliArgs args, CliArgs::Parse(argc, argv, 1,
                                                     {"lengths", "threads", "d-model", "layers",
                                                      "max-seconds", "only"}));
  LOOM_ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", 2, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t d_model, args.GetInt("d-model", 256, 8, 8192));
  LOOM_ASSIGN_OR_RETURN(int64_t layers, args.GetInt("layers", 5, 1, 64));
  LOOM_ASSIGN_OR_RETURN(double max_seconds, args.GetDouble("max-seconds", 120, 1, 1e6));
  LOOM_ASSIGN_OR_RETURN(std::vector<int64_t> lengths,
                        args.GetIntList("lengths", "1024,2048,4096,8192,16384", 2, 1 << 20));
  const std::vector<Variant> variants = {
      {"global MHA", R"("schedule": [{"repeat": 1, "attention": {"plugin": "mha"}}])"},
      {"global IHA P=2",
       R"("schedule": [{"repeat": 1, "attention": {"plugin": "iha", "options": {"p": "2"}}}])"},
      {"hybrid 4 local IHA : 1 global MHA",
       R"("hybrid": {"local_per_global": 4, "iha_options": {"p": 2}})"}};
  std::cout << absl::StrFormat(
      "d_model %d, 8 heads, %d layers, vocab 256, batch 1, fp32; one step (forward, loss, "
      "backward, no optimizer); %d LibTorch threads; peak RSS of the step in MiB (seconds)\n\n",
      d_model, layers, threads);
  std::string head = "| model | checkpointing |", rule = "|---|---|";
  for (int64_t l : lengths) {
    absl::StrAppend(&head, " ", l, " |");
    absl::StrAppend(&rule, "---|");
  }
  std::cout << head << "\n" << rule << std::endl;
  for (const Variant& v : variants) {
    if (v.name.find(args.Get("only")) == std::string::npos) continue;  // --only: a substring
    for (const std::string mode : {"none", "selective", "full"}) {
      std::string row = absl::StrCat("| ", v.name, " | ", mode, " |");
      bool stop = false;
      for (int64_t l : lengths) {
        if (stop) {
          absl::StrAppend(&row, " — |");
          continue;
        }
        const Measurement m = Measure(v, l, mode, d_model, layers, threads);
        absl::StrAppend(&row, m.peak_mib < 0
                                  ? std::string(" failed |")
                                  : absl::StrFormat(" %.0f (%.0f s) |", m.peak_mib, m.seconds));
        stop = m.peak_mib < 0 || m.seconds > max_seconds;
      }
      std::cout << row << std::endl;
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::trainer

int main(int argc, char** argv) {
  return loom::trainer::BenchmarkMain("loom-bench-memory", argv,
                                      [&] { return loom::trainer::Run(argc, argv); });
}
