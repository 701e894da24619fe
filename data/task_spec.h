// A job spec's built-in task checked the way the trainer builds it, without LibTorch: the
// coordinator refuses a bad task at submit (400 naming the field) instead of a worker failing the
// job later. A separate library from loom_data: it needs the job protos (libprotobuf), which
// loom-data must not load beside sentencepiece (data/CMakeLists.txt).
#ifndef LOOM_DATA_TASK_SPEC_H_
#define LOOM_DATA_TASK_SPEC_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "data/tasks.h"
#include "loom/v1/job.pb.h"

namespace loom::data {

// data.task_options as the text map MakeTask takes (strings, numbers and booleans only).
absl::StatusOr<std::map<std::string, std::string>> TaskOptionsText(const v1::DataConfig& d);
// A built-in task's shape against the model that is to learn it ("model.mode: ...").
absl::Status CheckTaskFitsModel(const TaskInfo& info, const v1::ModelConfig& m);
// A data.source task spec's tasks, as the trainer runs them: at seq_len, and at every
// eval.lengths entry (built now, so that a bad length fails before training).
struct SpecTasks {
  std::unique_ptr<Task> task;
  std::vector<std::pair<int64_t, std::unique_ptr<Task>>> at_lengths;
};
// The task, its options and the sequence length (MakeTask), the model's fit, and every
// eval.lengths entry; errors name the field.
absl::StatusOr<SpecTasks> MakeSpecTasks(const v1::JobSpec& spec);
// MakeSpecTasks' checks for data.source task; OK for other sources.
absl::Status CheckTaskSpec(const v1::JobSpec& spec);

}  // namespace loom::data

#endif  // LOOM_DATA_TASK_SPEC_H_
