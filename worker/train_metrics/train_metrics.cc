#include "worker/train_metrics/train_metrics.h"

namespace loom::worker {

void DeclareTrainMetrics(metrics::Registry& r) {
  r.DeclareGauge("loom_train_loss", "Training loss of the last optimizer step.");
  r.DeclareGauge("loom_train_eval_loss", "Held-out loss at the last evaluation.");
  r.DeclareGauge("loom_train_eval_accuracy_ratio", "Held-out accuracy over scored positions.");
  r.DeclareGauge("loom_train_eval_exact_match_ratio",
                 "Held-out share of examples with every scored position right.");
  r.DeclareGauge("loom_train_reasoning_pass_at_1_ratio",
                 "Reasoning eval: mean share of correct sampled answers per problem.");
  r.DeclareGauge("loom_train_reasoning_maj_at_k_ratio",
                 "Reasoning eval: share of problems whose majority answer is correct.");
  r.DeclareGauge("loom_train_learning_rate", "Learning rate of the last step.");
  r.DeclareGauge("loom_train_grad_norm", "Global gradient norm before clipping.");
  r.DeclareGauge("loom_train_tokens_per_second", "Training throughput of the last step.");
  r.DeclareGauge("loom_train_mfu_ratio", "Model FLOP utilisation against metrics.peak_flops.");
  r.DeclareGauge("loom_train_step", "Optimizer steps completed.");
  r.DeclareGauge("loom_train_total_steps", "Optimizer steps the job will run.");
  r.DeclareCounter("loom_train_tokens_total", "Training tokens processed.");
  r.DeclareCounter("loom_train_nan_skipped_steps_total",
                   "Steps skipped for a non-finite loss or gradient.");
  r.DeclareCounter("loom_train_checkpoint_bytes_total", "Bytes written to checkpoints.");
  r.DeclareGauge("loom_train_loss_scale", "Dynamic loss scale (loss_scale.mode dynamic).");
  r.DeclareCounter("loom_train_loss_scale_overflows_total",
                   "Steps skipped because the scaled gradients overflowed.");
  r.DeclareHistogram("loom_train_step_seconds", "Wall time of one optimizer step.",
                     {0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60});
  r.DeclareHistogram("loom_train_checkpoint_write_seconds",
                     "Wall time to write and commit a checkpoint.",
                     {0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300});
  r.DeclareHistogram("loom_train_checkpoint_upload_seconds",
                     "Wall time from a staged checkpoint to its manifest in the object store.",
                     {0.1, 0.5, 1, 5, 10, 60, 300, 1800});
  r.DeclareHistogram("loom_train_checkpoint_upload_wait_seconds",
                     "Wall time a checkpoint waited for the previous upload to finish.",
                     {0.001, 0.01, 0.1, 1, 5, 10, 60, 300});
  r.DeclareCounter("loom_train_checkpoint_upload_retries_total",
                   "Requests to the object store and whole checkpoint uploads tried again.");
  r.DeclareHistogram("loom_train_checkpoint_load_seconds",
                     "Wall time to load and verify a checkpoint.",
                     {0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300});
  // Per rank on a GPU, labels {job_id, rank, gpu, UUID}: what the rank's CUDA caching
  // allocator holds (written by the rank, re-exported by its agent) and what NVML reads off
  // the device the rank is bound to (the agent). UUID is dcgm-exporter's label: its series
  // join these on(UUID).
  r.DeclareGauge("loom_train_gpu_memory_allocated_bytes",
                 "CUDA memory the rank's tensors occupy now (caching allocator).");
  r.DeclareGauge("loom_train_gpu_memory_reserved_bytes",
                 "CUDA memory the rank's caching allocator holds from the driver.");
  r.DeclareGauge("loom_train_gpu_memory_peak_bytes",
                 "Largest CUDA memory the rank's tensors occupied since it started.");
  r.DeclareGauge("loom_train_gpu_utilization_ratio",
                 "Share of the last NVML sample period a kernel ran on the rank's GPU.");
  r.DeclareGauge("loom_train_gpu_memory_used_bytes",
                 "Device memory in use on the rank's GPU (NVML; every process on it).");
}

}  // namespace loom::worker
