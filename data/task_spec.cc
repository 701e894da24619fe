#include "data/task_spec.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "loom/spec.h"

namespace loom::data {

absl::Status CheckTaskFitsModel(const data::TaskInfo& info, const v1::ModelConfig& m) {
  if (info.encoder != (m.mode() == "encoder")) {
    return absl::InvalidArgumentError(absl::StrCat("model.mode: task ", info.name, " needs ",
                                                   info.encoder ? "an encoder" : "a decoder"));
  }
  if (info.encoder && m.num_classes() != info.num_classes) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.num_classes: task ", info.name, " needs ", info.num_classes));
  }
  if (info.grid > 0 && (m.grid_max_rows() < info.grid || m.grid_max_cols() < info.grid)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.grid_max_rows: task ", info.name, " needs grid positions of at least ", info.grid));
  }
  if (m.vocab_size() < info.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.vocab_size: task ", info.name, " needs ", info.vocab_size));
  }
  if (info.max_len > m.max_seq_len()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.max_seq_len: task ", info.name, " needs ", info.max_len));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, std::string>> TaskOptionsText(const v1::DataConfig& d) {
  LOOM_ASSIGN_OR_RETURN(auto options, OptionsAsText(d.task_options(), "data.task_options"));
  return std::map<std::string, std::string>(options.begin(), options.end());
}

absl::StatusOr<SpecTasks> MakeSpecTasks(const v1::JobSpec& spec) {
  const v1::DataConfig& d = spec.data();
  LOOM_ASSIGN_OR_RETURN(const auto text, TaskOptionsText(d));
  SpecTasks out;
  LOOM_ASSIGN_OR_RETURN(out.task, MakeTask(d.task(), text, spec.seq_len()));
  LOOM_RETURN_IF_ERROR(CheckTaskFitsModel(out.task->info(), spec.model()));
  for (int64_t length : spec.eval().lengths()) {
    auto at = MakeTask(d.task(), text, length);
    if (!at.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("eval.lengths: ", length, ": ", at.status().message()));
    }
    out.at_lengths.emplace_back(length, std::move(*at));
  }
  return out;
}

absl::Status CheckTaskSpec(const v1::JobSpec& spec) {
  if (spec.data().source() != "task") return absl::OkStatus();
  return MakeSpecTasks(spec).status();
}

}  // namespace loom::data
