// A safetensors file (checkpoint shards, imported Hugging Face weights): parse and validate; what
// parses must serialise back to a file that parses to the same tensors and metadata.
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "fuzz/fuzz_input.h"
#include "storage/safetensors.h"

using loom::storage::SafetensorsFile;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = SafetensorsFile::Parse(loom::fuzz::AsString(data, size), "fuzz.safetensors");
  if (!file.ok()) return 0;
  std::vector<loom::storage::TensorToWrite> tensors;
  for (const auto& t : file->tensors()) {
    const std::string_view bytes = file->Data(t);
    LOOM_FUZZ_CHECK(bytes.size() == t.end - t.begin, t.name);
    const int64_t elements =
        std::accumulate(t.shape.begin(), t.shape.end(), int64_t{1}, std::multiplies<int64_t>());
    LOOM_FUZZ_CHECK(
        bytes.size() == static_cast<size_t>(elements) * loom::storage::DTypeSize(t.dtype), t.name);
    LOOM_FUZZ_CHECK(file->Find(t.name) != nullptr, t.name);
    tensors.push_back({t.name, t.dtype, t.shape, bytes.data(), bytes.size()});
  }
  auto written = loom::storage::Serialize(tensors, file->metadata());
  LOOM_FUZZ_CHECK(written.ok(), std::string(written.status().message()));
  auto reread = SafetensorsFile::Parse(*written, "reserialised");
  LOOM_FUZZ_CHECK(reread.ok(), std::string(reread.status().message()));
  LOOM_FUZZ_CHECK(reread->metadata() == file->metadata(), "metadata");
  LOOM_FUZZ_CHECK(reread->tensors().size() == file->tensors().size(), "tensor count");
  for (const auto& t : file->tensors()) {
    const auto* r = reread->Find(t.name);
    LOOM_FUZZ_CHECK(r != nullptr && r->dtype == t.dtype && r->shape == t.shape, t.name);
    LOOM_FUZZ_CHECK(reread->Data(*r) == file->Data(t), t.name);
  }
  return 0;
}
