#include "storage/confined_files.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ext/stdio_filebuf.h>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"

namespace loom::storage {
namespace fs = std::filesystem;

namespace {

std::string& Root() {
  static std::string root;
  return root;
}

absl::Status Refused(const std::string& path, const std::string& root, int err) {
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(absl::StrCat(path, ": no such file (or a dangling symlink)"));
    case EXDEV:
    case ELOOP:
      return absl::PermissionDeniedError(
          absl::StrCat(path, ": resolving it leaves the storage root ", root,
                       " (a symlink that points out of it, an absolute or magic link)"));
    case ENOTDIR:
      return absl::InvalidArgumentError(absl::StrCat(path, ": a component is not a directory"));
    default:
      return absl::PermissionDeniedError(absl::StrCat(path, ": ", std::strerror(err)));
  }
}

int OpenFlags(bool directory) { return O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0); }

// Linux < 5.6 (or a seccomp filter without openat2): every component opened with O_NOFOLLOW from
// the one before, so any symlink on the path is refused (ELOOP), inside the root or not.
int WalkNoFollow(int root_fd, const fs::path& relative, bool directory) {
  int dir = ::fcntl(root_fd, F_DUPFD_CLOEXEC, 0);
  if (dir < 0) return -1;
  std::vector<std::string> parts;
  for (const auto& part : relative) parts.push_back(part.string());
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool last = i + 1 == parts.size();
    const int flags =
        last ? OpenFlags(directory) | O_NOFOLLOW : O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
    const int next = ::openat(dir, parts[i].c_str(), flags);
    int saved = errno;
    // O_DIRECTORY | O_NOFOLLOW on a symlink fails with ENOTDIR: report it as the link it is.
    struct stat st;
    if (next < 0 && saved == ENOTDIR &&
        ::fstatat(dir, parts[i].c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
      saved = ELOOP;
    ::close(dir);
    if (next < 0) {
      errno = saved;
      return -1;
    }
    dir = next;
  }
  return dir;
}

// An istream over a descriptor it owns (libstdc++'s stdio_filebuf closes it).
class FdInputStream : public std::istream {
 public:
  explicit FdInputStream(int fd) : std::istream(nullptr), buf_(fd, std::ios::in) { rdbuf(&buf_); }

 private:
  __gnu_cxx::stdio_filebuf<char> buf_;
};

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.Release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status ConfineReadsTo(const std::string& root) {
  if (root.empty()) {
    Root().clear();
    return absl::OkStatus();
  }
  std::error_code ec;
  const fs::path real = fs::canonical(root, ec);
  if (ec || !fs::is_directory(real, ec))
    return absl::InvalidArgumentError(absl::StrCat("--storage-root '", root, "': not a directory",
                                                   ec ? ": " : "", ec ? ec.message() : ""));
  Root() = real.string();
  return absl::OkStatus();
}

const std::string& ConfinedRoot() { return Root(); }

absl::StatusOr<UniqueFd> OpenBeneath(const std::string& root, const std::string& path,
                                     bool directory, bool use_openat2) {
  const fs::path base = fs::path(root).lexically_normal();
  const fs::path full =
      (fs::path(path).is_absolute() ? fs::path(path) : base / path).lexically_normal();
  fs::path relative = full.lexically_relative(base);
  if (relative.empty() || *relative.begin() == "..")
    return absl::PermissionDeniedError(absl::StrCat(path, ": outside the storage root ", root));
  UniqueFd root_fd(::open(base.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (root_fd.get() < 0) return Refused(root, root, errno);
  int fd = -1;
  if (use_openat2) {
    struct open_how how = {};
    how.flags = OpenFlags(directory);
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
    fd =
        static_cast<int>(::syscall(SYS_openat2, root_fd.get(), relative.c_str(), &how, sizeof how));
    if (fd < 0 && (errno == ENOSYS || errno == EPERM)) use_openat2 = false;
  }
  if (!use_openat2) fd = WalkNoFollow(root_fd.get(), relative, directory);
  if (fd < 0) return Refused(path, root, errno);
  return UniqueFd(fd);
}

absl::StatusOr<UniqueFd> OpenForRead(const std::string& path, bool directory) {
  if (!Root().empty()) return OpenBeneath(Root(), path, directory);
  UniqueFd fd(::open(path.c_str(), OpenFlags(directory)));
  if (fd.get() < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::PermissionDeniedError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  return fd;
}

absl::StatusOr<std::string> ReadConfinedFile(const std::string& path, uint64_t limit) {
  auto fd = OpenForRead(path);
  if (!fd.ok()) return fd.status();
  struct stat st;
  if (::fstat(fd->get(), &st) != 0)
    return absl::InternalError(absl::StrCat(path, ": ", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(path, ": not a file"));
  if (static_cast<uint64_t>(st.st_size) > limit)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", st.st_size, " bytes (at most ", limit, ")"));
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd->get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::DataLossError(absl::StrCat(path, ": read: ", std::strerror(errno)));
    if (n == 0) break;  // shrank while read
    done += static_cast<size_t>(n);
  }
  bytes.resize(done);
  return bytes;
}

absl::StatusOr<std::unique_ptr<std::istream>> OpenConfinedStream(const std::string& path) {
  auto fd = OpenForRead(path);
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<std::istream>(new FdInputStream(fd->Release()));
}

}  // namespace loom::storage
