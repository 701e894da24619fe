// What an S3 server (or anything posing as one) answers: listings, upload ids and error bodies,
// read by storage/s3/s3_xml.cc. Every parse ends in a value or an error, and a listing it
// accepts is consistent (a truncated page has its continuation token, every object a key).
#include <string>

#include "fuzz/fuzz_input.h"
#include "storage/s3/s3_xml.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = loom::fuzz::AsString(data, size);
  auto listing = loom::storage::ParseListObjects(text);
  if (listing.ok()) {
    LOOM_FUZZ_CHECK(!listing->truncated || !listing->next_token.empty(), text);
    for (const auto& o : listing->objects) LOOM_FUZZ_CHECK(!o.key.empty(), text);
  }
  (void)loom::storage::ParseUploadId(text);
  (void)loom::storage::ParseError(text);
  return 0;
}
