// Which LibTorch this build compiled against. CI builds Loom twice (docs/building.md,
// "LibTorch"): against Debian's 1.13 and, with LOOM_TORCH=pypi, against the torch wheel pinned
// in scripts/pins/torch.txt. A second build that silently found Debian's LibTorch again (its
// config searches the system folders first) would pass every other test while checking
// nothing new, so here the pypi build must have the pinned version, headers and libraries.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <regex>
#include <string>

#include "loom/torch_compat.h"

namespace {

#ifdef LOOM_TORCH_FROM_PYPI
std::string PinnedTorchVersion() {
  const char* source = std::getenv("LOOM_SOURCE_DIR");
  std::ifstream pins(std::string(source ? source : ".") + "/scripts/pins/torch.txt");
  const std::regex torch_pin(R"(^torch==([0-9.]+) )");
  std::smatch m;
  for (std::string line; std::getline(pins, line);) {
    if (std::regex_search(line, m, torch_pin)) return m[1];
  }
  return "";
}
#endif

// The file the running process took at::empty from.
std::string LoadedLibTorch() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&at::_ops::empty_memory_format::call), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  return info.dli_fname;
}

TEST(TorchBuildTest, ThePyPIBuildHasThePinnedWheel) {
#ifdef LOOM_TORCH_FROM_PYPI
  const std::string pinned = PinnedTorchVersion();
  ASSERT_FALSE(pinned.empty()) << "no torch== line in scripts/pins/torch.txt";
  EXPECT_EQ(TORCH_VERSION, pinned) << "compiled against LibTorch " << TORCH_VERSION;
  EXPECT_NE(LoadedLibTorch().find("/site-packages/torch/lib/"), std::string::npos)
      << "running " << LoadedLibTorch();
#else
  EXPECT_EQ(LoadedLibTorch().find("/site-packages/torch/lib/"), std::string::npos)
      << "a build without LOOM_TORCH=pypi runs " << LoadedLibTorch();
  GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " (not the pypi build)";
#endif
}

}  // namespace
