// absl::Status helpers. Debian's Abseil (20220623) ships no status macros, so Loom defines the
// two it needs once, here.
#ifndef LOOM_BASE_STATUS_MACROS_H_
#define LOOM_BASE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define LOOM_STATUS_CONCAT_INNER(a, b) a##b
#define LOOM_STATUS_CONCAT(a, b) LOOM_STATUS_CONCAT_INNER(a, b)

#define LOOM_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status loom_status_ = (expr);        \
    if (!loom_status_.ok()) return loom_status_; \
  } while (0)

#define LOOM_ASSIGN_OR_RETURN(lhs, expr) \
  LOOM_ASSIGN_OR_RETURN_IMPL(LOOM_STATUS_CONCAT(loom_statusor_, __LINE__), lhs, expr)

#define LOOM_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return statusor.status();         \
  lhs = std::move(statusor).value()

#endif  // LOOM_BASE_STATUS_MACROS_H_
