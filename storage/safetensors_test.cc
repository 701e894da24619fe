#include "storage/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <random>

namespace loom::storage {
namespace {

std::string Header(const std::string& json, const std::string& data = "") {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json + data;
}

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/loom_st_" + std::to_string(getpid()) + "_" + name;
}

TEST(Safetensors, RoundTripsEveryDType) {
  std::mt19937 rng(7);
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<TensorToWrite> tensors;
  const std::pair<DType, std::vector<int64_t>> cases[] = {
      {DType::kF64, {3, 4}},  {DType::kF32, {2, 3, 5}}, {DType::kF16, {7}},
      {DType::kBF16, {2, 2}}, {DType::kI64, {5}},       {DType::kI32, {1, 9}},
      {DType::kU8, {13}},     {DType::kBool, {4, 1}},   {DType::kF32, {0, 3}},  // empty tensor
      {DType::kF64, {}},                                                        // scalar
  };
  int i = 0;
  for (const auto& [dtype, shape] : cases) {
    size_t n = DTypeSize(dtype);
    for (int64_t d : shape) n *= d;
    std::vector<uint8_t> bytes(n);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    if (dtype == DType::kBool) {
      for (auto& b : bytes) b &= 1;
    }
    buffers.push_back(bytes);
    tensors.push_back({"t" + std::to_string(i++) + "." + std::string(DTypeName(dtype)), dtype,
                       shape, buffers.back().data(), n});
  }
  // buffers may have reallocated: re-point.
  for (size_t k = 0; k < tensors.size(); ++k) tensors[k].data = buffers[k].data();

  const std::string path = TempPath("roundtrip.safetensors");
  ASSERT_TRUE(Write(path, tensors, {{"format", "pt"}, {"loom", "test"}}).ok());
  auto file = SafetensorsFile::Read(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_EQ(file->metadata().at("loom"), "test");
  ASSERT_EQ(file->tensors().size(), tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    const TensorInfo* info = file->Find(tensors[k].name);
    ASSERT_NE(info, nullptr) << tensors[k].name;
    EXPECT_EQ(info->dtype, tensors[k].dtype);
    EXPECT_EQ(info->shape, tensors[k].shape);
    std::string_view data = file->Data(*info);
    ASSERT_EQ(data.size(), buffers[k].size());
    EXPECT_EQ(0, std::memcmp(data.data(), buffers[k].data(), data.size())) << tensors[k].name;
    // Alignment: every tensor starts at a multiple of its element size within the file.
    EXPECT_EQ((data.data() - file->Data(file->tensors().front()).data()) % DTypeSize(info->dtype),
              0);
  }
  unlink(path.c_str());
}

TEST(Safetensors, HeaderIsPaddedToEightBytes) {
  double v = 1.5;
  auto bytes = Serialize({{"x", DType::kF64, {1}, &v, 8}});
  ASSERT_TRUE(bytes.ok());
  uint64_t n = 0;
  std::memcpy(&n, bytes->data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ((*bytes)[8], '{');
}

TEST(Safetensors, WriterRejectsBadInput) {
  float v[2] = {1, 2};
  EXPECT_FALSE(Serialize({{"a", DType::kF32, {2}, v, 8}, {"a", DType::kF32, {2}, v, 8}}).ok());
  EXPECT_FALSE(Serialize({{"a", DType::kF32, {3}, v, 8}}).ok());
  EXPECT_FALSE(Serialize({{"__metadata__", DType::kF32, {2}, v, 8}}).ok());
}

struct Corruption {
  const char* what;
  std::string bytes;
  const char* expected;  // substring of the error message
};

TEST(Safetensors, RejectsCorruptFiles) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\x01');
  std::string huge(8, '\0');
  huge[7] = 0x7f;  // header length ~ 9e18
  std::string past_end = Header("{}");
  past_end[0] = 100;
  const std::vector<Corruption> cases = {
      {"truncated length", std::string(5, '\0'), "shorter than the 8-byte"},
      {"header length over limit", huge + "{}", "exceeds the limit"},
      {"header past end of file", past_end, "runs past the end"},
      {"not JSON", Header("{\"a\":", eight), "not well-formed JSON"},
      {"not an object", Header("[1,2]", eight), "JSON object"},
      {"entry not an object", Header(R"({"a":3})"), "must be an object"},
      {"unknown dtype", Header(R"({"a":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", "xx"),
       "unsupported dtype"},
      {"negative shape", Header(R"({"a":{"dtype":"U8","shape":[-2],"data_offsets":[0,2]}})", "xx"),
       "non-negative integer"},
      {"fractional shape",
       Header(R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,2]}})", "xx"),
       "non-negative integer"},
      {"shape/span mismatch",
       Header(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       "needs 12 bytes"},
      {"shape overflow",
       Header(
           R"({"a":{"dtype":"F64","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})",
           eight),
       "more bytes than can exist"},
      {"offsets out of range",
       Header(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight),
       "past the data section"},
      {"begin after end",
       Header(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight),
       "begin 8 > end 0"},
      {"offsets malformed",
       Header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", eight),
       "must be [begin, end]"},
      {"overlap",
       Header("{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
       "overlaps"},
      {"gap", Header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
       "gap of 4"},
      {"trailing bytes", Header("{" + ok_entry + "}", eight + "zz"), "trailing bytes"},
      {"duplicate key", Header("{" + ok_entry + "," + ok_entry + "}", eight), "duplicate key 'a'"},
      {"bad metadata", Header("{" + ok_entry + R"(,"__metadata__":{"k":1}})", eight),
       "must be a string"},
      {"unknown field",
       Header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight),
       "unknown field 'x'"},
      {"missing field", Header(R"({"a":{"dtype":"F32","shape":[2]}})", eight), "needs dtype"},
  };
  for (const Corruption& c : cases) {
    auto parsed = SafetensorsFile::Parse(c.bytes, "evil.safetensors");
    ASSERT_FALSE(parsed.ok()) << c.what;
    EXPECT_NE(parsed.status().message().find(c.expected), std::string::npos)
        << c.what << ": " << parsed.status().message();
    EXPECT_NE(parsed.status().message().find("evil.safetensors"), std::string::npos) << c.what;
  }
  // And the well-formed version of the same entry parses.
  EXPECT_TRUE(SafetensorsFile::Parse(Header("{" + ok_entry + "}", eight)).ok());
}

TEST(Safetensors, RandomBitFlipsNeverCrash) {
  float v[6] = {1, 2, 3, 4, 5, 6};
  auto bytes = Serialize({{"w", DType::kF32, {2, 3}, v, 24}, {"b", DType::kF32, {0}, v, 0}});
  ASSERT_TRUE(bytes.ok());
  std::mt19937 rng(3);
  for (int trial = 0; trial < 3000; ++trial) {
    std::string corrupt = *bytes;
    const int flips = 1 + trial % 4;
    for (int f = 0; f < flips; ++f) {
      corrupt[rng() % corrupt.size()] ^= static_cast<char>(1u << (rng() % 8));
    }
    if (trial % 7 == 0) corrupt.resize(rng() % corrupt.size());
    auto parsed = SafetensorsFile::Parse(corrupt);  // must return, ok or not
    if (parsed.ok()) {
      for (const auto& t : parsed->tensors()) EXPECT_LE(t.end, corrupt.size());
    }
  }
}

TEST(Safetensors, MissingFileIsNotFound) {
  auto r = SafetensorsFile::Read("/nonexistent/loom.safetensors");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace loom::storage
