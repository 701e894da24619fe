// Finds, loads and checks plugins (api/loom/plugin_abi.h) for the trainer.
//
// Libraries are opened with dlopen(RTLD_NOW | RTLD_LOCAL): unresolved symbols fail at load, not
// mid-training, and plugins cannot interpose on each other. Loaded libraries stay open for the
// life of the loader because the objects they create carry their code. Every failure is an
// absl::Status naming the file and the mismatch; a bad plugin never stops the others loading.
#ifndef LOOM_WORKER_TRAINER_PLUGIN_LOADER_H_
#define LOOM_WORKER_TRAINER_PLUGIN_LOADER_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "loom/plugin_abi.h"

namespace loom::trainer {

struct LoadedPlugin {
  std::string path;
  const LoomPluginV1* plugin = nullptr;  // static data inside the library
  void* handle = nullptr;                // dlopen handle
};

struct LoadReport {
  std::vector<std::string> loaded;     // plugin names, in load order
  std::vector<absl::Status> failures;  // one per library that did not load
};

class PluginLoader {
 public:
  // The stamp a plugin must carry to be accepted: LOOM_BUILD_STAMP as compiled into the trainer.
  static const char* ExpectedBuildStamp();

  // Plugin directories from LOOM_PLUGIN_PATH (colon-separated), then the directory installed
  // next to the running executable (<exe>/../lib/loom/plugins).
  static std::vector<std::string> DefaultSearchPath();

  PluginLoader() = default;
  PluginLoader(const PluginLoader&) = delete;
  PluginLoader& operator=(const PluginLoader&) = delete;
  ~PluginLoader();  // closes no library: see the header comment

  // Loads one library. Errors: NotFound (no such file), FailedPrecondition (dlopen failed, entry
  // symbol missing, ABI version or build stamp mismatch, malformed plugin struct),
  // AlreadyExists (a plugin of that name is loaded).
  absl::Status LoadFile(const std::string& path);

  // Loads every lib*.so in each directory (sorted by name, first directory first). Missing
  // directories are skipped; each library that fails goes into the report.
  LoadReport LoadDirectories(const std::vector<std::string>& directories);

  // The plugin called `name` of the given kind, or NotFound listing what is loaded.
  absl::StatusOr<const LoadedPlugin*> Find(const std::string& name, uint32_t kind) const;

  const std::map<std::string, LoadedPlugin>& plugins() const { return plugins_; }

 private:
  std::map<std::string, LoadedPlugin> plugins_;
  std::vector<void*> rejected_handles_;
  std::string last_loaded_;
};

// Loads every plugin in `dirs` (a --plugin-dir value, DIR[:DIR...]; "" = DefaultSearchPath()).
// A library that fails to load is reported on stderr and skipped, so one broken library never
// takes the others down; NotFound when no plugin loaded at all. verbose: prints the path.
absl::Status LoadPluginDirectories(const std::string& dirs, PluginLoader& loader, bool verbose);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_PLUGIN_LOADER_H_
