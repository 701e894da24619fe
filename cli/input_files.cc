#include "cli/input_files.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "loom/spec.h"

namespace loom::cli {

absl::StatusOr<std::string> ReadJsonOrYamlFile(const std::string& file) {
  std::ifstream in(file);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", file, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  if (absl::EndsWith(file, ".yaml") || absl::EndsWith(file, ".yml")) {
    return YamlToJson(ss.str(), file);
  }
  return ss.str();
}

}  // namespace loom::cli
