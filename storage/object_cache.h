// Single objects of an S3-compatible store as local files: small ones read whole (manifests,
// dataset indexes), large ones with a known CRC-32C and size (checkpoint shards, token shards)
// fetched into a content-addressed cache, $LOOM_CACHE_DIR/objects/<crc32c>-<bytes>
// (checkpoint_store.h's LocalCacheDir). A cached copy is checked (size, CRC-32C) before every
// use and fetched again when it does not match; a download enters the cache only once it
// matches what its manifest or index says. The cache stays under $LOOM_CACHE_MAX_GB (default
// 20), least recently used first.
#ifndef LOOM_STORAGE_OBJECT_CACHE_H_
#define LOOM_STORAGE_OBJECT_CACHE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "storage/confined_files.h"

namespace loom::storage {

// The bytes of the object at `url` ("s3://bucket/key"); NotFound when it does not exist,
// OutOfRange when it is larger than max_bytes.
absl::StatusOr<std::string> ReadRemoteObject(const std::string& url, uint64_t max_bytes);

// A local path holding the object at `url`, verified against `crc32c` (8 hex digits) and
// `bytes`. DataLoss names the URL when the store's copy does not match (or is missing).
absl::StatusOr<std::string> FetchVerified(const std::string& url, const std::string& crc32c,
                                          uint64_t bytes);

// The CRC-32C (8 hex digits) and size of a local file, read in blocks.
absl::StatusOr<std::string> FileCrc32c(const std::string& path, uint64_t* size);

// Opens a file of the cache read-only. Never confined to the storage root (confined_files.h):
// Loom wrote it there after checking it against its manifest or index.
absl::StatusOr<UniqueFd> OpenCachedForRead(const std::string& path);

// Removes the least recently used cached objects past $LOOM_CACHE_MAX_GB.
void TrimObjectCache();

}  // namespace loom::storage

#endif  // LOOM_STORAGE_OBJECT_CACHE_H_
