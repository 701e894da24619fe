#include "cli/output.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/rest_client.h"

namespace loom::cli {
namespace {

// A float that YAML 1.1 readers (PyYAML) also read as a float: with a '.' in the mantissa.
std::string YamlFloat(double v) {
  if (std::isnan(v)) return ".nan";
  if (std::isinf(v)) return v > 0 ? ".inf" : "-.inf";
  std::string t = absl::StrFormat("%.17g", v);
  for (int precision = 1; precision < 17; ++precision) {  // the shortest that round-trips
    std::string shorter = absl::StrFormat("%.*g", precision, v);
    if (std::strtod(shorter.c_str(), nullptr) == v) {
      t = shorter;
      break;
    }
  }
  if (t.find('.') != std::string::npos) return t;
  const size_t e = t.find_first_of("eE");
  return e == std::string::npos ? t + ".0" : t.substr(0, e) + ".0" + t.substr(e);
}

// JSON to block YAML with the same types: strings always quoted (so "40", "true" or "" stay
// strings, as the JSON output has them), numbers and booleans plain.
void EmitYaml(YAML::Emitter& out, const nlohmann::ordered_json& j) {
  if (j.is_object()) {
    out << YAML::BeginMap;
    for (const auto& [k, v] : j.items()) {
      out << YAML::Key << k << YAML::Value;
      EmitYaml(out, v);
    }
    out << YAML::EndMap;
  } else if (j.is_array()) {
    out << YAML::BeginSeq;
    for (const auto& v : j) EmitYaml(out, v);
    out << YAML::EndSeq;
  } else if (j.is_string()) {
    out << YAML::DoubleQuoted << j.get<std::string>();
  } else if (j.is_boolean()) {
    out << YAML::TrueFalseBool << j.get<bool>();
  } else if (j.is_number_float()) {
    out << YamlFloat(j.get<double>());
  } else if (j.is_number_unsigned()) {
    out << j.get<uint64_t>();
  } else if (j.is_number_integer()) {
    out << j.get<int64_t>();
  } else {
    out << YAML::Null;
  }
}

}  // namespace

absl::StatusOr<Output> ParseOutput(const std::string& name) {
  if (name == "table") return Output::kTable;
  if (name == "json") return Output::kJson;
  if (name == "yaml") return Output::kYaml;
  return absl::InvalidArgumentError(
      absl::StrCat("--output: expected table, json or yaml, got '", name, "'"));
}

std::string FormatMessage(const google::protobuf::Message& m, Output output) {
  // One line per document: `-o json` output is JSON lines when a command prints several.
  const std::string json = client::MessageToJson(m, /*pretty=*/false, /*with_defaults=*/true);
  if (output != Output::kYaml) return json;
  YAML::Emitter out;
  EmitYaml(out, nlohmann::ordered_json::parse(json));
  return std::string(out.c_str()) + "\n";
}

}  // namespace loom::cli
