#include "console/console.h"

#include <cstddef>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "console_files.h"  // generated: the embedded files

namespace loom::console {
namespace {

const std::map<std::string, std::string, std::less<>>& Files() {
  static const auto* files = [] {
    auto* m = new std::map<std::string, std::string, std::less<>>;
    for (size_t i = 0; i < kEmbeddedFileCount; ++i) {
      const EmbeddedFile& f = kEmbeddedFiles[i];
      (*m)[f.name] = std::string(reinterpret_cast<const char*>(f.data), f.size);
    }
    return m;
  }();
  return *files;
}

std::string ContentType(absl::string_view name) {
  if (absl::EndsWith(name, ".html")) return "text/html; charset=utf-8";
  if (absl::EndsWith(name, ".js")) return "text/javascript; charset=utf-8";
  if (absl::EndsWith(name, ".css")) return "text/css; charset=utf-8";
  return "application/octet-stream";
}

// Scripts and styles from this origin only, requests to this origin only, never framed: an
// injected string cannot run, and the token never leaves for another site.
constexpr char kContentSecurityPolicy[] =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'";

void Serve(absl::string_view name, net::HttpResponse& res) {
  const std::string* body = ConsoleFile(name);
  if (body == nullptr) {
    net::SetJsonError(res, 404, absl::StrCat("no console file '", name.substr(0, 80), "'"));
    return;
  }
  res.content_type = ContentType(name);
  res.body = *body;
  res.SetHeader("Content-Security-Policy", kContentSecurityPolicy);
  res.SetHeader("X-Content-Type-Options", "nosniff");
  res.SetHeader("X-Frame-Options", "DENY");
  res.SetHeader("Referrer-Policy", "no-referrer");
  res.SetHeader("Cache-Control", "no-cache");
}

}  // namespace

const std::string* ConsoleFile(absl::string_view name) {
  auto it = Files().find(name);
  return it == Files().end() ? nullptr : &it->second;
}

void InstallConsoleRoutes(net::HttpServer& server) {
  server.Route("GET", "/", "none",
               [](const net::HttpRequest&, net::HttpResponse& res) {
                 Serve("index.html", res);
               });
  server.Route("GET", "/console/{file}", "none",
               [](const net::HttpRequest& req, net::HttpResponse& res) {
                 Serve(req.matches[0], res);
               });
}

}  // namespace loom::console
