// One source, six deliberately broken plugins (see CMakeLists.txt): each LOOM_BROKEN_* macro
// breaks one rule the loader checks. Uses only the C ABI, no LibTorch library.
#include <cstdio>

#include "loom/plugin_abi.h"
#include "loom/torch_compat.h"

#if defined(LOOM_BROKEN_undefined_symbol)
// Never defined anywhere: dlopen(RTLD_NOW) must fail to resolve it.
extern "C" int loom_symbol_that_does_not_exist(void);
extern "C" __attribute__((visibility("default"))) int loom_force_reference(void) {
  return loom_symbol_that_does_not_exist();
}
#endif

namespace {

int32_t Create(const void*, void** out, char* error, size_t size) {
#if defined(LOOM_BROKEN_factory_fails)
  std::snprintf(error, size, "factory_fails: refusing to build a layer (test plugin)");
  *out = nullptr;
  return LOOM_INTERNAL;
#else
  std::snprintf(error, size, "test plugin cannot create layers");
  return LOOM_INTERNAL;
#endif
}

void Destroy(void*) {}

#if defined(LOOM_BROKEN_abi_version)
constexpr uint32_t kVersion = LOOM_PLUGIN_ABI_VERSION + 998;
#else
constexpr uint32_t kVersion = LOOM_PLUGIN_ABI_VERSION;
#endif

#if defined(LOOM_BROKEN_bad_stamp)
constexpr const char* kStamp = "abi=1;torch=0.1;libstdc++-cxx11abi=0";
#else
constexpr const char* kStamp = LOOM_BUILD_STAMP;
#endif

#if defined(LOOM_BROKEN_duplicate_name)
constexpr const char* kName = "mha";
#elif defined(LOOM_BROKEN_factory_fails)
constexpr const char* kName = "factory_fails";
#else
constexpr const char* kName = "broken";
#endif

const LoomPluginV1 kPlugin = {
    kVersion, kStamp,  kName, LOOM_PLUGIN_KIND_ATTENTION, "deliberately broken test plugin",
    &Create,  &Destroy};

}  // namespace

#if !defined(LOOM_BROKEN_no_entry)
extern "C" __attribute__((visibility("default"))) const LoomPluginV1* loom_plugin_v1() {
  return &kPlugin;
}
#else
// Exports something, just not the entry point.
extern "C" __attribute__((visibility("default"))) const LoomPluginV1* loom_plugin_v0() {
  return &kPlugin;
}
#endif
