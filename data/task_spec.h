// A job spec's built-in task checked the way the trainer builds it, without LibTorch: the
// coordinator refuses a bad task at submit (400 naming the field) instead of a worker failing the
// job later. A separate library from loom_data: it needs the job protos (libprotobuf), which
// loom-data must not load beside sentencepiece (data/CMakeLists.txt).
#ifndef LOOM_DATA_TASK_SPEC_H_
#define LOOM_DATA_TASK_SPEC_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "data/tasks.h"
#include "loom/v1/job.pb.h"

namespace loom::data {

// data.task_options as the text map MakeTask takes (strings, numbers and booleans only).
absl::StatusOr<std::map<std::string, std::string>> TaskOptionsText(const v1::DataConfig& d);
// A built-in task's shape against the model that is to learn it ("model.mode: ...").
absl::Status CheckTaskFitsModel(const TaskInfo& info, const v1::ModelConfig& m);
// For data.source task: the task, its options and the sequence length (MakeTask), the model's
// fit, and every eval.lengths entry; OK for other sources.
absl::Status CheckTaskSpec(const v1::JobSpec& spec);

}  // namespace loom::data

#endif  // LOOM_DATA_TASK_SPEC_H_
