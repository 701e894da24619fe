// A checkpoint's manifest.json (read on resume, by the catalogue and by eval jobs that take their
// model from it): parse, write back and parse again to the same manifest; and an eval spec
// filled from it.
#include <string>

#include "fuzz/fuzz_input.h"
#include "loom/spec.h"
#include "storage/checkpoint.h"

namespace {

bool SameManifest(const loom::storage::Manifest& a, const loom::storage::Manifest& b) {
  if (a.shards.size() != b.shards.size()) return false;
  for (size_t i = 0; i < a.shards.size(); ++i) {
    const auto &x = a.shards[i], &y = b.shards[i];
    if (x.file != y.file || x.rank != y.rank || x.bytes != y.bytes || x.crc32c != y.crc32c)
      return false;
  }
  return a.format_version == b.format_version && a.step == b.step &&
         a.tokens_seen == b.tokens_seen && a.world_size == b.world_size &&
         a.spec_hash == b.spec_hash && a.parent == b.parent && a.kind == b.kind &&
         a.created_unix_ms == b.created_unix_ms && a.state == b.state;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = loom::fuzz::AsString(data, size);
  loom::v1::JobSpec eval;
  eval.set_kind("eval");
  if (loom::FillModelFromManifest(&eval, text, "manifest.json").ok() && eval.has_model())
    (void)loom::ResolveModelConfig(eval.model());
  auto m = loom::storage::ManifestFromJson(text, "manifest.json");
  if (!m.ok()) return 0;
  const std::string written = loom::storage::ManifestToJson(*m);
  auto again = loom::storage::ManifestFromJson(written, "rewritten");
  LOOM_FUZZ_CHECK(again.ok(), std::string(again.status().message()) + "\n" + written);
  LOOM_FUZZ_CHECK(SameManifest(*m, *again), written);
  return 0;
}
