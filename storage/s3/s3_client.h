// An S3 client on libcurl, for any S3-compatible store (AWS S3, GCS's XML API, MinIO, Ceph RGW).
//
// Why libcurl and not an SDK: aws-sdk-cpp is not packaged for Debian, libcurl is (the same
// library every Loom program already links), it signs requests with SigV4 itself
// (CURLOPT_AWS_SIGV4, 7.75+) and speaks TLS through OpenSSL. What it leaves to us is small and
// kept here: the payload's SHA-256 (sent as x-amz-content-sha256, so the store checks every byte
// it receives), query strings in SigV4's canonical order, multipart uploads, and retries.
//
// Retries: transport errors (refused, reset, timed out, no answer), 5xx, 429, SlowDown and
// RequestTimeout are retried with exponential backoff and full jitter (AWS's "Exponential
// Backoff And Jitter"); anything else (403, 404, a malformed request) fails at once with the
// store's own code and message, naming the bucket and key. Large files go up as multipart
// uploads: parts of `part_bytes` read and hashed one at a time by `parallel_parts` threads
// (memory: part_bytes × parallel_parts), an incomplete upload is aborted, and one the store
// forgot (NoSuchUpload, e.g. after a restart) is started again.
#ifndef LOOM_STORAGE_S3_S3_CLIENT_H_
#define LOOM_STORAGE_S3_S3_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "storage/s3/s3_xml.h"

namespace loom::storage {

// "s3://bucket/some/prefix" → {bucket, "some/prefix"} (no leading or trailing '/').
struct S3Location {
  std::string bucket, prefix;
  // "s3://bucket/prefix/name"
  std::string Url(absl::string_view name = "") const;
  // "prefix/name" (or "name" without a prefix)
  std::string Key(absl::string_view name) const;
};
bool IsS3Url(absl::string_view url);
absl::StatusOr<S3Location> ParseS3Url(absl::string_view url);

struct S3Options {
  std::string endpoint;  // "http://127.0.0.1:9000"; "" = AWS, https://s3.<region>.amazonaws.com
  std::string region = "us-east-1";
  bool path_style = false;  // http://endpoint/bucket/key instead of http://bucket.endpoint/key
  std::string access_key, secret_key, session_token;  // no access key: unsigned requests
  std::string ca_file;                                // TLS trust; "" = the system's
  int64_t part_bytes = 16 << 20;  // multipart above this size, in parts of this size
  int parallel_parts = 4;
  int max_attempts = 8;  // per request, the first included
  double backoff_base_s = 0.1, backoff_cap_s = 8;
  int connect_timeout_s = 10;
  int low_speed_time_s = 30;  // a transfer under 1 KiB/s for this long is abandoned (retried)
};

// The options every Loom program takes from its environment, as the AWS CLI does (credentials
// never come from a job spec):
//   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, or else the profile
//   AWS_PROFILE (default "default") of AWS_SHARED_CREDENTIALS_FILE (default ~/.aws/credentials);
//   AWS_REGION or AWS_DEFAULT_REGION; AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; AWS_CA_BUNDLE;
//   LOOM_S3_ADDRESSING = path | virtual (default: path with an endpoint, virtual on AWS);
//   LOOM_S3_PART_MB, LOOM_S3_PARALLEL_PARTS, LOOM_S3_MAX_ATTEMPTS.
absl::StatusOr<S3Options> S3OptionsFromEnvironment();

class S3Client {
 public:
  explicit S3Client(S3Options options);

  absl::Status PutString(const std::string& bucket, const std::string& key, absl::string_view data);
  // Uploads a local file; multipart above options.part_bytes.
  absl::Status PutFile(const std::string& bucket, const std::string& key, const std::string& path);
  // The object's bytes; OutOfRange when it is larger than max_bytes.
  absl::StatusOr<std::string> GetString(const std::string& bucket, const std::string& key,
                                        uint64_t max_bytes = 64 << 20);
  // Downloads into `path` (written as path + ".part", renamed when complete).
  absl::Status GetFile(const std::string& bucket, const std::string& key, const std::string& path);
  // nullopt when the object does not exist.
  absl::StatusOr<std::optional<ObjectInfo>> Head(const std::string& bucket, const std::string& key);
  // Every object under `prefix` (all pages), in key order.
  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& bucket,
                                               const std::string& prefix);
  // Deleting what does not exist succeeds (as S3 does).
  absl::Status Delete(const std::string& bucket, const std::string& key);

  const S3Options& options() const { return options_; }
  // Requests retried since start (for metrics and tests).
  int64_t retries() const { return retries_.load(); }

  struct Request;
  struct Response;

 private:
  absl::StatusOr<Response> Call(const Request& request);
  absl::Status PutMultipart(const std::string& bucket, const std::string& key,
                            const std::string& path, uint64_t size);
  absl::StatusOr<Response> UploadPart(const std::string& bucket, const std::string& key,
                                      const std::string& upload_id, int part,
                                      absl::string_view bytes);
  absl::Status UploadParts(const std::string& bucket, const std::string& key,
                           const std::string& upload_id, const std::string& path, uint64_t size,
                           uint64_t part_bytes, std::vector<std::string>& etags);

  S3Options options_;
  std::atomic<int64_t> retries_{0};
};

}  // namespace loom::storage

#endif  // LOOM_STORAGE_S3_S3_CLIENT_H_
