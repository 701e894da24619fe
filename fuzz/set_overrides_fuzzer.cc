// `--set path=value` overrides (loom submit, loom-train): each line of the input is one
// assignment, applied to a preset's spec, which is then resolved as a submitted spec is.
#include <string>
#include <string_view>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "fuzz/fuzz_input.h"
#include "loom/spec.h"
#include "loom/spec_overrides.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = loom::fuzz::AsString(data, size);
  auto preset = loom::JobPreset("tiny-cpu");
  LOOM_FUZZ_CHECK(preset.ok(), std::string(preset.status().message()));
  loom::v1::JobSpec spec = *preset;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    (void)loom::ParseFieldPath(line.substr(0, line.find('=')));
    if (!loom::ApplySetFlag(&spec, line).ok()) return 0;
  }
  (void)loom::ResolveJobSpec(spec);
  return 0;
}
