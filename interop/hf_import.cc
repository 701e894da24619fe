// loom-train import-hf: a Hugging Face Llama, Mistral or Loom-IHA folder as a weights-only Loom
// checkpoint (hf_folder.h). Every field and tensor of the folder is treated as hostile input:
// bounded sizes, plain shard file names, every tensor mapped and shaped as the config says.

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/json_integer.h"
#include "base/read_file.h"
#include "base/status_macros.h"
#include "interop/hf_folder.h"
#include "interop/hf_model.h"
#include "loom/proto_json.h"
#include "loom/spec.h"
#include "storage/checkpoint.h"
#include "storage/safetensors.h"

namespace loom::interop {
namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

absl::StatusOr<std::string> ReadSmallFile(const fs::path& path, uint64_t limit) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(path.string(), ": ", ec.message()));
  if (size > limit)
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": ", size, " bytes (limit ", limit, ")"));
  return ReadFile(path.string(), "Hugging Face folder");
}

absl::Status ConfigError(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: ", field, ": ", what));
}

// An integer field in [min, max]; `fallback` when absent (or an error when fallback < min).
absl::StatusOr<int64_t> IntField(const Json& c, const char* key, int64_t min, int64_t max,
                                 int64_t fallback = -1) {
  if (!c.contains(key) || c[key].is_null()) {
    if (fallback >= min) return fallback;
    return ConfigError(key, "missing");
  }
  const std::optional<int64_t> exact = ExactInteger<int64_t>(c[key]);
  if (!exact) return ConfigError(key, "must be an integer");
  const int64_t v = *exact;
  if (v < min || v > max)
    return ConfigError(key, absl::StrCat(v, " is not in [", min, ", ", max, "]"));
  return v;
}

absl::StatusOr<double> NumberField(const Json& c, const char* key, double fallback) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  if (!c[key].is_number()) return ConfigError(key, "must be a number");
  const double v = c[key].get<double>();
  if (!(v >= 0) || v > 1e12) return ConfigError(key, "must be a finite number >= 0");
  return v;
}

bool BoolField(const Json& c, const char* key, bool fallback) {
  return c.contains(key) && c[key].is_boolean() ? c[key].get<bool>() : fallback;
}

// A string field: `fallback` when absent or null, an error naming it when not a string.
absl::StatusOr<std::string> StringField(const Json& c, const char* key,
                                        const std::string& fallback) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  if (!c[key].is_string()) return ConfigError(key, "must be a string");
  return c[key].get<std::string>();
}

std::string Architecture(const Json& c) {
  if (c.contains("architectures") && c["architectures"].is_array() && !c["architectures"].empty() &&
      c["architectures"][0].is_string())
    return c["architectures"][0].get<std::string>();
  const std::string type = StringField(c, "model_type", "").value_or("");
  return type == "llama"      ? "LlamaForCausalLM"
         : type == "mistral"  ? "MistralForCausalLM"
         : type == "loom_iha" ? "LoomIhaForCausalLM"
                              : type;
}

// RoPE's base: transformers 5 writes it as rope_parameters {rope_type, rope_theta}, 4.x as
// rope_theta (and rope_scaling). Only the default rotation is Loom's; a folder that says both
// must agree with itself.
absl::StatusOr<double> RopeTheta(const Json& c) {
  LOOM_ASSIGN_OR_RETURN(const double flat, NumberField(c, "rope_theta", 10000.0));
  if (!c.contains("rope_parameters") || c["rope_parameters"].is_null()) return flat;
  const Json& p = c["rope_parameters"];
  if (!p.is_object()) return ConfigError("rope_parameters", "must be an object");
  LOOM_ASSIGN_OR_RETURN(const std::string type, StringField(p, "rope_type", "default"));
  if (type != "default") {
    return ConfigError("rope_parameters.rope_type",
                       absl::StrCat("'", type,
                                    "': RoPE scaling (Llama 3.1's 'llama3', YaRN, ...) is not "
                                    "implemented in Loom"));
  }
  LOOM_ASSIGN_OR_RETURN(const double theta, NumberField(p, "rope_theta", flat));
  if (c.contains("rope_theta") && theta != flat) {
    return ConfigError("rope_parameters.rope_theta",
                       absl::StrCat(theta, " disagrees with rope_theta ", flat));
  }
  return theta;
}

// What the Llama/Mistral code paths of transformers would compute differently from Loom.
absl::Status CheckLlamaFields(const Json& c) {
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null())
    return ConfigError("rope_scaling",
                       "RoPE scaling (Llama 3.1's 'llama3', YaRN, ...) is not "
                       "implemented in Loom");
  if (BoolField(c, "mlp_bias", false)) return ConfigError("mlp_bias", "MLP biases are not in Loom");
  LOOM_ASSIGN_OR_RETURN(const std::string act, StringField(c, "hidden_act", "silu"));
  if (act != "silu")
    return ConfigError("hidden_act", absl::StrCat("'", act, "': Llama-style MLPs take silu"));
  return absl::OkStatus();
}

// One schedule entry per layer of a Loom-IHA folder.
absl::Status LoomLayers(const Json& c, v1::ModelConfig* m) {
  const Json& layers = c.contains("loom_layers") ? c["loom_layers"] : Json();
  if (!layers.is_array() || static_cast<int64_t>(layers.size()) != m->n_layers())
    return ConfigError("loom_layers", "must list one entry per layer");
  for (size_t i = 0; i < layers.size(); ++i) {
    const Json& l = layers[i];
    const std::string field = absl::StrCat("loom_layers[", i, "]");
    if (!l.is_object() || !l.contains("kind") || !l["kind"].is_string())
      return ConfigError(field, "needs a kind");
    v1::AttentionConfig* a = m->add_schedule()->mutable_attention();
    m->mutable_schedule()->rbegin()->set_repeat(1);
    a->set_plugin(l["kind"].get<std::string>());
    LOOM_ASSIGN_OR_RETURN(int64_t window, IntField(l, "window", 0, m->max_seq_len(), 0));
    a->set_window(window);
    if (a->plugin() != "iha") continue;
    auto& options = *a->mutable_options()->mutable_fields();
    LOOM_ASSIGN_OR_RETURN(int64_t p, IntField(l, "p", 1, 256));
    options["p"].set_number_value(static_cast<double>(p));
    for (const char* key : {"mask", "rope_phase", "score"}) {
      if (!l.contains(key) || !l[key].is_string()) return ConfigError(field + "." + key, "missing");
      options[key].set_string_value(l[key].get<std::string>());
    }
    LOOM_ASSIGN_OR_RETURN(double scale, NumberField(l, "scale", 0.0));
    if (scale > 0) options["scale"].set_number_value(scale);
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelConfig> ModelFromConfig(const Json& c, const std::string& arch,
                                                int64_t max_seq_len) {
  v1::ModelConfig m;
  m.set_mode("decoder");
  LOOM_ASSIGN_OR_RETURN(int64_t d, IntField(c, "hidden_size", 1, 1 << 16));
  LOOM_ASSIGN_OR_RETURN(int64_t h, IntField(c, "num_attention_heads", 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t kv, IntField(c, "num_key_value_heads", 1, 1024, h));
  if (kv != h)
    return ConfigError("num_key_value_heads", absl::StrCat(kv, " of ", h,
                                                           " heads: grouped-query "
                                                           "attention is not implemented in Loom"));
  m.set_d_model(static_cast<int32_t>(d));
  m.set_n_heads(static_cast<int32_t>(h));
  LOOM_ASSIGN_OR_RETURN(int64_t hd, IntField(c, "head_dim", 1, 4096, d % h == 0 ? d / h : -1));
  m.set_head_dim(static_cast<int32_t>(hd));
  LOOM_ASSIGN_OR_RETURN(int64_t layers, IntField(c, "num_hidden_layers", 1, 4096));
  m.set_n_layers(static_cast<int32_t>(layers));
  LOOM_ASSIGN_OR_RETURN(int64_t ffn, IntField(c, "intermediate_size", 1, 1 << 20));
  m.set_ffn_hidden(static_cast<int32_t>(ffn));
  LOOM_ASSIGN_OR_RETURN(int64_t vocab, IntField(c, "vocab_size", 1, 1 << 24));
  m.set_vocab_size(static_cast<int32_t>(vocab));
  LOOM_ASSIGN_OR_RETURN(int64_t positions, IntField(c, "max_position_embeddings", 1, 1 << 24));
  m.set_max_seq_len(static_cast<int32_t>(max_seq_len > 0 ? max_seq_len : positions));
  LOOM_ASSIGN_OR_RETURN(double theta, RopeTheta(c));
  m.set_rope_theta(theta);
  LOOM_ASSIGN_OR_RETURN(double eps, NumberField(c, "rms_norm_eps", 1e-6));
  m.set_norm_eps(eps);
  m.set_tie_embeddings(BoolField(c, "tie_word_embeddings", false));
  m.set_attention_bias(BoolField(c, "attention_bias", false));
  if (arch == "LoomIhaForCausalLM") {
    LOOM_ASSIGN_OR_RETURN(const std::string act, StringField(c, "hidden_act", "silu"));
    if (act != "silu" && act != "gelu")
      return ConfigError("hidden_act", absl::StrCat("'", act, "'"));
    m.set_ffn_activation(act == "silu" ? "swiglu" : "gelu");
    LOOM_RETURN_IF_ERROR(LoomLayers(c, &m));
  } else {
    LOOM_RETURN_IF_ERROR(CheckLlamaFields(c));
    m.set_ffn_activation("swiglu");
    LOOM_ASSIGN_OR_RETURN(int64_t window, IntField(c, "sliding_window", 0, 1 << 24, 0));
    if (arch != "MistralForCausalLM") window = 0;  // Llama has no sliding window
    v1::AttentionConfig* a = m.add_schedule()->mutable_attention();
    m.mutable_schedule(0)->set_repeat(1);
    a->set_plugin(window > 0 ? "local" : "mha");
    a->set_window(std::min<int64_t>(window, m.max_seq_len()));
  }
  absl::StatusOr<v1::ModelConfig> resolved = ResolveModelConfig(m);
  if (!resolved.ok())
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: as a Loom model: ", resolved.status().message()));
  return m;
}

// A shard name from an index: a plain file of the folder, never a path out of it.
bool PlainFileName(const std::string& name) {
  return !name.empty() && name.size() < 256 && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name != "." && name != ".." &&
         absl::EndsWith(name, ".safetensors");
}

absl::StatusOr<std::vector<storage::SafetensorsFile>> ReadWeights(const fs::path& dir) {
  std::vector<storage::SafetensorsFile> files;
  if (fs::exists(dir / "model.safetensors")) {
    LOOM_ASSIGN_OR_RETURN(auto f,
                          storage::SafetensorsFile::Read((dir / "model.safetensors").string()));
    files.push_back(std::move(f));
    return files;
  }
  const fs::path index_path = dir / "model.safetensors.index.json";
  if (!fs::exists(index_path))
    return absl::NotFoundError(
        absl::StrCat(dir.string(),
                     ": no model.safetensors or "
                     "model.safetensors.index.json (pytorch_model.bin is not "
                     "read: save the model with safetensors)"));
  LOOM_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path, 64 << 20));
  LOOM_ASSIGN_OR_RETURN(const auto names_by_file, ParseWeightIndex(text));
  for (const auto& [file, names] : names_by_file) {
    LOOM_ASSIGN_OR_RETURN(auto f, storage::SafetensorsFile::Read((dir / file).string()));
    std::set<std::string> held;
    for (const auto& t : f.tensors()) held.insert(t.name);
    if (held != names)
      return absl::InvalidArgumentError(absl::StrCat(file,
                                                     ": its tensors differ from what "
                                                     "model.safetensors.index.json lists for it"));
    files.push_back(std::move(f));
  }
  return files;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (frac << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (frac << 13);
  } else if (frac == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t f = frac;
    do {
      ++e;
      f <<= 1;
    } while ((f & 0x400u) == 0);
    bits = sign | ((112 - e) << 23) | ((f & 0x3ffu) << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Half-precision weights widened to float32 (exact); float32 and float64 kept as they are.
absl::StatusOr<std::pair<storage::DType, std::string>> Widen(const storage::TensorInfo& t,
                                                             std::string_view data) {
  if (t.dtype == storage::DType::kF32 || t.dtype == storage::DType::kF64)
    return std::make_pair(t.dtype, std::string(data));
  if (t.dtype != storage::DType::kBF16 && t.dtype != storage::DType::kF16)
    return absl::InvalidArgumentError(absl::StrCat(t.name, ": dtype ",
                                                   std::string(storage::DTypeName(t.dtype)),
                                                   " is not a floating-point weight"));
  std::string out(data.size() * 2, '\0');
  for (size_t i = 0; i < data.size() / 2; ++i) {
    uint16_t v;
    std::memcpy(&v, data.data() + 2 * i, 2);
    uint32_t bits;
    if (t.dtype == storage::DType::kBF16) {
      bits = static_cast<uint32_t>(v) << 16;
    } else {
      const float f = HalfToFloat(v);
      std::memcpy(&bits, &f, 4);
    }
    std::memcpy(out.data() + 4 * i, &bits, 4);
  }
  return std::make_pair(storage::DType::kF32, out);
}

// Meta's layout pairs RoPE dimensions (2i, 2i+1) within each head; Loom and transformers pair
// (i, i + d/2). Row 2i + c of a head moves to row c·d/2 + i (what transformers'
// convert_llama_weights_to_hf.py does to q and k).
std::string FromInterleavedPairs(const std::string& data, int64_t heads, int64_t head_dim) {
  const size_t row = data.size() / static_cast<size_t>(heads * head_dim);
  std::string out(data.size(), '\0');
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      for (int64_t c = 0; c < 2; ++c) {
        const size_t from = static_cast<size_t>(h * head_dim + 2 * i + c);
        const size_t to = static_cast<size_t>(h * head_dim + c * (head_dim / 2) + i);
        std::memcpy(out.data() + to * row, data.data() + from * row, row);
      }
    }
  }
  return out;
}

struct ImportedTensor {
  storage::DType dtype;
  std::vector<int64_t> shape;
  std::string data;
};

absl::StatusOr<std::map<std::string, ImportedTensor>> MapTensors(
    const std::vector<storage::SafetensorsFile>& files, const v1::ModelConfig& m,
    bool interleaved_pairs) {
  std::map<std::string, ImportedTensor> out;
  for (const storage::SafetensorsFile& f : files) {
    for (const storage::TensorInfo& t : f.tensors()) {
      if (absl::EndsWith(t.name, ".rotary_emb.inv_freq")) continue;  // a buffer older folders saved
      if (t.name == "lm_head.weight" && m.tie_embeddings()) continue;  // tied: the embedding
      const std::string loom = LoomName(t.name);
      if (loom.empty())
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", t.name.substr(0, 120), "' has no Loom counterpart (docs/interop.md)"));
      if (out.count(loom))
        return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' twice"));
      LOOM_ASSIGN_OR_RETURN(auto widened, Widen(t, f.Data(t)));
      ImportedTensor& it = out[loom];
      it.dtype = widened.first;
      it.shape = t.shape;
      it.data = std::move(widened.second);
      const bool rotated = absl::EndsWith(loom, "attention.q_proj.weight") ||
                           absl::EndsWith(loom, "attention.k_proj.weight") ||
                           absl::EndsWith(loom, "attention.q_proj.bias") ||
                           absl::EndsWith(loom, "attention.k_proj.bias");
      if (interleaved_pairs && rotated && !t.shape.empty() &&
          t.shape[0] == static_cast<int64_t>(m.n_heads()) * m.head_dim())
        it.data = FromInterleavedPairs(it.data, m.n_heads(), m.head_dim());
    }
  }
  return out;
}

absl::Status WriteModelJson(const fs::path& path, const v1::ModelConfig& m) {
  return storage::WriteFileAtomically(path.string(), MessageToJsonText(m, /*pretty=*/true));
}

absl::StatusOr<std::string> CommitCheckpoint(const ImportOptions& options, const v1::ModelConfig& m,
                                             const std::map<std::string, ImportedTensor>& tensors,
                                             const std::string& arch) {
  std::error_code ec;
  if (fs::exists(options.out_root, ec)) {
    LOOM_ASSIGN_OR_RETURN(auto existing, storage::ListCheckpoints(options.out_root));
    if (!existing.empty())
      return absl::AlreadyExistsError(
          absl::StrCat("--out '", options.out_root, "' already holds checkpoints"));
  }
  std::vector<storage::TensorToWrite> writes;
  for (const auto& [name, t] : tensors)
    writes.push_back({"model." + name, t.dtype, t.shape, t.data.data(), t.data.size()});
  LOOM_ASSIGN_OR_RETURN(storage::CheckpointWriter writer,
                        storage::CheckpointWriter::Begin(options.out_root, 0, 1));
  if (absl::Status s = writer.WriteShard(0, writes); !s.ok()) {
    writer.Abort();
    return s;
  }
  v1::JobSpec spec;
  *spec.mutable_model() = m;
  storage::Manifest manifest;
  manifest.kind = "import";
  manifest.state = {{"spec", MessageToJsonText(spec)},
                    {"imported_from", fs::absolute(options.in_dir).string()},
                    {"imported_architecture", arch},
                    {"rope_pairing", options.rope_pairing}};
  auto dir = writer.Commit(manifest);
  if (!dir.ok()) writer.Abort();
  return dir;
}

}  // namespace

absl::StatusOr<HfConfig> ParseHfConfig(const std::string& text, int64_t max_seq_len) {
  const Json config = Json::parse(text, nullptr, false);
  if (!config.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  HfConfig out;
  out.architecture = Architecture(config);
  if (out.architecture != "LlamaForCausalLM" && out.architecture != "MistralForCausalLM" &&
      out.architecture != "LoomIhaForCausalLM")
    return ConfigError("architectures",
                       absl::StrCat("'", out.architecture.substr(0, 80),
                                    "': Loom imports LlamaForCausalLM, MistralForCausalLM "
                                    "and LoomIhaForCausalLM"));
  LOOM_ASSIGN_OR_RETURN(out.model, ModelFromConfig(config, out.architecture, max_seq_len));
  return out;
}

absl::StatusOr<std::map<std::string, std::set<std::string>>> ParseWeightIndex(
    const std::string& text) {
  const Json index = Json::parse(text, nullptr, false);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    return absl::InvalidArgumentError("model.safetensors.index.json: no weight_map object");
  std::map<std::string, std::set<std::string>> names_by_file;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string() || !PlainFileName(file.get<std::string>()))
      return absl::InvalidArgumentError(absl::StrCat("model.safetensors.index.json: weight_map['",
                                                     name.substr(0, 80),
                                                     "']: not a .safetensors file of the folder"));
    names_by_file[file.get<std::string>()].insert(name);
  }
  return names_by_file;
}

absl::StatusOr<ImportSummary> ImportHuggingFace(const ImportOptions& options) {
  if (options.rope_pairing != "half" && options.rope_pairing != "interleaved")
    return absl::InvalidArgumentError(absl::StrCat("--rope-pairing: '", options.rope_pairing,
                                                   "' is not one of half | interleaved"));
  const fs::path dir(options.in_dir);
  LOOM_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(dir / "config.json", 1 << 20));
  LOOM_ASSIGN_OR_RETURN(HfConfig config, ParseHfConfig(text, options.max_seq_len));
  ImportSummary summary;
  summary.architecture = config.architecture;
  summary.model = config.model;
  const bool interleaved = options.rope_pairing == "interleaved";
  if (interleaved && summary.architecture == "LoomIhaForCausalLM")
    return absl::InvalidArgumentError(
        "--rope-pairing interleaved: a Loom-IHA folder is in Loom's own pairing");
  LOOM_ASSIGN_OR_RETURN(v1::ModelConfig resolved, ResolveModelConfig(summary.model));
  if (interleaved && resolved.rope_theta() <= 0)
    return absl::InvalidArgumentError("--rope-pairing interleaved: the model has no RoPE");
  LOOM_ASSIGN_OR_RETURN(std::vector<LayerAttention> layers, ResolveLayers(resolved));
  LOOM_ASSIGN_OR_RETURN(auto files, ReadWeights(dir));
  LOOM_ASSIGN_OR_RETURN(auto tensors, MapTensors(files, resolved, interleaved));
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, t] : tensors) shapes[name] = t.shape;
  LOOM_RETURN_IF_ERROR(CheckShapes(ExpectedShapes(resolved, layers), shapes, options.in_dir,
                                   [](const std::string& n) {
                                     const std::string hf = HfName(n);
                                     return hf.empty() ? n : hf;
                                   }));
  LOOM_ASSIGN_OR_RETURN(summary.checkpoint_dir,
                        CommitCheckpoint(options, summary.model, tensors, summary.architecture));
  LOOM_RETURN_IF_ERROR(WriteModelJson(fs::path(options.out_root) / "model.json", summary.model));
  summary.tensors = static_cast<int64_t>(tensors.size());
  return summary;
}

}  // namespace loom::interop
