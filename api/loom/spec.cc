#include "loom/spec.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/util/json_util.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/read_file.h"
#include "base/status_macros.h"
#include "storage/checkpoint.h"

namespace loom {
namespace {

absl::Status FieldError(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("model.", field, ": ", why));
}

// Replaces c->hybrid() by the equivalent explicit schedule.
absl::Status ExpandHybrid(v1::ModelConfig* c) {
  v1::HybridSchedule h = c->hybrid();
  if (h.local_per_global() < 0)
    return FieldError("hybrid.local_per_global", "must be >= 0 (0 = 4)");
  if (h.local_per_global() == 0) h.set_local_per_global(4);
  if (h.local_kind().empty()) h.set_local_kind("iha");
  if (h.global_kind().empty()) h.set_global_kind("mha");
  if (h.window() < 0) return FieldError("hybrid.window", "must be >= 0 (0 = max_seq_len / (2·P²))");
  int64_t p = c->n_heads();
  if (auto it = h.iha_options().fields().find("p"); it != h.iha_options().fields().end()) {
    if (it->second.kind_case() != google::protobuf::Value::kNumberValue ||
        it->second.number_value() < 1 ||
        it->second.number_value() != std::floor(it->second.number_value())) {
      return FieldError("hybrid.iha_options.p", "must be a positive integer");
    }
    p = static_cast<int64_t>(it->second.number_value());
  }
  const int64_t window =
      h.window() > 0 ? h.window() : std::max<int64_t>(1, c->max_seq_len() / (2 * p * p));
  auto entry = [&](const std::string& kind, int32_t repeat, int64_t w) {
    auto* e = c->add_schedule();
    e->set_repeat(repeat);
    e->mutable_attention()->set_plugin(kind);
    e->mutable_attention()->set_window(w);
    if (kind == "iha") *e->mutable_attention()->mutable_options() = h.iha_options();
  };
  entry(h.local_kind(), h.local_per_global(), window);
  entry(h.global_kind(), 1, 0);
  c->clear_hybrid();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ModelConfig> ResolveModelConfig(const v1::ModelConfig& in) {
  v1::ModelConfig c = in;
  if (c.d_model() <= 0 || c.d_model() > 65536)
    return FieldError("d_model", "must be in [1, 65536]");
  if (c.n_layers() <= 0 || c.n_layers() > 1024)
    return FieldError("n_layers", "must be in [1, 1024]");
  if (c.n_heads() <= 0 || c.n_heads() > 1024) return FieldError("n_heads", "must be in [1, 1024]");
  if (c.head_dim() < 0) return FieldError("head_dim", "must be >= 0 (0 = d_model / n_heads)");
  if (c.head_dim() == 0) {
    if (c.d_model() % c.n_heads() != 0) {
      return FieldError("n_heads",
                        absl::StrCat("d_model ", c.d_model(), " is not divisible by n_heads ",
                                     c.n_heads(), " (or set head_dim)"));
    }
    c.set_head_dim(c.d_model() / c.n_heads());
  }
  if (c.ffn_hidden() < 0) return FieldError("ffn_hidden", "must be >= 0 (0 = 4 * d_model)");
  if (c.ffn_hidden() == 0) c.set_ffn_hidden(4 * c.d_model());
  // Left empty when not given ("none"), so specs and their hashes stay what they were.
  if (!c.activation_checkpointing().empty() && c.activation_checkpointing() != "none" &&
      c.activation_checkpointing() != "full" && c.activation_checkpointing() != "selective") {
    return FieldError("activation_checkpointing", absl::StrCat("'", c.activation_checkpointing(),
                                                               "' is not none | full | selective"));
  }
  if (c.ffn_activation().empty()) c.set_ffn_activation("gelu");
  if (c.ffn_activation() != "gelu" && c.ffn_activation() != "swiglu") {
    return FieldError("ffn_activation",
                      absl::StrCat("'", c.ffn_activation(), "' is not gelu | swiglu"));
  }
  if (c.vocab_size() <= 0) return FieldError("vocab_size", "must be >= 1");
  if (c.max_seq_len() <= 0) return FieldError("max_seq_len", "must be >= 1");
  if (!std::isfinite(c.rope_theta()) || c.rope_theta() < 0) {
    return FieldError("rope_theta", "must be a finite number >= 0 (0 = off)");
  }
  if (c.rope_theta() > 0 && c.head_dim() % 2 != 0) {
    return FieldError("head_dim", "must be even when RoPE is on");
  }
  if (c.mode().empty()) c.set_mode("decoder");
  if (c.mode() != "decoder" && c.mode() != "encoder") {
    return FieldError("mode", absl::StrCat("'", c.mode(), "' is not decoder | encoder"));
  }
  if (c.mode() == "encoder") {
    if (c.num_classes() <= 0) return FieldError("num_classes", "must be >= 1 in encoder mode");
    if (c.tie_embeddings()) return FieldError("tie_embeddings", "has no meaning in encoder mode");
  } else {
    if (c.num_classes() != 0) return FieldError("num_classes", "is for encoder mode only");
    if (c.grid_max_rows() != 0 || c.grid_max_cols() != 0) {
      return FieldError("grid_max_rows", "grid positions are for encoder mode only");
    }
  }
  if (c.grid_max_rows() < 0 || c.grid_max_cols() < 0 ||
      (c.grid_max_rows() > 0) != (c.grid_max_cols() > 0)) {
    return FieldError("grid_max_rows",
                      "grid_max_rows and grid_max_cols must both be > 0 or both 0");
  }
  if (c.norm_eps() < 0 || !std::isfinite(c.norm_eps()))
    return FieldError("norm_eps", "must be >= 0");
  if (c.norm_eps() == 0) c.set_norm_eps(1e-5);
  if (c.has_hybrid()) {
    if (!c.schedule().empty()) return FieldError("hybrid", "is exclusive with schedule");
    LOOM_RETURN_IF_ERROR(ExpandHybrid(&c));
  }
  if (c.schedule().empty()) {
    auto* entry = c.add_schedule();
    entry->set_repeat(1);
    entry->mutable_attention()->set_plugin("mha");
  }
  for (int i = 0; i < c.schedule_size(); ++i) {
    const auto& e = c.schedule(i);
    const std::string field = absl::StrCat("schedule[", i, "]");
    if (e.repeat() <= 0) return FieldError(field + ".repeat", "must be >= 1");
    if (e.attention().plugin().empty())
      return FieldError(field + ".attention.plugin", "is required");
    if (e.attention().window() < 0) return FieldError(field + ".attention.window", "must be >= 0");
    if (e.attention().window() > c.max_seq_len()) {
      return FieldError(
          field + ".attention.window",
          absl::StrCat(e.attention().window(), " exceeds max_seq_len ", c.max_seq_len()));
    }
  }
  return c;
}

std::vector<v1::AttentionConfig> ExpandSchedule(const v1::ModelConfig& c) {
  std::vector<v1::AttentionConfig> layers;
  while (static_cast<int>(layers.size()) < c.n_layers()) {
    for (const auto& entry : c.schedule()) {
      for (int r = 0; r < entry.repeat() && static_cast<int>(layers.size()) < c.n_layers(); ++r) {
        layers.push_back(entry.attention());
      }
    }
  }
  return layers;
}

absl::Status ParseJsonMessage(const std::string& json, const std::string& source,
                              google::protobuf::Message* out) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  auto status = google::protobuf::util::JsonStringToMessage(json, out, options);
  if (!status.ok())
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", status.ToString()));
  return absl::OkStatus();
}

namespace {

absl::StatusOr<nlohmann::json> YamlNodeToJson(const YAML::Node& node, const std::string& source) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return nlohmann::json(nullptr);
    case YAML::NodeType::Sequence: {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& item : node) {
        LOOM_ASSIGN_OR_RETURN(nlohmann::json v, YamlNodeToJson(item, source));
        out.push_back(std::move(v));
      }
      return out;
    }
    case YAML::NodeType::Map: {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& kv : node) {
        if (!kv.first.IsScalar()) {  // `? [a, b]: c` — a key JSON cannot have
          return absl::InvalidArgumentError(absl::StrCat(source, ":", kv.first.Mark().line + 1,
                                                         ": a key must be a plain string"));
        }
        const std::string key = kv.first.Scalar();
        if (out.contains(key)) {
          return absl::InvalidArgumentError(
              absl::StrCat(source, ":", kv.first.Mark().line + 1, ": duplicate key '", key, "'"));
        }
        LOOM_ASSIGN_OR_RETURN(out[key], YamlNodeToJson(kv.second, source));
      }
      return out;
    }
    case YAML::NodeType::Scalar: {
      const std::string text = node.Scalar();
      if (node.Tag() != "!") {  // plain (unquoted) scalar: numbers and booleans keep their type
        if (text == "true" || text == "false") return nlohmann::json(text == "true");
        if (text == "null" || text == "~") return nlohmann::json(nullptr);
        nlohmann::json number = nlohmann::json::parse(text, nullptr, false);
        if (!number.is_discarded() && number.is_number()) return number;
      }
      return nlohmann::json(text);
    }
  }
  return nlohmann::json(nullptr);
}

constexpr int64_t kMaxCheckpointIntervalSeconds = 365 * 24 * 3600;

absl::Status SpecError(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

bool InRange(double v, double lo, double hi) { return std::isfinite(v) && v >= lo && v <= hi; }

uint64_t Fnv1a(const std::string& data) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : data) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string Deterministic(const google::protobuf::Message& m) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    m.SerializeToCodedStream(&coded);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> YamlToJson(const std::string& yaml, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ":", e.mark.line + 1, ":", e.mark.column + 1, ": ", e.msg));
  }
  absl::StatusOr<nlohmann::json> json;
  try {
    json = YamlNodeToJson(root, source);
  } catch (const YAML::Exception& e) {  // what the node walk did not foresee
    return absl::InvalidArgumentError(
        absl::StrCat(source, ":", e.mark.line + 1, ":", e.mark.column + 1, ": ", e.msg));
  }
  if (!json.ok()) return json.status();
  try {
    return json->dump();
  } catch (const nlohmann::json::type_error&) {  // a string that is not UTF-8
    return absl::InvalidArgumentError(absl::StrCat(source, ": not UTF-8 text"));
  }
}

absl::StatusOr<v1::JobSpec> ReadJobSpecFile(const std::string& path) {
  LOOM_ASSIGN_OR_RETURN(std::string json, ReadFile(path, "--spec"));
  const bool yaml = absl::EndsWith(path, ".yaml") || absl::EndsWith(path, ".yml");
  if (yaml) {
    LOOM_ASSIGN_OR_RETURN(json, YamlToJson(json, path));
  }
  v1::JobSpec spec;
  LOOM_RETURN_IF_ERROR(ParseJsonMessage(json, path, &spec));
  return spec;
}

namespace {

bool IsPluginName(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

// loss_scale: the mode defaults by precision (fp16 needs scaling: its gradients underflow).
absl::Status NormalizeLossScale(v1::JobSpec& j) {
  v1::LossScaleConfig* ls = j.mutable_loss_scale();
  if (ls->mode().empty()) ls->set_mode(j.precision() == "fp16" ? "dynamic" : "none");
  if (ls->mode() != "none" && ls->mode() != "dynamic") {
    return SpecError("loss_scale.mode", absl::StrCat("'", ls->mode(), "' is not none | dynamic"));
  }
  if (j.precision() == "fp16" && ls->mode() == "none") {
    return SpecError("loss_scale.mode", "fp16 needs dynamic (its gradients underflow without it)");
  }
  if (ls->initial() == 0) ls->set_initial(65536);
  if (!(ls->initial() >= 1 && ls->initial() <= 0x1p127)) {
    return SpecError("loss_scale.initial", "must be in [1, 2^127] (0 = 65536)");
  }
  if (ls->growth_interval() == 0) ls->set_growth_interval(2000);
  if (ls->growth_interval() < 1 || ls->growth_interval() > 1000000000) {
    return SpecError("loss_scale.growth_interval", "must be in [1, 10^9] (0 = 2000)");
  }
  return absl::OkStatus();
}

absl::Status ResolveReasoningEval(v1::JobSpec& j) {
  v1::ReasoningEvalConfig* r = j.mutable_reasoning_eval();
  if (r->source().empty()) r->set_source("builtin");
  const std::string& src = r->source();
  if (src != "builtin" && src != "gsm8k" && src != "math500" && src != "chat") {
    return SpecError("reasoning_eval.source",
                     absl::StrCat("'", src, "' is not builtin | gsm8k | math500 | chat"));
  }
  if (src == "builtin") {
    if (!r->path().empty())
      return SpecError("reasoning_eval.path", "is for file sources (gsm8k | math500 | chat)");
    if (r->task().empty()) {
      const bool generated = j.kind() == "sft" && !j.data().task().empty();
      r->set_task(generated ? j.data().task() : "mixed");
    }
    if (r->task() != "arithmetic" && r->task() != "relation" && r->task() != "mixed") {
      return SpecError("reasoning_eval.task",
                       absl::StrCat("'", r->task(), "' is not arithmetic | relation | mixed"));
    }
    if (r->problems() == 0) r->set_problems(64);
    if (r->ops().empty() && j.kind() == "sft" && j.data().task_options().fields().count("ops")) {
      const auto& v = j.data().task_options().fields().at("ops");
      r->set_ops(v.has_number_value() ? absl::StrCat(static_cast<int64_t>(v.number_value()))
                                      : v.string_value());
    }
  } else {
    if (r->path().empty())
      return SpecError("reasoning_eval.path", absl::StrCat("is required for source ", src));
    if (!r->task().empty()) return SpecError("reasoning_eval.task", "is for source builtin");
    if (!r->ops().empty()) return SpecError("reasoning_eval.ops", "is for source builtin");
  }
  if (r->problems() < 0 || r->problems() > 1000000)
    return SpecError("reasoning_eval.problems", "must be in [0, 1000000] (0 = 64 or the file)");
  if (r->samples() == 0) r->set_samples(16);
  if (r->samples() < 1 || r->samples() > 1024)
    return SpecError("reasoning_eval.samples", "must be in [1, 1024] (0 = 16)");
  if (r->answer_style().empty()) r->set_answer_style(src == "math500" ? "math" : "gsm8k");
  if (r->answer_style() != "gsm8k" && r->answer_style() != "math") {
    return SpecError("reasoning_eval.answer_style",
                     absl::StrCat("'", r->answer_style(), "' is not gsm8k | math"));
  }
  if (r->format().empty())
    r->set_format(j.kind() == "sft" && !j.data().format().empty() ? j.data().format()
                                                                  : "openthoughts");
  if (!IsPluginName(r->format()))
    return SpecError("reasoning_eval.format", "must be a plugin name, [a-z0-9_]+");
  if (r->when().empty()) r->set_when("end");
  if (r->when() != "end" && r->when() != "never") {
    return SpecError("reasoning_eval.when", absl::StrCat("'", r->when(), "' is not end | never"));
  }
  v1::GenerationConfig* g = r->mutable_generation();
  if (g->temperature() == 0) g->set_temperature(0.6);
  if (!InRange(g->temperature(), 1e-6, 100))
    return SpecError("reasoning_eval.generation.temperature", "must be in (0, 100] (0 = 0.6)");
  if (g->top_p() == 0) g->set_top_p(1.0);
  if (!InRange(g->top_p(), 1e-9, 1))
    return SpecError("reasoning_eval.generation.top_p", "must be in (0, 1] (0 = 1)");
  if (g->max_new_tokens() == 0) g->set_max_new_tokens(256);
  if (g->max_new_tokens() < 1 || g->max_new_tokens() > (int64_t{1} << 20))
    return SpecError("reasoning_eval.generation.max_new_tokens", "must be in [1, 2^20] (0 = 256)");
  if (g->stop_size() > 16) return SpecError("reasoning_eval.generation.stop", "at most 16 strings");
  for (const std::string& s : g->stop()) {
    if (s.empty() || s.size() > 256)
      return SpecError("reasoning_eval.generation.stop", "each string is 1..256 bytes");
  }
  if (g->seed() == 0) g->set_seed(j.seed());
  if (g->batch() == 0) g->set_batch(16);
  if (g->batch() < 1 || g->batch() > 4096)
    return SpecError("reasoning_eval.generation.batch", "must be in [1, 4096] (0 = 16)");
  return absl::OkStatus();
}

}  // namespace

namespace {

// The preset under the spec (its schedule replaced, not appended to, by the spec's own).
absl::StatusOr<v1::JobSpec> WithPreset(const v1::JobSpec& in) {
  v1::JobSpec j;
  if (!in.preset().empty()) {
    auto preset = JobPreset(in.preset());
    if (!preset.ok()) return SpecError("preset", std::string(preset.status().message()));
    j = *preset;
    if (!in.model().schedule().empty() || in.model().has_hybrid())
      j.mutable_model()->clear_schedule();
  }
  // The spec's `optional` fields (rope_theta, the optimizer's) win when set, even to 0.
  j.MergeFrom(in);
  if (!in.preset().empty() && !in.optimizer().has_warmup_steps()) {
    // The preset's warm-up is sized for its own run length; a shorter run warms up for a tenth.
    j.mutable_optimizer()->set_warmup_steps(PresetWarmup(j.optimizer().warmup_steps(), j.steps()));
  }
  return j;
}

// Eval and serve jobs only generate: no steps, no data.
bool Trains(const v1::JobSpec& j) { return j.kind() != "eval" && j.kind() != "serve"; }

// kind, and the defaults of a job that does not train.
absl::Status ResolveKind(const v1::JobSpec& in, v1::JobSpec& j) {
  if (j.kind().empty()) j.set_kind("pretrain");
  if (j.kind() != "pretrain" && j.kind() != "sft" && j.kind() != "eval" && j.kind() != "serve")
    return SpecError("kind", absl::StrCat("'", j.kind(), "' is not pretrain | sft | eval | serve"));
  if (!j.has_model()) {
    return SpecError("model", Trains(j) ? "is required (or set preset)"
                                        : absl::StrCat(j.kind(),
                                                       " jobs take it from their init-from "
                                                       "checkpoint when it is left out"));
  }
  if (Trains(j)) return absl::OkStatus();
  if (in.steps() != 0)
    return SpecError("steps", absl::StrCat(j.kind(), " jobs do not train; leave steps at 0"));
  j.set_steps(0);
  j.mutable_optimizer()->set_warmup_steps(0);
  // (An already resolved spec carries the default corpus data: resolving stays idempotent.)
  const v1::DataConfig& d = in.data();
  if (!d.path().empty() || !d.task().empty() || !d.format().empty() ||
      (!d.source().empty() && d.source() != "corpus")) {
    return SpecError("data", j.kind() == "eval" ? "eval jobs read reasoning_eval, not data"
                                                : "serve jobs read no data");
  }
  j.clear_data();
  if (j.micro_batch() == 0) j.set_micro_batch(1);
  if (j.seq_len() == 0) j.set_seq_len(std::max<int64_t>(1, j.model().max_seq_len()));
  if (j.optimizer().lr() == 0) j.mutable_optimizer()->set_lr(1e-3);
  if (j.kind() == "serve") {
    if (in.has_reasoning_eval())
      return SpecError("reasoning_eval", "serve jobs do not evaluate (kind eval does)");
  } else if (!j.has_reasoning_eval()) {
    j.mutable_reasoning_eval();
  }
  return absl::OkStatus();
}

// A serve job's server limits (loom-serve's flags of the same names).
absl::Status ResolveServe(v1::JobSpec& j) {
  if (j.kind() != "serve") {
    if (j.has_serve()) return SpecError("serve", "is for kind serve");
    return absl::OkStatus();
  }
  v1::ServeConfig* s = j.mutable_serve();
  const struct {
    const char* field;
    int32_t value, max;
  } limits[] = {{"max_batch", s->max_batch(), 1024},
                {"max_queue", s->max_queue(), 100000},
                {"max_tokens", s->max_tokens(), 1 << 24},
                {"max_n", s->max_n(), 1024},
                {"prefix_cache_mb", s->prefix_cache_mb(), 1 << 20},
                {"startup_seconds", s->startup_seconds(), 86400},
                {"unhealthy_seconds", s->unhealthy_seconds(), 86400}};
  for (const auto& l : limits) {
    if (l.value < 0 || l.value > l.max)
      return SpecError(absl::StrCat("serve.", l.field),
                       absl::StrCat("must be in [0, ", l.max, "]"));
  }
  for (char c : s->model_name()) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.' &&
        c != '/' && c != ':')
      return SpecError("serve.model_name", "may hold letters, digits and - _ . / : only");
  }
  if (s->model_name().size() > 128) return SpecError("serve.model_name", "at most 128 bytes");
  return absl::OkStatus();
}

// micro_batch, grad_accum, seq_len and steps.
absl::Status ResolveShape(v1::JobSpec& j) {
  if (j.micro_batch() <= 0 || j.micro_batch() > 65536)
    return SpecError("micro_batch", "must be in [1, 65536]");
  if (j.grad_accum() < 0 || j.grad_accum() > 65536)
    return SpecError("grad_accum", "must be in [0, 65536] (0 = 1)");
  if (j.grad_accum() == 0) j.set_grad_accum(1);
  if (j.seq_len() <= 0) return SpecError("seq_len", "must be >= 1");
  if (j.seq_len() > j.model().max_seq_len()) {
    return SpecError("seq_len", absl::StrCat(j.seq_len(), " exceeds model.max_seq_len ",
                                             j.model().max_seq_len()));
  }
  if (Trains(j) && (j.steps() <= 0 || j.steps() > 1000000000))
    return SpecError("steps", "must be in [1, 1e9]");
  return absl::OkStatus();
}

absl::Status ResolveOptimizer(v1::JobSpec& j) {
  v1::OptimizerConfig* o = j.mutable_optimizer();
  if (!InRange(o->lr(), 1e-12, 10)) return SpecError("optimizer.lr", "must be in (0, 10]");
  if (!InRange(o->min_lr(), 0, o->lr())) return SpecError("optimizer.min_lr", "must be in [0, lr]");
  if (o->warmup_steps() < 0 || o->warmup_steps() > std::max<int64_t>(j.steps(), 0)) {
    return SpecError("optimizer.warmup_steps",
                     absl::StrCat("must be in [0, steps = ", j.steps(), "]"));
  }
  if (!InRange(o->beta1(), 0.0, 0.999999)) return SpecError("optimizer.beta1", "must be in [0, 1)");
  if (!InRange(o->beta2(), 0.0, 0.999999)) return SpecError("optimizer.beta2", "must be in [0, 1)");
  if (!InRange(o->eps(), 0, 1)) return SpecError("optimizer.eps", "must be in [0, 1] (0 = 1e-8)");
  if (o->eps() == 0) o->set_eps(1e-8);
  if (!InRange(o->weight_decay(), 0.0, 10.0))
    return SpecError("optimizer.weight_decay", "must be in [0, 10]");
  if (!InRange(o->clip_norm(), 0.0, 1e6))
    return SpecError("optimizer.clip_norm", "must be in [0, 1e6] (0 = off)");
  return absl::OkStatus();
}

// data.source chat: conversations from a JSONL file (data.path), or the built-in reasoning
// generator (data.task arithmetic | relation | mixed, default mixed). docs/tasks.md.
absl::Status ResolveChatData(const v1::ModelConfig& m, v1::DataConfig* d) {
  if (!d->path().empty() && !d->task().empty()) {
    return SpecError("data.task", "is the built-in generator; leave it empty with data.path");
  }
  if (d->path().empty() && d->task().empty()) d->set_task("mixed");
  if (!d->task().empty() && d->task() != "arithmetic" && d->task() != "relation" &&
      d->task() != "mixed") {
    return SpecError("data.task",
                     absl::StrCat("'", d->task(), "' is not arithmetic | relation | mixed"));
  }
  if (m.vocab_size() < 260) {
    return SpecError("model.vocab_size", "chat data needs 260 (256 bytes + 4 role tokens)");
  }
  if (d->format().empty()) d->set_format("openthoughts");
  if (!IsPluginName(d->format()))
    return SpecError("data.format", "must be a plugin name, [a-z0-9_]+");
  return absl::OkStatus();
}

// data.source and what each source needs (task, path, format).
absl::Status ResolveDataSource(v1::JobSpec& j) {
  v1::DataConfig* d = j.mutable_data();
  if (d->source().empty()) d->set_source("corpus");
  if (d->source() != "corpus" && d->source() != "shards" && d->source() != "task" &&
      d->source() != "chat") {
    return SpecError("data.source",
                     absl::StrCat("'", d->source(), "' is not corpus | shards | task | chat"));
  }
  if (Trains(j) && (j.kind() == "sft") != (d->source() == "chat")) {
    return SpecError("kind", "sft jobs train on data.source chat, and chat data is for sft jobs");
  }
  if (d->source() == "chat") {
    LOOM_RETURN_IF_ERROR(ResolveChatData(j.model(), d));
  } else if (!d->format().empty() || d->has_format_options()) {
    return SpecError("data.format", "is for source chat");
  } else if ((d->source() == "task") != !d->task().empty()) {
    return SpecError("data.task", d->source() == "task" ? "is required for source task"
                                                        : "is only for source task");
  }
  if (d->source() == "shards" && d->path().empty()) {
    return SpecError("data.path", "is required for source shards");
  }
  if (d->source() == "corpus" && !d->path().empty()) {
    return SpecError("data.path", "is only for source shards");
  }
  return absl::OkStatus();
}

// data.tokenizer, the generated corpus's size and the seeds.
absl::Status ResolveTokensAndSeeds(v1::JobSpec& j) {
  v1::DataConfig* d = j.mutable_data();
  if (d->tokenizer().empty()) d->set_tokenizer("byte");
  if (d->tokenizer() != "byte" && d->tokenizer() != "bpe") {
    return SpecError("data.tokenizer", absl::StrCat("'", d->tokenizer(), "' is not byte | bpe"));
  }
  if (d->tokenizer() == "bpe") {
    if (d->source() != "corpus" && d->source() != "chat") {
      return SpecError("data.tokenizer",
                       "bpe is for sources corpus and chat (loom-data datasets carry their own; "
                       "tasks are byte-level)");
    }
    if (d->tokenizer_path().empty())
      return SpecError("data.tokenizer_path", "is required with tokenizer bpe (a tokenizer.json)");
  } else if (!d->tokenizer_path().empty()) {
    return SpecError("data.tokenizer_path", "is only for tokenizer bpe");
  }
  if (d->source() == "corpus" && d->tokenizer() == "byte" && j.model().vocab_size() < 256) {
    return SpecError("model.vocab_size", absl::StrCat(j.model().vocab_size(),
                                                      " is smaller than the byte tokenizer's 256"));
  }
  if (d->corpus_bytes() < 0 || d->corpus_bytes() > (int64_t{1} << 34)) {
    return SpecError("data.corpus_bytes", "must be in [0, 2^34] (0 = 1 MiB)");
  }
  if (d->corpus_bytes() == 0) d->set_corpus_bytes(1 << 20);
  if (d->corpus_bytes() < 4 * (j.seq_len() + 1)) {
    return SpecError("data.corpus_bytes", "must hold at least four training windows");
  }
  if (j.seed() == 0) j.set_seed(1);
  if (d->seed() == 0) d->set_seed(j.seed());
  // The job seed is the initialisation seed too (docs/jobs.md), unless the model sets its own:
  // the seeds of a sweep then vary the initialisation as well as the data order.
  if (j.has_model() && j.model().init_seed() == 0) j.mutable_model()->set_init_seed(j.seed());
  return absl::OkStatus();
}

absl::Status ResolvePrecision(v1::JobSpec& j) {
  if (j.precision().empty()) j.set_precision("fp32");
  if (j.precision() != "fp32" && j.precision() != "fp64" && j.precision() != "bf16" &&
      j.precision() != "fp16") {
    return SpecError("precision",
                     absl::StrCat("'", j.precision(), "' is not fp32 | fp64 | bf16 | fp16"));
  }
  if (j.device().empty()) j.set_device("auto");
  if (j.device() != "auto" && j.device() != "cpu" && j.device() != "cuda") {
    return SpecError("device", absl::StrCat("'", j.device(), "' is not auto | cpu | cuda"));
  }
  if (j.precision() == "fp16" && j.device() == "cpu") {
    return SpecError("precision", "fp16 autocast needs device cuda; on the CPU use bf16");
  }
  return NormalizeLossScale(j);
}

// eval, with data.splits (App. D: built-in tasks only, every split non-empty).
absl::Status ResolveEval(v1::JobSpec& j) {
  v1::EvalConfig* e = j.mutable_eval();
  const v1::DataConfig& d = j.data();
  if (e->interval() < 0) return SpecError("eval.interval", "must be >= 0 (0 = only at the end)");
  if (e->batches() < 0 || e->batches() > 100000)
    return SpecError("eval.batches", "must be in [0, 100000] (0 = 8)");
  if (e->batches() == 0) e->set_batches(8);
  if (d.has_splits()) {
    if (d.source() != "task") return SpecError("data.splits", "is only for data.source task");
    const v1::SplitsConfig& sp = d.splits();
    const std::pair<const char*, int64_t> sizes[] = {{"data.splits.train", sp.train()},
                                                     {"data.splits.validation", sp.validation()},
                                                     {"data.splits.test", sp.test()}};
    for (const auto& [field, n] : sizes) {
      if (n < 1 || n > 10000000) return SpecError(field, "must be in 1..10000000 examples");
    }
  }
  if (e->patience() < 0) return SpecError("eval.patience", "must be >= 0 (0 = no early stopping)");
  if (e->lengths_size() > 0) {
    if (d.source() != "task") return SpecError("eval.lengths", "is only for data.source task");
    if (d.has_splits()) return SpecError("eval.lengths", "cannot be combined with data.splits");
    if (e->lengths_size() > 16) return SpecError("eval.lengths", "at most 16 lengths");
    for (int i = 0; i < e->lengths_size(); ++i) {
      if (e->lengths(i) < 16 || (j.has_model() && e->lengths(i) > j.model().max_seq_len())) {
        return SpecError(
            absl::StrCat("eval.lengths[", i, "]"),
            absl::StrCat("must be in [16, model.max_seq_len = ", j.model().max_seq_len(), "]"));
      }
    }
  }
  if (e->patience() > 0 && !d.has_splits()) {
    return SpecError("eval.patience", "needs data.splits (early stopping on the validation split)");
  }
  return absl::OkStatus();
}

absl::Status ResolveCheckpointAndMetrics(v1::JobSpec& j) {
  v1::CheckpointConfig* c = j.mutable_checkpoint();
  if (c->interval() < 0)
    return SpecError("checkpoint.interval", "must be >= 0 (0 = only at the end)");
  if (c->keep_last() < 0) return SpecError("checkpoint.keep_last", "must be >= 0 (0 = 3)");
  if (c->keep_last() == 0) c->set_keep_last(3);
  if (c->keep_every() < 0) return SpecError("checkpoint.keep_every", "must be >= 0");
  if (c->interval_seconds() < -1 || c->interval_seconds() > kMaxCheckpointIntervalSeconds) {
    return SpecError("checkpoint.interval_seconds",
                     "must be in [-1, 31536000] (0 = not by time, -1 = never by time)");
  }
  if (c->dir().empty() && (c->interval() > 0 || c->keep_every() > 0 || c->interval_seconds() > 0)) {
    return SpecError("checkpoint.dir",
                     "is required when checkpoint.interval, interval_seconds or keep_every is set");
  }
  v1::MetricsConfig* mc = j.mutable_metrics();
  if (mc->port() < -1 || mc->port() > 65535)
    return SpecError("metrics.port", "must be in [-1, 65535]");
  if (mc->bind().empty()) mc->set_bind("127.0.0.1");
  if (!InRange(mc->peak_flops(), 0, 1e20))
    return SpecError("metrics.peak_flops", "must be in [0, 1e20]");
  if (mc->log_every() < 0) return SpecError("metrics.log_every", "must be >= 0 (0 = 10)");
  if (mc->log_every() == 0) mc->set_log_every(10);
  return absl::OkStatus();
}

// NaN guard, threads and the distributed settings.
absl::Status ResolveRuntime(v1::JobSpec& j) {
  if (j.max_nan_skips() < 0) return SpecError("max_nan_skips", "must be >= 0 (0 = 5)");
  if (j.max_nan_skips() == 0) j.set_max_nan_skips(5);
  if (j.threads() < 0 || j.threads() > 1024) return SpecError("threads", "must be in [0, 1024]");
  if (j.dist_timeout_seconds() < 0 || j.dist_timeout_seconds() > 86400) {
    return SpecError("dist_timeout_seconds", "must be in [0, 86400] (0 = 60)");
  }
  if (j.dist_timeout_seconds() == 0) j.set_dist_timeout_seconds(60);
  if (j.zero_stage() != 0 && j.zero_stage() != 1) return SpecError("zero_stage", "must be 0 or 1");
  if (j.dist_bucket_bytes() == 0) j.set_dist_bucket_bytes(25 << 20);
  if (j.dist_bucket_bytes() < 1024 || j.dist_bucket_bytes() > (int64_t{1} << 32)) {
    return SpecError("dist_bucket_bytes", "must be in 1024..4294967296 (0 = 25 MiB)");
  }
  return absl::OkStatus();
}

// reasoning_eval (sft and eval jobs), then dist_backend.
absl::Status ResolveChatAndBackend(v1::JobSpec& j) {
  if (j.kind() == "pretrain" && j.has_reasoning_eval()) {
    return SpecError("reasoning_eval",
                     "is for sft and eval jobs (pretrained models have no chat "
                     "template yet)");
  }
  if (j.kind() != "pretrain" && j.kind() != "serve") {
    if (j.model().vocab_size() < 260) {
      return SpecError("model.vocab_size", "chat models need 260 (256 bytes + 4 role tokens)");
    }
    LOOM_RETURN_IF_ERROR(ResolveReasoningEval(j));
  }
  if (j.dist_backend().empty()) j.set_dist_backend("auto");
  if (j.dist_backend() != "auto" && j.dist_backend() != "gloo" && j.dist_backend() != "mpi" &&
      j.dist_backend() != "nccl") {
    return SpecError("dist_backend",
                     absl::StrCat("'", j.dist_backend(), "' is not auto | gloo | nccl | mpi"));
  }
  return absl::OkStatus();
}

}  // namespace

// Each section in the order its errors take precedence; every error names its field.
absl::StatusOr<v1::JobSpec> ResolveJobSpec(const v1::JobSpec& in) {
  LOOM_ASSIGN_OR_RETURN(v1::JobSpec j, WithPreset(in));
  LOOM_RETURN_IF_ERROR(ResolveKind(in, j));
  auto model = ResolveModelConfig(j.model());
  if (!model.ok()) return model.status();
  if (model->mode() != "decoder" && in.data().source() != "task" && j.data().source() != "task") {
    return SpecError("model.mode",
                     "encoder models train on built-in tasks only (data.source task)");
  }
  *j.mutable_model() = *model;
  LOOM_RETURN_IF_ERROR(ResolveShape(j));
  LOOM_RETURN_IF_ERROR(ResolveOptimizer(j));
  LOOM_RETURN_IF_ERROR(ResolveDataSource(j));
  LOOM_RETURN_IF_ERROR(ResolveTokensAndSeeds(j));
  LOOM_RETURN_IF_ERROR(ResolvePrecision(j));
  LOOM_RETURN_IF_ERROR(ResolveEval(j));
  LOOM_RETURN_IF_ERROR(ResolveCheckpointAndMetrics(j));
  LOOM_RETURN_IF_ERROR(ResolveRuntime(j));
  LOOM_RETURN_IF_ERROR(ResolveChatAndBackend(j));
  LOOM_RETURN_IF_ERROR(ResolveServe(j));
  // Without a preset an explicit 0 means what an absent one does: the resolved spec is written
  // as an older Loom wrote it. With one, the presence keeps the 0 when the spec is resolved again.
  if (j.preset().empty()) ClearExplicitZeros(&j);
  return j;
}

absl::StatusOr<v1::JobSpec> RecordedSpec(const std::map<std::string, std::string>& state,
                                         const std::string& dir) {
  auto it = state.find("spec");
  if (it == state.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint: ", dir, " records no job spec (written by an old Loom)"));
  }
  v1::JobSpec spec;
  google::protobuf::util::JsonParseOptions parse;
  parse.ignore_unknown_fields = true;
  if (!google::protobuf::util::JsonStringToMessage(it->second, &spec, parse).ok())
    return absl::DataLossError(absl::StrCat("checkpoint: ", dir, ": unreadable job spec"));
  return spec;
}

absl::Status FillModelFromManifest(v1::JobSpec* spec, const std::string& manifest_json,
                                   const std::string& source) {
  if ((spec->kind() != "eval" && spec->kind() != "serve") || spec->has_model() ||
      !spec->preset().empty())
    return absl::OkStatus();
  absl::StatusOr<storage::Manifest> m = storage::ManifestFromJson(manifest_json, source);
  if (!m.ok()) return absl::InvalidArgumentError(absl::StrCat("model: ", m.status().message()));
  if (!m->state.count("spec")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: ", source, " records no job spec to take the model from; give model or preset"));
  }
  absl::StatusOr<v1::JobSpec> recorded = RecordedSpec(m->state, source);
  if (!recorded.ok())
    return absl::InvalidArgumentError(absl::StrCat("model: ", recorded.status().message()));
  *spec->mutable_model() = recorded->model();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> OptionsAsText(
    const google::protobuf::Struct& options, const std::string& field) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [key, value] : options.fields()) {
    std::string text;
    switch (value.kind_case()) {
      case google::protobuf::Value::kStringValue:
        text = value.string_value();
        break;
      case google::protobuf::Value::kBoolValue:
        text = value.bool_value() ? "true" : "false";
        break;
      case google::protobuf::Value::kNumberValue: {
        const double v = value.number_value();
        if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9.0e15) {
          text = absl::StrCat(static_cast<int64_t>(v));
        } else {
          char buf[64];
          std::snprintf(buf, sizeof(buf), "%.17g", v);
          text = buf;
        }
        break;
      }
      default:
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".", key, ": must be a string, number or boolean"));
    }
    out.emplace_back(key, std::move(text));
  }
  return out;
}

namespace {

// +0 only: the value a field without presence did not serialise (-0 it did).
bool IsPositiveZero(double v) { return v == 0 && !std::signbit(v); }

}  // namespace

void ClearExplicitZeros(v1::JobSpec* spec) {
  if (spec->has_model()) {
    v1::ModelConfig* m = spec->mutable_model();
    if (m->has_rope_theta() && IsPositiveZero(m->rope_theta())) m->clear_rope_theta();
  }
  if (spec->has_optimizer()) {
    v1::OptimizerConfig* o = spec->mutable_optimizer();
    if (o->has_min_lr() && IsPositiveZero(o->min_lr())) o->clear_min_lr();
    if (o->has_warmup_steps() && o->warmup_steps() == 0) o->clear_warmup_steps();
    if (o->has_beta1() && IsPositiveZero(o->beta1())) o->clear_beta1();
    if (o->has_beta2() && IsPositiveZero(o->beta2())) o->clear_beta2();
    if (o->has_weight_decay() && IsPositiveZero(o->weight_decay())) o->clear_weight_decay();
    if (o->has_clip_norm() && IsPositiveZero(o->clip_norm())) o->clear_clip_norm();
  }
}

// Both hashes see the spec as ClearExplicitZeros leaves it, so they are what they were before
// those fields became `optional`: checkpoints written earlier still resume.
std::string ModelHash(const v1::JobSpec& resolved) {
  v1::JobSpec spec;
  *spec.mutable_model() = resolved.model();
  ClearExplicitZeros(&spec);
  v1::ModelConfig& model = *spec.mutable_model();
  model.clear_activation_checkpointing();  // how to train, not what is trained
  return Hex(Fnv1a(Deterministic(model)));
}

std::string SpecHash(const v1::JobSpec& resolved) {
  // Fields that change where output goes or how long to run, not what is trained, are left out.
  v1::JobSpec copy = resolved;
  ClearExplicitZeros(&copy);
  copy.clear_name();
  copy.clear_steps();
  copy.clear_checkpoint();
  copy.clear_metrics();
  copy.clear_threads();
  return Hex(Fnv1a(Deterministic(copy)));
}

}  // namespace loom
