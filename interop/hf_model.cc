#include "interop/hf_model.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "loom/spec.h"

namespace loom::interop {
namespace {

// One name in both spellings.
struct NamePair {
  const char* loom;
  const char* hf;
};
// Per-layer names: Loom's suffix after "layers.<i>." and Hugging Face's after
// "model.layers.<i>.".
constexpr NamePair kLayerNames[] = {
    {"attention_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"attention.q_proj.weight", "self_attn.q_proj.weight"},
    {"attention.k_proj.weight", "self_attn.k_proj.weight"},
    {"attention.v_proj.weight", "self_attn.v_proj.weight"},
    {"attention.o_proj.weight", "self_attn.o_proj.weight"},
    {"attention.q_proj.bias", "self_attn.q_proj.bias"},
    {"attention.k_proj.bias", "self_attn.k_proj.bias"},
    {"attention.v_proj.bias", "self_attn.v_proj.bias"},
    {"attention.o_proj.bias", "self_attn.o_proj.bias"},
    {"attention.alpha_q", "self_attn.alpha_q"},
    {"attention.alpha_k", "self_attn.alpha_k"},
    {"attention.alpha_v", "self_attn.alpha_v"},
    {"attention.collapse", "self_attn.collapse"},
    {"ffn.up.weight", "mlp.up_proj.weight"},
    {"ffn.gate.weight", "mlp.gate_proj.weight"},
    {"ffn.down.weight", "mlp.down_proj.weight"},
};
// Whole-model names.
constexpr NamePair kModelNames[] = {
    {"embed.weight", "model.embed_tokens.weight"},
    {"final_norm.weight", "model.norm.weight"},
    {"lm_head.weight", "lm_head.weight"},
};

// "<prefix><digits>.<rest>" -> (index, rest); false when the name is not of that form.
bool SplitLayer(const std::string& name, const std::string& prefix, int64_t* index,
                std::string* rest) {
  if (!absl::StartsWith(name, prefix)) return false;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos || dot == prefix.size() || dot - prefix.size() > 6) return false;
  const std::string digits = name.substr(prefix.size(), dot - prefix.size());
  for (char c : digits) {
    if (c < '0' || c > '9') return false;
  }
  if (digits.size() > 1 && digits[0] == '0') return false;  // one spelling per layer
  if (!absl::SimpleAtoi(digits, index)) return false;
  *rest = name.substr(dot + 1);
  return true;
}

// A plugin option as the plugin factory hands it over: numbers without a fraction as integers.
std::string OptionText(const google::protobuf::Value& v) {
  switch (v.kind_case()) {
    case google::protobuf::Value::kStringValue:
      return v.string_value();
    case google::protobuf::Value::kBoolValue:
      return v.bool_value() ? "true" : "false";
    case google::protobuf::Value::kNumberValue: {
      const double x = v.number_value();
      if (std::isfinite(x) && x == std::floor(x) && std::fabs(x) < 9.0e15)
        return absl::StrCat(static_cast<int64_t>(x));
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.17g", x);
      return buf;
    }
    default:
      return "";
  }
}

absl::Status LayerError(int i, const std::string& what) {
  return absl::FailedPreconditionError(absl::StrCat("model.layers[", i, "]: ", what));
}

// The iha plugin's options with its defaults (plugins/attention/iha/iha_attention.cc); keys
// that only choose a kernel, a cache layout or an initialisation do not change the function.
absl::StatusOr<LayerAttention> ResolveIha(const v1::AttentionConfig& a, int64_t n_heads, int i) {
  LayerAttention l;
  l.kind = "iha";
  l.window = a.window();
  l.p = n_heads;
  l.mask = "interleaved";
  l.rope_phase = "interleaved";
  l.score = "softmax";
  static const std::set<std::string> kIgnored = {"kernel", "kv_cache", "init", "init_noise"};
  for (const auto& [key, value] : a.options().fields()) {
    const std::string text = OptionText(value);
    if (key == "p") {
      if (!absl::SimpleAtoi(text, &l.p) || l.p < 1 || l.p > 256)
        return LayerError(i, absl::StrCat("options.p: '", text, "' is not in [1, 256]"));
    } else if (key == "mask" || key == "rope_phase" || key == "score") {
      std::string& field = key == "mask" ? l.mask : key == "rope_phase" ? l.rope_phase : l.score;
      field = text;
    } else if (key == "scale") {
      if (!absl::SimpleAtod(text, &l.scale) || !(l.scale >= 0))
        return LayerError(i, absl::StrCat("options.scale: '", text, "' is not a number >= 0"));
    } else if (!kIgnored.count(key)) {
      return LayerError(i, absl::StrCat("options.", key, ": unknown iha option"));
    }
  }
  if (l.mask != "interleaved" && l.mask != "block")
    return LayerError(i, absl::StrCat("options.mask: '", l.mask,
                                      "' (a decoder takes interleaved "
                                      "or block)"));
  if (l.rope_phase != "interleaved" && l.rope_phase != "token")
    return LayerError(i, absl::StrCat("options.rope_phase: '", l.rope_phase, "'"));
  if (l.score != "softmax" && l.score != "linear")
    return LayerError(i, absl::StrCat("options.score: '", l.score, "'"));
  return l;
}

}  // namespace

// Both directions through the two tables: `to_hf` maps Loom's names, else Hugging Face's.
std::string MapName(const std::string& name, bool to_hf) {
  for (const NamePair& n : kModelNames) {
    if (name == (to_hf ? n.loom : n.hf)) return to_hf ? n.hf : n.loom;
  }
  int64_t index = 0;
  std::string rest;
  if (!SplitLayer(name, to_hf ? "layers." : "model.layers.", &index, &rest)) return "";
  for (const NamePair& n : kLayerNames) {
    if (rest == (to_hf ? n.loom : n.hf))
      return absl::StrCat(to_hf ? "model.layers." : "layers.", index, ".", to_hf ? n.hf : n.loom);
  }
  return "";
}

std::string HfName(const std::string& loom_name) { return MapName(loom_name, true); }
std::string LoomName(const std::string& hf_name) { return MapName(hf_name, false); }

absl::StatusOr<std::vector<LayerAttention>> ResolveLayers(const v1::ModelConfig& resolved) {
  if (resolved.mode() != "decoder") {
    return absl::FailedPreconditionError(absl::StrCat(
        "model.mode: '", resolved.mode(), "': only decoders (causal language models) export"));
  }
  if (resolved.grid_max_rows() > 0 || resolved.grid_max_cols() > 0) {
    return absl::FailedPreconditionError(
        "model.grid_max_rows: grid position embeddings have no Hugging Face counterpart");
  }
  std::vector<LayerAttention> out;
  const std::vector<v1::AttentionConfig> layers = ExpandSchedule(resolved);
  for (int i = 0; i < static_cast<int>(layers.size()); ++i) {
    const v1::AttentionConfig& a = layers[i];
    if (a.plugin() == "iha") {
      absl::StatusOr<LayerAttention> l = ResolveIha(a, resolved.n_heads(), i);
      if (!l.ok()) return l.status();
      out.push_back(*l);
      continue;
    }
    if (a.plugin() != "mha" && a.plugin() != "local") {
      return LayerError(i,
                        absl::StrCat("plugin '", a.plugin(),
                                     "': only mha, local and iha layers export (docs/interop.md)"));
    }
    for (const auto& [key, value] : a.options().fields()) {
      if (key != "kernel") return LayerError(i, absl::StrCat("options.", key, ": unknown option"));
    }
    LayerAttention layer;  // mha or local: the iha-only fields stay empty
    layer.kind = a.plugin();
    layer.window = a.window();
    out.push_back(layer);
  }
  return out;
}

std::map<std::string, std::vector<int64_t>> ExpectedShapes(
    const v1::ModelConfig& m, const std::vector<LayerAttention>& layers) {
  const int64_t d = m.d_model(), h = m.n_heads(), inner = m.n_heads() * m.head_dim();
  const int64_t f = m.ffn_hidden(), v = m.vocab_size();
  std::map<std::string, std::vector<int64_t>> out = {{"embed.weight", {v, d}},
                                                     {"final_norm.weight", {d}}};
  if (!m.tie_embeddings()) out["lm_head.weight"] = {v, d};
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string l = absl::StrCat("layers.", i, ".");
    out[l + "attention_norm.weight"] = {d};
    out[l + "ffn_norm.weight"] = {d};
    for (const char* x : {"q", "k", "v"})
      out[absl::StrCat(l, "attention.", x, "_proj.weight")] = {inner, d};
    out[l + "attention.o_proj.weight"] = {d, inner};
    if (m.attention_bias()) {
      for (const char* x : {"q", "k", "v"})
        out[absl::StrCat(l, "attention.", x, "_proj.bias")] = {inner};
      out[l + "attention.o_proj.bias"] = {d};
    }
    if (layers[i].kind == "iha") {
      const int64_t p = layers[i].p;
      for (const char* x : {"alpha_q", "alpha_k", "alpha_v"}) out[l + "attention." + x] = {h, h, p};
      out[l + "attention.collapse"] = {h, h * p};
    }
    out[l + "ffn.up.weight"] = {f, d};
    if (m.ffn_activation() == "swiglu") out[l + "ffn.gate.weight"] = {f, d};
    out[l + "ffn.down.weight"] = {d, f};
  }
  return out;
}

absl::Status CheckShapes(const std::map<std::string, std::vector<int64_t>>& expected,
                         const std::map<std::string, std::vector<int64_t>>& found,
                         const std::string& what, std::string (*display)(const std::string&)) {
  std::vector<std::string> missing, unexpected, wrong;
  for (const auto& [name, shape] : expected) {
    auto it = found.find(name);
    if (it == found.end()) {
      missing.push_back(display(name));
    } else if (it->second != shape) {
      wrong.push_back(absl::StrCat(display(name), " [", absl::StrJoin(it->second, ", "),
                                   "], expected [", absl::StrJoin(shape, ", "), "]"));
    }
  }
  for (const auto& [name, shape] : found) {
    if (!expected.count(name)) unexpected.push_back(display(name));
  }
  if (missing.empty() && unexpected.empty() && wrong.empty()) return absl::OkStatus();
  std::vector<std::string> parts;
  auto some = [](const std::vector<std::string>& v) {
    std::vector<std::string> head(v.begin(), v.begin() + std::min<size_t>(v.size(), 8));
    return absl::StrCat(absl::StrJoin(head, ", "), v.size() > 8 ? ", ..." : "");
  };
  if (!missing.empty()) parts.push_back(absl::StrCat("missing ", some(missing)));
  if (!unexpected.empty()) parts.push_back(absl::StrCat("unexpected ", some(unexpected)));
  if (!wrong.empty()) parts.push_back(absl::StrCat("wrong shape ", some(wrong)));
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", absl::StrJoin(parts, "; ")));
}

}  // namespace loom::interop
