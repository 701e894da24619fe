// The `openthoughts` SFT plugin through the real loader (dlopen of the built library): kind and
// lookup, option errors that name the field, the assistant-only loss mask, the last_assistant
// loss, the system prompt, both truncation policies, line-numbered parse errors, prompts and
// stop tokens.
#include <gtest/gtest.h>

#include <cstdlib>

#include "data/chat.h"
#include "data/tokenizer.h"
#include "loom/spec.h"
#include "worker/trainer/plugin_factory.h"

namespace loom::trainer {
namespace {

class SftPluginTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LoadReport r = loader_.LoadDirectories({std::getenv("LOOM_PLUGIN_PATH")});
    ASSERT_TRUE(r.failures.empty());
  }
  SftObjectivePtr Make(const std::string& options_json) {
    google::protobuf::Struct options;
    EXPECT_TRUE(ParseJsonMessage(options_json, "options", &options).ok());
    auto o = CreateSftObjective(loader_, "openthoughts", options, 256);
    EXPECT_TRUE(o.ok()) << o.status();
    return o.ok() ? *o : nullptr;
  }
  PluginLoader loader_;
};

ChatConversation TwoTurns() {
  return {{{ChatRole::kUser, "hi"},
           {ChatRole::kAssistant, "yo"},
           {ChatRole::kUser, "2+2?"},
           {ChatRole::kAssistant, "4"}},
          0};
}

// The scored tokens as text ('|' for <|end|>).
std::string Scored(const EncodedConversation& e) {
  std::string s;
  for (size_t i = 0; i < e.tokens.size(); ++i) {
    if (!e.loss_mask[i]) continue;
    s += e.tokens[i] < 256 ? static_cast<char>(e.tokens[i]) : '|';
  }
  return s;
}

TEST_F(SftPluginTest, LoadsAsAnSftPluginAndRejectsBadOptions) {
  EXPECT_TRUE(loader_.Find("openthoughts", LOOM_PLUGIN_KIND_SFT).ok());
  EXPECT_FALSE(loader_.Find("openthoughts", LOOM_PLUGIN_KIND_ATTENTION).ok());
  EXPECT_FALSE(loader_.Find("mha", LOOM_PLUGIN_KIND_SFT).ok());
  google::protobuf::Struct bad;
  ASSERT_TRUE(ParseJsonMessage(R"({"loss": "everything"})", "o", &bad).ok());
  auto r = CreateSftObjective(loader_, "openthoughts", bad, 256);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("format_options.loss"), std::string::npos) << r.status();
  ASSERT_TRUE(ParseJsonMessage(R"({"lose": "last_assistant"})", "o", &bad).ok());
  r = CreateSftObjective(loader_, "openthoughts", bad, 256);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("format_options.lose: unknown option"), std::string::npos)
      << r.status();
  r = CreateSftObjective(loader_, "no_such_format", {}, 256);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SftPluginTest, LossMasksAndTemplate) {
  SftObjectivePtr all = Make("{}");
  ASSERT_TRUE(all);
  EXPECT_EQ(all->VocabSize(), 260);
  const EncodedConversation e = all->Encode(TwoTurns(), data::EncodeBytes);
  ASSERT_EQ(e.tokens.size(), e.loss_mask.size());
  EXPECT_EQ(Scored(e), "yo|4|");  // both answers and their <|end|>, nothing else
  SftObjectivePtr last = Make(R"({"loss": "last_assistant"})");
  EXPECT_EQ(Scored(last->Encode(TwoTurns(), data::EncodeBytes)), "4|");
  // Same tokens either way: the option changes targets only.
  EXPECT_EQ(last->Encode(TwoTurns(), data::EncodeBytes).tokens, e.tokens);

  SftObjectivePtr system = Make(R"({"system_prompt": "be brief"})");
  const auto prompt = system->Prompt(TwoTurns(), data::EncodeBytes);
  EXPECT_EQ(prompt.front(), 256u);  // <|system|>
  EXPECT_EQ(prompt.back(), 258u);   // ends with <|assistant|>: the model answers next
  const auto stops = all->StopTokens();
  EXPECT_NE(std::find(stops.begin(), stops.end(), 259u), stops.end());  // <|end|>
}

TEST_F(SftPluginTest, TruncationPolicies) {
  SftObjectivePtr head = Make("{}"), drop = Make(R"({"truncate": "drop"})");
  EncodedConversation e = head->Encode(TwoTurns(), data::EncodeBytes);
  const int64_t n = static_cast<int64_t>(e.tokens.size());
  EncodedConversation cut = e;
  ASSERT_TRUE(head->Truncate(&cut, n - 2));  // keeps the first n - 2 tokens
  EXPECT_EQ(static_cast<int64_t>(cut.tokens.size()), n - 2);
  EncodedConversation dropped = e;
  EXPECT_FALSE(drop->Truncate(&dropped, n - 2));
  EncodedConversation fits = e;
  EXPECT_TRUE(drop->Truncate(&fits, n));
  EncodedConversation nothing = e;
  EXPECT_FALSE(head->Truncate(&nothing, 3));  // no target left: dropped
}

TEST_F(SftPluginTest, ParseErrorsCarryTheLineNumber) {
  SftObjectivePtr o = Make("{}");
  ChatConversation c;
  std::string error;
  EXPECT_TRUE(o->ParseLine(
      R"({"conversations": [{"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}]})",
      3, &c, &error))
      << error;
  EXPECT_EQ(c.turns.size(), 2u);
  EXPECT_FALSE(o->ParseLine("{not json", 17, &c, &error));
  EXPECT_NE(error.find("17"), std::string::npos) << error;
}

}  // namespace
}  // namespace loom::trainer
