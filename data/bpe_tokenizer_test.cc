// The byte-level BPE on a tokenizer.json written here (256 byte tokens, a few merges, an added
// token): merges by rank, ignore_merges, added tokens, decode, the UTF-8 replacement rule and the
// errors a malformed file gets. Parity on the real Llama-3 file: tests/bpe_parity_test.js.
#include "data/bpe_tokenizer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>

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

// Crafted ids: each refused with status 1's message naming the field and the value, before
// anything is allocated for them (4294967295 used to wrap max_id + 1 to 0 and write through a
// null pointer; 2^31 + 5 died on bad_alloc).
TEST_F(BpeTest, CraftedIdsAreRefusedNamingTheField) {
  struct Case {
    std::function<void(Json&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](Json& j) { j["added_tokens"][0]["id"] = 4294967295u; },
       "added_tokens[0].id: 4294967295 is not a token id"},
      {[](Json& j) { j["added_tokens"][0]["id"] = (uint64_t{1} << 31) + 5; },
       "added_tokens[0].id: 2147483653 is not a token id"},
      {[](Json& j) { j["added_tokens"][0]["id"] = -1; }, "added_tokens[0].id: -1 is not"},
      {[](Json& j) { j["added_tokens"][0]["id"] = "7"; }, "added_tokens[0].id"},
      {[](Json& j) { j["model"]["vocab"]["a"] = uint64_t{1} << 40; }, "model.vocab['a']: "},
      {[](Json& j) { j["added_tokens"][0]["id"] = 9000000; },
       "added_tokens[0].id: 9000000 leaves most ids below it unused"},
  };
  for (const auto& c : cases) {
    Json j = TinyTokenizer();
    c.edit(j);
    auto t = BpeTokenizer::Load(Write(j));
    ASSERT_FALSE(t.ok()) << c.message;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
    EXPECT_NE(t.status().message().find(c.message), std::string::npos) << t.status();
  }
}

// The merge order against a direct transcription of the rule (lowest-ranked adjacent pair,
// leftmost first, until none merges) on strings over the merges' letters.
std::vector<uint32_t> NaiveBpe(const Json& tokenizer, const std::string& word) {
  const Json& vocab = tokenizer["model"]["vocab"];
  if (vocab.contains(word)) return {vocab[word].get<uint32_t>()};  // ignore_merges
  std::map<std::pair<std::string, std::string>, size_t> rank;
  const Json& merges = tokenizer["model"]["merges"];
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string m = merges[r];
    const size_t space = m.find(' ', 1);
    rank[{m.substr(0, space), m.substr(space + 1)}] = r;
  }
  std::vector<std::string> parts;
  for (char ch : word) parts.push_back(std::string(1, ch));
  for (;;) {
    size_t best = parts.size(), best_rank = merges.size();
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      auto it = rank.find({parts[i], parts[i + 1]});
      if (it != rank.end() && it->second < best_rank) best = i, best_rank = it->second;
    }
    if (best == parts.size()) break;
    parts[best] += parts[best + 1];
    parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  std::vector<uint32_t> ids;
  for (const std::string& p : parts) ids.push_back(vocab[p].get<uint32_t>());
  return ids;
}

TEST_F(BpeTest, MergesMatchTheRuleAndStayFastOnOneHugePiece) {
  const Json j = TinyTokenizer();
  auto t = BpeTokenizer::Load(Write(j));
  ASSERT_TRUE(t.ok()) << t.status();
  std::mt19937 rng(7);
  for (int n = 0; n < 500; ++n) {
    std::string word;
    const size_t length = 1 + rng() % 40;
    for (size_t i = 0; i < length; ++i) word += "abc"[rng() % 3];
    EXPECT_EQ((*t)->Encode(word), NaiveBpe(j, word)) << word;
  }
  std::string long_word;
  for (int i = 0; i < 5000; ++i) long_word += "abc"[rng() % 3];
  EXPECT_EQ((*t)->Encode(long_word), NaiveBpe(j, long_word));
  // 1 MiB of letters is one pre-tokenized piece: quadratic merging took minutes.
  std::string huge;
  while (huge.size() < (1 << 20)) huge += "abcab";
  const auto start = std::chrono::steady_clock::now();
  const std::vector<uint32_t> ids = (*t)->Encode(huge);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 1.0) << "1 MiB single piece";
  EXPECT_EQ((*t)->Decode(ids), huge);
  EXPECT_EQ(ids.size(), huge.size() / 5 * 3) << "each abcab is a|bc|ab";
}

}  // namespace
}  // namespace loom::data
