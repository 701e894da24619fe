// export-hf / import-hf on checkpoints written here (no LibTorch): names, architectures, bitwise
// round trips, shards, dtype widening, the RoPE pairing permutation and hostile folders.
// tests/interop/hf_interop_test.py checks the numbers (logits) against Python.
#include "interop/hf_folder.h"

#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/read_file.h"
#include "interop/hf_model.h"
#include "loom/spec.h"
#include "storage/checkpoint.h"
#include "storage/safetensors.h"

namespace loom::interop {
namespace {
namespace fs = std::filesystem;
using Json = nlohmann::json;

class HfFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ =
        fs::temp_directory_path() /
        absl::StrCat("loom-hf-", ::testing::UnitTest::GetInstance()->current_test_info()->name(),
                     "-", ::getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  static v1::ModelConfig Model(const std::string& schedule_json) {
    v1::ModelConfig m;
    const std::string json = absl::StrCat(
        R"({"d_model": 16, "n_layers": 3, "n_heads": 4, "head_dim": 6, "ffn_hidden": 24,
            "ffn_activation": "swiglu", "vocab_size": 300, "max_seq_len": 64,
            "rope_theta": 10000, "tie_embeddings": false, )",
        schedule_json, "}");
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(json, &m).ok()) << json;
    return m;
  }

  // A checkpoint holding every tensor of `model` with deterministic values, plus optimizer
  // state that must never be exported. Returns the tensors' bytes by Loom name.
  std::map<std::string, std::string> WriteCheckpoint(const v1::ModelConfig& model,
                                                     const std::string& root) {
    auto resolved = ResolveModelConfig(model);
    EXPECT_TRUE(resolved.ok()) << resolved.status();
    // A model no folder can describe (an encoder) still gets a checkpoint: the export refuses it.
    auto layers = ResolveLayers(*resolved);
    const std::vector<LayerAttention> kinds = layers.ok() ? *layers : std::vector<LayerAttention>{};
    std::map<std::string, std::vector<int64_t>> shapes = ExpectedShapes(*resolved, kinds);
    std::map<std::string, std::string> bytes;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    for (const auto& [name, shape] : shapes) {
      int64_t n = 1;
      for (int64_t s : shape) n *= s;
      std::vector<float> v(n);
      for (float& x : v) x = normal(rng);
      bytes[name] = std::string(reinterpret_cast<const char*>(v.data()), n * 4);
    }
    std::vector<storage::TensorToWrite> writes;
    for (const auto& [name, b] : bytes)
      writes.push_back({"model." + name, storage::DType::kF32, shapes[name], b.data(), b.size()});
    const float moment[2] = {1, 2};
    writes.push_back({"optim.embed.weight.exp_avg", storage::DType::kF32, {2}, moment, 8});
    auto writer = storage::CheckpointWriter::Begin(root, 40, 1);
    EXPECT_TRUE(writer.ok()) << writer.status();
    EXPECT_TRUE(writer->WriteShard(0, writes).ok());
    v1::JobSpec spec;
    *spec.mutable_model() = model;
    std::string json;
    (void)google::protobuf::util::MessageToJsonString(spec, &json);
    storage::Manifest manifest;
    manifest.step = 40;
    manifest.state["spec"] = json;
    EXPECT_TRUE(writer->Commit(manifest).ok());
    return bytes;
  }

  // model.* tensors of the newest checkpoint under root, by Loom name.
  static std::map<std::string, std::string> CheckpointTensors(const std::string& root) {
    auto loaded = storage::LoadLatestCheckpoint(root, nullptr);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    std::map<std::string, std::string> out;
    for (const auto& shard : loaded->shards) {
      for (const auto& t : shard.tensors()) {
        EXPECT_TRUE(absl::StartsWith(t.name, "model.")) << t.name;
        EXPECT_EQ(t.dtype, storage::DType::kF32) << t.name;
        out[t.name.substr(6)] = std::string(shard.Data(t));
      }
    }
    return out;
  }

  static Json ReadJson(const fs::path& p) {
    return Json::parse(ReadFile(p.string(), "test").value());
  }

  fs::path root_;
};

TEST_F(HfFolderTest, EveryLoomNameHasOneHuggingFaceNameAndBack) {
  v1::ModelConfig m = Model(R"("attention_bias": true, "schedule": [{"repeat": 1,
      "attention": {"plugin": "iha", "options": {"p": 3}}}])");
  auto resolved = ResolveModelConfig(m);
  ASSERT_TRUE(resolved.ok());
  auto layers = ResolveLayers(*resolved);
  ASSERT_TRUE(layers.ok()) << layers.status();
  std::set<std::string> hf;
  for (const auto& [name, shape] : ExpectedShapes(*resolved, *layers)) {
    const std::string h = HfName(name);
    ASSERT_FALSE(h.empty()) << name;
    EXPECT_TRUE(hf.insert(h).second) << h;
    EXPECT_EQ(LoomName(h), name);
  }
  EXPECT_EQ(HfName("layers.2.attention.q_proj.weight"), "model.layers.2.self_attn.q_proj.weight");
  EXPECT_EQ(HfName("layers.0.ffn.gate.weight"), "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(HfName("embed.weight"), "model.embed_tokens.weight");
  for (const char* junk : {"model.layers.01.mlp.up_proj.weight", "model.layers..mlp.up_proj.weight",
                           "model.layers.1.self_attn.rotary_emb.inv_freq", "model.layers.1",
                           "lm_head.bias", "model.layers.-1.mlp.up_proj.weight"}) {
    EXPECT_EQ(LoomName(junk), "") << junk;
  }
}

TEST_F(HfFolderTest, GlobalSwigluModelExportsAsLlamaAndImportsBitwise) {
  const v1::ModelConfig model =
      Model(R"("schedule": [{"repeat": 1, "attention": {"plugin": "mha"}}])");
  const auto original = WriteCheckpoint(model, (root_ / "ckpt").string());
  auto exported = ExportHuggingFace({(root_ / "ckpt").string(), (root_ / "hf").string()});
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->architecture, "LlamaForCausalLM");
  EXPECT_EQ(exported->step, 40);
  EXPECT_EQ(exported->shards, 1);
  EXPECT_EQ(exported->tensors, static_cast<int64_t>(original.size()));
  const Json config = ReadJson(root_ / "hf" / "config.json");
  EXPECT_EQ(config["model_type"], "llama");
  EXPECT_EQ(config["head_dim"], 6);
  EXPECT_EQ(config["num_key_value_heads"], 4);
  EXPECT_EQ(config["tie_word_embeddings"], false);
  EXPECT_EQ(config["hidden_act"], "silu");
  EXPECT_FALSE(fs::exists(root_ / "hf" / "modeling_loom_iha.py"));
  auto st = storage::SafetensorsFile::Read((root_ / "hf" / "model.safetensors").string());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->metadata().at("format"), "pt");
  EXPECT_NE(st->Find("model.layers.2.mlp.down_proj.weight"), nullptr);
  EXPECT_EQ(st->Find("optim.embed.weight.exp_avg"), nullptr);

  auto imported = ImportHuggingFace({(root_ / "hf").string(), (root_ / "back").string()});
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->architecture, "LlamaForCausalLM");
  EXPECT_EQ(CheckpointTensors((root_ / "back").string()), original);
  EXPECT_TRUE(fs::exists(root_ / "back" / "model.json"));
  // The byte tokenizer as a byte-level BPE: byte 'A' is id 65, byte 0x00 is U+0100.
  const Json tok = ReadJson(root_ / "hf" / "tokenizer.json");
  EXPECT_EQ(tok["model"]["vocab"]["A"], 65);
  EXPECT_EQ(tok["model"]["vocab"]["\xc4\x80"], 0);
  EXPECT_EQ(tok["model"]["vocab"].size(), 256u);
  EXPECT_EQ(tok["added_tokens"].size(), 300u - 256u);
}

TEST_F(HfFolderTest, LocalModelExportsAsMistralWithItsWindow) {
  const v1::ModelConfig model =
      Model(R"("schedule": [{"repeat": 1, "attention": {"plugin": "local", "window": 8}}])");
  const auto original = WriteCheckpoint(model, (root_ / "ckpt").string());
  auto exported = ExportHuggingFace({(root_ / "ckpt").string(), (root_ / "hf").string()});
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->architecture, "MistralForCausalLM");
  EXPECT_EQ(ReadJson(root_ / "hf" / "config.json")["sliding_window"], 8);
  auto imported = ImportHuggingFace({(root_ / "hf").string(), (root_ / "back").string()});
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->model.schedule(0).attention().plugin(), "local");
  EXPECT_EQ(imported->model.schedule(0).attention().window(), 8);
  EXPECT_EQ(CheckpointTensors((root_ / "back").string()), original);
}

TEST_F(HfFolderTest, HybridIhaModelExportsWithItsModelingFileAndShards) {
  const v1::ModelConfig model = Model(R"("hybrid": {"local_per_global": 2, "window": 4,
      "iha_options": {"p": 2, "rope_phase": "token"}})");
  const auto original = WriteCheckpoint(model, (root_ / "ckpt").string());
  // Shards of at most 4 KiB: the index path.
  auto exported = ExportHuggingFace({(root_ / "ckpt").string(), (root_ / "hf").string(), 4096});
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->architecture, "LoomIhaForCausalLM");
  EXPECT_GT(exported->shards, 2);
  EXPECT_FALSE(fs::exists(root_ / "hf" / "model.safetensors"));
  const Json index = ReadJson(root_ / "hf" / "model.safetensors.index.json");
  EXPECT_EQ(index["weight_map"].size(), original.size());
  EXPECT_EQ(index["metadata"]["total_size"], exported->bytes);
  const Json config = ReadJson(root_ / "hf" / "config.json");
  EXPECT_EQ(config["auto_map"]["AutoModelForCausalLM"], "modeling_loom_iha.LoomIhaForCausalLM");
  ASSERT_EQ(config["loom_layers"].size(), 3u);
  EXPECT_EQ(config["loom_layers"][0]["kind"], "iha");
  EXPECT_EQ(config["loom_layers"][0]["window"], 4);
  EXPECT_EQ(config["loom_layers"][0]["p"], 2);
  EXPECT_EQ(config["loom_layers"][0]["mask"], "interleaved");
  EXPECT_EQ(config["loom_layers"][0]["rope_phase"], "token");
  EXPECT_EQ(config["loom_layers"][2]["kind"], "mha");
  const std::string text =
      ReadFile((root_ / "hf" / "modeling_loom_iha.py").string(), "modeling file").value();
  EXPECT_EQ(text, std::string(ModelingLoomIhaPy()));
  EXPECT_NE(text.find("class LoomIhaForCausalLM"), std::string::npos);

  auto imported = ImportHuggingFace({(root_ / "hf").string(), (root_ / "back").string()});
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(CheckpointTensors((root_ / "back").string()), original);
  // Exporting the import again gives the same folder description.
  auto again = ExportHuggingFace({(root_ / "back").string(), (root_ / "hf2").string()});
  ASSERT_TRUE(again.ok()) << again.status();
  Json c2 = ReadJson(root_ / "hf2" / "config.json");
  EXPECT_EQ(c2["loom_layers"], config["loom_layers"]);
}

TEST_F(HfFolderTest, WhatAFolderCannotDescribeIsRefusedByName) {
  v1::ModelConfig encoder = Model(R"("mode": "encoder", "num_classes": 3)");
  WriteCheckpoint(encoder, (root_ / "enc").string());
  auto s = ExportHuggingFace({(root_ / "enc").string(), (root_ / "out1").string()});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("model.mode"), std::string::npos) << s.status();

  v1::ModelConfig talking =
      Model(R"("schedule": [{"repeat": 1, "attention": {"plugin": "talking_heads"}}])");
  auto resolved = ResolveModelConfig(talking);
  ASSERT_TRUE(resolved.ok());
  auto layers = ResolveLayers(*resolved);
  ASSERT_FALSE(layers.ok());
  EXPECT_NE(layers.status().message().find("talking_heads"), std::string::npos) << layers.status();

  const v1::ModelConfig model =
      Model(R"("schedule": [{"repeat": 1, "attention": {"plugin": "mha"}}])");
  WriteCheckpoint(model, (root_ / "ckpt").string());
  fs::create_directories(root_ / "busy");
  std::ofstream(root_ / "busy" / "x") << "x";
  s = ExportHuggingFace({(root_ / "ckpt").string(), (root_ / "busy").string()});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kAlreadyExists) << s.status();
}

// Writes a Llama folder by hand (as transformers would) with `edit` applied to config.json.
void WriteLlamaFolder(const fs::path& dir, const Json& config,
                      const std::vector<storage::TensorToWrite>& tensors) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config.dump();
  ASSERT_TRUE(storage::Write((dir / "model.safetensors").string(), tensors).ok());
}

Json LlamaConfig() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", 8},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 2},
          {"num_hidden_layers", 1},
          {"intermediate_size", 12},
          {"vocab_size", 10},
          {"max_position_embeddings", 32},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 10000.0},
          {"tie_word_embeddings", true},
          {"hidden_act", "silu"}};
}

// The tensors of LlamaConfig(); q_proj rows hold their row index, so a permutation shows.
struct LlamaTensors {
  std::map<std::string, std::vector<float>> values;
  std::map<std::string, std::vector<int64_t>> shapes;
  std::vector<storage::TensorToWrite> Writes(storage::DType dtype = storage::DType::kF32) {
    std::vector<storage::TensorToWrite> out;
    bf16.clear();
    for (auto& [name, v] : values) {
      if (dtype == storage::DType::kBF16) {
        auto& b = bf16[name];
        for (float x : v) {
          uint32_t bits;
          std::memcpy(&bits, &x, 4);
          b.push_back(static_cast<uint16_t>(bits >> 16));
        }
        out.push_back({name, dtype, shapes[name], b.data(), b.size() * 2});
      } else {
        out.push_back({name, dtype, shapes[name], v.data(), v.size() * 4});
      }
    }
    return out;
  }
  std::map<std::string, std::vector<uint16_t>> bf16;
};

LlamaTensors MakeLlamaTensors() {
  LlamaTensors t;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 97) * 0.25f - 3.0f;
    t.values[name] = v;
    t.shapes[name] = shape;
  };
  add("model.embed_tokens.weight", {10, 8});
  add("model.norm.weight", {8});
  const std::string l = "model.layers.0.";
  add(l + "input_layernorm.weight", {8});
  add(l + "post_attention_layernorm.weight", {8});
  for (const char* p : {"q", "k", "v"})
    add(absl::StrCat(l, "self_attn.", p, "_proj.weight"), {8, 8});
  add(l + "self_attn.o_proj.weight", {8, 8});
  add(l + "mlp.gate_proj.weight", {12, 8});
  add(l + "mlp.up_proj.weight", {12, 8});
  add(l + "mlp.down_proj.weight", {8, 12});
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < 8; ++c)
      t.values[l + "self_attn.q_proj.weight"][r * 8 + c] = static_cast<float>(r);
  }
  return t;
}

TEST_F(HfFolderTest, MetaPairingIsPermutedAndHalfPrecisionWidenedExactly) {
  LlamaTensors t = MakeLlamaTensors();
  WriteLlamaFolder(root_ / "meta", LlamaConfig(), t.Writes(storage::DType::kBF16));
  auto imported =
      ImportHuggingFace({(root_ / "meta").string(), (root_ / "ckpt").string(), "interleaved"});
  ASSERT_TRUE(imported.ok()) << imported.status();
  const auto tensors = CheckpointTensors((root_ / "ckpt").string());
  // head_dim 4, heads 2: Meta rows (0,1,2,3) = pairs (0,1),(2,3) -> Loom rows 0,2,1,3.
  const std::string& q = tensors.at("layers.0.attention.q_proj.weight");
  std::vector<float> rows;
  for (int r = 0; r < 8; ++r) {
    float v;
    std::memcpy(&v, q.data() + r * 8 * 4, 4);
    rows.push_back(v);
  }
  EXPECT_EQ(rows, (std::vector<float>{0, 2, 1, 3, 4, 6, 5, 7}));
  // bf16 -> f32 is exact: every value of these small multiples of 1/4 survives.
  const std::string& up = tensors.at("layers.0.ffn.up.weight");
  std::vector<float> got(up.size() / 4);
  std::memcpy(got.data(), up.data(), up.size());
  EXPECT_EQ(got, t.values["model.layers.0.mlp.up_proj.weight"]);
  EXPECT_FALSE(tensors.count("lm_head.weight"));  // tied
}

TEST_F(HfFolderTest, HostileFoldersAreRefusedWithTheFieldNamed) {
  LlamaTensors t = MakeLlamaTensors();
  auto try_config = [&](const std::string& name, Json config) {
    WriteLlamaFolder(root_ / name, config, t.Writes());
    return ImportHuggingFace({(root_ / name).string(), (root_ / (name + "-out")).string()})
        .status();
  };
  Json gqa = LlamaConfig();
  gqa["num_key_value_heads"] = 1;
  EXPECT_NE(try_config("gqa", gqa).message().find("num_key_value_heads"), std::string::npos);
  Json scaled = LlamaConfig();
  scaled["rope_scaling"] = {{"rope_type", "llama3"}};
  EXPECT_NE(try_config("scaled", scaled).message().find("rope_scaling"), std::string::npos);
  // transformers 5's form of the same fields: its save_pretrained writes RoPE's base only in
  // rope_parameters (before 2026-12-07 the import took the default 10000 instead).
  Json v5 = LlamaConfig();
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  WriteLlamaFolder(root_ / "v5", v5, t.Writes());
  auto imported = ImportHuggingFace({(root_ / "v5").string(), (root_ / "v5-out").string()});
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->model.rope_theta(), 500000.0);
  Json scaled5 = LlamaConfig();
  scaled5.erase("rope_theta");
  scaled5["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}};
  EXPECT_NE(try_config("scaled5", scaled5).message().find("rope_parameters.rope_type"),
            std::string::npos);
  Json disagree = LlamaConfig();
  disagree["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
  EXPECT_NE(try_config("disagree", disagree).message().find("disagrees with rope_theta"),
            std::string::npos);
  Json other = LlamaConfig();
  other["architectures"] = {"GPT2LMHeadModel"};
  EXPECT_NE(try_config("other", other).message().find("architectures"), std::string::npos);
  Json huge = LlamaConfig();
  huge["hidden_size"] = -8;
  EXPECT_NE(try_config("huge", huge).message().find("hidden_size"), std::string::npos);
  Json wide = LlamaConfig();
  wide["intermediate_size"] = 16;  // the tensors say 12
  const absl::Status shape = try_config("wide", wide);
  EXPECT_NE(shape.message().find("model.layers.0.mlp.up_proj.weight [12, 8], expected [16, 8]"),
            std::string::npos)
      << shape;

  // A stray tensor and an index pointing out of the folder.
  auto writes = t.Writes();
  const float extra[1] = {1};
  writes.push_back({"model.layers.0.self_attn.q_norm.weight", storage::DType::kF32, {1}, extra, 4});
  WriteLlamaFolder(root_ / "stray", LlamaConfig(), writes);
  auto stray = ImportHuggingFace({(root_ / "stray").string(), (root_ / "stray-out").string()});
  EXPECT_NE(stray.status().message().find("q_norm"), std::string::npos) << stray.status();
  fs::create_directories(root_ / "escape");
  std::ofstream(root_ / "escape" / "config.json") << LlamaConfig().dump();
  std::ofstream(root_ / "escape" / "model.safetensors.index.json")
      << R"({"weight_map": {"model.norm.weight": "../stray/model.safetensors"}})";
  auto escape = ImportHuggingFace({(root_ / "escape").string(), (root_ / "escape-out").string()});
  EXPECT_NE(escape.status().message().find("not a .safetensors file of the folder"),
            std::string::npos)
      << escape.status();
  fs::create_directories(root_ / "garbage");
  std::ofstream(root_ / "garbage" / "config.json") << "{not json";
  EXPECT_FALSE(ImportHuggingFace({(root_ / "garbage").string(), (root_ / "g-out").string()}).ok());
  // Nothing half-written: failed imports leave no checkpoint behind.
  EXPECT_FALSE(fs::exists(root_ / "gqa-out"));
  EXPECT_FALSE(fs::exists(root_ / "stray-out" / "step-00000000"));
}

}  // namespace
}  // namespace loom::interop
