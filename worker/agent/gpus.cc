#include "worker/agent/gpus.h"

#include <dlfcn.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace loom::agent {
namespace {

// The few NVML entry points used, declared here so that building needs no NVML header.
using NvmlDevice = void*;
struct NvmlMemory {
  unsigned long long total, free, used;  // NOLINT(runtime/int): NVML's own types
};
using InitFn = int (*)();
using CountFn = int (*)(unsigned*);
using HandleFn = int (*)(unsigned, NvmlDevice*);
using TextFn = int (*)(NvmlDevice, char*, unsigned);
using MemoryFn = int (*)(NvmlDevice, NvmlMemory*);

template <typename Fn>
Fn Symbol(void* lib, const char* name) {
  return reinterpret_cast<Fn>(::dlsym(lib, name));
}

}  // namespace

std::vector<v1::Gpu> DiscoverGpus(std::string* why) {
  std::vector<v1::Gpu> gpus;
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    *why = "no NVML (libnvidia-ml.so.1 not found: no NVIDIA driver)";
    return gpus;
  }
  auto init = Symbol<InitFn>(lib, "nvmlInit_v2");
  auto shutdown = Symbol<InitFn>(lib, "nvmlShutdown");
  auto count = Symbol<CountFn>(lib, "nvmlDeviceGetCount_v2");
  auto handle = Symbol<HandleFn>(lib, "nvmlDeviceGetHandleByIndex_v2");
  auto uuid = Symbol<TextFn>(lib, "nvmlDeviceGetUUID");
  auto name = Symbol<TextFn>(lib, "nvmlDeviceGetName");
  auto memory = Symbol<MemoryFn>(lib, "nvmlDeviceGetMemoryInfo");
  unsigned n = 0;
  if (!init || !shutdown || !count || !handle || !uuid || !name || !memory) {
    *why = "NVML lacks the expected entry points";
  } else if (init() != 0) {
    *why = "nvmlInit failed (driver not loaded?)";
  } else {
    if (count(&n) != 0) n = 0;
    for (unsigned i = 0; i < n; ++i) {
      NvmlDevice d = nullptr;
      if (handle(i, &d) != 0) continue;
      v1::Gpu g;
      g.set_index(static_cast<int32_t>(i));
      char text[128] = {0};
      if (uuid(d, text, sizeof(text)) == 0) g.set_uuid(text);
      char model[128] = {0};
      if (name(d, model, sizeof(model)) == 0) g.set_model(model);
      NvmlMemory m{};
      if (memory(d, &m) == 0) g.set_memory_bytes(static_cast<int64_t>(m.total));
      gpus.push_back(g);
    }
    shutdown();
    if (gpus.empty()) *why = "NVML reports no GPUs";
  }
  ::dlclose(lib);
  return gpus;
}

absl::StatusOr<std::vector<v1::Gpu>> GpusFromFlag(const std::string& flag, std::string* why) {
  if (flag.empty() || flag == "auto") return DiscoverGpus(why);
  std::vector<v1::Gpu> gpus;
  if (flag == "none") {
    *why = "--gpus none";
    return gpus;
  }
  std::set<int> seen;
  for (absl::string_view part : absl::StrSplit(flag, ',')) {
    int index = -1;
    if (!absl::SimpleAtoi(part, &index) || index < 0 || index > 1023 ||
        !seen.insert(index).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--gpus: '", part,
                       "' is not a new device index in 0..1023 (want auto, "
                       "none or a list such as 0,1,2,3)"));
    }
    v1::Gpu g;
    g.set_index(index);
    gpus.push_back(g);
  }
  return gpus;
}

std::unique_ptr<NvmlSampler> NvmlSampler::Open() {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return nullptr;
  std::unique_ptr<NvmlSampler> s(new NvmlSampler());
  s->lib_ = lib;
  auto init = Symbol<InitFn>(lib, "nvmlInit_v2");
  s->shutdown_ = Symbol<InitFn>(lib, "nvmlShutdown");
  s->by_index_ = Symbol<int (*)(unsigned, void**)>(lib, "nvmlDeviceGetHandleByIndex_v2");
  s->by_uuid_ = Symbol<int (*)(const char*, void**)>(lib, "nvmlDeviceGetHandleByUUID");
  s->utilization_ = Symbol<int (*)(void*, void*)>(lib, "nvmlDeviceGetUtilizationRates");
  s->memory_ = Symbol<int (*)(void*, void*)>(lib, "nvmlDeviceGetMemoryInfo");
  if (!init || !s->shutdown_ || !s->by_index_ || !s->by_uuid_ || !s->utilization_ || !s->memory_ ||
      init() != 0) {
    s->shutdown_ = nullptr;  // not initialised: nothing to shut down
    return nullptr;
  }
  return s;
}

NvmlSampler::~NvmlSampler() {
  if (shutdown_ != nullptr) shutdown_();
  if (lib_ != nullptr) ::dlclose(lib_);
}

std::optional<NvmlSampler::Reading> NvmlSampler::Read(const v1::Gpu& gpu) const {
  struct Utilization {
    unsigned gpu, memory;  // percent over the driver's last sample period
  };
  void* d = nullptr;
  const int found = gpu.uuid().empty() ? by_index_(static_cast<unsigned>(gpu.index()), &d)
                                       : by_uuid_(gpu.uuid().c_str(), &d);
  Utilization u{};
  NvmlMemory m{};
  if (found != 0 || utilization_(d, &u) != 0 || memory_(d, &m) != 0) return std::nullopt;
  return Reading{u.gpu / 100.0, static_cast<int64_t>(m.used)};
}

std::string VisibleDeviceName(const v1::Gpu& gpu) {
  return gpu.uuid().empty() ? std::to_string(gpu.index()) : gpu.uuid();
}

GpuPool::GpuPool(const std::vector<v1::Gpu>& gpus) : all_(gpus) {
  for (int i = 0; i < static_cast<int>(all_.size()); ++i) free_.insert(i);
}

absl::StatusOr<int> GpuPool::Take() {
  if (free_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", all_.size(),
                     " GPUs of this node are held by running ranks (an earlier attempt's "
                     "processes may still be stopping)"));
  }
  const int gpu = *free_.begin();
  free_.erase(free_.begin());
  return gpu;
}

void GpuPool::Give(int gpu) {
  if (gpu >= 0 && gpu < static_cast<int>(all_.size())) free_.insert(gpu);
}

}  // namespace loom::agent
