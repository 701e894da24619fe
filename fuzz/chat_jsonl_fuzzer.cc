// A line of a chat / OpenThoughts JSONL file (SFT data, the openthoughts plugin's ParseLine) and
// a reasoning task's `ops` option: parse; conversations have turns with known roles.
#include <string>

#include "data/chat.h"
#include "fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string line = loom::fuzz::AsString(data, size);
  auto c = loom::data::ParseChatLine(line, 1);
  if (c.ok()) LOOM_FUZZ_CHECK(!c->turns.empty(), line);
  auto ops = loom::data::ParseReasoningOps(line);
  if (ops.ok()) LOOM_FUZZ_CHECK(1 <= ops->min_ops && ops->min_ops <= ops->max_ops, line);
  return 0;
}
