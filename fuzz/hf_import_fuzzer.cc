// What import-hf reads from a Hugging Face folder before any weight: config.json (architecture
// and model shape, resolved to a Loom model) and model.safetensors.index.json (the shard of each
// tensor; shard names must stay inside the folder). Input: config.json, separator, index.
#include <string>

#include "fuzz/fuzz_input.h"
#include "interop/hf_folder.h"
#include "interop/hf_model.h"
#include "loom/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = loom::fuzz::SplitParts(data, size, 2);
  auto config = loom::interop::ParseHfConfig(parts[0], /*max_seq_len=*/0);
  if (config.ok()) {
    auto resolved = loom::ResolveModelConfig(config->model);
    if (resolved.ok()) (void)loom::interop::ResolveLayers(*resolved);
  }
  auto index = loom::interop::ParseWeightIndex(parts[1]);
  if (index.ok()) {
    for (const auto& [file, names] : *index) {
      LOOM_FUZZ_CHECK(file.find('/') == std::string::npos && file != ".." && !names.empty(), file);
    }
  }
  return 0;
}
