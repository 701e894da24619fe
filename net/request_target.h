// Internal to net/: the request target (path and query) of a parsed request head.
#ifndef LOOM_NET_REQUEST_TARGET_H_
#define LOOM_NET_REQUEST_TARGET_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "net/http_server.h"

namespace loom::net {

// Fills request->path (percent-decoded) and request->params (decoded, '+' as space). Refuses
// what the router must never see: a target that is not a path or holds control characters
// (InvalidArgument), an encoded '/' (%2F) inside a segment (NotFound: it names no route).
absl::Status ParseRequestTarget(absl::string_view target, HttpRequest* request);

}  // namespace loom::net

#endif  // LOOM_NET_REQUEST_TARGET_H_
