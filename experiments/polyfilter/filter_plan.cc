#include "experiments/polyfilter/filter_plan.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/read_file.h"
#include "base/status_macros.h"

namespace loom::polyfilter {
namespace {

absl::Status Bad(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("plan: ", field, ": ", what));
}

std::string Join(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : absl::StrCat(parent, ".", key);
}

// `node` must be a map whose keys are all in `known`.
absl::Status CheckMap(const YAML::Node& node, const std::string& field,
                      const std::set<std::string>& known) {
  if (!node.IsMap()) return Bad(field.empty() ? "(top level)" : field, "must be a map");
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    if (known.count(key) == 0) {
      return Bad(Join(field, key),
                 absl::StrCat("unknown field (known: ", absl::StrJoin(known, ", "), ")"));
    }
  }
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<T> ReadScalar(const YAML::Node& node, const std::string& field, T lo, T hi) {
  T value;
  try {
    value = node.as<T>();
  } catch (const YAML::Exception&) {
    return Bad(field, absl::StrCat("must be a number in [", lo, ", ", hi, "]"));
  }
  if (!(value >= lo && value <= hi)) {
    return Bad(field, absl::StrCat("must be in [", lo, ", ", hi, "], got ", value));
  }
  return value;
}

template <typename T>
absl::StatusOr<T> Read(const YAML::Node& parent, const std::string& parent_field,
                       const std::string& key, T lo, T hi, std::optional<T> fallback = {}) {
  const YAML::Node node = parent[key];
  if (!node) {
    if (fallback) return *fallback;
    return Bad(Join(parent_field, key), "missing");
  }
  return ReadScalar<T>(node, Join(parent_field, key), lo, hi);
}

absl::StatusOr<std::vector<int64_t>> ReadInts(const YAML::Node& node, const std::string& field,
                                              int64_t lo, int64_t hi) {
  if (!node || !node.IsSequence() || node.size() == 0) {
    return Bad(field, "must be a non-empty list of integers");
  }
  std::vector<int64_t> out;
  for (size_t i = 0; i < node.size(); ++i) {
    LOOM_ASSIGN_OR_RETURN(int64_t v,
                          ReadScalar<int64_t>(node[i], absl::StrCat(field, "[", i, "]"), lo, hi));
    if (std::find(out.begin(), out.end(), v) != out.end()) {
      return Bad(field, absl::StrCat("duplicate ", v));
    }
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<std::string> ReadString(const YAML::Node& parent, const std::string& parent_field,
                                       const std::string& key, const std::set<std::string>& allowed,
                                       std::optional<std::string> fallback = {}) {
  const std::string field = Join(parent_field, key);
  const YAML::Node node = parent[key];
  if (!node) {
    if (fallback) return *fallback;
    return Bad(field, "missing");
  }
  const std::string value = node.IsScalar() ? node.as<std::string>() : "";
  if (allowed.count(value) == 0) {
    return Bad(field, absl::StrCat("must be one of ", absl::StrJoin(allowed, ", ")));
  }
  return value;
}

absl::StatusOr<std::vector<Family>> ReadFamilies(const YAML::Node& node) {
  if (!node || !node.IsSequence() || node.size() == 0) {
    return Bad("families", "must be a non-empty list");
  }
  std::vector<Family> out;
  for (size_t i = 0; i < node.size(); ++i) {
    const std::string field = absl::StrCat("families[", i, "]");
    LOOM_RETURN_IF_ERROR(CheckMap(node[i], field, {"name", "kind", "edge_prob"}));
    Family f;
    if (!node[i]["name"] || !node[i]["name"].IsScalar()) return Bad(field + ".name", "missing");
    f.name = node[i]["name"].as<std::string>();
    if (f.name.empty() || f.name.find_first_of(",\"\n") != std::string::npos) {
      return Bad(field + ".name", "must be a non-empty name without commas or quotes");
    }
    LOOM_ASSIGN_OR_RETURN(std::string kind,
                          ReadString(node[i], field, "kind", {"erdos_renyi", "orthogonal"}));
    f.kind = kind == "orthogonal" ? GraphKind::kOrthogonal : GraphKind::kErdosRenyi;
    if (f.kind == GraphKind::kErdosRenyi) {
      LOOM_ASSIGN_OR_RETURN(f.edge_prob, Read<double>(node[i], field, "edge_prob", 0.0, 1.0));
    } else if (node[i]["edge_prob"]) {
      return Bad(field + ".edge_prob", "only for kind erdos_renyi");
    }
    out.push_back(f);
  }
  return out;
}

absl::StatusOr<std::vector<GridRow>> ReadGrid(const YAML::Node& node, int64_t nodes) {
  if (!node || !node.IsSequence() || node.size() == 0) {
    return Bad("grid", "must be a non-empty list");
  }
  std::vector<GridRow> out;
  for (size_t i = 0; i < node.size(); ++i) {
    const std::string field = absl::StrCat("grid[", i, "]");
    LOOM_RETURN_IF_ERROR(CheckMap(node[i], field, {"k", "mha", "iha"}));
    GridRow row;
    // N >= k: by Cayley–Hamilton, more than N powers of an N×N matrix are dependent.
    LOOM_ASSIGN_OR_RETURN(row.k, Read<int64_t>(node[i], field, "k", 1, nodes));
    LOOM_ASSIGN_OR_RETURN(row.mha, ReadInts(node[i]["mha"], field + ".mha", 1, 64));
    LOOM_ASSIGN_OR_RETURN(row.iha, ReadInts(node[i]["iha"], field + ".iha", 1, 64));
    out.push_back(row);
  }
  return out;
}

absl::Status ReadModel(const YAML::Node& node, Plan& plan) {
  LOOM_RETURN_IF_ERROR(
      CheckMap(node, "model", {"key_width", "value_width", "scale", "iha_init", "init_noise"}));
  ModelConfig& m = plan.model;
  LOOM_ASSIGN_OR_RETURN(m.key_width, Read<int64_t>(node, "model", "key_width", 0, 4096, 0));
  LOOM_ASSIGN_OR_RETURN(m.value_width, Read<int64_t>(node, "model", "value_width", 0, 4096, 0));
  LOOM_ASSIGN_OR_RETURN(m.scale, Read<double>(node, "model", "scale", 0.0, 1e6, 0.0));
  LOOM_ASSIGN_OR_RETURN(std::string init,
                        ReadString(node, "model", "iha_init", {"near_mha", "random"}, "near_mha"));
  m.iha_init = init == "random" ? Init::kRandom : Init::kNearMha;
  LOOM_ASSIGN_OR_RETURN(m.init_noise, Read<double>(node, "model", "init_noise", 0.0, 10.0, 0.02));
  return absl::OkStatus();
}

absl::Status ReadTrain(const YAML::Node& node, TrainConfig& t) {
  LOOM_RETURN_IF_ERROR(
      CheckMap(node, "train", {"steps", "batch", "lr", "min_lr_ratio", "window", "stop_residual"}));
  LOOM_ASSIGN_OR_RETURN(t.steps, Read<int64_t>(node, "train", "steps", 1, 10000000));
  LOOM_ASSIGN_OR_RETURN(t.batch, Read<int64_t>(node, "train", "batch", 0, 1 << 20));
  LOOM_ASSIGN_OR_RETURN(t.lr, Read<double>(node, "train", "lr", 1e-12, 10.0));
  LOOM_ASSIGN_OR_RETURN(t.min_lr_ratio, Read<double>(node, "train", "min_lr_ratio", 0.0, 1.0));
  LOOM_ASSIGN_OR_RETURN(t.window, Read<int64_t>(node, "train", "window", 1, t.steps));
  LOOM_ASSIGN_OR_RETURN(t.stop_residual, Read<double>(node, "train", "stop_residual", 0.0, 1.0));
  return absl::OkStatus();
}

absl::Status ReadPlan(const YAML::Node& root, Plan& plan) {
  LOOM_RETURN_IF_ERROR(CheckMap(root, "",
                                {"nodes", "features", "dtype", "families", "grid", "seeds",
                                 "restarts", "model", "train", "eval", "report"}));
  LOOM_ASSIGN_OR_RETURN(plan.nodes, Read<int64_t>(root, "", "nodes", 1, 256));
  LOOM_ASSIGN_OR_RETURN(plan.features, Read<int64_t>(root, "", "features", 1, 256));
  LOOM_ASSIGN_OR_RETURN(std::string dtype,
                        ReadString(root, "", "dtype", {"float32", "float64"}, "float64"));
  plan.dtype = dtype == "float32" ? torch::kFloat32 : torch::kFloat64;
  LOOM_ASSIGN_OR_RETURN(plan.families, ReadFamilies(root["families"]));
  LOOM_ASSIGN_OR_RETURN(plan.grid, ReadGrid(root["grid"], plan.nodes));
  LOOM_ASSIGN_OR_RETURN(plan.seeds, ReadInts(root["seeds"], "seeds", 0, 1000000000));
  LOOM_ASSIGN_OR_RETURN(plan.restarts, Read<int64_t>(root, "", "restarts", 1, 1000));
  LOOM_RETURN_IF_ERROR(
      ReadModel(root["model"] ? root["model"] : YAML::Node(YAML::NodeType::Map), plan));
  if (!root["train"]) return Bad("train", "missing");
  LOOM_RETURN_IF_ERROR(ReadTrain(root["train"], plan.train));
  if (!root["eval"]) return Bad("eval", "missing");
  LOOM_RETURN_IF_ERROR(CheckMap(root["eval"], "eval", {"samples"}));
  LOOM_ASSIGN_OR_RETURN(plan.eval_samples,
                        Read<int64_t>(root["eval"], "eval", "samples", 1, 1 << 20));
  if (root["report"])
    LOOM_RETURN_IF_ERROR(CheckMap(root["report"], "report", {"threshold", "secondary_threshold"}));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Plan> ParsePlan(const std::string& yaml) {
  Plan plan;
  try {
    LOOM_RETURN_IF_ERROR(ReadPlan(YAML::Load(yaml), plan));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("plan: not YAML: ", e.what()));
  }
  return plan;
}

absl::StatusOr<Plan> LoadPlan(const std::string& path) {
  LOOM_ASSIGN_OR_RETURN(std::string text, ReadFile(path, "--plan"));
  return ParsePlan(text);
}

LayerShape CellShape(const Plan& plan, int64_t k, bool iha, int64_t heads) {
  LayerShape s;
  s.nodes = plan.nodes;
  s.features = plan.features;
  s.powers = k;
  s.heads = heads;
  s.pseudo = iha ? heads : 1;
  s.mixing = iha;
  s.key_width = plan.model.key_width > 0 ? plan.model.key_width : plan.nodes;
  s.value_width = plan.model.value_width > 0 ? plan.model.value_width : k * plan.features;
  s.scale =
      plan.model.scale > 0 ? plan.model.scale : 1.0 / std::sqrt(static_cast<double>(s.key_width));
  s.dtype = plan.dtype;
  return s;
}

}  // namespace loom::polyfilter
