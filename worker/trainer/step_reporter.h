// The trainer's step reporter: every record the trainer produces (a step, an evaluation, a
// checkpoint, what a resume found) goes out once, here, to its three readers: the metrics
// registry (and its /metrics exporter), the event log (metrics.jsonl, api/loom/v1/events.proto,
// read by the worker agent) and the console (progress lines or a redrawn bar).
#ifndef LOOM_WORKER_TRAINER_STEP_REPORTER_H_
#define LOOM_WORKER_TRAINER_STEP_REPORTER_H_

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "loom/v1/events.pb.h"
#include "loom/v1/job.pb.h"
#include "metrics/prometheus.h"
#include "net/metrics_endpoint.h"
#include "worker/trainer/evaluator.h"

namespace loom::trainer {

struct StepRecord {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0, tokens_per_second = 0, mfu = 0;
  double loss_scale = 0;   // the dynamic loss scale this step ran at; 0 without loss scaling
  double train_flops = 0;  // training FLOPs through this step (3 x forward x tokens_seen)
  bool skipped = false;
  bool overflowed = false;  // skipped because the scaled gradients overflowed (loss scaling)
  double cpu_user_s = 0, cpu_sys_s = 0;  // the process's user and system CPU time in the step
};

// Where an evaluation ran: the fixed held-out batches (split ""), a data.splits split with its
// epoch, or the task at an eval.lengths length.
struct EvalWhere {
  std::string split;
  int64_t epoch = 0, length = 0;
};

class StepReporter {
 public:
  struct Options {
    std::ostream* console = nullptr;  // null: silent (every rank but 0)
    bool progress_bar = false;        // redraw one line (a terminal) instead of printing lines
    bool loss_scaling = false;        // step events carry loss_scale and overflowed
  };
  StepReporter(const v1::JobSpec& spec, int rank, Options options);

  // The /metrics exporter when metrics.port asks for one (rank 0).
  absl::Status StartExporter();
  // Opens metrics.jsonl (rank 0; append when resuming).
  absl::Status OpenEventLog(bool append);

  // A finished optimizer step: gauges, the step event, a console line every metrics.log_every.
  void Step(const StepRecord& r, int64_t tokens_seen, int64_t tokens_per_step);
  void Eval(const EvalResult& r, int64_t step, const EvalWhere& where);
  // A checkpoint committed (on an object store: uploaded, with its upload's times).
  struct UploadTimes {
    double seconds = 0, wait_seconds = 0;
    int64_t retries = 0;  // requests and whole uploads tried again
  };
  void Checkpoint(int64_t step, const std::string& dir, double seconds, uint64_t bytes,
                  const UploadTimes* upload = nullptr);
  void Event(const v1::TrainerEvent& event);  // written as one line of metrics.jsonl
  void Log(const std::string& line);          // a console line (above the bar)
  // The run's first step and its total, for the console's ETA and bar.
  void StartRun(int64_t first_step, int64_t total_steps);
  void EndRun();  // ends the bar's line

  metrics::Registry& registry() { return registry_; }
  const metrics::Labels& labels() const { return labels_; }
  int port() const { return exporter_ ? exporter_->port() : 0; }

 private:
  void Console(const StepRecord& r);

  v1::MetricsConfig metrics_;
  Options options_;
  metrics::Registry registry_{"trainer"};
  metrics::Labels labels_;
  std::unique_ptr<net::MetricsEndpoint> exporter_;
  std::ofstream events_;
  int64_t first_step_ = 0, total_steps_ = 0;
  std::chrono::steady_clock::time_point run_start_;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_STEP_REPORTER_H_
