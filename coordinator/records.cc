#include "coordinator/records.h"

#include <google/protobuf/util/message_differencer.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace loom::coordinator {

std::string IdempotencyKey(absl::string_view kind, const std::string& user,
                           const std::string& request_id) {
  return absl::StrCat(kind, user, "\x1f", request_id);
}

absl::Status CheckRetry(const google::protobuf::Message* stored,
                        const google::protobuf::Message& retry, const std::string& earlier,
                        absl::string_view what) {
  if (stored == nullptr || google::protobuf::util::MessageDifferencer::Equals(*stored, retry)) {
    return absl::OkStatus();
  }
  return absl::AlreadyExistsError(absl::StrCat("request_id: already used for ", earlier,
                                               " with a different ", what,
                                               " (a retry must repeat the request exactly)"));
}

const v1::Placement* PlacementOf(const v1::Job& job, const std::string& worker_id) {
  for (const auto& p : job.placement()) {
    if (p.worker_id() == worker_id) return &p;
  }
  return nullptr;
}

bool Contains(const google::protobuf::RepeatedPtrField<std::string>& list, const std::string& s) {
  return std::find(list.begin(), list.end(), s) != list.end();
}

bool HasLabels(const google::protobuf::Map<std::string, std::string>& labels,
               const std::map<std::string, std::string>& want) {
  for (const auto& [k, v] : want) {
    auto it = labels.find(k);
    if (it == labels.end() || it->second != v) return false;
  }
  return true;
}

absl::Status MayChange(const Caller& caller, absl::string_view what, const std::string& id,
                       const std::string& owner) {
  if (caller.admin || (!owner.empty() && owner == caller.user)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(what, " ", id, " belongs to ",
                                                  owner.empty() ? "nobody on record" : owner,
                                                  ": only its owner or an admin may change it"));
}

}  // namespace loom::coordinator
