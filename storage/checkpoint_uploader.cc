#include "storage/checkpoint_uploader.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"

namespace loom::storage {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kUploadNice = 10;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Failures of the store or the network, which a later try may not meet.
bool Transient(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsAborted(s) ||
         absl::IsResourceExhausted(s) || absl::IsInternal(s);
}

}  // namespace

CheckpointUploader::CheckpointUploader(CheckpointStore* store, Hooks hooks)
    : store_(store), hooks_(std::move(hooks)), thread_([this] { Loop(); }) {}

// Reached after Flush on every normal path (nothing in flight). On an error path an upload may
// still be retrying against a store that is down: it gets its current try, no more, so that a
// failed run's process exits.
CheckpointUploader::~CheckpointUploader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

double CheckpointUploader::Submit(int64_t step, std::string local_dir, uint64_t bytes) {
  return Start(Job{step, std::move(local_dir), bytes, {}, std::nullopt, std::nullopt});
}

double CheckpointUploader::SubmitShard(int64_t step, std::string local_dir, ShardInfo shard,
                                       std::optional<Manifest> commit, uint64_t bytes) {
  return Start(Job{step, std::move(local_dir), bytes, {}, std::move(shard), std::move(commit)});
}

double CheckpointUploader::Start(Job job) {
  const double waited = Wait();
  job.submitted = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
  }
  cv_.notify_all();
  return waited;
}

absl::StatusOr<std::string> CheckpointUploader::TryOnce(const Job& job) {
  if (!job.shard) return store_->Upload(job.local_dir, hooks_.before_commit);
  const std::string file = job.local_dir + "/" + ShardFileName(0, 1);
  if (absl::Status s = store_->UploadShard(job.step, file, *job.shard); !s.ok()) return s;
  if (!job.commit) return std::string();
  auto give_up = [this] {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_;
  };
  return store_->CommitManifest(*job.commit, give_up, hooks_.before_commit);
}

double CheckpointUploader::Wait() {
  const auto start = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !job_.has_value(); });
  return Since(start);
}

std::vector<CheckpointUploader::Finished> CheckpointUploader::TakeFinished() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(finished_, {});
}

std::vector<std::string> CheckpointUploader::TakeNotes() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(notes_, {});
}

void CheckpointUploader::Loop() {
  // Training comes first: this thread (and the part threads it starts, which inherit it) runs
  // at a lower priority than the rank's compute threads when the node's cores are contended.
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), kUploadNice);
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || job_.has_value(); });
      if (!job_.has_value()) return;  // stopping, nothing in flight
      job = *job_;
    }
    Finished done = Upload(job);
    if (done.status.ok() && hooks_.after_upload) hooks_.after_upload();
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_.push_back(std::move(done));
      job_.reset();
    }
    cv_.notify_all();
  }
}

CheckpointUploader::Finished CheckpointUploader::Upload(const Job& job) {
  Finished out;
  out.step = job.step;
  out.bytes = job.bytes;
  const int64_t retried_before = store_->request_retries();
  double backoff = 1;
  for (;;) {
    auto where = TryOnce(job);
    if (where.ok()) {
      out.where = *where;
      break;
    }
    if (!Transient(where.status())) {
      out.status = where.status();
      break;
    }
    ++out.retries;
    std::unique_lock<std::mutex> lock(mu_);
    notes_.push_back(absl::StrCat("checkpoint: upload of step ", job.step, " failed (",
                                  where.status().message(), "); trying again in ", backoff, " s"));
    if (cv_.wait_for(lock, std::chrono::duration<double>(backoff), [this] { return stop_; })) {
      out.status = absl::CancelledError(absl::StrCat(
          "upload of step ", job.step, " abandoned at exit: ", where.status().message()));
      break;
    }
    backoff = std::min(backoff * 2, hooks_.max_backoff_s);
  }
  out.seconds = Since(job.submitted);
  out.request_retries = store_->request_retries() - retried_before;
  return out;
}

}  // namespace loom::storage
