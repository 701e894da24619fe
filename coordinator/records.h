// Small questions about stored records that several of the coordinator's files ask: who may
// change a job or sweep, which labels it has, where a job runs, and request idempotency keys.
#ifndef LOOM_COORDINATOR_RECORDS_H_
#define LOOM_COORDINATOR_RECORDS_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "loom/v1/control.pb.h"

namespace loom::coordinator {

// Who asks for a change: a user may change their own jobs and sweeps, an admin anyone's.
struct Caller {
  std::string user;
  bool admin = false;
};

// Idempotency keys are scoped per user: the same request_id from two users names two requests,
// and one user's key never reveals or returns another's job.
std::string IdempotencyKey(absl::string_view kind, const std::string& user,
                           const std::string& request_id);
// A retry under an idempotency key already used for `earlier`: refused unless it repeats the
// stored request exactly (`stored` null: nothing is left to compare). `what`: "request", "sweep".
absl::Status CheckRetry(const google::protobuf::Message* stored,
                        const google::protobuf::Message& retry, const std::string& earlier,
                        absl::string_view what);
// The job's placement on the worker, or null.
const v1::Placement* PlacementOf(const v1::Job& job, const std::string& worker_id);
bool Contains(const google::protobuf::RepeatedPtrField<std::string>& list, const std::string& s);
// Every label of the selector, with its value.
bool HasLabels(const google::protobuf::Map<std::string, std::string>& labels,
               const std::map<std::string, std::string>& want);
// Owners change their own jobs and sweeps; admins anyone's. A record without an owner (stored
// before owners were kept) is an admin's to change.
absl::Status MayChange(const Caller& caller, absl::string_view what, const std::string& id,
                       const std::string& owner);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_RECORDS_H_
