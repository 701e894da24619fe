// A job spec as users submit it (JSON, or YAML as `loom submit` reads it) to the resolved spec
// the coordinator stores: parse, resolve (presets, defaults, cross-field checks), the task checks
// submit runs, and the options text the console shows. First byte: 'y' = YAML, else JSON.
#include <string>

#include "data/task_spec.h"
#include "fuzz/fuzz_input.h"
#include "loom/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string text = loom::fuzz::AsString(data + 1, size - 1);
  if (data[0] == 'y') {
    auto json = loom::YamlToJson(text, "spec.yaml");
    if (!json.ok()) return 0;
    text = *std::move(json);
  }
  loom::v1::JobSpec spec;
  if (!loom::ParseJsonMessage(text, "spec", &spec).ok()) return 0;
  auto resolved = loom::ResolveJobSpec(spec);
  if (!resolved.ok()) return 0;
  (void)loom::data::CheckTaskSpec(*resolved);
  (void)loom::data::TaskOptionsText(resolved->data());
  // What the coordinator stores is resolved again when a job restarts: it must still resolve.
  auto again = loom::ResolveJobSpec(*resolved);
  LOOM_FUZZ_CHECK(again.ok(), std::string(again.status().message()));
  return 0;
}
