// Command-line overrides of a protobuf message, derived from its schema: `loom submit --set`,
// `loom-train train --set` and loom-train's per-field flags all set spec fields through here.
//
// A path names a field the way sweeps do (docs/sweeps.md): dotted field names (`optimizer.lr`,
// `model.n_layers`; snake_case or lowerCamelCase), list elements by index (`eval.lengths[0]`,
// `model.schedule[1].attention.plugin`; the index one past the end appends), map entries and
// the keys of google.protobuf.Struct options by name (`data.task_options.ops`). A leading
// `spec.` is ignored when the message has no `spec` field, so a sweep's grid paths work as is.
//
// The value is parsed by the field's type: integers (32-bit overflow is an error), reals,
// booleans (true | false), strings (as given), enums (name or number). google.protobuf.Value
// fields and Struct keys take JSON when the value parses as JSON, else the string. A message
// field takes a JSON object merged into it: each field the JSON names replaces that field's
// value, the others keep theirs (Struct and Value fields take their JSON as a whole). A list or
// map field without an index or key takes a JSON list or object that replaces it.
//
// Errors are InvalidArgument "LABEL: problem", LABEL being "--set PATH" unless the caller names
// its own (a flag): "--set optimizer.lrr: JobSpec.optimizer has no field 'lrr'".
#ifndef LOOM_API_SPEC_OVERRIDES_H_
#define LOOM_API_SPEC_OVERRIDES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace loom {

// One step of a path: a field, map or Struct key, or (index >= 0) a list element.
struct PathStep {
  std::string key;
  int index = -1;
};

// "a.b[2].c" -> {a}, {b}, {[2]}, {c}. Indices are 0..1000.
absl::StatusOr<std::vector<PathStep>> ParseFieldPath(absl::string_view path);

// Inclusive limits on a numeric value beyond its type's own: integer fields are checked
// against `integer`, double and float fields against `real`.
struct ValueLimits {
  std::optional<std::pair<int64_t, int64_t>> integer;
  std::optional<std::pair<double, double>> real;

  static ValueLimits Integer(int64_t min, int64_t max) { return {std::make_pair(min, max), {}}; }
  static ValueLimits Real(double min, double max) { return {{}, std::make_pair(min, max)}; }
};

// Sets the field at `path` of `message` from `value`. `label` prefixes errors ("" = "--set
// PATH"); `limits` applies when the field is numeric. On error the message is unchanged.
absl::Status SetFieldFromText(google::protobuf::Message* message, absl::string_view path,
                              absl::string_view value, absl::string_view label = "",
                              const ValueLimits& limits = {});

// "PATH=VALUE" (the first '=' splits them), as `--set` takes it.
absl::Status ApplySetFlag(google::protobuf::Message* message, absl::string_view assignment);

// Every assignment in order; the first error stops.
absl::Status ApplySetFlags(google::protobuf::Message* message,
                           const std::vector<std::string>& assignments);

}  // namespace loom

#endif  // LOOM_API_SPEC_OVERRIDES_H_
