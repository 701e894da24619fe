// The byte-level BPE on a tokenizer.json written here (256 byte tokens, a few merges, an added
// token): merges by rank, ignore_merges, added tokens, decode, the UTF-8 replacement rule and the
// errors a malformed file gets. Parity on the real Llama-3 file: tests/bpe_parity_test.js.
#include "data/bpe_tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "nlohmann/json.hpp"

namespace loom::data {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// GPT-2's byte alphabet for the printable ASCII bytes is the byte itself; space is U+0120 "Ġ".
Json TinyTokenizer() {
  Json vocab = Json::object();
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    std::string s;
    const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const uint32_t cp = direct ? b : next++;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    vocab[s] = b;
  }
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  vocab["bc"] = 258;
  vocab
      ["\xC4\xA0"
       "ab"] = 259;    // "Ġab"
  vocab["xyz"] = 260;  // a word with no merges: only ignore_merges finds it
  Json j = {{"version", "1.0"},
            {"normalizer", nullptr},
            {"added_tokens", Json::array({{{"id", 300}, {"content", "<|end_of_text|>"}}})},
            {"pre_tokenizer",
             {{"type", "Sequence"},
              {"pretokenizers",
               Json::array(
                   {{{"type", "Split"},
                     {"pattern", {{"Regex", R"( ?\p{L}+|\p{N}{1,3}|\s+|[^\s\p{L}\p{N}]+)"}}},
                     {"behavior", "Isolated"},
                     {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}}},
            {"model",
             {{"type", "BPE"},
              {"ignore_merges", true},
              {"vocab", vocab},
              {"merges", Json::array({"b c", "a b", "ab c", "\xC4\xA0 ab"})}}}};
  return j;
}

class BpeTest : public ::testing::Test {
 protected:
  std::string Write(const Json& j) {
    const std::string path =
        (fs::path(::testing::TempDir()) / (std::to_string(files_++) + "-tokenizer.json")).string();
    std::ofstream(path) << j.dump();
    return path;
  }
  int files_ = 0;
};

TEST_F(BpeTest, MergesByRankAddedTokensAndIgnoreMerges) {
  auto t = BpeTokenizer::Load(Write(TinyTokenizer()));
  ASSERT_TRUE(t.ok()) << t.status();
  // "abc": b+c (rank 0) first gives a|bc, which has no merge: not ab|c -> abc.
  EXPECT_EQ((*t)->Encode("abc"), (std::vector<uint32_t>{257}));  // ignore_merges: a word token
  EXPECT_EQ((*t)->Encode("abcd"), (std::vector<uint32_t>{'a', 258, 'd'}));
  EXPECT_EQ((*t)->Encode("xyz"), (std::vector<uint32_t>{260}));
  EXPECT_EQ((*t)->Encode(" ab"), (std::vector<uint32_t>{259}));
  EXPECT_EQ((*t)->Encode("12345"), (std::vector<uint32_t>{'1', '2', '3', '4', '5'}));
  EXPECT_EQ((*t)->Encode("ab<|end_of_text|>ab"), (std::vector<uint32_t>{256, 300, 256}));
  EXPECT_EQ((*t)->Decode({256, 300, 259}), "ab<|end_of_text|> ab");
  EXPECT_EQ((*t)->eos_id(), 300);
  EXPECT_EQ((*t)->vocab_size(), 301);
  EXPECT_EQ((*t)->TokenId("<|end_of_text|>"), 300u);
  EXPECT_FALSE((*t)->TokenId("nope").has_value());
  const std::string text = "a b\tc\n\xE4\xBD\xA0\xE5\xA5\xBD 12 !?";
  EXPECT_EQ((*t)->Decode((*t)->Encode(text)), text);
}

TEST(Utf8, EachMaximalInvalidSubsequenceBecomesOneReplacement) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(SanitizeUtf8("ok \xC3\xA9"), "ok \xC3\xA9");
  EXPECT_EQ(SanitizeUtf8("\x80"), r);
  EXPECT_EQ(SanitizeUtf8("\xC0\x80"), r + r);          // overlong: two bad bytes
  EXPECT_EQ(SanitizeUtf8("\xED\xA0\x80"), r + r + r);  // a surrogate
  EXPECT_EQ(SanitizeUtf8("\xE2\x82"), r);              // truncated: one
  EXPECT_EQ(SanitizeUtf8("\xE4\xBD\x41"), r + "A");    // cut short by an ASCII byte
  EXPECT_EQ(SanitizeUtf8("\xF0\x9F\x98"), r);
  EXPECT_EQ(SanitizeUtf8("\xF4\x90\x80\x80"), r + r + r + r);  // above U+10FFFF
  EXPECT_EQ(SanitizeUtf8("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
}

TEST_F(BpeTest, MalformedFilesAreRefusedNamingWhat) {
  struct Case {
    std::function<void(Json&)> edit;
    std::string message;
  };
  std::vector<Case> cases = {
      {[](Json& j) { j["model"]["type"] = "WordPiece"; }, "model.type"},
      {[](Json& j) {
         j["normalizer"] = {{"type", "NFC"}};
       },
       "normalizer"},
      {[](Json& j) { j["model"]["merges"].push_back("q zz"); }, "model.merges[4]"},
      {[](Json& j) { j["model"]["vocab"].erase("a"); }, "no token for byte 97"},
      {[](Json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(("; },
       "pre_tokenizer regex"},
      {[](Json& j) {
         j["pre_tokenizer"] = {{"type", "Whitespace"}};
       },
       "pre_tokenizer"},
      {[](Json& j) { j["added_tokens"][0].erase("id"); }, "added_tokens"},
  };
  for (const auto& c : cases) {
    Json j = TinyTokenizer();
    c.edit(j);
    auto t = BpeTokenizer::Load(Write(j));
    ASSERT_FALSE(t.ok()) << c.message;
    EXPECT_NE(t.status().message().find(c.message), std::string::npos) << t.status();
  }
  const std::string garbage = (fs::path(::testing::TempDir()) / "garbage.json").string();
  std::ofstream(garbage) << "{not json";
  EXPECT_FALSE(BpeTokenizer::Load(garbage).ok());
  EXPECT_EQ(BpeTokenizer::Load("/nonexistent/tokenizer.json").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace loom::data
