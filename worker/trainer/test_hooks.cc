#include "worker/trainer/test_hooks.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace loom::trainer {

#ifdef LOOM_TEST_HOOKS
absl::StatusOr<TrainerTestHooks> TestHooksFromEnvironment() {
  TrainerTestHooks hooks;
  if (const char* steps = std::getenv("LOOM_TEST_INJECT_NAN_AT_STEPS")) {
    for (absl::string_view part : absl::StrSplit(steps, ',', absl::SkipEmpty())) {
      int64_t v;
      if (!absl::SimpleAtoi(part, &v)) {
        return absl::InvalidArgumentError("LOOM_TEST_INJECT_NAN_AT_STEPS: want STEP,STEP,...");
      }
      hooks.nan_at_steps.push_back(v);
    }
  }
  if (const char* pause = std::getenv("LOOM_TEST_CHECKPOINT_PAUSE")) {
    std::vector<std::string> parts = absl::StrSplit(pause, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &hooks.checkpoint_pause_step) ||
        !absl::SimpleAtoi(parts[1], &hooks.checkpoint_pause_ms)) {
      return absl::InvalidArgumentError("LOOM_TEST_CHECKPOINT_PAUSE: want STEP:MILLISECONDS");
    }
  }
  return hooks;
}
#else
absl::StatusOr<TrainerTestHooks> TestHooksFromEnvironment() { return TrainerTestHooks(); }
#endif

}  // namespace loom::trainer
