// `loom sweep submit|list|status|cancel|report` (docs/sweeps.md): the CLI side of /v1/sweeps.
#ifndef LOOM_CLI_SWEEP_COMMANDS_H_
#define LOOM_CLI_SWEEP_COMMANDS_H_

#include <string>

#include "absl/status/status.h"
#include "base/cli_args.h"
#include "cli/output.h"
#include "client/rest_client.h"

namespace loom::cli {

// `loom sweep expand FILE [--cell NAME] [--seed N]`: the job specs the sweep file makes, as
// submitting it would, without a coordinator. One (cell, seed): its JobSpec as JSON, which
// `loom-train train --spec` takes; several: a JSON list of {cell, seed, spec}. Errors name the
// flag and list the choices.
absl::Status ExpandSweepFile(const std::string& file, const CliArgs& args);

// `what`: submit | list | status | cancel | report; `arg`: the file (submit) or the sweep id.
absl::Status RunSweepCommand(client::RestClient& client, const std::string& what,
                             const std::string& arg, const CliArgs& args, Output output);

}  // namespace loom::cli

#endif  // LOOM_CLI_SWEEP_COMMANDS_H_
