// kind: serve jobs (docs/serve.md, "Serving on the pool"): where the proxy sends a request.
// What the agents report of the servers is applied in coordinator_reports.cc.
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "coordinator/coordinator.h"
#include "coordinator/states.h"

namespace loom::coordinator {

absl::StatusOr<Coordinator::ServeTarget> Coordinator::ServeTargetOf(const std::string& id,
                                                                    const std::string& scope) {
  std::lock_guard<std::mutex> lock(mutex_);
  LOOM_ASSIGN_OR_RETURN(const v1::Job* job, FindJobLocked(id));
  if (!scope.empty() && job->submitted_by() != scope) {
    return absl::PermissionDeniedError(absl::StrCat("job ", id, " belongs to ", job->submitted_by(),
                                                    ": with --private-jobs only its owner or an "
                                                    "admin may use its server"));
  }
  if (job->spec().kind() != "serve") {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is a ", job->spec().kind(), " job, not a serve job"));
  }
  if (IsTerminal(*job)) {
    serve_targets_.erase(id);
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is ", job->state(), ": it serves no more"));
  }
  auto it = serve_targets_.find(id);
  if (JobStateOf(*job) != JobState::kRunning || !job->serve().ready() ||
      job->serve().attempt() != job->attempt() || it == serve_targets_.end() ||
      it->second.attempt != job->attempt()) {
    return absl::UnavailableError(absl::StrCat("job ", id, " is not serving yet (", job->state(),
                                               job->reason().empty() ? "" : ": ", job->reason(),
                                               "); retry"));
  }
  return it->second;
}

}  // namespace loom::coordinator
