#include "cli/input_files.h"

#include "absl/strings/match.h"
#include "base/read_file.h"
#include "base/status_macros.h"
#include "loom/spec.h"

namespace loom::cli {

absl::StatusOr<std::string> ReadJsonOrYamlFile(const std::string& file) {
  LOOM_ASSIGN_OR_RETURN(std::string text, ReadFile(file, "submitted file"));
  if (absl::EndsWith(file, ".yaml") || absl::EndsWith(file, ".yml")) {
    return YamlToJson(text, file);
  }
  return text;
}

}  // namespace loom::cli
