// One way to print a Loom message as JSON: proto field names (job files, manifests and the REST
// API all use them), optionally indented and with default-valued fields. Printing a well-formed
// message cannot fail; ParseJsonMessage (spec.h) reads it back.
#ifndef LOOM_API_PROTO_JSON_H_
#define LOOM_API_PROTO_JSON_H_

#include <google/protobuf/message.h>

#include <string>

namespace loom {

std::string MessageToJsonText(const google::protobuf::Message& m, bool pretty = false,
                              bool with_defaults = false);

}  // namespace loom

#endif  // LOOM_API_PROTO_JSON_H_
