// The trainer's event log lines (api/loom/v1/events.proto): written by loom-train, read by the
// worker agent. Neither side names a JSON key by hand; the proto is the schema.
#ifndef LOOM_API_TRAINER_EVENTS_H_
#define LOOM_API_TRAINER_EVENTS_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "loom/v1/events.pb.h"

namespace loom {

// {"event": KIND, ...} without the trailing newline: keys in field order, 64-bit integers as
// JSON numbers, non-finite doubles as null, `optional` fields only when set. Invalid UTF-8 in
// strings is replaced, never thrown on.
std::string TrainerEventLine(const v1::TrainerEvent& event);

// One line back into an event. InvalidArgument for anything that is not an object with a known
// "event" whose fields have the schema's types (unknown fields are ignored; null is the default).
absl::StatusOr<v1::TrainerEvent> ParseTrainerEventLine(std::string_view line);

}  // namespace loom

#endif  // LOOM_API_TRAINER_EVENTS_H_
