// Reading the files a job names (data, tokenizer, reasoning eval, init_from) so that no symlink
// leads out of the shared storage root, whenever it was made. The coordinator checks the paths at
// submit (coordinator/submit_validation.h), but a link created or a directory swapped for one
// after that check would otherwise be followed by the ranks (a worker credential read as a
// tokenizer). loom-train confines its reads to the root the coordinator names (--storage-root):
// each file is opened with openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) from a descriptor of
// the root, so the kernel refuses any resolution that leaves it, symlinks within it still work.
// Where openat2 is missing (Linux < 5.6) the path is walked component by component with
// O_NOFOLLOW, and any symlink on it is refused. Without a root (standalone loom-train) paths open
// as given.
#ifndef LOOM_STORAGE_CONFINED_FILES_H_
#define LOOM_STORAGE_CONFINED_FILES_H_

#include <cstdint>
#include <istream>
#include <limits>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace loom::storage {

// An open file descriptor, closed when dropped.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.Release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();
  int get() const { return fd_; }
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// From now on, OpenForRead opens only beneath `root` (an existing directory). Once per process,
// before any reader runs; "" confines nothing.
absl::Status ConfineReadsTo(const std::string& root);
// The root reads are confined to ("" when none).
const std::string& ConfinedRoot();

// Opens `path` read-only (O_CLOEXEC; `directory`: O_DIRECTORY). With a confining root: the path
// must lie inside it lexically, and PermissionDenied names the path when resolving it leaves the
// root (through a symlink, absolute or relative) or crosses a magic link. NotFound when absent.
absl::StatusOr<UniqueFd> OpenForRead(const std::string& path, bool directory = false);

// The whole file, through OpenForRead; InvalidArgument when it is larger than `limit` bytes.
absl::StatusOr<std::string> ReadConfinedFile(const std::string& path,
                                             uint64_t limit = std::numeric_limits<uint64_t>::max());

// A confined file as a stream (line readers of large JSONL files).
absl::StatusOr<std::unique_ptr<std::istream>> OpenConfinedStream(const std::string& path);

// The same as OpenForRead beneath an explicit root, with openat2 or (use_openat2 false, or the
// kernel lacks it) the component walk. For tests of both paths.
absl::StatusOr<UniqueFd> OpenBeneath(const std::string& root, const std::string& path,
                                     bool directory, bool use_openat2 = true);

}  // namespace loom::storage

#endif  // LOOM_STORAGE_CONFINED_FILES_H_
