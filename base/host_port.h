// "host:port" for URLs, Host headers and listen addresses: an IPv6 address goes in brackets
// (RFC 3986), one already bracketed is kept as it is.
#ifndef LOOM_BASE_HOST_PORT_H_
#define LOOM_BASE_HOST_PORT_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace loom {

inline std::string JoinHostPort(absl::string_view host, int port) {
  const bool v6 = host.find(':') != absl::string_view::npos && host.front() != '[';
  return v6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

}  // namespace loom

#endif  // LOOM_BASE_HOST_PORT_H_
