// The XML documents an S3 server answers with, read with Expat: object listings
// (ListObjectsV2), the id of a new multipart upload, and error bodies. The bytes come from a
// server we do not control (a proxy, a misbehaving store): the parser refuses DTDs, caps depth
// and size, and every caller copes with a field that is missing (fuzz/s3_xml_fuzzer.cc).
#ifndef LOOM_STORAGE_S3_S3_XML_H_
#define LOOM_STORAGE_S3_S3_XML_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace loom::storage {

struct ObjectInfo {
  std::string key;
  uint64_t size = 0;
  std::string etag;
};

struct ObjectListing {
  std::vector<ObjectInfo> objects;
  std::vector<std::string> common_prefixes;  // with a delimiter: the "folders"
  bool truncated = false;
  std::string next_token;  // continuation token of the next page
};

struct S3Error {
  std::string code, message;
};

absl::StatusOr<ObjectListing> ParseListObjects(absl::string_view xml);
absl::StatusOr<std::string> ParseUploadId(absl::string_view xml);  // InitiateMultipartUpload
// An <Error> document; an empty code when the body is not one (S3 can answer 200 with an error
// body to CompleteMultipartUpload).
S3Error ParseError(absl::string_view xml);

}  // namespace loom::storage

#endif  // LOOM_STORAGE_S3_S3_XML_H_
