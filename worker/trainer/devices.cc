#include "devices.h"

#include <torch/torch.h>

#include "absl/strings/str_cat.h"

#ifdef LOOM_HAVE_CUDA
#include "cuda/cuda_probe.h"
#endif

namespace loom::trainer {

DeviceReport DetectDevices() {
  DeviceReport r;
  r.cpu_threads = torch::get_num_threads();
  r.torch_cuda = torch::cuda::is_available();
#ifdef LOOM_HAVE_CUDA
  r.cuda_compiled = true;
  char message[256] = {0};
  int count = 0;
  if (loom_cuda_device_count(&count, message, sizeof(message)) == 0) {
    r.cuda_devices = count;
    for (int i = 0; i < count; ++i) {
      char name[256] = {0};
      loom_cuda_device_name(i, name, sizeof(name));
      r.cuda_names.push_back(name);
    }
    if (count == 0) r.cuda_status = "the CUDA runtime reports no devices";
  } else {
    r.cuda_status = message;
  }
#else
  r.cuda_status = "built without CUDA (-DLOOM_CUDA=OFF or no toolkit found)";
#endif
  return r;
}

absl::Status CudaSelfTest(int device) {
#ifdef LOOM_HAVE_CUDA
  char message[256] = {0};
  if (loom_cuda_self_test(device, message, sizeof(message)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cuda device ", device, ": ", message));
  }
  return absl::OkStatus();
#else
  (void)device;
  return absl::UnimplementedError("built without CUDA");
#endif
}

}  // namespace loom::trainer
