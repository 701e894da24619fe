#include "worker/trainer/devices.h"

#include <torch/torch.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#ifdef LOOM_HAVE_CUDA
#include "worker/trainer/cuda/cuda_probe.h"
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

absl::StatusOr<int> CudaDeviceForRank(const char* local_rank, int visible) {
  if (visible < 1) return absl::FailedPreconditionError("no CUDA device is visible to this rank");
  int local = 0;
  if (local_rank != nullptr && (!absl::SimpleAtoi(local_rank, &local) || local < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LOCAL_RANK '", local_rank, "' is not a non-negative number"));
  }
  if (visible == 1) return 0;  // bound to one GPU by the launcher
  if (local >= visible) {
    return absl::FailedPreconditionError(
        absl::StrCat("LOCAL_RANK ", local, " but only ", visible,
                     " CUDA devices are visible: ranks would share a GPU (bind one GPU per rank "
                     "with CUDA_VISIBLE_DEVICES, or run at most ",
                     visible, " ranks per node)"));
  }
  return local;
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
