// A whole file as a string, or an error that names what it was for (a flag, a field).
#ifndef LOOM_BASE_READ_FILE_H_
#define LOOM_BASE_READ_FILE_H_

#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace loom {

// Fails with "<what>: cannot read '<path>'" when the file cannot be read or is empty.
inline absl::StatusOr<std::string> ReadNonEmptyFile(const std::string& path,
                                                    absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in || text.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read '", path, "'"));
  }
  return text.str();
}

}  // namespace loom

#endif  // LOOM_BASE_READ_FILE_H_
