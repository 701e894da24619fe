// The coordinator's identifiers: job, worker and sweep ids, and checkpoint ids built from them.
#ifndef LOOM_COORDINATOR_IDS_H_
#define LOOM_COORDINATOR_IDS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace loom::coordinator {

// 1..64 characters of [a-z0-9-]: one path segment and one URL segment.
bool IsValidId(const std::string& id);

// Checkpoint ids are "<job id>.<step>" (job-000001.150): one path segment, so a URL can hold
// one. The older "<job id>/<step>" is still accepted wherever an id is given (init_from) and
// state written with it is migrated when the coordinator opens it.
std::string CheckpointId(const std::string& job_id, int64_t step);
// The canonical form of either spelling; InvalidArgument (naming `field`) otherwise.
absl::StatusOr<std::string> CanonicalCheckpointId(const std::string& id, const std::string& field);
// The job a checkpoint id (either spelling) belongs to.
std::string ParentJob(const std::string& checkpoint_id);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_IDS_H_
