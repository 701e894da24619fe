#include "worker/trainer/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "worker/trainer/devices.h"

namespace loom::trainer {
namespace {

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status Nccl(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

}  // namespace

struct NcclComm::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void* staging = nullptr;
  int64_t staging_bytes = 0;
};

absl::StatusOr<std::unique_ptr<NcclComm>> NcclComm::Create(
    int rank, int world_size,
    const std::function<void(const std::string&, const std::string&)>& set,
    const std::function<std::string(const std::string&)>& get) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError(
        "dist_backend nccl: no CUDA device is visible to this rank (use gloo on CPU machines)");
  }
  std::unique_ptr<NcclComm> c(new NcclComm());
  c->impl_ = std::make_unique<Impl>();
  c->rank_ = rank;
  auto device = CudaDeviceForRank(std::getenv("LOCAL_RANK"), devices);
  if (!device.ok()) return device.status();
  c->device_ = *device;
  if (auto s = Cuda(cudaSetDevice(c->device_), "cudaSetDevice"); !s.ok()) return s;
  ncclUniqueId id;
  if (rank == 0) {
    if (auto s = Nccl(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
    set("loom/nccl/unique_id", std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  } else {
    const std::string bytes = get("loom/nccl/unique_id");
    if (bytes.size() != sizeof(id))
      return absl::DataLossError("nccl: malformed unique id in the store");
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  if (auto s = Nccl(ncclCommInitRank(&c->impl_->comm, world_size, id, rank), "ncclCommInitRank");
      !s.ok()) {
    return s;
  }
  if (auto s = Cuda(cudaStreamCreateWithFlags(&c->impl_->stream, cudaStreamNonBlocking),
                    "cudaStreamCreate");
      !s.ok()) {
    return s;
  }
  return c;
}

NcclComm::~NcclComm() {
  if (!impl_) return;
  if (impl_->staging != nullptr) cudaFree(impl_->staging);
  if (impl_->stream != nullptr) cudaStreamDestroy(impl_->stream);
  if (impl_->comm != nullptr) ncclCommDestroy(impl_->comm);
}

absl::Status NcclComm::Stage(void* data, int64_t bytes, bool on_device, void** device_ptr) {
  if (on_device) {
    *device_ptr = data;
    return absl::OkStatus();
  }
  if (impl_->staging_bytes < bytes) {
    if (impl_->staging != nullptr) cudaFree(impl_->staging);
    impl_->staging = nullptr;
    impl_->staging_bytes = 0;
    if (auto s = Cuda(cudaMalloc(&impl_->staging, static_cast<size_t>(bytes)), "cudaMalloc");
        !s.ok())
      return s;
    impl_->staging_bytes = bytes;
  }
  *device_ptr = impl_->staging;
  return Cuda(cudaMemcpyAsync(impl_->staging, data, static_cast<size_t>(bytes),
                              cudaMemcpyHostToDevice, impl_->stream),
              "cudaMemcpy to device");
}

// Copies a staged result back to the host (unless it lives on the device) and waits.
absl::Status NcclComm::Complete(void* data, void* dev, int64_t bytes, bool on_device,
                                const char* what) {
  if (!on_device) {
    if (auto s = Cuda(cudaMemcpyAsync(data, dev, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost,
                                      impl_->stream),
                      "cudaMemcpy to host");
        !s.ok()) {
      return s;
    }
  }
  return Cuda(cudaStreamSynchronize(impl_->stream), what);
}

absl::Status NcclComm::AllReduceSum(void* data, int64_t count, bool float64, bool on_device) {
  const int64_t bytes = count * (float64 ? 8 : 4);
  void* dev = nullptr;
  if (auto s = Stage(data, bytes, on_device, &dev); !s.ok()) return s;
  if (auto s = Nccl(
          ncclAllReduce(dev, dev, static_cast<size_t>(count), float64 ? ncclFloat64 : ncclFloat32,
                        ncclSum, impl_->comm, impl_->stream),
          "ncclAllReduce");
      !s.ok()) {
    return absl::UnavailableError(absl::StrCat("rank ", rank_, ": ", s.message()));
  }
  return Complete(data, dev, bytes, on_device, "nccl all-reduce");
}

absl::Status NcclComm::Broadcast(void* data, int64_t bytes, int root, bool on_device) {
  void* dev = nullptr;
  if (auto s = Stage(data, bytes, on_device, &dev); !s.ok()) return s;
  if (auto s = Nccl(ncclBroadcast(dev, dev, static_cast<size_t>(bytes), ncclChar, root, impl_->comm,
                                  impl_->stream),
                    "ncclBroadcast");
      !s.ok()) {
    return absl::UnavailableError(absl::StrCat("rank ", rank_, ": ", s.message()));
  }
  return Complete(data, dev, bytes, on_device, "nccl broadcast");
}

}  // namespace loom::trainer
