// A line of a trainer's event log (written by loom-train, read by the worker agent, whose
// ranks may be anything): parse; what parses writes back to a line that parses to the same event.
#include <string>

#include "fuzz/fuzz_input.h"
#include "google/protobuf/util/message_differencer.h"
#include "loom/trainer_events.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto event = loom::ParseTrainerEventLine(loom::fuzz::AsString(data, size));
  if (!event.ok()) return 0;
  const std::string line = loom::TrainerEventLine(*event);
  auto again = loom::ParseTrainerEventLine(line);
  LOOM_FUZZ_CHECK(again.ok(), std::string(again.status().message()) + "\n" + line);
  // NaN != NaN: compare the written lines, which print non-finite values as null.
  LOOM_FUZZ_CHECK(loom::TrainerEventLine(*again) == line, line);
  return 0;
}
