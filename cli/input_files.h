// How `loom` reads the files it submits (job and sweep files): JSON, or YAML by the name's
// extension.
#ifndef LOOM_CLI_INPUT_FILES_H_
#define LOOM_CLI_INPUT_FILES_H_

#include <string>

#include "absl/status/statusor.h"

namespace loom::cli {

// The file's text as JSON: YAML (a name ending in .yaml or .yml) converted by YamlToJson
// (loom/spec.h), anything else as it is. NotFound when it cannot be opened (base/read_file.h).
absl::StatusOr<std::string> ReadJsonOrYamlFile(const std::string& file);

}  // namespace loom::cli

#endif  // LOOM_CLI_INPUT_FILES_H_
