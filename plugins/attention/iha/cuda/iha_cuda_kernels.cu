// The CUDA IHA kernels: each __global__ function runs one block program of iha_cuda_tiles.h
// (the code the CPU emulation test checks) with __syncthreads() between its phases. One block =
// one tile of pseudo rows (one thread per row) of one (batch row, head); grid (tiles, B·H).
// Three kernels: forward (out, lse), backward dK/dV (grid over key tiles) and backward dQ (grid
// over query tiles). Instantiated for float, bf16 and fp16 inputs; compute is float.
#include <cuda_runtime.h>

#include <string>

#include "plugins/attention/iha/cuda/iha_cuda_kernels.h"
#include "plugins/attention/iha/cuda/iha_cuda_tiles.h"

namespace loom::attention::iha::cuda {
namespace {

// One phase for every thread of the block, then a barrier.
struct DeviceRun {
  template <typename Phase>
  __device__ void operator()(const Phase& phase) const {
    phase(static_cast<int>(threadIdx.x));
    __syncthreads();
  }
};

enum Kind { kForward = 0, kBackwardKeys = 1, kBackwardQueries = 2 };

template <typename T>
__global__ void IhaForwardKernel(IhaCudaParams params) {
  extern __shared__ float smem[];
  const IhaSmem layout =
      IhaSmemLayout(kForward, params.dk, params.dv, static_cast<int>(blockDim.x));
  IhaForwardBlock<T>(params, blockIdx.x, blockIdx.y, smem, layout, DeviceRun{});
}

template <typename T>
__global__ void IhaBackwardKeysKernel(IhaCudaParams params) {
  extern __shared__ float smem[];
  const IhaSmem layout =
      IhaSmemLayout(kBackwardKeys, params.dk, params.dv, static_cast<int>(blockDim.x));
  IhaBackwardKeyBlock<T>(params, blockIdx.x, blockIdx.y, smem, layout, DeviceRun{});
}

template <typename T>
__global__ void IhaBackwardQueriesKernel(IhaCudaParams params) {
  extern __shared__ float smem[];
  const IhaSmem layout =
      IhaSmemLayout(kBackwardQueries, params.dk, params.dv, static_cast<int>(blockDim.x));
  IhaBackwardQueryBlock<T>(params, blockIdx.x, blockIdx.y, smem, layout, DeviceRun{});
}

std::string Error(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return {};
  return std::string("iha cuda: ") + what + ": " + cudaGetErrorString(err);
}

// The tile (pseudo rows per block) for a kernel: the requested one, or the largest of 64, 32,
// 16 whose shared memory fits the device's opt-in limit.
std::string ChooseTile(int kind, const IhaCudaParams& p, int requested, int* tile, int64_t* bytes) {
  int device = 0, limit = 0;
  std::string err = Error(cudaGetDevice(&device), "cudaGetDevice");
  if (err.empty())
    err = Error(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                "cudaDeviceGetAttribute");
  if (!err.empty()) return err;
  for (int t : {64, 32, 16}) {
    if (requested > 0 && t != requested) continue;
    const int64_t need = IhaSmemBytes(kind, p.dk, p.dv, t);
    if (need <= limit) {
      *tile = t;
      *bytes = need;
      return {};
    }
  }
  if (requested > 0 && requested != 64 && requested != 32 && requested != 16) {
    return "iha cuda: tile must be 16, 32 or 64, got " + std::to_string(requested);
  }
  return "iha cuda: head widths dk=" + std::to_string(p.dk) + ", dv=" + std::to_string(p.dv) +
         " need more shared memory than the device's " + std::to_string(limit) + " bytes";
}

template <typename Kernel>
std::string Launch(Kernel kernel, int kind, const IhaCudaParams& p, int requested, void* stream,
                   const char* name) {
  if (p.Len() == 0 || p.b * p.h == 0) return {};
  int tile = 0;
  int64_t bytes = 0;
  std::string err = ChooseTile(kind, p, requested, &tile, &bytes);
  if (!err.empty()) return err;
  if (p.b * p.h > 65535) return "iha cuda: B·H = " + std::to_string(p.b * p.h) + " > 65535";
  if (bytes > 48 * 1024) {
    err = Error(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(bytes)),
                "cudaFuncSetAttribute");
    if (!err.empty()) return err;
  }
  const dim3 grid(static_cast<unsigned>(p.Tiles(tile)), static_cast<unsigned>(p.b * p.h));
  kernel<<<grid, tile, bytes, static_cast<cudaStream_t>(stream)>>>(p);
  return Error(cudaGetLastError(), name);
}

template <typename T>
std::string Forward(const IhaCudaParams& p, int tile, void* stream) {
  return Launch(IhaForwardKernel<T>, kForward, p, tile, stream, "forward kernel");
}

template <typename T>
std::string Backward(const IhaCudaParams& p, int tile, void* stream) {
  std::string err =
      Launch(IhaBackwardKeysKernel<T>, kBackwardKeys, p, tile, stream, "backward dK/dV kernel");
  if (!err.empty()) return err;
  return Launch(IhaBackwardQueriesKernel<T>, kBackwardQueries, p, tile, stream,
                "backward dQ kernel");
}

}  // namespace

std::string LaunchIhaForward(const IhaCudaParams& params, IhaDType dtype, int tile, void* stream) {
  switch (dtype) {
    case IhaDType::kFloat32:
      return Forward<float>(params, tile, stream);
    case IhaDType::kBFloat16:
      return Forward<IhaBf16>(params, tile, stream);
    case IhaDType::kFloat16:
      return Forward<IhaHalf>(params, tile, stream);
  }
  return "iha cuda: unknown dtype";
}

std::string LaunchIhaBackward(const IhaCudaParams& params, IhaDType dtype, int tile, void* stream) {
  switch (dtype) {
    case IhaDType::kFloat32:
      return Backward<float>(params, tile, stream);
    case IhaDType::kBFloat16:
      return Backward<IhaBf16>(params, tile, stream);
    case IhaDType::kFloat16:
      return Backward<IhaHalf>(params, tile, stream);
  }
  return "iha cuda: unknown dtype";
}

}  // namespace loom::attention::iha::cuda
