// loom-train export-hf: a Loom checkpoint as a Hugging Face model folder (hf_folder.h).

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "data/bpe_tokenizer.h"
#include "data/token_shards.h"
#include "interop/hf_folder.h"
#include "interop/hf_model.h"
#include "loom/spec.h"
#include "storage/checkpoint.h"
#include "storage/checkpoint_store.h"
#include "storage/safetensors.h"

namespace loom::interop {
namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

namespace {

constexpr char kModelPrefix[] = "model.";

// Llama for all-global SwiGLU stacks with RoPE, Mistral for all-local ones with one window and
// no biases (its attention has none); everything else needs Loom's own modeling file.
std::string ChooseArchitecture(const v1::ModelConfig& m,
                               const std::vector<LayerAttention>& layers) {
  const bool llama_like = m.ffn_activation() == "swiglu" && m.rope_theta() > 0;
  bool all_mha = true, all_local = true;
  for (const LayerAttention& l : layers) {
    all_mha &= l.kind == "mha";
    all_local &= l.kind == "local" && l.window == layers.front().window;
  }
  if (llama_like && all_mha) return "LlamaForCausalLM";
  if (llama_like && all_local && !m.attention_bias()) return "MistralForCausalLM";
  return "LoomIhaForCausalLM";
}

OrderedJson LayersJson(const std::vector<LayerAttention>& layers) {
  OrderedJson out = OrderedJson::array();
  for (const LayerAttention& l : layers) {
    OrderedJson j = {{"kind", l.kind}, {"window", l.window}};
    if (l.kind == "iha") {
      j["p"] = l.p;
      j["mask"] = l.mask;
      j["rope_phase"] = l.rope_phase;
      j["score"] = l.score;
      j["scale"] = l.scale;
    }
    out.push_back(j);
  }
  return out;
}

OrderedJson ConfigJson(const std::string& arch, const v1::ModelConfig& m,
                       const std::vector<LayerAttention>& layers, int64_t eos) {
  OrderedJson c;
  c["architectures"] = OrderedJson::array({arch});
  c["model_type"] = arch == "LlamaForCausalLM"     ? "llama"
                    : arch == "MistralForCausalLM" ? "mistral"
                                                   : "loom_iha";
  if (arch == "LoomIhaForCausalLM") {
    c["auto_map"] = {{"AutoConfig", "modeling_loom_iha.LoomIhaConfig"},
                     {"AutoModelForCausalLM", "modeling_loom_iha.LoomIhaForCausalLM"}};
  }
  c["vocab_size"] = m.vocab_size();
  c["hidden_size"] = m.d_model();
  c["intermediate_size"] = m.ffn_hidden();
  c["num_hidden_layers"] = m.n_layers();
  c["num_attention_heads"] = m.n_heads();
  c["num_key_value_heads"] = m.n_heads();
  c["head_dim"] = m.head_dim();
  c["hidden_act"] = m.ffn_activation() == "swiglu" ? "silu" : "gelu";
  c["max_position_embeddings"] = m.max_seq_len();
  c["rms_norm_eps"] = m.norm_eps();
  c["rope_theta"] = m.rope_theta();
  c["rope_scaling"] = nullptr;
  c["tie_word_embeddings"] = m.tie_embeddings();
  c["attention_bias"] = m.attention_bias();
  c["attention_dropout"] = 0.0;
  c["initializer_range"] = 0.02;
  c["torch_dtype"] = "float32";
  c["use_cache"] = arch != "LoomIhaForCausalLM";  // the Python IHA model recomputes the prefix
  if (arch == "LlamaForCausalLM") {
    c["mlp_bias"] = false;
    c["pretraining_tp"] = 1;
  }
  if (arch == "MistralForCausalLM") c["sliding_window"] = layers.front().window;
  if (arch == "LoomIhaForCausalLM") {
    c["mlp_gated"] = m.ffn_activation() == "swiglu";
    c["loom_layers"] = LayersJson(layers);
  }
  if (eos >= 0) c["eos_token_id"] = eos;
  return c;
}

absl::Status WriteText(const fs::path& path, const std::string& text) {
  return storage::WriteFileAtomically(path.string(), text);
}

// The model's tensors in the order a reader expects them (embedding, layers by number, final
// norm, head), under Hugging Face names, pointing into the loaded shards.
struct NamedTensor {
  std::string hf_name;
  const storage::TensorInfo* info;
  const storage::SafetensorsFile* file;
};

absl::StatusOr<std::vector<NamedTensor>> ModelTensors(const storage::LoadedCheckpoint& c,
                                                      const v1::ModelConfig& m,
                                                      const std::vector<LayerAttention>& layers) {
  std::map<std::string, NamedTensor> by_loom;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const storage::SafetensorsFile& shard : c.shards) {
    for (const storage::TensorInfo& t : shard.tensors()) {
      if (!absl::StartsWith(t.name, kModelPrefix)) continue;  // optimizer state, RNG, ...
      const std::string loom = t.name.substr(sizeof(kModelPrefix) - 1);
      if (by_loom.count(loom)) continue;  // parameters are written once; copies are equal
      by_loom[loom] = NamedTensor{HfName(loom), &t, &shard};
      shapes[loom] = t.shape;
    }
  }
  LOOM_RETURN_IF_ERROR(CheckShapes(ExpectedShapes(m, layers), shapes,
                                   absl::StrCat("checkpoint ", c.dir),
                                   [](const std::string& n) { return n; }));
  std::vector<std::pair<std::tuple<int, int64_t, std::string>, NamedTensor>> keyed;
  for (auto& [loom, t] : by_loom) {
    if (t.hf_name.empty())
      return absl::InternalError(absl::StrCat("export: no Hugging Face name for '", loom, "'"));
    int64_t layer = -1;
    int group = loom == "embed.weight" ? 0 : absl::StartsWith(loom, "layers.") ? 1 : 2;
    if (group == 1) (void)absl::SimpleAtoi(loom.substr(7, loom.find('.', 7) - 7), &layer);
    keyed.push_back({{group, layer, t.hf_name}, t});
  }
  std::sort(keyed.begin(), keyed.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<NamedTensor> out;
  for (auto& [key, t] : keyed) out.push_back(t);
  return out;
}

// model.safetensors, or model-0000i-of-0000n.safetensors with model.safetensors.index.json.
absl::Status WriteWeights(const fs::path& out, const std::vector<NamedTensor>& tensors,
                          uint64_t max_shard_bytes, ExportSummary* summary) {
  std::vector<std::vector<storage::TensorToWrite>> shards(1);
  uint64_t in_shard = 0;
  for (const NamedTensor& t : tensors) {
    const std::string_view data = t.file->Data(*t.info);
    if (in_shard > 0 && in_shard + data.size() > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back({t.hf_name, t.info->dtype, t.info->shape, data.data(), data.size()});
    in_shard += data.size();
    summary->bytes += data.size();
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  summary->shards = static_cast<int>(shards.size());
  summary->tensors = static_cast<int64_t>(tensors.size());
  if (shards.size() == 1)
    return storage::Write((out / "model.safetensors").string(), shards[0], metadata);
  OrderedJson weight_map = OrderedJson::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file =
        absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards.size());
    LOOM_RETURN_IF_ERROR(storage::Write((out / file).string(), shards[i], metadata));
    for (const auto& t : shards[i]) weight_map[t.name] = file;
  }
  OrderedJson index = {{"metadata", {{"total_size", summary->bytes}}}, {"weight_map", weight_map}};
  return WriteText(out / "model.safetensors.index.json", index.dump(2) + "\n");
}

// GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the others are
// moved to U+0100 and up, so every byte has a visible, non-space character.
std::string ByteChar(int b) {
  const bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
  int code = b;
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      n += !((x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae));
    }
    code = 256 + n;
  }
  std::string utf8;
  if (code < 0x80) {
    utf8 += static_cast<char>(code);
  } else {
    utf8 += static_cast<char>(0xc0 | (code >> 6));
    utf8 += static_cast<char>(0x80 | (code & 0x3f));
  }
  return utf8;
}

// Loom's byte tokenizer as a tokenizer.json: a byte-level BPE whose vocabulary is the 256
// bytes (id = byte value) and no merges; ids past 255 (an SFT model's role tokens) are named
// <|loom_reserved_ID|>.
std::string ByteTokenizerJson(int64_t vocab_size) {
  OrderedJson vocab = OrderedJson::object();
  for (int b = 0; b < 256; ++b) vocab[ByteChar(b)] = b;
  OrderedJson added = OrderedJson::array();
  for (int64_t id = 256; id < vocab_size; ++id) {
    added.push_back({{"id", id},
                     {"content", absl::StrCat("<|loom_reserved_", id, "|>")},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  OrderedJson byte_level = {{"type", "ByteLevel"},
                            {"add_prefix_space", false},
                            {"trim_offsets", false},
                            {"use_regex", true}};
  OrderedJson t = {{"version", "1.0"},
                   {"truncation", nullptr},
                   {"padding", nullptr},
                   {"added_tokens", added},
                   {"normalizer", nullptr},
                   {"pre_tokenizer", byte_level},
                   {"post_processor", nullptr},
                   {"decoder", byte_level},
                   {"model",
                    {{"type", "BPE"},
                     {"dropout", nullptr},
                     {"unk_token", nullptr},
                     {"continuing_subword_prefix", nullptr},
                     {"end_of_word_suffix", nullptr},
                     {"fuse_unk", false},
                     {"byte_fallback", false},
                     {"ignore_merges", false},
                     {"vocab", vocab},
                     {"merges", OrderedJson::array()}}}};
  return t.dump() + "\n";
}

// The tokenizer the job trained with, as files next to the weights. Returns what was written
// (for the summary) and the end-of-text id (-1 when none).
absl::StatusOr<std::pair<std::string, int64_t>> WriteTokenizer(const fs::path& out,
                                                               const v1::JobSpec& spec) {
  std::string described = "byte";
  if (spec.data().tokenizer() == "bpe") {
    described = "bpe:" + spec.data().tokenizer_path();
  } else if (spec.data().source() == "shards") {
    auto shards = data::TokenShards::Open(spec.data().path(), false);
    if (!shards.ok())
      return std::make_pair(absl::StrCat("none (", shards.status().message(), ")"), int64_t{-1});
    described = (*shards)->index().tokenizer;
  }
  OrderedJson config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                        {"model_max_length", spec.model().max_seq_len()},
                        {"clean_up_tokenization_spaces", false}};
  if (described == "byte") {
    LOOM_RETURN_IF_ERROR(
        WriteText(out / "tokenizer.json", ByteTokenizerJson(spec.model().vocab_size())));
    LOOM_RETURN_IF_ERROR(WriteText(out / "tokenizer_config.json", config.dump(2) + "\n"));
    return std::make_pair(std::string("tokenizer.json (Loom's byte tokenizer)"), int64_t{-1});
  }
  const size_t colon = described.find(':');
  const std::string kind = described.substr(0, colon), path = described.substr(colon + 1);
  std::error_code ec;
  if (colon == std::string::npos || !fs::is_regular_file(path, ec))
    return std::make_pair(absl::StrCat("none (tokenizer '", described, "' not found)"),
                          int64_t{-1});
  if (kind == "sentencepiece") {
    fs::copy_file(path, out / "tokenizer.model", fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::UnavailableError(absl::StrCat("copying ", path, ": ", ec.message()));
    return std::make_pair(absl::StrCat("tokenizer.model (copied from ", path, ")"), int64_t{-1});
  }
  LOOM_ASSIGN_OR_RETURN(auto bpe, data::BpeTokenizer::Load(path));
  fs::copy_file(path, out / "tokenizer.json", fs::copy_options::overwrite_existing, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("copying ", path, ": ", ec.message()));
  LOOM_RETURN_IF_ERROR(WriteText(out / "tokenizer_config.json", config.dump(2) + "\n"));
  return std::make_pair(absl::StrCat("tokenizer.json (copied from ", path, ")"), bpe->eos_id());
}

absl::Status PrepareOutput(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_empty(dir, ec))
    return absl::AlreadyExistsError(absl::StrCat("--out '", dir, "' exists and is not empty"));
  fs::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("--out '", dir, "': ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ExportSummary> ExportHuggingFace(const ExportOptions& options) {
  LOOM_ASSIGN_OR_RETURN(storage::LoadedCheckpoint loaded,
                        storage::LoadNamedCheckpoint(options.checkpoint));
  LOOM_ASSIGN_OR_RETURN(v1::JobSpec spec, RecordedSpec(loaded.manifest.state, loaded.dir));
  LOOM_ASSIGN_OR_RETURN(v1::ModelConfig model, ResolveModelConfig(spec.model()));
  *spec.mutable_model() = model;
  LOOM_ASSIGN_OR_RETURN(std::vector<LayerAttention> layers, ResolveLayers(model));
  LOOM_ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, ModelTensors(loaded, model, layers));
  LOOM_RETURN_IF_ERROR(PrepareOutput(options.out_dir));
  const fs::path out(options.out_dir);

  ExportSummary summary;
  summary.architecture = ChooseArchitecture(model, layers);
  summary.checkpoint_dir = loaded.dir;
  summary.step = loaded.manifest.step;
  LOOM_RETURN_IF_ERROR(
      WriteWeights(out, tensors, std::max<uint64_t>(1, options.max_shard_bytes), &summary));
  LOOM_ASSIGN_OR_RETURN(auto tokenizer, WriteTokenizer(out, spec));
  OrderedJson config = ConfigJson(summary.architecture, model, layers, tokenizer.second);
  config["loom"] = {{"checkpoint", loaded.dir},
                    {"step", loaded.manifest.step},
                    {"spec_hash", loaded.manifest.spec_hash},
                    {"tokenizer", tokenizer.first}};
  LOOM_RETURN_IF_ERROR(WriteText(out / "config.json", config.dump(2) + "\n"));
  OrderedJson generation = {{"_from_model_config", true}, {"max_length", model.max_seq_len()}};
  if (tokenizer.second >= 0) generation["eos_token_id"] = tokenizer.second;
  LOOM_RETURN_IF_ERROR(WriteText(out / "generation_config.json", generation.dump(2) + "\n"));
  if (summary.architecture == "LoomIhaForCausalLM")
    LOOM_RETURN_IF_ERROR(WriteText(out / "modeling_loom_iha.py", std::string(ModelingLoomIhaPy())));
  return summary;
}

}  // namespace loom::interop
