// A whole file as a string, or an error that names the file and what it was for (a flag, a
// field): the one way Loom reads a file whole (outside the confined reads of job input,
// storage/confined_files.h).
#ifndef LOOM_BASE_READ_FILE_H_
#define LOOM_BASE_READ_FILE_H_

#include <fstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace loom {

// NotFound "<what>: cannot open '<path>'" when the file cannot be opened, DataLoss
// "<what>: cannot read '<path>'" when reading fails (a directory, an I/O error).
[[nodiscard]] inline absl::StatusOr<std::string> ReadFile(const std::string& path,
                                                          absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(what, ": cannot open '", path, "'"));
  std::string text, block(1 << 16, '\0');
  while (in.read(block.data(), static_cast<std::streamsize>(block.size())) || in.gcount() > 0) {
    text.append(block.data(), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat(what, ": cannot read '", path, "'"));
  return text;
}

// As ReadFile, but any failure, and an empty file, is InvalidArgument "<what>: cannot read
// '<path>'" (certificates, keys, manifests: empty is never right).
[[nodiscard]] inline absl::StatusOr<std::string> ReadNonEmptyFile(const std::string& path,
                                                                  absl::string_view what) {
  absl::StatusOr<std::string> text = ReadFile(path, what);
  if (!text.ok() || text->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cannot read '", path, "'"));
  }
  return text;
}

}  // namespace loom

#endif  // LOOM_BASE_READ_FILE_H_
