// The files cmake/EmbedFiles.cmake compiled in (interop/CMakeLists.txt).
#include <string_view>

#include "interop/hf_folder.h"
#include "interop_files.h"  // generated: the embedded files

namespace loom::interop {

std::string_view ModelingLoomIhaPy() {
  for (size_t i = 0; i < kEmbeddedFileCount; ++i) {
    if (std::string_view(kEmbeddedFiles[i].name) == "modeling_loom_iha.py")
      return {reinterpret_cast<const char*>(kEmbeddedFiles[i].data), kEmbeddedFiles[i].size};
  }
  return {};
}

}  // namespace loom::interop
