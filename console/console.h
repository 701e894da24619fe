// The web console: a single page at / that talks to the REST API with the user's bearer token
// (docs/console.md). Its files are compiled in; these routes serve them and nothing else, so
// the page has no access the API would not give the same token.
#ifndef LOOM_CONSOLE_CONSOLE_H_
#define LOOM_CONSOLE_CONSOLE_H_

#include <string>

#include "absl/strings/string_view.h"
#include "net/http_server.h"

namespace loom::console {

// An embedded file by name ("app.js"): its bytes, or nullptr when there is none.
const std::string* ConsoleFile(absl::string_view name);

// GET / (the page) and GET /console/{file} (its script, style and libraries). No token: the
// files hold no data; every datum the page shows comes from the API with the user's token.
void InstallConsoleRoutes(net::HttpServer& server);

}  // namespace loom::console

#endif  // LOOM_CONSOLE_CONSOLE_H_
