#include "worker/trainer/tensor_io.h"

#include <gtest/gtest.h>
#include <unistd.h>

namespace loom::trainer {
namespace {

TEST(TensorIo, RoundTripsTorchDTypes) {
  const std::string path = "/tmp/loom_tensor_io_" + std::to_string(getpid()) + ".safetensors";
  NamedTensors in = {
      {"f64", torch::randn({3, 4}, torch::kFloat64)},
      {"f32", torch::randn({2, 5})},
      {"f16", torch::randn({4}).to(torch::kFloat16)},
      {"bf16", torch::randn({2, 2}).to(torch::kBFloat16)},
      {"i64", torch::arange(6).view({2, 3})},
      {"i32", torch::arange(5, torch::kInt32)},
      {"u8", torch::arange(9, torch::kUInt8)},
      {"bool", torch::tensor({true, false, true})},
      {"strided", torch::randn({4, 6}).t()},  // non-contiguous input is written contiguous
  };
  ASSERT_TRUE(SaveTensors(path, in).ok());
  auto out = LoadTensors(path);
  ASSERT_TRUE(out.ok()) << out.status();
  for (const auto& [name, t] : in) {
    ASSERT_TRUE(out->count(name)) << name;
    EXPECT_EQ(out->at(name).scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(out->at(name), t)) << name;
  }
  unlink(path.c_str());
}

TEST(TensorIo, UnsupportedDTypeIsAnError) {
  auto s = SaveTensors("/tmp/never.safetensors", {{"c", torch::randn({2}, torch::kComplexFloat)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tensor 'c'"), std::string::npos) << s;
}

TEST(TensorIo, LoadIntoModuleChecksNamesAndShapes) {
  torch::nn::Linear lin(torch::nn::LinearOptions(3, 2).bias(true));
  std::map<std::string, torch::Tensor> good = {{"weight", torch::ones({2, 3})},
                                               {"bias", torch::zeros({2})}};
  ASSERT_TRUE(LoadIntoModule(*lin, good).ok());
  EXPECT_TRUE(torch::equal(lin->weight, torch::ones({2, 3})));

  auto missing = LoadIntoModule(*lin, {{"weight", torch::ones({2, 3})}});
  EXPECT_NE(missing.message().find("missing: bias"), std::string::npos) << missing;
  auto shape = LoadIntoModule(*lin, {{"weight", torch::ones({3, 2})}, {"bias", torch::zeros({2})}});
  EXPECT_NE(shape.message().find("wrong shape: weight (expected [2, 3], got [3, 2])"),
            std::string::npos)
      << shape;
  auto extra = LoadIntoModule(
      *lin,
      {{"weight", torch::ones({2, 3})}, {"bias", torch::zeros({2})}, {"x", torch::ones({1})}});
  EXPECT_NE(extra.message().find("unexpected: x"), std::string::npos) << extra;
}

}  // namespace
}  // namespace loom::trainer
