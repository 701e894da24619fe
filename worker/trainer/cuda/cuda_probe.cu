// Device discovery and a self-test kernel. Kept apart from LibTorch: Debian's LibTorch is
// CPU-only, yet Loom's CUDA code must compile and link everywhere and run where a GPU exists.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "worker/trainer/cuda/cuda_probe.h"

namespace {

int Report(cudaError_t err, const char* what, char* error, size_t size) {
  if (err == cudaSuccess) return 0;
  if (error && size) std::snprintf(error, size, "%s: %s", what, cudaGetErrorString(err));
  return 1;
}

__global__ void AxpyKernel(int n, float a, const float* x, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

}  // namespace

extern "C" int loom_cuda_device_count(int* count, char* error, size_t error_size) {
  *count = 0;
  cudaError_t err = cudaGetDeviceCount(count);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    *count = 0;
    Report(err, "cudaGetDeviceCount", error, error_size);
    cudaGetLastError();  // clear the sticky status for later callers
    return 0;            // "no GPU" is an answer, not a failure
  }
  return Report(err, "cudaGetDeviceCount", error, error_size);
}

extern "C" int loom_cuda_device_name(int device, char* name, size_t name_size) {
  cudaDeviceProp prop;
  cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) return Report(err, "cudaGetDeviceProperties", name, name_size);
  std::snprintf(name, name_size, "%s (sm_%d%d, %.1f GiB)", prop.name, prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1u << 30));
  return 0;
}

extern "C" int loom_cuda_self_test(int device, char* error, size_t error_size) {
  const int n = 1 << 20;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) {
    x[i] = static_cast<float>(i % 97);
    y[i] = 1.0f;
  }
  float *dx = nullptr, *dy = nullptr;
  int rc = Report(cudaSetDevice(device), "cudaSetDevice", error, error_size);
  if (!rc) rc = Report(cudaMalloc(&dx, n * sizeof(float)), "cudaMalloc", error, error_size);
  if (!rc) rc = Report(cudaMalloc(&dy, n * sizeof(float)), "cudaMalloc", error, error_size);
  if (!rc)
    rc = Report(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy",
                error, error_size);
  if (!rc)
    rc = Report(cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy",
                error, error_size);
  if (!rc) {
    AxpyKernel<<<(n + 255) / 256, 256>>>(n, 2.0f, dx, dy);
    rc = Report(cudaGetLastError(), "kernel launch", error, error_size);
  }
  if (!rc)
    rc = Report(cudaMemcpy(y.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy",
                error, error_size);
  if (dx) cudaFree(dx);
  if (dy) cudaFree(dy);
  if (rc) return rc;
  for (int i = 0; i < n; ++i) {
    if (y[i] != 2.0f * static_cast<float>(i % 97) + 1.0f) {
      std::snprintf(error, error_size, "self-test kernel gave a wrong result at %d", i);
      return 1;
    }
  }
  return 0;
}
