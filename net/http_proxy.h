// Forwards one request to an upstream HTTP/1.1 server and relays its answer: the coordinator's
// proxy for kind: serve jobs (docs/serve.md, "Serving on the pool"). Built on Beast's client
// side, as the server is on its server side. A streamed answer (chunked, e.g. server-sent events)
// is relayed piece by piece as it arrives, and a client that goes away closes the upstream
// connection, so the server stops generating for nobody.
#ifndef LOOM_NET_HTTP_PROXY_H_
#define LOOM_NET_HTTP_PROXY_H_

#include <cstddef>
#include <string>

#include "net/http_server.h"

namespace loom::net {

struct ProxyTarget {
  std::string host;  // a name or an address (IPv6 without brackets)
  int port = 0;
  std::string path;          // the upstream path, e.g. "/v1/chat/completions"
  std::string bearer_token;  // sent as "Authorization: Bearer ..." instead of the client's
  std::string what;          // names the upstream in error messages ("job-000003's server")
  int connect_timeout_ms = 5000;
  // Until the answer's head, and between two pieces of its body: a non-streamed completion
  // answers only once it is generated.
  int response_timeout_ms = 600000;
  size_t max_body_bytes = 64 << 20;  // a longer non-streamed answer is a 502
};

// Sends `request` (its method, body, Content-Type and Accept; not its query, cookies or
// credentials) to the target and fills `response` with the upstream's status, Content-Type,
// Retry-After and body, or a streamed body. An upstream that cannot be reached or answers
// badly gives 502, one that does not answer in time 504, each with a JSON error naming `what`.
void ForwardRequest(const ProxyTarget& target, const HttpRequest& request, HttpResponse& response);

}  // namespace loom::net

#endif  // LOOM_NET_HTTP_PROXY_H_
