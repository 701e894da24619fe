// Test seams of loom-train, RocksDB's TEST_SYNC_POINT style: multi-process tests drive them
// through LOOM_TEST_* environment variables, but only builds configured with LOOM_TEST_HOOKS
// (on with LOOM_BUILD_TESTS) read those; otherwise this returns no hooks and reads nothing.
//   LOOM_TEST_INJECT_NAN_AT_STEPS=3,4        those steps' losses become NaN
//   LOOM_TEST_CHECKPOINT_PAUSE=STEP:MS       sleep MS between writing STEP's shards and commit
#ifndef LOOM_WORKER_TRAINER_TEST_HOOKS_H_
#define LOOM_WORKER_TRAINER_TEST_HOOKS_H_

#include "absl/status/statusor.h"
#include "worker/trainer/trainer.h"

namespace loom::trainer {

absl::StatusOr<TrainerTestHooks> TestHooksFromEnvironment();

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_TEST_HOOKS_H_
