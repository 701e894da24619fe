#include "loom/proto_json.h"

#include <google/protobuf/util/json_util.h>

namespace loom {

std::string MessageToJsonText(const google::protobuf::Message& m, bool pretty, bool with_defaults) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.add_whitespace = pretty;
  options.always_print_primitive_fields = with_defaults;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(m, &json, options);
  return json;
}

}  // namespace loom
