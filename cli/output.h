// How `loom` prints results: a table for people (the default) or every field of the API's
// message as JSON or YAML (`-o json|yaml`, `--json`), default values included, so scripts can
// rely on a field being present.
#ifndef LOOM_CLI_OUTPUT_H_
#define LOOM_CLI_OUTPUT_H_

#include <google/protobuf/message.h>

#include <string>

#include "absl/status/statusor.h"

namespace loom::cli {

enum class Output { kTable, kJson, kYaml };

absl::StatusOr<Output> ParseOutput(const std::string& name);  // table | json | yaml

// The message with every field (proto3 JSON names as the API prints them), as JSON or YAML.
std::string FormatMessage(const google::protobuf::Message& m, Output output);

}  // namespace loom::cli

#endif  // LOOM_CLI_OUTPUT_H_
