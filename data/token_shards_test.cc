#include "data/token_shards.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "data/tokenizer.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

class TokenShardsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() /
            ("loom_data_" + std::to_string(getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) { return (fs::path(dir_) / name).string(); }

  std::pair<int, std::string> Run(const std::string& args) {
    const std::string cmd = std::string(std::getenv("LOOM_DATA_BIN")) + " " + args + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[512];
    while (fgets(buf, sizeof(buf), p)) out += buf;
    const int rc = pclose(p);
    return {WEXITSTATUS(rc), out};
  }
  std::string dir_;
};

TEST_F(TokenShardsTest, RoundTripAcrossShardBoundaries) {
  auto w = TokenShardWriter::Create(Path("ds"), 1000, "test", 100);
  ASSERT_TRUE(w.ok()) << w.status();
  std::mt19937 rng(1);
  std::vector<int64_t> all;
  for (int doc = 0; doc < 23; ++doc) {
    std::vector<uint32_t> ids(rng() % 40 + 1);
    for (auto& id : ids) {
      id = rng() % 1000;
      all.push_back(id);
    }
    ASSERT_TRUE((*w)->AddDocument(ids).ok());
  }
  auto index = (*w)->Finish();
  ASSERT_TRUE(index.ok());
  EXPECT_EQ(index->dtype, "uint16");
  EXPECT_EQ(index->documents, 23u);
  EXPECT_EQ(index->total_tokens, all.size());
  EXPECT_GT(index->shards.size(), 2u);
  auto shards = TokenShards::Open(Path("ds"));
  ASSERT_TRUE(shards.ok()) << shards.status();
  ASSERT_EQ((*shards)->size(), static_cast<int64_t>(all.size()));
  std::vector<int64_t> got(all.size());
  (*shards)->Copy(0, static_cast<int64_t>(all.size()), got.data());
  EXPECT_EQ(got, all);
  std::vector<int64_t> window(150);
  (*shards)->Copy(57, 150, window.data());  // spans two shard boundaries
  EXPECT_TRUE(std::equal(window.begin(), window.end(), all.begin() + 57));
  // A dataset is never overwritten.
  EXPECT_EQ(TokenShardWriter::Create(Path("ds"), 1000, "test", 100).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(TokenShardsTest, WideVocabulariesUseUint32AndIdsAreChecked) {
  auto w = TokenShardWriter::Create(Path("wide"), 70000, "test", 1000);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->AddDocument({69999, 5, 65536}).ok());
  EXPECT_FALSE((*w)->AddDocument({70000}).ok());
  auto index = (*w)->Finish();
  ASSERT_TRUE(index.ok());
  EXPECT_EQ(index->dtype, "uint32");
  auto shards = TokenShards::Open(Path("wide"));
  ASSERT_TRUE(shards.ok());
  std::vector<int64_t> got(3);
  (*shards)->Copy(0, 3, got.data());
  EXPECT_EQ(got, (std::vector<int64_t>{69999, 5, 65536}));
}

TEST_F(TokenShardsTest, CorruptionIsNamed) {
  auto w = TokenShardWriter::Create(Path("c"), 300, "test", 50);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->AddDocument(std::vector<uint32_t>(120, 7)).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  {
    std::fstream f(Path("c/shard-00001.bin"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(10);
    f.put(1);
  }
  auto flipped = TokenShards::Open(Path("c"));
  ASSERT_FALSE(flipped.ok());
  EXPECT_NE(flipped.status().message().find("shard-00001.bin: checksum"), std::string::npos)
      << flipped.status();
  fs::resize_file(Path("c/shard-00002.bin"), 3);
  auto truncated = TokenShards::Open(Path("c"), /*verify_checksums=*/false);
  EXPECT_NE(truncated.status().message().find("shard-00002.bin: 3 bytes, index says 40"),
            std::string::npos)
      << truncated.status();
  fs::remove(Path("c/index.json"));
  EXPECT_EQ(TokenShards::Open(Path("c")).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TokenShardsTest, SentencePieceTokenizerAndCliPacking) {
  {
    std::ofstream text(Path("corpus.txt"));
    const char* words[] = {"the",     "quick",   "brown",  "fox",      "jumps",  "over",
                           "lazy",    "dog",     "river",  "mountain", "silver", "garden",
                           "library", "harbour", "market", "school",   "yellow", "window",
                           "thunder", "pencil",  "orange", "planet",   "whisper"};
    std::mt19937 rng(3);
    for (int i = 0; i < 400; ++i) {
      for (int w = 0; w < 9; ++w) text << words[rng() % 23] << (w == 8 ? ".\n" : " ");
    }
  }
  auto trained = TrainSentencePiece({Path("corpus.txt")}, 48, Path("spm"));
  ASSERT_TRUE(trained.ok()) << trained;
  auto tok = MakeTokenizer("sentencepiece", Path("spm.model"));
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 48);
  const std::string sample = "the lazy dog jumps over the silver river.";
  auto ids = (*tok)->Encode(sample);
  EXPECT_LT(ids.size(), sample.size());  // pieces are longer than bytes
  EXPECT_EQ((*tok)->Decode(ids), sample);
  EXPECT_FALSE(MakeTokenizer("sentencepiece", Path("missing.model")).ok());
  EXPECT_FALSE(MakeTokenizer("gpt2", "").ok());

  auto [rc, out] = Run("pack --output " + Path("spm_ds") + " --input " + Path("corpus.txt") +
                       " --format lines --tokenizer sentencepiece --tokenizer-model " +
                       Path("spm.model") + " --eos");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("packed 400 documents"), std::string::npos) << out;
  auto shards = TokenShards::Open(Path("spm_ds"));
  ASSERT_TRUE(shards.ok());
  std::vector<int64_t> all((*shards)->size());
  (*shards)->Copy(0, (*shards)->size(), all.data());
  EXPECT_EQ(std::count(all.begin(), all.end(), (*tok)->eos_id()), 400);
}

TEST_F(TokenShardsTest, JsonlErrorsNameTheLineOrAreCounted) {
  {
    std::ofstream f(Path("data.jsonl"));
    f << R"({"text": "first document"})"
      << "\n"
      << R"({"text": "second"})"
      << "\n"
      << R"({"text": 3})"
      << "\n"
      << "not json at all\n"
      << R"({"body": "no text field"})"
      << "\n"
      << R"({"text": "last"})"
      << "\n";
  }
  auto [rc, out] =
      Run("pack --output " + Path("fail") + " --input " + Path("data.jsonl") + " --format jsonl");
  EXPECT_EQ(rc, 1) << out << "a bad input file (2 is for a wrong command line)";
  EXPECT_NE(out.find("data.jsonl:3: \"text\" is not a string"), std::string::npos) << out;
  auto [rc2, out2] = Run("pack --output " + Path("skip") + " --input " + Path("data.jsonl") +
                         " --format jsonl --on-error skip");
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("packed 3 documents, 24 tokens"), std::string::npos) << out2;
  EXPECT_NE(out2.find("skipped 3 malformed line(s)"), std::string::npos) << out2;
  auto [rc3, out3] = Run("verify " + Path("skip"));
  EXPECT_EQ(rc3, 0) << out3;
  auto [rc4, out4] =
      Run("pack --output " + Path("x") + " --input " + Path("data.jsonl") + " --format csv");
  EXPECT_EQ(rc4, 2);
  EXPECT_NE(out4.find("--format"), std::string::npos);
}

}  // namespace
}  // namespace loom::data
