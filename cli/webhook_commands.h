// `loom admin webhook add|list|delete` (docs/control-plane.md, "Webhooks"): the CLI side of
// /v1/admin/webhooks.
#ifndef LOOM_CLI_WEBHOOK_COMMANDS_H_
#define LOOM_CLI_WEBHOOK_COMMANDS_H_

#include <string>

#include "absl/status/status.h"
#include "base/cli_args.h"
#include "cli/output.h"
#include "client/rest_client.h"

namespace loom::cli {

// `what`: add (arg: the URL; --events, --format, --secret) | list | delete (arg: the id).
absl::Status RunWebhookCommand(client::RestClient& client, const std::string& what,
                               const std::string& arg, const CliArgs& args, Output output);

}  // namespace loom::cli

#endif  // LOOM_CLI_WEBHOOK_COMMANDS_H_
