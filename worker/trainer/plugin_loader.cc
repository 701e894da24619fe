#include "worker/trainer/plugin_loader.h"

#include <dirent.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "loom/torch_compat.h"

namespace loom::trainer {
namespace {

bool IsValidName(const char* name) {
  if (name == nullptr || *name == '\0' || std::strlen(name) > 64) return false;
  for (const char* p = name; *p; ++p) {
    if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_')) return false;
  }
  return true;
}

std::string KindName(uint32_t kind) {
  switch (kind) {
    case LOOM_PLUGIN_KIND_ATTENTION:
      return "attention";
    case LOOM_PLUGIN_KIND_SFT:
      return "sft";
    default:
      return absl::StrCat("unknown(", kind, ")");
  }
}

}  // namespace

const char* PluginLoader::ExpectedBuildStamp() { return LOOM_BUILD_STAMP; }

std::vector<std::string> PluginLoader::DefaultSearchPath() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH"); env != nullptr && *env != '\0') {
    for (absl::string_view d : absl::StrSplit(env, ':', absl::SkipEmpty())) dirs.emplace_back(d);
  }
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    exe[n] = '\0';
    std::string dir(exe);
    dir = dir.substr(0, dir.find_last_of('/'));
    dirs.push_back(dir + "/../lib/loom/plugins");
  }
  return dirs;
}

PluginLoader::~PluginLoader() = default;

absl::Status PluginLoader::LoadFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("plugin ", path, ": no such file"));
  }
  ::dlerror();
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = ::dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("plugin ", path, ": dlopen failed: ", err ? err : "unknown error"));
  }
  // A rejected library is not closed: its static initialisers may have registered state with
  // LibTorch, and unloading code that registered callbacks is a crash waiting to happen.
  auto reject = [&](absl::Status status) {
    rejected_handles_.push_back(handle);
    return status;
  };
  auto entry = reinterpret_cast<LoomPluginEntryFn>(::dlsym(handle, LOOM_PLUGIN_ENTRY_SYMBOL));
  if (entry == nullptr) {
    return reject(absl::FailedPreconditionError(
        absl::StrCat("plugin ", path, ": missing entry symbol '", LOOM_PLUGIN_ENTRY_SYMBOL,
                     "' (not a Loom plugin, or built without LOOM_*_PLUGIN)")));
  }
  const LoomPluginV1* plugin = entry();
  if (plugin == nullptr) {
    return reject(absl::FailedPreconditionError(
        absl::StrCat("plugin ", path, ": ", LOOM_PLUGIN_ENTRY_SYMBOL, "() returned null")));
  }
  if (plugin->abi_version != LOOM_PLUGIN_ABI_VERSION) {
    return reject(absl::FailedPreconditionError(
        absl::StrCat("plugin ", path, ": ABI version mismatch: plugin has ", plugin->abi_version,
                     ", loader expects ", LOOM_PLUGIN_ABI_VERSION, "; rebuild the plugin")));
  }
  const char* stamp = plugin->build_stamp ? plugin->build_stamp : "(null)";
  if (std::strcmp(stamp, ExpectedBuildStamp()) != 0) {
    return reject(absl::FailedPreconditionError(
        absl::StrCat("plugin ", path, ": build stamp mismatch: plugin has '", stamp,
                     "', loader expects '", ExpectedBuildStamp(), "'")));
  }
  if (!IsValidName(plugin->name)) {
    return reject(absl::FailedPreconditionError(
        absl::StrCat("plugin ", path, ": invalid name '", plugin->name ? plugin->name : "(null)",
                     "' (want 1-64 characters of [a-z0-9_])")));
  }
  if (plugin->kind != LOOM_PLUGIN_KIND_ATTENTION && plugin->kind != LOOM_PLUGIN_KIND_SFT) {
    return reject(absl::FailedPreconditionError(
        absl::StrCat("plugin ", path, ": '", plugin->name, "' has unknown kind ", plugin->kind)));
  }
  if (plugin->create == nullptr || plugin->destroy == nullptr) {
    return reject(absl::FailedPreconditionError(
        absl::StrCat("plugin ", path, ": '", plugin->name, "' has no create/destroy functions")));
  }
  auto existing = plugins_.find(plugin->name);
  if (existing != plugins_.end()) {
    return reject(
        absl::AlreadyExistsError(absl::StrCat("plugin ", path, ": duplicate name '", plugin->name,
                                              "', already loaded from ", existing->second.path)));
  }
  plugins_[plugin->name] = LoadedPlugin{path, plugin, handle};
  last_loaded_ = plugin->name;
  return absl::OkStatus();
}

LoadReport PluginLoader::LoadDirectories(const std::vector<std::string>& directories) {
  LoadReport report;
  std::vector<std::string> seen;  // canonical directories: the same one reached twice loads once
  for (const std::string& dir : directories) {
    char resolved[PATH_MAX];
    if (::realpath(dir.c_str(), resolved) == nullptr) continue;  // missing directory
    if (std::find(seen.begin(), seen.end(), resolved) != seen.end()) continue;
    seen.emplace_back(resolved);
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) continue;
    std::vector<std::string> files;
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (absl::StartsWith(name, "lib") && absl::EndsWith(name, ".so")) files.push_back(name);
    }
    ::closedir(d);
    std::sort(files.begin(), files.end());
    for (const std::string& f : files) {
      const std::string path = absl::StrCat(dir, "/", f);
      absl::Status s = LoadFile(path);
      if (s.ok()) {
        report.loaded.push_back(last_loaded_);
      } else {
        report.failures.push_back(std::move(s));
      }
    }
  }
  return report;
}

absl::StatusOr<const LoadedPlugin*> PluginLoader::Find(const std::string& name,
                                                       uint32_t kind) const {
  auto it = plugins_.find(name);
  if (it == plugins_.end() || it->second.plugin->kind != kind) {
    std::vector<std::string> names;
    for (const auto& [n, p] : plugins_) {
      if (p.plugin->kind == kind) names.push_back(n);
    }
    return absl::NotFoundError(absl::StrCat("no ", KindName(kind), " plugin named '", name,
                                            "' (loaded: ", absl::StrJoin(names, ", "), ")"));
  }
  return &it->second;
}

absl::Status LoadPluginDirectories(const std::string& flag, PluginLoader& loader, bool verbose) {
  std::vector<std::string> dirs;
  for (auto d : absl::StrSplit(flag, ':', absl::SkipEmpty())) dirs.emplace_back(d);
  if (dirs.empty()) dirs = PluginLoader::DefaultSearchPath();
  LoadReport report = loader.LoadDirectories(dirs);
  for (const absl::Status& s : report.failures) std::cerr << "warning: " << s.message() << "\n";
  if (verbose) std::cout << "search path: " << absl::StrJoin(dirs, " ") << "\n";
  if (loader.plugins().empty()) {
    return absl::NotFoundError(absl::StrCat("no plugins found in ", absl::StrJoin(dirs, ":"),
                                            " (set --plugin-dir or LOOM_PLUGIN_PATH)"));
  }
  return absl::OkStatus();
}

}  // namespace loom::trainer
