// The trainer's metric schema: the loom_train_* families, with their types and help. Owned by
// the trainer (worker/trainer/step_reporter.cc sets them on each rank); the worker agent declares
// the same families to re-export rank 0's numbers from the event log (api/loom/v1/events.proto),
// so one scrape of a node sees every job it runs (docs/deploy.md). No LibTorch: the agent links it.
#ifndef LOOM_WORKER_TRAIN_METRICS_TRAIN_METRICS_H_
#define LOOM_WORKER_TRAIN_METRICS_TRAIN_METRICS_H_

#include "metrics/prometheus.h"

namespace loom::worker {

void DeclareTrainMetrics(metrics::Registry& r);

}  // namespace loom::worker

#endif  // LOOM_WORKER_TRAIN_METRICS_TRAIN_METRICS_H_
