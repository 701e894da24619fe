// The files cmake/EmbedFiles.cmake compiled in (interop/CMakeLists.txt).
#include <cstddef>
#include <string_view>

#include "hf_folder.h"

namespace loom::interop {

struct EmbeddedFile {
  const char* name;
  const unsigned char* data;
  size_t size;
};
extern const EmbeddedFile kEmbeddedFiles[];
extern const size_t kEmbeddedFileCount;

std::string_view ModelingLoomIhaPy() {
  for (size_t i = 0; i < kEmbeddedFileCount; ++i) {
    if (std::string_view(kEmbeddedFiles[i].name) == "modeling_loom_iha.py")
      return {reinterpret_cast<const char*>(kEmbeddedFiles[i].data), kEmbeddedFiles[i].size};
  }
  return {};
}

}  // namespace loom::interop
