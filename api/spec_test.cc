#include "loom/spec.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "loom/proto_json.h"
#include "loom/spec_overrides.h"
#include "storage/checkpoint.h"

namespace loom {
namespace {

absl::StatusOr<v1::JobSpec> Resolve(const std::string& json) {
  v1::JobSpec spec;
  absl::Status s = ParseJsonMessage(json, "job.json", &spec);
  if (!s.ok()) return s;
  return ResolveJobSpec(spec);
}

TEST(JobSpec, PresetFillsUnsetFieldsAndSpecOverrides) {
  auto j = Resolve(R"({"preset": "micro", "steps": 40, "optimizer": {"lr": 0.001}})");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->steps(), 40);
  EXPECT_EQ(j->optimizer().warmup_steps(), 4);  // the preset's 20, capped at a tenth of the run
  EXPECT_DOUBLE_EQ(j->optimizer().lr(), 0.001);
  EXPECT_DOUBLE_EQ(j->optimizer().beta2(), 0.95);  // from the preset
  EXPECT_EQ(j->model().d_model(), 64);
  EXPECT_EQ(j->grad_accum(), 1);
  EXPECT_EQ(j->data().source(), "corpus");
  EXPECT_EQ(j->data().seed(), 1u);
  EXPECT_EQ(j->checkpoint().keep_last(), 3);
  // A spec's schedule replaces the preset's.
  auto s = Resolve(
      R"({"preset": "tiny-cpu", "model": {"schedule": [{"repeat": 1, "attention": {"plugin": "iha"}}]}})");
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->model().schedule_size(), 1);
  EXPECT_EQ(s->model().schedule(0).attention().plugin(), "iha");
}

// rope_theta 0 is RoPE off, not "unset": under a preset an explicit 0 stays 0 however it is
// written (JSON, YAML, --set, a --set message), and only a spec that leaves the field out gets
// the preset's θ. Before 2026-12-07 the preset's θ replaced the 0 (proto3 merges skip zeros).
TEST(JobSpec, AnExplicitZeroRopeThetaTurnsRopeOffUnderAPreset) {
  auto off = Resolve(R"({"preset": "micro", "model": {"rope_theta": 0}})");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->model().rope_theta(), 0);
  EXPECT_TRUE(off->model().has_rope_theta());  // so that resolving it again keeps the 0
  auto preset = Resolve(R"({"preset": "micro"})");
  ASSERT_TRUE(preset.ok()) << preset.status();
  EXPECT_EQ(preset->model().rope_theta(), 10000);
  auto camel = Resolve(R"({"preset": "micro", "model": {"ropeTheta": 0.0}})");
  ASSERT_TRUE(camel.ok()) << camel.status();
  EXPECT_EQ(camel->model().rope_theta(), 0);

  auto yaml = YamlToJson("preset: micro\nmodel:\n  rope_theta: 0\n", "job.yaml");
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  auto from_yaml = Resolve(*yaml);
  ASSERT_TRUE(from_yaml.ok()) << from_yaml.status();
  EXPECT_EQ(from_yaml->model().rope_theta(), 0);

  for (const char* set : {"model.rope_theta=0", "model.ropeTheta=0.0", "spec.model.rope_theta=0",
                          R"(model={"rope_theta": 0})"}) {
    v1::JobSpec spec;
    spec.set_preset("micro");
    ASSERT_TRUE(ApplySetFlag(&spec, set).ok()) << set;
    EXPECT_TRUE(spec.model().has_rope_theta()) << set;  // setting 0 marks it set
    auto r = ResolveJobSpec(spec);
    ASSERT_TRUE(r.ok()) << set << ": " << r.status();
    EXPECT_EQ(r->model().rope_theta(), 0) << set;
  }
  // A file's explicit 0 under a preset, then --set: the last setting wins.
  v1::JobSpec spec;
  ASSERT_TRUE(
      ParseJsonMessage(R"({"preset": "micro", "model": {"rope_theta": 0}})", "job.json", &spec)
          .ok());
  ASSERT_TRUE(ApplySetFlag(&spec, "model.rope_theta=500").ok());
  EXPECT_EQ(ResolveJobSpec(spec)->model().rope_theta(), 500);

  // The resolved spec, as a coordinator stores it and an agent hands it to loom-train (JSON
  // without defaults), resolves to the same 0; so does the resolved spec itself.
  v1::JobSpec printed;
  ASSERT_TRUE(ParseJsonMessage(MessageToJsonText(*off), "spec.json", &printed).ok());
  EXPECT_EQ(ResolveJobSpec(printed)->model().rope_theta(), 0);
  EXPECT_EQ(ResolveJobSpec(*off)->model().rope_theta(), 0);
  EXPECT_EQ(ResolveJobSpec(*preset)->model().rope_theta(), 10000);
}

// The optimizer's fields whose 0 is a setting of its own (no decay floor, no warm-up, no
// momentum, no weight decay, no clipping) keep an explicit 0 under a preset too.
TEST(JobSpec, ExplicitZeroOptimizerFieldsSurviveAPreset) {
  auto zeros = Resolve(R"({"preset": "micro", "optimizer": {"lr": 0.001, "min_lr": 0,
      "warmup_steps": 0, "beta1": 0, "beta2": 0, "weight_decay": 0, "clip_norm": 0}})");
  ASSERT_TRUE(zeros.ok()) << zeros.status();
  const v1::OptimizerConfig& z = zeros->optimizer();
  EXPECT_EQ(z.min_lr(), 0);
  EXPECT_EQ(z.warmup_steps(), 0);
  EXPECT_EQ(z.beta1(), 0);
  EXPECT_EQ(z.beta2(), 0);
  EXPECT_EQ(z.weight_decay(), 0);
  EXPECT_EQ(z.clip_norm(), 0);
  EXPECT_EQ(ResolveJobSpec(*zeros)->optimizer().warmup_steps(), 0);  // not capped again
  auto preset = Resolve(R"({"preset": "micro", "optimizer": {"lr": 0.001}})");
  ASSERT_TRUE(preset.ok()) << preset.status();
  const v1::OptimizerConfig& p = preset->optimizer();
  EXPECT_DOUBLE_EQ(p.min_lr(), 3e-4);
  EXPECT_EQ(p.warmup_steps(), 15);  // the preset's 20, capped at a tenth of its 150 steps
  EXPECT_DOUBLE_EQ(p.beta1(), 0.9);
  EXPECT_DOUBLE_EQ(p.beta2(), 0.95);
  EXPECT_DOUBLE_EQ(p.weight_decay(), 0.1);
  EXPECT_DOUBLE_EQ(p.clip_norm(), 1.0);
  v1::JobSpec spec;
  spec.set_preset("micro");
  ASSERT_TRUE(ApplySetFlags(&spec, {"optimizer.weight_decay=0", "optimizer.warmup_steps=0",
                                    "optimizer.clip_norm=0"})
                  .ok());
  auto set = ResolveJobSpec(spec);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->optimizer().weight_decay(), 0);
  EXPECT_EQ(set->optimizer().warmup_steps(), 0);
  EXPECT_EQ(set->optimizer().clip_norm(), 0);
  EXPECT_DOUBLE_EQ(set->optimizer().beta1(), 0.9);
}

// Presence is no part of what a spec means once it is resolved: without a preset an explicit 0
// resolves to what an older Loom wrote, and the hashes a checkpoint records (resume compares
// the model's) are those of a spec that leaves the field at 0.
TEST(JobSpec, ExplicitZerosHashAsBefore) {
  auto text = [](const std::string& model, const std::string& optimizer) {
    return absl::StrCat(
        R"({"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 256, )",
        R"("max_seq_len": 128)", model, R"(}, "steps": 10, "micro_batch": 2, "seq_len": 16, )",
        R"("optimizer": {"lr": 0.001)", optimizer, "}}");
  };
  auto implicit = Resolve(text("", ""));
  auto explicit_zero =
      Resolve(text(R"(, "rope_theta": 0)", R"(, "clip_norm": 0, "warmup_steps": 0)"));
  ASSERT_TRUE(implicit.ok()) << implicit.status();
  ASSERT_TRUE(explicit_zero.ok()) << explicit_zero.status();
  EXPECT_FALSE(explicit_zero->model().has_rope_theta());
  EXPECT_EQ(explicit_zero->SerializeAsString(), implicit->SerializeAsString());
  // Under a preset the 0 keeps its presence, and still hashes as an unset 0.
  auto preset_off = Resolve(R"({"preset": "micro", "model": {"rope_theta": 0}})");
  ASSERT_TRUE(preset_off.ok()) << preset_off.status();
  ASSERT_TRUE(preset_off->model().has_rope_theta());
  v1::JobSpec unset = *preset_off;
  unset.mutable_model()->clear_rope_theta();
  EXPECT_EQ(ModelHash(*preset_off), ModelHash(unset));
  EXPECT_EQ(SpecHash(*preset_off), SpecHash(unset));
  auto preset_on = Resolve(R"({"preset": "micro"})");
  ASSERT_TRUE(preset_on.ok()) << preset_on.status();
  EXPECT_NE(ModelHash(*preset_off), ModelHash(*preset_on));
}

TEST(JobSpec, PaperPresetMatchesTheSpec) {
  auto j = JobPreset("paper-2.4b");
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->model().n_layers(), 26);
  EXPECT_EQ(j->model().d_model(), 2560);
  EXPECT_EQ(j->model().n_heads(), 20);
  EXPECT_EQ(j->model().ffn_hidden(), 10240);
  EXPECT_EQ(j->model().vocab_size(), 128256);
  EXPECT_EQ(j->model().max_seq_len(), 8192);
  EXPECT_DOUBLE_EQ(j->model().rope_theta(), 500000);
  EXPECT_DOUBLE_EQ(j->optimizer().lr(), 8e-4);
  EXPECT_DOUBLE_EQ(j->optimizer().min_lr(), 8e-6);
  EXPECT_EQ(j->optimizer().warmup_steps(), 1000);
  EXPECT_DOUBLE_EQ(j->optimizer().beta1(), 0.9);
  EXPECT_DOUBLE_EQ(j->optimizer().beta2(), 0.95);
  EXPECT_DOUBLE_EQ(j->optimizer().weight_decay(), 0.1);
  EXPECT_DOUBLE_EQ(j->optimizer().clip_norm(), 1.0);
  EXPECT_EQ(j->precision(), "bf16");
  auto resolved = ResolveJobSpec(*j);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->model().head_dim(), 128);
}

TEST(JobSpec, LossScalingDefaultsByPrecision) {
  auto fp16 = Resolve(R"({"preset": "micro", "precision": "fp16", "device": "cuda"})");
  ASSERT_TRUE(fp16.ok()) << fp16.status();
  EXPECT_EQ(fp16->loss_scale().mode(), "dynamic");
  EXPECT_DOUBLE_EQ(fp16->loss_scale().initial(), 65536);
  EXPECT_EQ(fp16->loss_scale().growth_interval(), 2000);
  auto bf16 = Resolve(R"({"preset": "micro", "precision": "bf16"})");
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->loss_scale().mode(), "none");
}

TEST(JobSpec, BadSpecsNameTheField) {
  struct Bad {
    const char* json;
    const char* needle;
  };
  const Bad cases[] = {
      {R"({"preset": "micro", "stepz": 3})", "stepz"},                        // unknown field
      {R"({"preset": "micro", "steps": "ten"})", "steps"},                    // wrong type
      {R"({"preset": "micro", "optimizer": {"lr": "fast"}})", "lr"},          // wrong type
      {R"({"preset": "nano"})", "preset"},                                    // unknown preset
      {R"({"steps": 3})", "model"},                                           // no model
      {R"({"preset": "micro", "model": {"d_model": 66}})", "model.n_heads"},  // D % H
      {R"({"preset": "micro", "seq_len": 4096})", "seq_len"},                 // > max_seq_len
      {R"({"preset": "micro", "model": {"schedule": [{"repeat": 1, "attention": {"plugin": "local", "window": 999}}]}})",
       "model.schedule[0].attention.window"},  // window > context
      {R"({"preset": "micro", "micro_batch": -1})", "micro_batch"},
      {R"({"preset": "micro", "grad_accum": -2})", "grad_accum"},
      {R"({"preset": "micro", "steps": -5})", "steps"},
      {R"({"preset": "micro", "optimizer": {"lr": -1}})", "optimizer.lr"},
      {R"({"preset": "micro", "optimizer": {"min_lr": 1}})", "optimizer.min_lr"},
      {R"({"preset": "micro", "optimizer": {"beta1": 1.0}})", "optimizer.beta1"},
      {R"({"preset": "micro", "optimizer": {"warmup_steps": 1000}})", "optimizer.warmup_steps"},
      {R"({"preset": "micro", "optimizer": {"weight_decay": -0.1}})", "optimizer.weight_decay"},
      {R"({"preset": "micro", "optimizer": {"clip_norm": -1}})", "optimizer.clip_norm"},
      {R"({"preset": "micro", "precision": "fp8"})", "precision"},
      {R"({"preset": "micro", "device": "tpu"})", "device"},
      {R"({"preset": "micro", "precision": "fp16", "device": "cpu"})", "precision"},
      {R"({"preset": "micro", "loss_scale": {"mode": "static"}})", "loss_scale.mode"},
      {R"({"preset": "micro", "eval": {"lengths": [64]}})", "eval.lengths"},  // not a task
      {R"({"preset": "micro", "data": {"source": "task", "task": "needle"},
           "eval": {"lengths": [64, 1000000]}})",
       "eval.lengths[1]"},
      {R"({"preset": "micro", "precision": "fp16", "loss_scale": {"mode": "none"}})",
       "loss_scale.mode"},
      {R"({"preset": "micro", "loss_scale": {"initial": 0.5}})", "loss_scale.initial"},
      {R"({"preset": "micro", "loss_scale": {"initial": 1e300}})", "loss_scale.initial"},
      {R"({"preset": "micro", "loss_scale": {"growth_interval": -1}})",
       "loss_scale.growth_interval"},
      {R"({"preset": "micro", "data": {"source": "web"}})", "data.source"},
      {R"({"preset": "micro", "data": {"tokenizer": "gpt2"}})", "data.tokenizer"},
      {R"({"preset": "micro", "data": {"tokenizer": "bpe"}})", "data.tokenizer_path"},
      {R"({"preset": "micro", "data": {"tokenizer_path": "t.json"}})", "data.tokenizer_path"},
      {R"({"preset": "micro", "data": {"source": "task", "task": "needle", "tokenizer": "bpe",
          "tokenizer_path": "t.json"}})",
       "data.tokenizer"},
      {R"({"preset": "micro", "data": {"source": "shards"}})", "data.path"},
      {R"({"preset": "micro", "data": {"source": "task"}})", "data.task"},
      {R"({"preset": "micro", "data": {"task": "khop"}})", "data.task"},
      {R"({"preset": "micro", "data": {"path": "/tmp/ds"}})", "data.path"},
      {R"({"preset": "micro", "model": {"vocab_size": 100}})", "model.vocab_size"},
      {R"({"preset": "micro", "checkpoint": {"interval": 10}})", "checkpoint.dir"},
      {R"({"preset": "micro", "checkpoint": {"interval_seconds": 60}})", "checkpoint.dir"},
      {R"({"preset": "micro", "checkpoint": {"dir": "/tmp/x", "interval_seconds": -2}})",
       "checkpoint.interval_seconds"},
      {R"({"preset": "micro", "checkpoint": {"dir": "/tmp/x", "keep_last": -1}})",
       "checkpoint.keep_last"},
      {R"({"preset": "micro", "eval": {"interval": -1}})", "eval.interval"},
      {R"({"preset": "micro", "metrics": {"port": 70000}})", "metrics.port"},
      {R"({"preset": "micro", "kind": "finetune"})", "kind"},
      {R"({"preset": "micro", "max_nan_skips": -1})", "max_nan_skips"},
      {R"({"preset": "micro", "dist_backend": "nccl2"})", "dist_backend"},
      {R"({"preset": "micro", "kind": "sft"})", "kind"},  // sft needs chat data
      {R"({"preset": "micro", "data": {"source": "chat"}})", "kind"},
      {R"({"preset": "micro", "kind": "sft", "data": {"source": "chat"}})", "model.vocab_size"},
      {R"({"preset": "micro", "kind": "sft", "model": {"vocab_size": 260}, "data": {"source": "chat", "task": "poetry"}})",
       "data.task"},
      {R"({"preset": "micro", "dist_bucket_bytes": 12})", "dist_bucket_bytes"},
      {R"({"preset": "micro", "model": {"mode": "encoder", "num_classes": 2, "tie_embeddings": false}})",
       "model.mode"},  // encoder without a task
      {R"({"preset": "micro", "model": {"ffn_activation": "relu"}})", "model.ffn_activation"},
      {R"({"preset": "micro", "data": {"corpus_bytes": 10}})", "data.corpus_bytes"},
      {R"({"preset": "micro", "data": {"splits": {"train": 10, "validation": 5, "test": 5}}})",
       "data.splits"},  // not a task
      {R"({"preset": "micro", "data": {"source": "task", "task": "khop", "splits": {"train": 10, "validation": 0, "test": 5}}})",
       "data.splits.validation"},
      {R"({"preset": "micro", "data": {"source": "task", "task": "khop", "splits": {"train": 20000000, "validation": 5, "test": 5}}})",
       "data.splits.train"},
      {R"({"preset": "micro", "data": {"source": "task", "task": "khop", "splits": {"train": 10, "validation": 5}}})",
       "data.splits.test"},
      {R"({"preset": "micro", "eval": {"patience": 3}})", "eval.patience"},  // no splits
      {R"({"preset": "micro", "data": {"source": "task", "task": "khop", "splits": {"train": 10, "validation": 5, "test": 5}}, "eval": {"patience": -1}})",
       "eval.patience"},
      {R"({"preset": "micro", "data": {"format": "openthoughts"}})", "data.format"},  // not chat
      {R"({"preset": "micro", "kind": "sft", "model": {"vocab_size": 260}, "data": {"source": "chat", "format": "Open Thoughts"}})",
       "data.format"},
      {R"({"kind": "eval"})", "model"},  // no model and no checkpoint to take it from
      {R"({"preset": "micro", "kind": "eval", "steps": 5, "model": {"vocab_size": 260}})", "steps"},
      {R"({"preset": "micro", "kind": "eval", "model": {"vocab_size": 260}, "data": {"source": "chat"}})",
       "data"},
      {R"({"preset": "micro", "kind": "eval"})", "model.vocab_size"},
      {R"({"preset": "micro", "reasoning_eval": {}})", "reasoning_eval"},  // pretrain
      {R"({"preset": "micro", "kind": "eval", "model": {"vocab_size": 260}, "reasoning_eval": {"source": "gsm8k"}})",
       "reasoning_eval.path"},
      {R"({"preset": "micro", "kind": "eval", "model": {"vocab_size": 260}, "reasoning_eval": {"source": "aime"}})",
       "reasoning_eval.source"},
      {R"({"preset": "micro", "kind": "eval", "model": {"vocab_size": 260}, "reasoning_eval": {"samples": 5000}})",
       "reasoning_eval.samples"},
      {R"({"preset": "micro", "kind": "eval", "model": {"vocab_size": 260}, "reasoning_eval": {"generation": {"top_p": 1.5}}})",
       "reasoning_eval.generation.top_p"},
      {R"({"preset": "micro", "kind": "eval", "model": {"vocab_size": 260}, "reasoning_eval": {"generation": {"stop": [""]}}})",
       "reasoning_eval.generation.stop"},
      {R"({"preset": "micro", "kind": "eval", "model": {"vocab_size": 260}, "reasoning_eval": {"when": "sometimes"}})",
       "reasoning_eval.when"},
  };
  int rejected = 0;
  for (const Bad& b : cases) {
    auto r = Resolve(b.json);
    ASSERT_FALSE(r.ok()) << "accepted: " << b.json;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.json;
    EXPECT_NE(r.status().message().find(b.needle), std::string::npos)
        << b.json << " -> " << r.status().message();
    ++rejected;
  }
  EXPECT_GE(rejected, 15);
}

TEST(JobSpec, FixedSplitsWithPatience) {
  auto r = Resolve(
      R"({"preset": "micro", "data": {"source": "task", "task": "khop", "splits": {"train": 40000, "validation": 5000, "test": 5000}}, "eval": {"patience": 10}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->data().has_splits());
  EXPECT_EQ(r->data().splits().train(), 40000);
  EXPECT_EQ(r->eval().patience(), 10);
  auto fresh = Resolve(R"({"preset": "micro", "data": {"source": "task", "task": "khop"}})");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_FALSE(fresh->data().has_splits());
  EXPECT_EQ(fresh->eval().patience(), 0);
}

TEST(JobSpec, EvalJobsAndReasoningEvalDefaults) {
  auto eval = Resolve(R"({"preset": "micro", "kind": "eval", "model": {"vocab_size": 260}})");
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_EQ(eval->steps(), 0);
  const auto& r = eval->reasoning_eval();
  EXPECT_EQ(r.source(), "builtin");
  EXPECT_EQ(r.task(), "mixed");
  EXPECT_EQ(r.problems(), 64);
  EXPECT_EQ(r.samples(), 16);
  EXPECT_EQ(r.answer_style(), "gsm8k");
  EXPECT_DOUBLE_EQ(r.generation().temperature(), 0.6);  // the paper's evaluation
  EXPECT_EQ(r.generation().seed(), eval->seed());
  // Resolving a resolved spec changes nothing (the coordinator resolves, then the worker does).
  auto again = ResolveJobSpec(*eval);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->SerializeAsString(), eval->SerializeAsString());
  auto sft = Resolve(R"({"preset": "micro", "kind": "sft", "model": {"vocab_size": 260},
      "data": {"source": "chat", "task": "arithmetic", "task_options": {"ops": 1}}})");
  ASSERT_TRUE(sft.ok()) << sft.status();
  EXPECT_EQ(sft->reasoning_eval().when(), "end");
  EXPECT_EQ(sft->reasoning_eval().task(), "arithmetic");  // evaluates what it trained on
  EXPECT_EQ(sft->reasoning_eval().ops(), "1");
  auto math = Resolve(R"({"preset": "micro", "kind": "eval", "model": {"vocab_size": 260},
      "reasoning_eval": {"source": "math500", "path": "m.jsonl"}})");
  ASSERT_TRUE(math.ok()) << math.status();
  EXPECT_EQ(math->reasoning_eval().answer_style(), "math");
  // The model of an eval job can come from a checkpoint manifest's recorded spec.
  storage::Manifest manifest;
  manifest.shards = {{0, storage::ShardFileName(0, 1), 8, "0123abcd"}};
  manifest.state = {{"spec", R"({"model": {"d_model": 64}})"}};
  v1::JobSpec spec;
  spec.set_kind("eval");
  ASSERT_TRUE(FillModelFromManifest(&spec, storage::ManifestToJson(manifest), "m").ok());
  EXPECT_EQ(spec.model().d_model(), 64);
  manifest.state.clear();
  v1::JobSpec other;
  other.set_kind("eval");
  EXPECT_FALSE(FillModelFromManifest(&other, storage::ManifestToJson(manifest), "m").ok());
  EXPECT_FALSE(FillModelFromManifest(&other, R"({"state": {}})", "m").ok());
}

TEST(JobSpec, YamlIsTheSameSpec) {
  const std::string yaml = R"(# a comment
preset: micro
name: "007"          # quoted: stays a string
steps: 40
optimizer:
  lr: 0.001
model:
  tie_embeddings: false
  schedule:
    - repeat: 1
      attention: {plugin: iha, options: {p: 2, mask: block}}
)";
  auto json = YamlToJson(yaml, "job.yaml");
  ASSERT_TRUE(json.ok()) << json.status();
  v1::JobSpec spec;
  ASSERT_TRUE(ParseJsonMessage(*json, "job.yaml", &spec).ok()) << *json;
  auto r = ResolveJobSpec(spec);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->name(), "007");
  EXPECT_EQ(r->steps(), 40);
  EXPECT_DOUBLE_EQ(r->optimizer().lr(), 0.001);
  EXPECT_FALSE(r->model().tie_embeddings());
  EXPECT_EQ(r->model().schedule(0).attention().options().fields().at("mask").string_value(),
            "block");
  EXPECT_EQ(r->model().schedule(0).attention().options().fields().at("p").number_value(), 2);
  auto bad = YamlToJson("steps: [1, 2\nname: x\n", "bad.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("bad.yaml:"), std::string::npos) << bad.status();
  auto dup = YamlToJson("steps: 1\nsteps: 2\n", "dup.yaml");
  EXPECT_NE(dup.status().message().find("duplicate key 'steps'"), std::string::npos)
      << dup.status();
}

TEST(JobSpec, HashesIgnoreWhereOutputGoesButNotWhatIsTrained) {
  auto a = Resolve(R"({"preset": "micro", "steps": 200})");
  auto b =
      Resolve(R"({"preset": "micro", "steps": 999, "name": "x", "checkpoint": {"dir": "/tmp/c"}})");
  auto c = Resolve(R"({"preset": "micro", "optimizer": {"lr": 0.001}})");
  auto d = Resolve(R"({"preset": "micro", "model": {"n_layers": 3}})");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
  EXPECT_EQ(SpecHash(*a), SpecHash(*b)) << a->ShortDebugString() << "\n" << b->ShortDebugString();
  EXPECT_NE(SpecHash(*a), SpecHash(*c));
  EXPECT_EQ(ModelHash(*a), ModelHash(*c));
  EXPECT_NE(ModelHash(*a), ModelHash(*d));
  EXPECT_EQ(SpecHash(*a).size(), 16u);
}

}  // namespace
}  // namespace loom
