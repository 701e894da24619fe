// Loom plugin ABI: the C entry point every plugin shared library exports.
//
// A plugin is a shared library that exports exactly one symbol, `loom_plugin_v1`, returning a
// pointer to a static LoomPluginV1. The trainer's loader dlopen()s the library, calls the entry
// point and checks, in order:
//   1. abi_version == LOOM_PLUGIN_ABI_VERSION (the layout of every struct in this header and of
//      the C++ interfaces a plugin kind implements, e.g. loom/attention_plugin.h);
//   2. build_stamp equals the loader's own (LibTorch major.minor and the C++ library ABI), since
//      attention plugins hand LibTorch objects across the boundary;
//   3. name is a non-empty identifier that no other loaded plugin uses.
// Any mismatch is reported with both values and the file name; the process goes on.
//
// Nothing may throw across this boundary: factories report failure through their return code
// and a caller-provided message buffer.
//
// When any struct here, or a kind's C++ interface, changes layout or meaning, bump
// LOOM_PLUGIN_ABI_VERSION. plugin_abi_version_test fails until you do (it records a digest of the
// ABI headers per version).
#ifndef LOOM_API_PLUGIN_ABI_H_
#define LOOM_API_PLUGIN_ABI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LOOM_PLUGIN_ABI_VERSION 7
#define LOOM_PLUGIN_ENTRY_SYMBOL "loom_plugin_v1"

typedef enum LoomPluginKind {
  LOOM_PLUGIN_KIND_ATTENTION =
      1,                     // factory spec: LoomAttentionSpecV1, object: see attention_plugin.h
  LOOM_PLUGIN_KIND_SFT = 2,  // chat objectives: spec LoomSftSpecV1, object: see sft_plugin.h
} LoomPluginKind;

// Factory results. Anything but LOOM_OK comes with a message in the caller's buffer.
typedef enum LoomStatusCode {
  LOOM_OK = 0,
  LOOM_INVALID_ARGUMENT = 1,  // bad spec or option: the message names the field
  LOOM_INTERNAL = 2,          // anything else (an exception caught at the boundary, OOM, ...)
} LoomStatusCode;

// A plugin-specific option, both sides as text ("p" -> "4", "mask" -> "block"). Plugins parse
// and validate their own options and must reject keys they do not know.
typedef struct LoomOption {
  const char* key;
  const char* value;
} LoomOption;

typedef struct LoomPluginV1 {
  uint32_t abi_version;     // LOOM_PLUGIN_ABI_VERSION the plugin was compiled with
  const char* build_stamp;  // LOOM_BUILD_STAMP the plugin was compiled with (see below)
  const char* name;         // unique plugin name, [a-z0-9_]+, e.g. "mha", "iha"
  uint32_t kind;            // LoomPluginKind
  const char* description;  // one line for `loom-train plugins`
  // Creates an object of the plugin's kind from a kind-specific spec. On success stores an owned
  // object in *out (release it with destroy) and returns LOOM_OK; otherwise writes a
  // NUL-terminated message of at most error_size bytes into error.
  int32_t (*create)(const void* spec, void** out, char* error, size_t error_size);
  void (*destroy)(void* object);
} LoomPluginV1;

typedef const LoomPluginV1* (*LoomPluginEntryFn)(void);

#ifdef __cplusplus
}  // extern "C"
#endif

// The build stamp: what must agree between loader and plugin for C++ objects to cross. Only the
// preprocessor is used so the C header stays usable without LibTorch; LibTorch users define
// LOOM_TORCH_VERSION_STRING through loom/torch_compat.h before using it.
#define LOOM_STAMP_STR2(x) #x
#define LOOM_STAMP_STR(x) LOOM_STAMP_STR2(x)
#if defined(_GLIBCXX_USE_CXX11_ABI)
#define LOOM_STAMP_CXXABI "libstdc++-cxx11abi=" LOOM_STAMP_STR(_GLIBCXX_USE_CXX11_ABI)
#elif defined(_LIBCPP_VERSION)
#define LOOM_STAMP_CXXABI "libc++"
#else
#define LOOM_STAMP_CXXABI "c"
#endif
#ifndef LOOM_TORCH_VERSION_STRING
#define LOOM_TORCH_VERSION_STRING "none"
#endif
#define LOOM_BUILD_STAMP                                                             \
  "abi=" LOOM_STAMP_STR(LOOM_PLUGIN_ABI_VERSION) ";torch=" LOOM_TORCH_VERSION_STRING \
                                                 ";" LOOM_STAMP_CXXABI

#ifdef __cplusplus
#include <cstdio>
#include <exception>
#include <utility>

namespace loom::plugin_internal {

inline void CopyMessage(const char* message, char* error, size_t error_size) {
  if (error != nullptr && error_size > 0) std::snprintf(error, error_size, "%s", message);
}

// Runs a plugin kind's C++ factory and converts every outcome into the C contract: nothing
// escapes. Spec: the kind's C spec struct; Holder: what *out owns ({object}); Invalid: the
// exception type a factory throws for a bad spec or option (LOOM_INVALID_ARGUMENT).
template <typename Spec, typename Holder, typename Invalid, typename Factory>
int32_t Create(Factory factory, const void* spec, void** out, char* error,
               size_t error_size) noexcept {
  try {
    if (spec == nullptr || out == nullptr) {
      CopyMessage("create: null spec or out pointer", error, error_size);
      return LOOM_INVALID_ARGUMENT;
    }
    auto object = factory(*static_cast<const Spec*>(spec));
    if (!object) {
      CopyMessage("create: the factory returned nothing", error, error_size);
      return LOOM_INTERNAL;
    }
    *out = new Holder{std::move(object)};
    return LOOM_OK;
  } catch (const Invalid& e) {
    CopyMessage(e.what(), error, error_size);
    return LOOM_INVALID_ARGUMENT;
  } catch (const std::exception& e) {
    CopyMessage(e.what(), error, error_size);
    return LOOM_INTERNAL;
  } catch (...) {
    CopyMessage("create: unknown exception", error, error_size);
    return LOOM_INTERNAL;
  }
}

template <typename Holder>
void Destroy(void* object) noexcept {
  delete static_cast<Holder*>(object);
}

}  // namespace loom::plugin_internal

// The exported entry point of a plugin of KIND whose objects are made by FACTORY (a callable
// taking the kind's Spec, returning a shared_ptr) and owned through Holder. The kinds' headers
// wrap it (LOOM_ATTENTION_PLUGIN, LOOM_SFT_PLUGIN).
#define LOOM_DEFINE_PLUGIN(NAME, DESCRIPTION, KIND, SPEC, HOLDER, INVALID, FACTORY)          \
  namespace {                                                                                \
  int32_t LoomCreatePlugin(const void* spec, void** out, char* error, size_t size) {         \
    return ::loom::plugin_internal::Create<SPEC, HOLDER, INVALID>(FACTORY, spec, out, error, \
                                                                  size);                     \
  }                                                                                          \
  const LoomPluginV1 kLoomPlugin = {LOOM_PLUGIN_ABI_VERSION,                                 \
                                    LOOM_BUILD_STAMP,                                        \
                                    NAME,                                                    \
                                    KIND,                                                    \
                                    DESCRIPTION,                                             \
                                    &LoomCreatePlugin,                                       \
                                    &::loom::plugin_internal::Destroy<HOLDER>};              \
  }                                                                                          \
  extern "C" __attribute__((visibility("default"))) const LoomPluginV1* loom_plugin_v1() {   \
    return &kLoomPlugin;                                                                     \
  }
#endif  // __cplusplus

#endif  // LOOM_API_PLUGIN_ABI_H_
