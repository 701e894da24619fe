#include "coordinator/submit_validation.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "data/task_spec.h"
#include "loom/spec.h"
#include "storage/checkpoint_store.h"

namespace fs = std::filesystem;

namespace loom::coordinator {
namespace {

absl::Status CheckRequestId(const std::string& request_id) {
  if (!request_id.empty() && !IsToken(request_id, 128)) {
    return FieldError("request_id", "1..128 characters of [A-Za-z0-9._:/-]");
  }
  return absl::OkStatus();
}

// Checkpoints are what restarts resume from: always the job's own directory.
absl::Status CheckCheckpointDirUnset(const v1::JobSpec& spec) {
  if (!spec.checkpoint().dir().empty()) {
    return FieldError("spec.checkpoint.dir",
                      "is chosen by the coordinator (<storage root>/jobs/<id>/checkpoints); "
                      "leave it empty");
  }
  return absl::OkStatus();
}

// A client path field made absolute inside the root, when it is set (an unset one stays unset).
absl::Status ResolveInsideRoot(const std::string& root, const std::string& field,
                               const std::string& value,
                               const std::function<void(std::string)>& set) {
  if (value.empty()) return absl::OkStatus();
  if (storage::IsRemoteLocation(value)) {  // a dataset in the object store, read by the ranks
    if (field != "spec.data.path")
      return FieldError(field, "must be a path under the storage root");
    if (absl::Status s = storage::CheckRemoteLocation(value); !s.ok()) {
      return FieldError(field, std::string(s.message()));
    }
    return absl::OkStatus();
  }
  LOOM_ASSIGN_OR_RETURN(std::string path, InsideStorageRoot(root, field, value));
  set(std::move(path));
  return absl::OkStatus();
}

bool LabelChar(char c, bool upper_ok) {
  return std::islower(static_cast<unsigned char>(c)) ||
         std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
         (upper_ok && std::isupper(static_cast<unsigned char>(c)));
}

}  // namespace

absl::Status CheckLabels(const std::string& field,
                         const google::protobuf::Map<std::string, std::string>& labels) {
  if (labels.size() > 16) return FieldError(field, "at most 16 labels");
  for (const auto& [k, v] : labels) {
    const bool key_ok = !k.empty() && k.size() <= 63 &&
                        std::isalnum(static_cast<unsigned char>(k.front())) &&
                        std::isalnum(static_cast<unsigned char>(k.back())) &&
                        std::all_of(k.begin(), k.end(), [](char c) { return LabelChar(c, false); });
    if (!key_ok)
      return FieldError(field, absl::StrCat("'", k.substr(0, 80),
                                            "' is not a label name (1-63 of [a-z0-9._-], "
                                            "alphanumeric at both ends)"));
    if (v.size() > 63 ||
        !std::all_of(v.begin(), v.end(), [](char c) { return LabelChar(c, true); }))
      return FieldError(absl::StrCat(field, ".", k), "a label value is 0-63 of [A-Za-z0-9._-]");
  }
  return absl::OkStatus();
}

absl::Status CheckDescription(const std::string& field, const std::string& text) {
  if (text.size() > 1024) return FieldError(field, "at most 1024 bytes");
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, std::string>> ParseLabelSelector(const std::string& text) {
  std::map<std::string, std::string> want;
  if (text.empty()) return want;
  google::protobuf::Map<std::string, std::string> check;
  for (absl::string_view pair : absl::StrSplit(text, ',')) {
    const size_t eq = pair.find('=');
    if (eq == absl::string_view::npos)
      return FieldError("label", "expected k=v pairs separated by commas");
    const std::string key(pair.substr(0, eq)), value(pair.substr(eq + 1));
    want[key] = value;
    check[key] = value;
  }
  LOOM_RETURN_IF_ERROR(CheckLabels("label", check));
  return want;
}

absl::Status FieldError(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

bool IsToken(const std::string& s, size_t max_len) {
  if (s.empty() || s.size() > max_len) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == '/' || c == ':')) {
      return false;
    }
  }
  return true;
}

int WorldSizeOf(const v1::SubmitJobRequest& request) {
  return request.world_size() == 0 ? 1 : request.world_size();
}

int MaxRestartsOf(const v1::SubmitJobRequest& request) {
  return request.has_max_restarts() ? request.max_restarts() : 3;
}

absl::Status CheckSubmitRequest(const v1::SubmitJobRequest& request) {
  if (!request.has_spec()) return FieldError("spec", "is required");
  const int world_size = WorldSizeOf(request);
  if (world_size < 1 || world_size > 1024) return FieldError("world_size", "must be in 1..1024");
  if (request.priority() < -1000 || request.priority() > 1000) {
    return FieldError("priority", "must be in -1000..1000");
  }
  const int max_restarts = MaxRestartsOf(request);
  if (max_restarts < 0 || max_restarts > 100)
    return FieldError("max_restarts", "must be in 0..100");
  if (request.pool_size() > 16) return FieldError("pool", "at most 16 labels");
  for (const auto& [k, v] : request.pool()) {
    if (!IsToken(k, 63))
      return FieldError("pool", absl::StrCat("bad label name '", k.substr(0, 80), "'"));
    if (!IsToken(v, 63)) return FieldError(absl::StrCat("pool.", k), "bad label value");
  }
  LOOM_RETURN_IF_ERROR(CheckRequestId(request.request_id()));
  LOOM_RETURN_IF_ERROR(CheckLabels("labels", request.labels()));
  LOOM_RETURN_IF_ERROR(CheckDescription("description", request.description()));
  LOOM_RETURN_IF_ERROR(CheckServeRequest(request));
  return CheckCheckpointDirUnset(request.spec());
}

// A serve job runs one loom-serve of its init_from checkpoint, with that checkpoint's model.
absl::Status CheckServeRequest(const v1::SubmitJobRequest& request) {
  if (request.spec().kind() != "serve") return absl::OkStatus();
  if (request.init_from().empty())
    return FieldError("init_from", "is required for kind serve: the checkpoint to serve");
  if (WorldSizeOf(request) != 1)
    return FieldError("world_size", "a serve job is one server: leave it at 1");
  if (request.spec().has_model() || !request.spec().preset().empty()) {
    return FieldError("spec.model",
                      "a serve job serves its init_from checkpoint's model: leave model and "
                      "preset out");
  }
  return absl::OkStatus();
}

bool TakesModelFromCheckpoint(const v1::SubmitJobRequest& request) {
  const std::string& kind = request.spec().kind();
  return (kind == "eval" || kind == "serve") && !request.spec().has_model() &&
         !request.init_from().empty();
}

absl::StatusOr<v1::JobSpec> ResolveSubmittedSpec(const v1::SubmitJobRequest& request,
                                                 const std::string& model_checkpoint_dir) {
  // The job's id is not known yet; ResolveJobPaths fills its checkpoint directory in.
  v1::JobSpec unresolved = request.spec();
  unresolved.mutable_checkpoint()->set_dir("jobs/pending/checkpoints");
  if (TakesModelFromCheckpoint(request) && !model_checkpoint_dir.empty()) {
    auto text = storage::ReadManifestText(model_checkpoint_dir);
    if (text.ok()) {
      if (absl::Status s = FillModelFromManifest(&unresolved, *text, "init_from manifest");
          !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("spec.", s.message()));
      }
    }
  }
  auto resolved = ResolveJobSpec(unresolved);
  if (!resolved.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec.", resolved.status().message()));
  }
  // A built-in task is checked as the trainer will build it, so a bad one is a 400 now rather
  // than a job that fails on a worker.
  if (absl::Status task = data::CheckTaskSpec(*resolved); !task.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("spec.", task.message()));
  }
  v1::JobSpec spec = *std::move(resolved);
  spec.mutable_checkpoint()->clear_dir();
  return spec;
}

absl::Status CheckSweepRequest(const v1::SweepSpec& spec) {
  if (spec.name().size() > 128) return FieldError("name", "at most 128 characters");
  LOOM_RETURN_IF_ERROR(CheckRequestId(spec.request_id()));
  LOOM_RETURN_IF_ERROR(CheckLabels("labels", spec.labels()));
  LOOM_RETURN_IF_ERROR(CheckDescription("description", spec.description()));
  if (spec.max_concurrent() < 0) return FieldError("max_concurrent", "must be >= 0 (0: no limit)");
  if (!spec.base().request_id().empty()) {
    return FieldError("base.request_id", "set request_id on the sweep, not its base job");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> InsideStorageRoot(const std::string& storage_root,
                                              const std::string& field, const std::string& value) {
  const fs::path root(storage_root);
  if (value.find('\0') != std::string::npos) return FieldError(field, "contains a NUL byte");
  fs::path p(value);
  for (const auto& part : p) {
    if (part == "..") return FieldError(field, absl::StrCat("'", value, "' must not contain '..'"));
  }
  const fs::path full = p.is_absolute() ? p.lexically_normal() : (root / p).lexically_normal();
  const std::string r = root.string();
  auto inside = [&](const fs::path& f) {
    return f.string() == r || absl::StartsWith(f.string(), r + "/");
  };
  if (!inside(full))
    return FieldError(field, absl::StrCat("'", value, "' is outside the storage root ", r));
  // Each symlink on the path must resolve, and inside the root. A dangling one is refused too: it
  // may name a file that exists only where the ranks run (a worker's credential). The ranks
  // open the files confined to the root as well (storage/confined_files.h): this is the early,
  // clear error; that is the guarantee against links made later.
  fs::path prefix = root;
  for (const auto& part : full.lexically_relative(root)) {
    if (part == ".") continue;
    prefix /= part;
    std::error_code ec;
    const fs::file_status st = fs::symlink_status(prefix, ec);
    if (ec || st.type() == fs::file_type::not_found) break;  // the rest does not exist yet
    if (st.type() != fs::file_type::symlink) continue;
    const fs::path target = fs::canonical(prefix, ec);
    if (ec)
      return FieldError(field, absl::StrCat("'", value, "': ", prefix.string(),
                                            " is a symlink that resolves to nothing"));
    if (!inside(target))
      return FieldError(field, absl::StrCat("'", value, "' is outside the storage root ", r,
                                            " (through the symlink ", prefix.string(), ")"));
  }
  return full.string();
}

void ApplyCheckpointIntervalDefault(v1::JobSpec& spec, int64_t seconds) {
  if (spec.checkpoint().interval_seconds() == 0) {
    spec.mutable_checkpoint()->set_interval_seconds(seconds);
  }
}

absl::Status ResolveJobPaths(v1::JobSpec& spec, const std::string& storage_root,
                             const std::string& job_id) {
  LOOM_RETURN_IF_ERROR(CheckCheckpointDirUnset(spec));
  spec.mutable_checkpoint()->set_dir(
      (fs::path(storage_root) / "jobs" / job_id / "checkpoints").string());
  LOOM_RETURN_IF_ERROR(ResolveInsideRoot(storage_root, "spec.data.path", spec.data().path(),
                                         [&](std::string p) { spec.mutable_data()->set_path(p); }));
  LOOM_RETURN_IF_ERROR(
      ResolveInsideRoot(storage_root, "spec.data.tokenizer_path", spec.data().tokenizer_path(),
                        [&](std::string p) { spec.mutable_data()->set_tokenizer_path(p); }));
  LOOM_RETURN_IF_ERROR(
      ResolveInsideRoot(storage_root, "spec.reasoning_eval.path", spec.reasoning_eval().path(),
                        [&](std::string p) { spec.mutable_reasoning_eval()->set_path(p); }));
  if (!spec.metrics().jsonl().empty()) {
    return FieldError("spec.metrics.jsonl",
                      "is set by the worker agent for service jobs; leave it empty");
  }
  if (spec.metrics().port() > 0) {
    return FieldError(
        "spec.metrics.port",
        "a fixed port would collide between ranks; use -1 (any free port) or 0 (off)");
  }
  return absl::OkStatus();
}

absl::Status CheckPrintable(const v1::Job& job) {
  google::protobuf::util::JsonPrintOptions print;
  print.preserve_proto_field_names = true;
  print.always_print_primitive_fields = true;
  std::string json;
  auto s = google::protobuf::util::MessageToJsonString(job, &json, print);
  v1::Job back;
  if (s.ok()) s = google::protobuf::util::JsonStringToMessage(json, &back);
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec: cannot be stored (it would not print as JSON: ", s.ToString(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace loom::coordinator
