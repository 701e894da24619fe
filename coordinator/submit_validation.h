// What clients submit (POST /v1/jobs, POST /v1/sweeps), checked before anything is stored: every
// refusal is InvalidArgument and names the field at fault. And where a job's files go: its
// checkpoints in its own directory, every client path inside the storage root (symlinks
// resolved). Nothing here reads the coordinator's state; the catalogue checks (init_from) stay
// in coordinator.cc, under its lock.
#ifndef LOOM_COORDINATOR_SUBMIT_VALIDATION_H_
#define LOOM_COORDINATOR_SUBMIT_VALIDATION_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "loom/v1/control.pb.h"

namespace loom::coordinator {

// InvalidArgument "<field>: <message>".
absl::Status FieldError(const std::string& field, const std::string& message);
// Labels, pool selectors and idempotency keys: short printable tokens.
bool IsToken(const std::string& s, size_t max_len);

// Labels of a job or sweep (SubmitJobRequest.labels), and a description; errors name `field`.
absl::Status CheckLabels(const std::string& field,
                         const google::protobuf::Map<std::string, std::string>& labels);
absl::Status CheckDescription(const std::string& field, const std::string& text);
// A label selector "k=v,k2=v2" (GET /v1/jobs?label=...): every pair must match.
absl::StatusOr<std::map<std::string, std::string>> ParseLabelSelector(const std::string& text);

// The request's own fields (sizes, ranges, tokens), before its spec is resolved.
absl::Status CheckSubmitRequest(const v1::SubmitJobRequest& request);
// kind serve: init_from is required, world_size is 1, the model is the checkpoint's.
absl::Status CheckServeRequest(const v1::SubmitJobRequest& request);
// The request's world size and restart budget, with their defaults filled in.
int WorldSizeOf(const v1::SubmitJobRequest& request);
int MaxRestartsOf(const v1::SubmitJobRequest& request);
// An eval job that leaves the model out takes it from its init_from checkpoint's manifest.
bool TakesModelFromCheckpoint(const v1::SubmitJobRequest& request);
// The spec resolved (presets, defaults, validation; ResolveJobSpec), its checkpoint directory
// still empty. `model_checkpoint_dir`: where init_from is on disk when TakesModelFromCheckpoint,
// else "".
absl::StatusOr<v1::JobSpec> ResolveSubmittedSpec(const v1::SubmitJobRequest& request,
                                                 const std::string& model_checkpoint_dir);

// The sweep's own fields (name, request_id), before its cells are expanded.
absl::Status CheckSweepRequest(const v1::SweepSpec& spec);

// `value` (relative to the root, or absolute) as an absolute path inside `storage_root`.
absl::StatusOr<std::string> InsideStorageRoot(const std::string& storage_root,
                                              const std::string& field, const std::string& value);
// The job's checkpoint directory (<storage root>/jobs/<id>/checkpoints) and its client paths
// made absolute inside the root; refuses fields the coordinator or the agent owns.
absl::Status ResolveJobPaths(v1::JobSpec& spec, const std::string& storage_root,
                             const std::string& job_id);
// checkpoint.interval_seconds 0 (unset) becomes `seconds`; -1 (never by time) and a value stay.
void ApplyCheckpointIntervalDefault(v1::JobSpec& spec, int64_t seconds);

// A stored job must print and parse back as JSON: agents and every GET depend on it.
absl::Status CheckPrintable(const v1::Job& job);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_SUBMIT_VALIDATION_H_
