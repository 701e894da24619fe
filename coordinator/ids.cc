#include "coordinator/ids.h"

#include <cctype>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/submit_validation.h"

namespace loom::coordinator {

bool IsValidId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!(std::islower(static_cast<unsigned char>(c)) ||
          std::isdigit(static_cast<unsigned char>(c)) || c == '-')) {
      return false;
    }
  }
  return true;
}

std::string CheckpointId(const std::string& job_id, int64_t step) {
  return absl::StrCat(job_id, ".", step);
}

absl::StatusOr<std::string> CanonicalCheckpointId(const std::string& id, const std::string& field) {
  const size_t sep = id.find_first_of("./");
  int64_t step = -1;
  if (sep == std::string::npos || !IsValidId(id.substr(0, sep)) ||
      id.find_first_of("./", sep + 1) != std::string::npos ||
      !absl::SimpleAtoi(id.substr(sep + 1), &step) || step < 0 ||
      id.substr(sep + 1) != std::to_string(step)) {
    return FieldError(field, absl::StrCat("'", id.substr(0, 100),
                                          "' is not a checkpoint id (<job id>.<step>, e.g. "
                                          "job-000001.150)"));
  }
  return CheckpointId(id.substr(0, sep), step);
}

std::string ParentJob(const std::string& checkpoint_id) {
  return checkpoint_id.substr(0, checkpoint_id.find_first_of("./"));
}

}  // namespace loom::coordinator
