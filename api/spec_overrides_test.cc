#include "loom/spec_overrides.h"

#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/util/message_differencer.h>
#include <google/protobuf/wrappers.pb.h>
#include <gtest/gtest.h>

#include "loom/spec.h"
#include "loom/v1/control.pb.h"

namespace loom {
namespace {

using google::protobuf::util::MessageDifferencer;

// The error message of `--set ASSIGNMENT` on `message` ("" when it succeeds).
std::string SetError(google::protobuf::Message* message, const std::string& assignment) {
  return std::string(ApplySetFlag(message, assignment).message());
}

TEST(ParseFieldPath, NamesAndIndices) {
  auto steps = ParseFieldPath("model.schedule[1].attention.options.p");
  ASSERT_TRUE(steps.ok()) << steps.status();
  ASSERT_EQ(steps->size(), 6u);
  EXPECT_EQ((*steps)[1].key, "schedule");
  EXPECT_EQ((*steps)[2].index, 1);
  EXPECT_EQ((*steps)[5].key, "p");
  auto nested = ParseFieldPath("a[0][2]");
  ASSERT_TRUE(nested.ok()) << nested.status();
  EXPECT_EQ(nested->size(), 3u);
  for (const char* bad :
       {"", "a..b", "a.", ".a", "a[x]", "a[1001]", "a[-1]", "a[1", "a]", "a[0]b"}) {
    EXPECT_FALSE(ParseFieldPath(bad).ok()) << bad;
  }
}

TEST(SpecOverrides, DottedScalarsByType) {
  v1::JobSpec spec;
  for (const char* a :
       {"optimizer.lr=3e-4", "model.n_layers=4", "checkpoint.dir=/tmp/x", "steps=100",
        "seed=18446744073709551615", "model.tie_embeddings=false", "precision=bf16",
        "metrics.port=-1", "microBatch=8", "spec.grad_accum=2", "name=a=b"}) {
    ASSERT_TRUE(ApplySetFlag(&spec, a).ok()) << a << ": " << ApplySetFlag(&spec, a);
  }
  EXPECT_DOUBLE_EQ(spec.optimizer().lr(), 3e-4);
  EXPECT_EQ(spec.model().n_layers(), 4);
  EXPECT_EQ(spec.checkpoint().dir(), "/tmp/x");
  EXPECT_EQ(spec.steps(), 100);
  EXPECT_EQ(spec.seed(), 18446744073709551615u);
  EXPECT_TRUE(spec.model().has_tie_embeddings());  // optional: set, even to false
  EXPECT_FALSE(spec.model().tie_embeddings());
  EXPECT_EQ(spec.precision(), "bf16");
  EXPECT_EQ(spec.metrics().port(), -1);
  EXPECT_EQ(spec.micro_batch(), 8);  // lowerCamelCase names work too
  EXPECT_EQ(spec.grad_accum(), 2);   // a sweep's "spec." prefix is ignored
  EXPECT_EQ(spec.name(), "a=b");     // the first '=' splits
}

TEST(SpecOverrides, ErrorsNameThePathAndTheProblem) {
  const std::pair<const char*, const char*> cases[] = {
      {"optimizer.lrr=1", "--set optimizer.lrr: JobSpec.optimizer has no field 'lrr'"},
      {"stepz=1", "--set stepz: JobSpec has no field 'stepz'"},
      {"steps=abc", "--set steps: 'abc' is not an integer"},
      {"steps=1.5", "--set steps: '1.5' is not an integer"},
      {"model.n_layers=3000000000", "--set model.n_layers: 3000000000 is out of range for int32"},
      {"steps=99999999999999999999", "--set steps: '99999999999999999999' is not an integer"},
      {"seed=-1", "--set seed: '-1' is not a non-negative integer"},
      {"optimizer.lr=fast", "--set optimizer.lr: 'fast' is not a number"},
      {"optimizer.lr=inf", "--set optimizer.lr: 'inf' is not a number"},
      {"model.tie_embeddings=yes", "--set model.tie_embeddings: 'yes' is not true or false"},
      {"steps.x=1", "--set steps.x: JobSpec.steps (int64) is not a message or list"},
      {"model[0]=1", "--set model[0]: JobSpec.model is not a list"},
      {"model.schedule.repeat=1",
       "--set model.schedule.repeat: JobSpec.model.schedule is a list: index it (name[N])"},
      {"a..b=1", "--set a..b: empty path component"},
      {"steps", "--set: expected PATH=VALUE, got 'steps'"},
      {"=3", "--set: expected PATH=VALUE, got '=3'"},
  };
  v1::JobSpec spec;
  for (const auto& [assignment, error] : cases) EXPECT_EQ(SetError(&spec, assignment), error);
  EXPECT_TRUE(MessageDifferencer::Equals(spec, v1::JobSpec()));  // nothing was set
}

TEST(SpecOverrides, CallerLabelsAndLimits) {
  v1::JobSpec spec;
  const auto steps = ValueLimits::Integer(1, 1000000000);
  EXPECT_EQ(SetFieldFromText(&spec, "steps", "0", "--steps", steps).message(),
            "--steps: 0 is out of range [1, 1000000000]");
  EXPECT_EQ(SetFieldFromText(&spec, "steps", "x", "--steps", steps).message(),
            "--steps: 'x' is not an integer");
  const auto lr = ValueLimits::Real(1e-12, 10);
  EXPECT_EQ(SetFieldFromText(&spec, "optimizer.lr", "20", "--lr", lr).message(),
            "--lr: 20 is out of range [1e-12, 10]");
  const auto seed = ValueLimits::Integer(1, INT64_MAX);
  // An unsigned field under an int64 range reads its text as an int64 (loom-train's --seed).
  EXPECT_EQ(SetFieldFromText(&spec, "seed", "-3", "--seed", seed).message(),
            "--seed: -3 is out of range [1, 9223372036854775807]");
  EXPECT_EQ(SetFieldFromText(&spec, "seed", "9223372036854775808", "--seed", seed).message(),
            "--seed: '9223372036854775808' is not an integer");
  EXPECT_EQ(SetFieldFromText(&spec, "seed", "-3", "--seed", ValueLimits::Integer(-5, 5)).message(),
            "--seed: -3 is out of range for uint64");
  ASSERT_TRUE(SetFieldFromText(&spec, "seed", "9223372036854775807", "--seed", seed).ok());
  EXPECT_EQ(spec.seed(), 9223372036854775807u);
  ASSERT_TRUE(SetFieldFromText(&spec, "steps", "1000000000", "--steps", steps).ok());
  EXPECT_EQ(spec.steps(), 1000000000);
  // Limits of the other kind do not apply.
  ASSERT_TRUE(SetFieldFromText(&spec, "optimizer.lr", "20", "--lr", steps).ok());
}

TEST(SpecOverrides, ListsByIndexAndWhole) {
  v1::JobSpec spec;
  ASSERT_TRUE(ApplySetFlag(&spec, "model.schedule[0].attention.plugin=iha").ok());
  ASSERT_TRUE(ApplySetFlag(&spec, "model.schedule[0].repeat=2").ok());
  ASSERT_TRUE(ApplySetFlag(&spec, "model.schedule[1]={\"attention\": {\"plugin\": \"mha\"}}").ok());
  ASSERT_EQ(spec.model().schedule_size(), 2);
  EXPECT_EQ(spec.model().schedule(0).attention().plugin(), "iha");
  EXPECT_EQ(spec.model().schedule(0).repeat(), 2);
  EXPECT_EQ(spec.model().schedule(1).attention().plugin(), "mha");
  EXPECT_EQ(SetError(&spec, "model.schedule[3].repeat=1"),
            "--set model.schedule[3].repeat: index 3 past the end of JobSpec.model.schedule (it "
            "has 2 elements)");
  EXPECT_EQ(SetError(&spec, "model.schedule[0].attention=iha")
                .rfind("--set model.schedule[0].attention: 'iha' is not a JSON object for "
                       "JobSpec.model.schedule[0].attention: ",
                       0),
            0u);
  ASSERT_TRUE(ApplySetFlag(&spec, "eval.lengths[0]=512").ok());
  ASSERT_TRUE(ApplySetFlag(&spec, "eval.lengths[1]=1024").ok());
  ASSERT_TRUE(ApplySetFlag(&spec, "eval.lengths[0]=256").ok());
  EXPECT_EQ(std::vector<int64_t>(spec.eval().lengths().begin(), spec.eval().lengths().end()),
            (std::vector<int64_t>{256, 1024}));
  ASSERT_TRUE(ApplySetFlag(&spec, "eval.lengths=[64, 128, 192]").ok());
  EXPECT_EQ(spec.eval().lengths_size(), 3);
  EXPECT_EQ(spec.eval().lengths(2), 192);
  ASSERT_TRUE(ApplySetFlag(&spec, "eval.lengths=64").ok());  // protobuf's JSON: one element
  EXPECT_EQ(spec.eval().lengths_size(), 1);
  EXPECT_FALSE(ApplySetFlag(&spec, "eval.lengths=[1, \"x\"]").ok());
  EXPECT_EQ(SetError(&spec, "eval.lengths[0].x=1"),
            "--set eval.lengths[0].x: JobSpec.eval.lengths[0] (int64) is not a message or list");
}

TEST(SpecOverrides, StructOptionsTakeJsonElseStrings) {
  v1::JobSpec spec;
  for (const char* a : {"data.task_options.foo=3", "data.task_options.mask=block",
                        "data.task_options.flags={\"x\": true}", "data.task_options.deep.k=1.5",
                        "data.task_options.list[0]=a", "data.task_options.list[1]=null",
                        "model.hybrid.iha_options.p=4"}) {
    ASSERT_TRUE(ApplySetFlag(&spec, a).ok()) << a << ": " << ApplySetFlag(&spec, a);
  }
  const auto& f = spec.data().task_options().fields();
  EXPECT_EQ(f.at("foo").number_value(), 3);
  EXPECT_EQ(f.at("mask").string_value(), "block");
  EXPECT_TRUE(f.at("flags").struct_value().fields().at("x").bool_value());
  EXPECT_EQ(f.at("deep").struct_value().fields().at("k").number_value(), 1.5);
  EXPECT_EQ(f.at("list").list_value().values(0).string_value(), "a");
  EXPECT_EQ(f.at("list").list_value().values(1).kind_case(), google::protobuf::Value::kNullValue);
  EXPECT_EQ(spec.model().hybrid().iha_options().fields().at("p").number_value(), 4);
  EXPECT_EQ(SetError(&spec, "data.task_options.foo.x=1"),
            "--set data.task_options.foo.x: JobSpec.data.task_options.foo is not an object");
  EXPECT_EQ(SetError(&spec, "data.task_options.mask[0]=1"),
            "--set data.task_options.mask[0]: JobSpec.data.task_options.mask is not a list");
  // A whole Struct is replaced by a JSON object, and must be one.
  ASSERT_TRUE(ApplySetFlag(&spec, "data.task_options={\"ops\": \"2-4\"}").ok());
  EXPECT_EQ(spec.data().task_options().fields().size(), 1u);
  EXPECT_FALSE(ApplySetFlag(&spec, "data.task_options=abc").ok());
}

TEST(SpecOverrides, MessagesFromJsonKeepFieldsTheJsonLeavesOut) {
  auto preset = JobPreset("tiny-cpu");
  ASSERT_TRUE(preset.ok()) << preset.status();
  v1::JobSpec spec = *preset;
  ASSERT_TRUE(ApplySetFlag(&spec, "model={\"n_layers\": 2, \"ffnActivation\": \"swiglu\"}").ok());
  EXPECT_EQ(spec.model().n_layers(), 2);
  EXPECT_EQ(spec.model().ffn_activation(), "swiglu");
  EXPECT_EQ(spec.model().d_model(), preset->model().d_model());
  const std::string error = SetError(&spec, "model={\"nlayers\": 2}");
  EXPECT_NE(error.find("--set model: '{\"nlayers\": 2}' is not a JSON object for JobSpec.model"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("nlayers"), std::string::npos) << error;
  EXPECT_FALSE(ApplySetFlag(&spec, "optimizer=3").ok());
}

TEST(SpecOverrides, MapsByKeyAndWhole) {
  v1::SubmitJobRequest req;
  ASSERT_TRUE(ApplySetFlag(&req, "pool.gpu=h200").ok());
  ASSERT_TRUE(ApplySetFlag(&req, "pool.zone=a").ok());
  ASSERT_TRUE(ApplySetFlag(&req, "pool.gpu=a100").ok());
  EXPECT_EQ(req.pool().size(), 2u);
  EXPECT_EQ(req.pool().at("gpu"), "a100");
  ASSERT_TRUE(ApplySetFlag(&req, "pool={\"site\": \"x\"}").ok());
  EXPECT_EQ(req.pool().size(), 1u);
  EXPECT_EQ(req.pool().at("site"), "x");
  EXPECT_EQ(SetError(&req, "pool[0]=x"),
            "--set pool[0]: SubmitJobRequest.pool is a map: name a key (name.KEY)");
  // The request has a `spec` field: the prefix is a real step there.
  ASSERT_TRUE(ApplySetFlag(&req, "spec.steps=7").ok());
  EXPECT_EQ(req.spec().steps(), 7);
  EXPECT_TRUE(ApplySetFlag(&req, "max_restarts=0").ok());
  EXPECT_TRUE(req.has_max_restarts());
  v1::SweepSpec sweep;
  ASSERT_TRUE(ApplySetFlag(&sweep, "grid.lr=[0.001, 0.003]").ok());
  ASSERT_TRUE(ApplySetFlag(&sweep, "grid.lr[2]=0.01").ok());
  EXPECT_EQ(sweep.grid().at("lr").values_size(), 3);
  EXPECT_EQ(sweep.grid().at("lr").values(2).number_value(), 0.01);
  const std::string error = SetError(&sweep, "grid.lr=abc");
  EXPECT_EQ(error.rfind("--set grid.lr: 'abc' is not a JSON list for SweepSpec.grid.lr: ", 0), 0u)
      << error;
}

TEST(SpecOverrides, EnumsAndFloats) {
  google::protobuf::FieldDescriptorProto field;
  ASSERT_TRUE(ApplySetFlag(&field, "type=TYPE_STRING").ok());
  EXPECT_EQ(field.type(), google::protobuf::FieldDescriptorProto::TYPE_STRING);
  ASSERT_TRUE(ApplySetFlag(&field, "type=5").ok());
  EXPECT_EQ(field.type(), google::protobuf::FieldDescriptorProto::TYPE_INT32);
  const std::string error = SetError(&field, "type=TYPE_NOPE");
  EXPECT_EQ(error.rfind("--set type: 'TYPE_NOPE' is not one of TYPE_DOUBLE | TYPE_FLOAT", 0), 0u)
      << error;
  EXPECT_FALSE(ApplySetFlag(&field, "type=99").ok());
  google::protobuf::FloatValue f;
  ASSERT_TRUE(ApplySetFlag(&f, "value=0.5").ok());
  EXPECT_EQ(f.value(), 0.5f);
  EXPECT_EQ(SetError(&f, "value=1e39"), "--set value: 1e+39 is out of range for float");
}

}  // namespace
}  // namespace loom
