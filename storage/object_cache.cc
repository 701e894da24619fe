#include "storage/object_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "storage/checkpoint_store.h"
#include "storage/crc32c.h"
#include "storage/s3/s3_client.h"

namespace loom::storage {
namespace {

namespace fs = std::filesystem;

fs::path ObjectsDir() { return fs::path(LocalCacheDir()) / "objects"; }

bool Matches(const fs::path& path, const std::string& crc32c, uint64_t bytes) {
  uint64_t size = 0;
  auto crc = FileCrc32c(path.string(), &size);
  return crc.ok() && *crc == crc32c && size == bytes;
}

}  // namespace

absl::StatusOr<std::string> FileCrc32c(const std::string& path, uint64_t* size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read"));
  std::string block(4 << 20, '\0');
  uint32_t crc = 0;
  *size = 0;
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    const auto n = static_cast<size_t>(in.gcount());
    crc = Crc32c(block.data(), n, crc);
    *size += n;
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return Crc32cHex(crc);
}

absl::StatusOr<std::string> ReadRemoteObject(const std::string& url, uint64_t max_bytes) {
  LOOM_ASSIGN_OR_RETURN(S3Location at, ParseS3Url(url));
  LOOM_ASSIGN_OR_RETURN(S3Options options, S3OptionsFromEnvironment());
  return S3Client(options).GetString(at.bucket, at.prefix, max_bytes);
}

absl::StatusOr<std::string> FetchVerified(const std::string& url, const std::string& crc32c,
                                          uint64_t bytes) {
  if (!IsCrc32cHex(crc32c)) {  // it names the cached file
    return absl::DataLossError(absl::StrCat(url, ": checksum '", crc32c, "' is no CRC-32C"));
  }
  const fs::path cached = ObjectsDir() / absl::StrCat(crc32c, "-", bytes);
  std::error_code ec;
  if (fs::exists(cached, ec)) {
    if (Matches(cached, crc32c, bytes)) {
      fs::last_write_time(cached, fs::file_time_type::clock::now(), ec);  // for TrimObjectCache
      return cached.string();
    }
    fs::remove(cached, ec);  // damaged in the cache: fetch it again
  }
  LOOM_ASSIGN_OR_RETURN(S3Location at, ParseS3Url(url));
  LOOM_ASSIGN_OR_RETURN(S3Options options, S3OptionsFromEnvironment());
  fs::create_directories(ObjectsDir(), ec);
  const fs::path part =
      ObjectsDir() / absl::StrCat(".fetch-", cached.filename().string(), "-", ::getpid(), "-",
                                  std::hash<std::thread::id>()(std::this_thread::get_id()));
  absl::Status got = S3Client(options).GetFile(at.bucket, at.prefix, part.string());
  if (absl::IsNotFound(got)) return absl::DataLossError(absl::StrCat(url, ": missing"));
  if (!got.ok()) return got;
  uint64_t size = 0;
  auto crc = FileCrc32c(part.string(), &size);
  if (!crc.ok() || *crc != crc32c || size != bytes) {
    fs::remove(part, ec);
    return absl::DataLossError(absl::StrCat(url, ": ", size, " bytes with checksum ",
                                            crc.ok() ? *crc : "?", ", expected ", bytes,
                                            " bytes with ", crc32c));
  }
  fs::rename(part, cached, ec);
  if (ec) return absl::InternalError(absl::StrCat(cached.string(), ": ", ec.message()));
  return cached.string();
}

absl::StatusOr<UniqueFd> OpenCachedForRead(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  return UniqueFd(fd);
}

void TrimObjectCache() {
  int64_t max_gb = 20;
  const char* env = std::getenv("LOOM_CACHE_MAX_GB");
  if (env == nullptr || !absl::SimpleAtoi(env, &max_gb) || max_gb < 0) max_gb = 20;
  const uint64_t budget = static_cast<uint64_t>(max_gb) << 30;
  std::vector<std::pair<fs::file_time_type, fs::path>> files;
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(ObjectsDir(), ec)) {
    if (!e.is_regular_file(ec) || e.path().filename().string()[0] == '.') continue;
    total += e.file_size(ec);
    files.emplace_back(e.last_write_time(ec), e.path());
  }
  std::sort(files.begin(), files.end());
  for (const auto& [when, path] : files) {
    if (total <= budget) break;
    const uint64_t size = fs::file_size(path, ec);
    if (fs::remove(path, ec)) total -= size;
  }
}

}  // namespace loom::storage
