#include "worker/trainer/step_reporter.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "loom/trainer_events.h"
#include "worker/train_metrics/train_metrics.h"

namespace loom::trainer {
namespace {

using Clock = std::chrono::steady_clock;

int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string Duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds);
  return s >= 3600 ? absl::StrFormat("%d:%02d:%02d", s / 3600, s / 60 % 60, s % 60)
                   : absl::StrFormat("%d:%02d", s / 60, s % 60);
}

}  // namespace

StepReporter::StepReporter(const v1::JobSpec& spec, int rank, Options options)
    : metrics_(spec.metrics()), options_(options) {
  labels_ = {{metrics::kJobLabel, spec.name().empty() ? "standalone" : spec.name()},
             {"rank", std::to_string(rank)}};
  if (const char* worker = std::getenv("LOOM_WORKER_NAME"); worker && *worker) {
    registry_.SetConstantLabels({{"worker", worker}});
  }
  worker::DeclareTrainMetrics(registry_);
  registry_.Set("loom_train_total_steps", static_cast<double>(spec.steps()), labels_);
}

absl::Status StepReporter::StartExporter() {
  if (metrics_.port() == 0) return absl::OkStatus();
  auto exporter =
      net::MetricsEndpoint::Start(&registry_, metrics_.bind(), std::max(0, metrics_.port()));
  if (!exporter.ok()) return exporter.status();
  exporter_ = *std::move(exporter);
  Log(absl::StrCat("metrics: http://", metrics_.bind(), ":", exporter_->port(), "/metrics"));
  return absl::OkStatus();
}

absl::Status StepReporter::OpenEventLog(bool append) {
  if (metrics_.jsonl().empty()) return absl::OkStatus();
  events_.open(metrics_.jsonl(), append ? std::ios::app : std::ios::trunc);
  if (!events_) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics.jsonl: cannot open '", metrics_.jsonl(), "'"));
  }
  return absl::OkStatus();
}

void StepReporter::Step(const StepRecord& r, int64_t tokens_seen, int64_t tokens_per_step) {
  registry_.Set("loom_train_loss", r.loss, labels_);
  registry_.Set("loom_train_learning_rate", r.lr, labels_);
  registry_.Set("loom_train_grad_norm", r.grad_norm, labels_);
  registry_.Set("loom_train_tokens_per_second", r.tokens_per_second, labels_);
  registry_.Set("loom_train_mfu_ratio", r.mfu, labels_);
  registry_.Set("loom_train_step", static_cast<double>(r.step), labels_);
  registry_.Increment("loom_train_tokens_total", static_cast<double>(tokens_per_step), labels_);
  registry_.Observe("loom_train_step_seconds", r.seconds, labels_);
  v1::TrainerEvent e;
  v1::StepEvent& s = *e.mutable_step();
  s.set_step(r.step);
  s.set_loss(r.loss);
  s.set_lr(r.lr);
  s.set_grad_norm(r.grad_norm);
  s.set_step_seconds(r.seconds);
  s.set_tokens_per_second(r.tokens_per_second);
  s.set_mfu(r.mfu);
  s.set_tokens_seen(tokens_seen);
  s.set_train_flops(r.train_flops);
  s.set_skipped(r.skipped);
  if (options_.loss_scaling) {
    s.set_loss_scale(r.loss_scale);
    s.set_overflowed(r.overflowed);
  }
  s.set_time_unix_ms(UnixMillis());
  Event(e);
  Console(r);
}

void StepReporter::Console(const StepRecord& r) {
  const int64_t every = metrics_.log_every(), step = r.step;
  if (options_.console == nullptr ||
      !(step % every == 0 || step == total_steps_ || step == first_step_ + 1)) {
    return;
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - run_start_).count();
  const double eta =
      elapsed / static_cast<double>(step - first_step_) * static_cast<double>(total_steps_ - step);
  std::string line =
      absl::StrFormat("step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s", step,
                      total_steps_, r.loss, r.lr, r.grad_norm, r.tokens_per_second);
  if (r.mfu > 0) line += absl::StrFormat("  mfu %.1f%%", 100 * r.mfu);
  line += "  ETA " + Duration(eta);
  if (!options_.progress_bar) return Log(line);
  const int width = 24, filled = static_cast<int>(width * step / total_steps_);
  *options_.console << "\r\033[K[" << std::string(filled, '#') << std::string(width - filled, '.')
                    << "] " << line << std::flush;
}

void StepReporter::Eval(const EvalResult& r, int64_t step, const EvalWhere& where) {
  // The gauges follow the held-out (validation) evaluations, not test or other lengths.
  if (where.split != "test" && where.length == 0) {
    registry_.Set("loom_train_eval_loss", r.loss, labels_);
    registry_.Set("loom_train_eval_accuracy_ratio", r.accuracy, labels_);
    registry_.Set("loom_train_eval_exact_match_ratio", r.exact_match, labels_);
  }
  v1::TrainerEvent e;
  v1::EvalEvent& ev = *e.mutable_eval();
  ev.set_step(step);
  if (!where.split.empty()) {
    ev.set_split(where.split);
    ev.set_epoch(where.epoch);
  }
  if (where.length > 0) ev.set_length(where.length);
  ev.set_eval_loss(r.loss);
  ev.set_accuracy(r.accuracy);
  ev.set_exact_match(r.exact_match);
  Event(e);
}

void StepReporter::Checkpoint(int64_t step, const std::string& dir, double seconds, uint64_t bytes,
                              const UploadTimes* upload) {
  registry_.Observe("loom_train_checkpoint_write_seconds", seconds, labels_);
  registry_.Increment("loom_train_checkpoint_bytes_total", static_cast<double>(bytes), labels_);
  v1::TrainerEvent e;
  e.mutable_checkpoint()->set_step(step);
  e.mutable_checkpoint()->set_dir(dir);
  e.mutable_checkpoint()->set_seconds(seconds);
  e.mutable_checkpoint()->set_bytes(bytes);
  if (upload != nullptr) {
    registry_.Observe("loom_train_checkpoint_upload_seconds", upload->seconds, labels_);
    registry_.Observe("loom_train_checkpoint_upload_wait_seconds", upload->wait_seconds, labels_);
    registry_.Increment("loom_train_checkpoint_upload_retries_total",
                        static_cast<double>(upload->retries), labels_);
    e.mutable_checkpoint()->set_upload_seconds(upload->seconds);
    e.mutable_checkpoint()->set_upload_wait_seconds(upload->wait_seconds);
    e.mutable_checkpoint()->set_upload_retries(upload->retries);
  }
  Event(e);
}

void StepReporter::Event(const v1::TrainerEvent& event) {
  if (events_.is_open()) events_ << TrainerEventLine(event) << "\n" << std::flush;
}

void StepReporter::Log(const std::string& line) {
  if (options_.console == nullptr) return;
  if (options_.progress_bar) *options_.console << "\r\033[K";
  *options_.console << line << "\n" << std::flush;
}

void StepReporter::StartRun(int64_t first_step, int64_t total_steps) {
  first_step_ = first_step;
  total_steps_ = total_steps;
  run_start_ = Clock::now();
}

void StepReporter::EndRun() {
  if (options_.progress_bar && options_.console != nullptr) *options_.console << "\n";
}

}  // namespace loom::trainer
