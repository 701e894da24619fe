#include "coordinator/paging.h"

#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace loom::coordinator {
namespace {
constexpr char kSeparator = '\x1f';
constexpr char kVersion[] = "p1";
}  // namespace

std::string EncodePageToken(absl::string_view list, absl::string_view filter,
                            absl::string_view last_key) {
  return absl::WebSafeBase64Escape(absl::StrCat(kVersion, std::string(1, kSeparator), list,
                                                std::string(1, kSeparator), filter,
                                                std::string(1, kSeparator), last_key));
}

absl::StatusOr<std::string> DecodePageToken(absl::string_view token, absl::string_view list,
                                            absl::string_view filter) {
  if (token.empty()) return std::string();
  std::string raw;
  if (token.size() > 1024 || !absl::WebSafeBase64Unescape(token, &raw)) {
    return absl::InvalidArgumentError("page_token: malformed");
  }
  std::vector<std::string> parts = absl::StrSplit(raw, absl::MaxSplits(kSeparator, 3));
  if (parts.size() != 4 || parts[0] != kVersion || parts[1] != list) {
    return absl::InvalidArgumentError("page_token: malformed or from another list");
  }
  if (parts[2] != filter) {
    return absl::InvalidArgumentError(
        "page_token: issued for another filter; keep the query's filters while paging");
  }
  return parts[3];
}

absl::Status CheckPageSize(int page_size) {
  if (page_size < 1 || page_size > kMaxPageSize) {
    return absl::InvalidArgumentError(absl::StrCat("page_size: must be in 1..", kMaxPageSize));
  }
  return absl::OkStatus();
}

}  // namespace loom::coordinator
