#include "coordinator/sweep_cells.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "loom/proto_json.h"
#include "loom/spec.h"

namespace loom::coordinator {
namespace {

// "field: message", as every sweep error names its field (submit_validation.h's FieldError,
// which this library cannot link: it is the coordinator's).
absl::Status FieldError(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

}  // namespace

std::string ValueText(const google::protobuf::Value& v) {
  if (v.has_string_value()) return v.string_value();
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(v, &json);
  return json;
}

namespace {

// "a.b[2].c" -> {"a", "b", 2, "c"} as (key, index) steps; index -1 for a key.
absl::StatusOr<std::vector<std::pair<std::string, int>>> ParsePath(const std::string& path) {
  std::vector<std::pair<std::string, int>> steps;
  std::string p = path;
  if (absl::StartsWith(p, "spec.")) p = p.substr(5);
  for (absl::string_view part : absl::StrSplit(p, '.')) {
    const size_t bracket = part.find('[');
    const std::string key(part.substr(0, bracket));
    if (key.empty()) return absl::InvalidArgumentError("empty path component");
    steps.push_back({key, -1});
    absl::string_view rest =
        part.substr(bracket == absl::string_view::npos ? part.size() : bracket);
    while (!rest.empty()) {
      const size_t close = rest.find(']');
      int index = -1;
      if (rest[0] != '[' || close == absl::string_view::npos ||
          !absl::SimpleAtoi(rest.substr(1, close - 1), &index) || index < 0 || index > 1000) {
        return absl::InvalidArgumentError("malformed index (want name[N])");
      }
      steps.push_back({"", index});
      rest = rest.substr(close + 1);
    }
  }
  return steps;
}

absl::Status SetPath(nlohmann::json& root, const std::string& path, const nlohmann::json& value) {
  LOOM_ASSIGN_OR_RETURN(auto steps, ParsePath(path));
  nlohmann::json* at = &root;
  for (const auto& [key, index] : steps) {
    if (index < 0) {
      if (at->is_null()) *at = nlohmann::json::object();
      if (!at->is_object())
        return absl::InvalidArgumentError(absl::StrCat("'", key, "' is not in an object"));
      at = &(*at)[key];
    } else {
      if (at->is_null()) *at = nlohmann::json::array();
      if (!at->is_array())
        return absl::InvalidArgumentError("indexing something that is not a list");
      if (static_cast<size_t>(index) > at->size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("index ", index, " past the end (the list has ", at->size(), ")"));
      }
      if (static_cast<size_t>(index) == at->size()) at->push_back(nullptr);
      at = &(*at)[static_cast<size_t>(index)];
    }
  }
  *at = value;
  return absl::OkStatus();
}

}  // namespace

bool IsReasoningMetric(const std::string& metric) {
  return metric == "pass@1" || metric == "maj@k" || metric == "answered";
}

absl::Status CheckMetricAndSelect(const std::string& metric, const std::string& select,
                                  int64_t length, double threshold) {
  if (!metric.empty() && metric != "eval_loss" && metric != "accuracy" && metric != "exact_match" &&
      !IsReasoningMetric(metric)) {
    return FieldError("metric", "eval_loss | accuracy | exact_match | pass@1 | maj@k | answered");
  }
  if (IsReasoningMetric(metric) && (select == "best" || select == "test")) {
    return FieldError("select", absl::StrCat(metric,
                                             " is a reasoning evaluation's: final | reach | "
                                             "mean (best and test go by eval loss)"));
  }
  if (IsReasoningMetric(metric) && length > 0) {
    return FieldError("length", absl::StrCat(metric,
                                             " is a reasoning evaluation's, which has no "
                                             "eval.lengths"));
  }
  if (!select.empty() && select != "final" && select != "best" && select != "test" &&
      select != "reach" && select != "mean") {
    return FieldError("select", "final | best | test | reach | mean");
  }
  if (length < 0) return FieldError("length", "must be >= 0 (0 = the training length)");
  if (length > 0 && (select == "test" || select == "reach" || select == "mean")) {
    return FieldError("length", "is an end-of-run evaluation: select final or best, not " + select);
  }
  if (select != "reach") return absl::OkStatus();
  const bool loss = metric.empty() || metric == "eval_loss";
  if (!(threshold > 0) || !std::isfinite(threshold) || (!loss && threshold > 1)) {
    return FieldError("threshold", absl::StrCat("select reach needs the level to reach: ",
                                                loss ? "an eval_loss > 0" : "a fraction in (0, 1]",
                                                ", got ", threshold));
  }
  return absl::OkStatus();
}

namespace {

// The grid's combinations: paths sorted (a protobuf map iterates in no fixed order), values in
// their order.
absl::StatusOr<std::vector<SweepCell>> GridCells(const v1::SweepSpec& spec) {
  const std::map<std::string, google::protobuf::ListValue> sorted_grid(spec.grid().begin(),
                                                                       spec.grid().end());
  std::vector<SweepCell> grid = {SweepCell{}};
  for (const auto& [path, values] : sorted_grid) {
    std::vector<SweepCell> next;
    for (const SweepCell& cell : grid) {
      for (const auto& v : values.values()) {
        SweepCell c = cell;
        c.set.emplace_back(path, v);
        next.push_back(std::move(c));
      }
    }
    grid = std::move(next);
  }
  return grid;
}

// A listed cell `l` crossed with grid cell `g`: its settings, and a name from the listed cell's
// and the grid's settings ("base" for the base spec alone).
SweepCell CrossCell(const SweepCell& l, const SweepCell& g) {
  SweepCell c = l;
  c.set.insert(c.set.end(), g.set.begin(), g.set.end());
  std::vector<std::string> parts;
  for (const auto& [path, v] : g.set) parts.push_back(absl::StrCat(path, "=", ValueText(v)));
  if (c.name.empty() && parts.empty()) {
    for (const auto& [path, v] : c.set) parts.push_back(absl::StrCat(path, "=", ValueText(v)));
  }
  c.name = absl::StrJoin({c.name, absl::StrJoin(parts, ",")},
                         c.name.empty() || parts.empty() ? "" : ",");
  if (c.name.empty()) c.name = "base";
  return c;
}

}  // namespace

absl::Status CheckSweepSize(const v1::SweepSpec& spec) {
  // Products saturate at kMaxSweepJobs + 1 (times never exceeds it): a hostile grid's product
  // must not overflow into a small number, and nothing past the limit needs counting.
  constexpr uint64_t kOver = kMaxSweepJobs + 1;
  auto times = [](uint64_t a, uint64_t b) { return b != 0 && a > kOver / b ? kOver : a * b; };
  uint64_t grid = 1;
  for (const auto& [path, values] : spec.grid()) {
    if (values.values().empty()) return FieldError(absl::StrCat("grid.", path), "no values");
    grid = times(grid, values.values_size());
  }
  const uint64_t cells = std::max(1, spec.cells_size());
  const uint64_t seeds = spec.seeds_size();
  const uint64_t jobs = times(times(cells, grid), seeds);
  if (jobs > kMaxSweepJobs) {
    return FieldError("cells",
                      absl::StrCat(cells, " cells x ", grid == kOver ? "over " : "",
                                   std::min<uint64_t>(grid, kMaxSweepJobs), " grid combinations x ",
                                   seeds, " seeds is more than ", kMaxSweepJobs, " jobs"));
  }
  // Every job stores its own copy of the base spec with a cell's settings.
  size_t largest_cell = 0;
  for (const auto& cell : spec.cells()) largest_cell = std::max(largest_cell, cell.ByteSizeLong());
  size_t largest_grid_value = 0;
  for (const auto& [path, values] : spec.grid()) {
    for (const auto& v : values.values())
      largest_grid_value = std::max(largest_grid_value, path.size() + v.ByteSizeLong());
  }
  const size_t per_job =
      spec.base().ByteSizeLong() + largest_cell + spec.grid_size() * largest_grid_value;
  if (per_job * jobs > kMaxSweepSpecBytes) {
    return FieldError("base.spec", absl::StrCat(jobs, " jobs of up to ", per_job,
                                                " bytes of spec each is more than ",
                                                kMaxSweepSpecBytes >> 20, " MiB in all"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SweepCell>> ExpandSweep(const v1::SweepSpec& spec) {
  if (!spec.has_base() || !spec.base().has_spec()) return FieldError("base.spec", "is required");
  if (spec.seeds().empty()) return FieldError("seeds", "at least one seed");
  LOOM_RETURN_IF_ERROR(CheckSweepSize(spec));
  std::set<uint64_t> seeds(spec.seeds().begin(), spec.seeds().end());
  if (seeds.size() != static_cast<size_t>(spec.seeds_size())) {
    return FieldError("seeds", "each seed at most once");
  }
  LOOM_RETURN_IF_ERROR(
      CheckMetricAndSelect(spec.metric(), spec.select(), spec.length(), spec.threshold()));
  LOOM_ASSIGN_OR_RETURN(const std::vector<SweepCell> grid, GridCells(spec));
  std::vector<SweepCell> listed;
  for (int i = 0; i < spec.cells_size(); ++i) {
    SweepCell c;
    c.name = spec.cells(i).name();
    for (const auto& [path, v] : spec.cells(i).set().fields()) c.set.emplace_back(path, v);
    listed.push_back(std::move(c));
  }
  if (listed.empty()) listed.push_back(SweepCell{});
  std::vector<SweepCell> cells;
  std::set<std::string> names;
  for (const SweepCell& l : listed) {
    for (const SweepCell& g : grid) {
      SweepCell c = CrossCell(l, g);
      if (c.name.size() > 200)
        return FieldError("cells", absl::StrCat("cell name too long: ", c.name.substr(0, 60)));
      if (!names.insert(c.name).second) {
        return FieldError("cells", absl::StrCat("two cells are named '", c.name, "'"));
      }
      cells.push_back(std::move(c));
    }
  }
  if (!spec.baseline().empty() && !names.count(spec.baseline())) {
    return FieldError("baseline", absl::StrCat("no cell named '", spec.baseline(),
                                               "' (cells: ", absl::StrJoin(names, "; "), ")"));
  }
  return cells;
}

absl::StatusOr<v1::JobSpec> ApplyCell(const v1::JobSpec& base, const SweepCell& cell,
                                      uint64_t seed) {
  nlohmann::json json = nlohmann::json::parse(MessageToJsonText(base), nullptr, false);
  if (json.is_discarded()) return absl::InternalError("base spec does not print as JSON");
  for (const auto& [path, value] : cell.set) {
    nlohmann::json v = nlohmann::json::parse(ValueText(value), nullptr, false);
    if (value.has_string_value()) v = value.string_value();
    if (absl::Status s = SetPath(json, path, v); !s.ok()) {
      return FieldError(absl::StrCat("cells[", cell.name, "].", path), std::string(s.message()));
    }
  }
  v1::JobSpec spec;
  const std::string where = absl::StrCat("cell '", cell.name, "'");
  LOOM_RETURN_IF_ERROR(ParseJsonMessage(json.dump(), where, &spec));
  spec.set_seed(seed);
  return spec;
}

}  // namespace loom::coordinator
