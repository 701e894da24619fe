// C interface to the CUDA probe (cuda_probe.cu), so the .cu file needs no LibTorch or Abseil.
// Functions return 0 on success, else non-zero with a message in `error`.
#ifndef LOOM_WORKER_TRAINER_CUDA_CUDA_PROBE_H_
#define LOOM_WORKER_TRAINER_CUDA_CUDA_PROBE_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

int loom_cuda_device_count(int* count, char* error, size_t error_size);
int loom_cuda_device_name(int device, char* name, size_t name_size);
int loom_cuda_self_test(int device, char* error, size_t error_size);

#ifdef __cplusplus
}
#endif

#endif  // LOOM_WORKER_TRAINER_CUDA_CUDA_PROBE_H_
