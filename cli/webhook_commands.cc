#include "cli/webhook_commands.h"

#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "loom/v1/control.pb.h"

namespace loom::cli {
namespace {

constexpr char kPath[] = "/v1/admin/webhooks";

absl::Status Add(client::RestClient& client, const std::string& url, const CliArgs& args,
                 Output output) {
  v1::Webhook w;
  w.set_url(url);
  for (absl::string_view e : absl::StrSplit(args.Get("events"), ',', absl::SkipWhitespace())) {
    w.add_events(std::string(e));
  }
  w.set_format(args.Get("format"));
  w.set_secret(args.Get("secret"));
  v1::Webhook added;
  LOOM_RETURN_IF_ERROR(client.Call("POST", kPath, &w, &added));
  if (output != Output::kTable) {
    std::cout << FormatMessage(added, output) << "\n";
    return absl::OkStatus();
  }
  std::cout << "added " << added.id() << " (" << added.format() << ") for "
            << absl::StrJoin(added.events(), ",") << "\n"
            << "secret: " << added.secret()
            << "\n(shown only now: verify X-Loom-Signature with it, docs/control-plane.md)\n";
  return absl::OkStatus();
}

absl::Status List(client::RestClient& client, Output output) {
  v1::ListWebhooksResponse r;
  LOOM_RETURN_IF_ERROR(client.Call("GET", kPath, nullptr, &r));
  if (output != Output::kTable) {
    std::cout << FormatMessage(r, output) << "\n";
    return absl::OkStatus();
  }
  std::cout << absl::StrFormat("%-10s %-6s %-40s %s\n", "ID", "FORMAT", "EVENTS", "URL");
  for (const auto& w : r.webhooks()) {
    std::cout << absl::StrFormat("%-10s %-6s %-40s %s\n", w.id(), w.format(),
                                 absl::StrJoin(w.events(), ","), w.url());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunWebhookCommand(client::RestClient& client, const std::string& what,
                               const std::string& arg, const CliArgs& args, Output output) {
  if (what == "add") return Add(client, arg, args, output);
  if (what == "list") return List(client, output);
  LOOM_RETURN_IF_ERROR(
      client.Call("DELETE", absl::StrCat(kPath, "/", client::QueryValue(arg)), nullptr, nullptr));
  std::cout << "removed " << arg << " (and its deliveries not made yet)\n";
  return absl::OkStatus();
}

}  // namespace loom::cli
