// Paging of the REST lists: opaque page tokens, each valid only for the list and the filter it
// was issued for, and one check of page_size. Lists are ordered by a key (a job or worker id, a
// checkpoint's "<job>/<step>"); a token carries the last key of its page.
#ifndef LOOM_COORDINATOR_PAGING_H_
#define LOOM_COORDINATOR_PAGING_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace loom::coordinator {

inline constexpr int kDefaultPageSize = 100;
inline constexpr int kMaxPageSize = 500;

std::string EncodePageToken(absl::string_view list, absl::string_view filter,
                            absl::string_view last_key);
// The last key of the previous page ("" for an empty token); InvalidArgument naming page_token
// for a token that is malformed or was issued for another list or filter.
absl::StatusOr<std::string> DecodePageToken(absl::string_view token, absl::string_view list,
                                            absl::string_view filter);
absl::Status CheckPageSize(int page_size);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_PAGING_H_
