#include "data/chat.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "data/tokenizer.h"

namespace loom::data {
namespace {

TEST(ChatTest, ParsesBothFormats) {
  auto ot = ParseChatLine(
      R"({"system": "Think.", "conversations": [{"from": "user", "value": "2+2?"}, {"from": "assistant", "value": "4"}]})",
      3);
  ASSERT_TRUE(ot.ok()) << ot.status();
  ASSERT_EQ(ot->turns.size(), 3u);
  EXPECT_EQ(ot->turns[0].role, Role::kSystem);
  EXPECT_EQ(ot->turns[2].text, "4");
  EXPECT_EQ(ot->line, 3);
  auto sharegpt = ParseChatLine(
      R"({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})",
      1);
  ASSERT_TRUE(sharegpt.ok()) << sharegpt.status();
  auto msgs = ParseChatLine(
      R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]})",
      9);
  ASSERT_TRUE(msgs.ok()) << msgs.status();
  EXPECT_EQ(msgs->turns.size(), 5u);
}

TEST(ChatTest, MalformedLinesAreReportedByLineAndKind) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{not json", "not valid JSON"},
      {"[1, 2]", "expected a JSON object"},
      {R"({"text": "hi"})", "exactly one of"},
      {R"({"conversations": [], "messages": []})", "exactly one of"},
      {R"({"conversations": {"from": "user"}})", "must be an array"},
      {R"({"conversations": []})", "is empty"},
      {R"({"conversations": ["hi"]})", "conversations[0] must be an object"},
      {R"({"conversations": [{"from": "user"}]})", "conversations[0].value must be a string"},
      {R"({"messages": [{"role": 7, "content": "x"}]})", "messages[0].role must be a string"},
      {R"({"messages": [{"role": "robot", "content": "x"}]})", "unknown role 'robot'"},
      {R"({"system": 5, "conversations": [{"from": "user", "value": "q"}]})",
       "\"system\" must be a string"},
      {R"({"conversations": [{"from": "user", "value": "q"}]})", "no assistant turn"},
      {R"({"conversations": [{"from": "assistant", "value": "a"}]})", "must follow a user turn"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]})",
       "two user turns"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]})",
       "may only come first"},
  };
  const std::string path = ::testing::TempDir() + "/chat_bad.jsonl";
  {
    std::ofstream out(path);
    out << R"({"conversations": [{"from": "user", "value": "ok"}, {"from": "assistant", "value": "fine"}]})"
        << "\n\n";
    for (const auto& [line, why] : bad) out << line << "\n";
  }
  for (size_t i = 0; i < bad.size(); ++i) {
    auto c = ParseChatLine(bad[i].first, static_cast<int64_t>(i + 3));
    ASSERT_FALSE(c.ok()) << bad[i].first;
    EXPECT_NE(c.status().message().find("line " + std::to_string(i + 3) + ": "), std::string::npos)
        << c.status();
    EXPECT_NE(c.status().message().find(bad[i].second), std::string::npos) << c.status();
  }
  ChatReadReport report;
  auto all = ReadChatJsonl(path, true, &report);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 1u);
  EXPECT_EQ(report.lines, static_cast<int64_t>(bad.size() + 2));
  EXPECT_EQ(report.blank, 1);
  EXPECT_EQ(report.skipped, static_cast<int64_t>(bad.size()));
  EXPECT_EQ(report.errors.size(), bad.size());
  auto strict = ReadChatJsonl(path, false, nullptr);
  ASSERT_FALSE(strict.ok());
  EXPECT_NE(strict.status().message().find("line 3: not valid JSON"), std::string::npos)
      << strict.status();
  std::remove(path.c_str());
}

TEST(ChatTest, OnlyAssistantTokensAreScored) {
  ChatTemplate t;
  Conversation c{{{Role::kSystem, "S"},
                  {Role::kUser, "ab"},
                  {Role::kAssistant, "xyz"},
                  {Role::kUser, "c"},
                  {Role::kAssistant, "w"}}};
  EncodedChat e = EncodeChat(c, t, EncodeBytes);
  const std::vector<uint32_t> want = {
      t.system(), 'S', t.end(), t.user(), 'a', 'b',     t.end(),       t.assistant(), 'x',
      'y',        'z', t.end(), t.user(), 'c', t.end(), t.assistant(), 'w',           t.end()};
  EXPECT_EQ(e.tokens, want);
  const std::vector<uint8_t> mask = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1};
  EXPECT_EQ(e.loss_mask, mask);
  // Changing prompt text changes no scored token and no mask position after it moves with it.
  Conversation c2 = c;
  c2.turns[1].text = "zz";
  EncodedChat e2 = EncodeChat(c2, t, EncodeBytes);
  EXPECT_EQ(e2.loss_mask, e.loss_mask);
  for (size_t i = 0; i < e.tokens.size(); ++i) {
    if (e.loss_mask[i]) {
      EXPECT_EQ(e2.tokens[i], e.tokens[i]);
    }
  }
  // The generation prompt ends with the assistant marker and has no answer in it.
  std::vector<uint32_t> prompt = EncodePrompt(c, t, EncodeBytes);
  EXPECT_EQ(prompt.back(), t.assistant());
  EXPECT_EQ(prompt.size(), 16u);
  EXPECT_EQ(t.vocab_size(), 260);
}

// A tokenizer with Llama 3's chat tokens renders its own template: headers with the role as
// text, trimmed messages, <|eot_id|> ends (scored after the assistant), nothing added to the
// vocabulary; without all three header tokens the template stays Loom's.
TEST(ChatTest, TokenizerChatTokensGiveLlama3Headers) {
  const std::map<std::string, uint32_t> special = {{"<|begin_of_text|>", 300},
                                                   {"<|start_header_id|>", 301},
                                                   {"<|end_header_id|>", 302},
                                                   {"<|eot_id|>", 303}};
  auto id = [&](std::string_view t) -> std::optional<uint32_t> {
    auto it = special.find(std::string(t));
    return it == special.end() ? std::nullopt : std::optional<uint32_t>(it->second);
  };
  const ChatTemplate t = ChatTemplateFor(400, id);
  ASSERT_TRUE(t.headers());
  EXPECT_EQ(t.vocab_size(), 400);
  EXPECT_EQ(t.end(), 303u);
  EXPECT_EQ(t.stop_tokens(), (std::vector<uint32_t>{303, 301}));
  Conversation c;
  c.turns = {{Role::kUser, " hi\n"}, {Role::kAssistant, "ok "}};
  std::vector<size_t> starts;
  const EncodedChat e = EncodeChat(c, t, EncodeBytes, &starts);
  std::vector<uint32_t> want = {300, 301};
  for (char ch : std::string("user")) want.push_back(static_cast<unsigned char>(ch));
  want.insert(want.end(), {302, '\n', '\n', 'h', 'i', 303, 301});
  for (char ch : std::string("assistant")) want.push_back(static_cast<unsigned char>(ch));
  want.insert(want.end(), {302, '\n', '\n', 'o', 'k', 303});
  EXPECT_EQ(e.tokens, want);
  EXPECT_EQ(starts, (std::vector<size_t>{1, 12}));
  std::vector<uint32_t> scored;
  for (size_t i = 0; i < e.tokens.size(); ++i)
    if (e.loss_mask[i]) scored.push_back(e.tokens[i]);
  EXPECT_EQ(scored, (std::vector<uint32_t>{'o', 'k', 303}));
  const std::vector<uint32_t> prompt = EncodePrompt(c, t, EncodeBytes);
  EXPECT_EQ(std::vector<uint32_t>(prompt.begin(), prompt.begin() + 10),
            std::vector<uint32_t>(want.begin(), want.begin() + 10));
  EXPECT_EQ(prompt.back(), static_cast<uint32_t>('\n'));

  auto partial = [&](std::string_view tok) -> std::optional<uint32_t> {
    return tok == "<|eot_id|>" ? std::optional<uint32_t>(303) : std::nullopt;
  };
  const ChatTemplate loom = ChatTemplateFor(256, partial);
  EXPECT_FALSE(loom.headers());
  EXPECT_EQ(loom.vocab_size(), 260);
  EXPECT_EQ(loom.end(), 259u);
}

TEST(ChatTest, TruncationAndPacking) {
  ChatTemplate t;
  Conversation c{{{Role::kUser, "abcdef"}, {Role::kAssistant, "xy"}}};
  EncodedChat e = EncodeChat(c, t, EncodeBytes);  // 8 prompt tokens + 3 scored
  ASSERT_EQ(e.tokens.size(), 12u);
  EXPECT_FALSE(Truncate(e, 9).has_value());  // only the assistant marker fits: nothing to train on
  auto cut = Truncate(e, 10);
  ASSERT_TRUE(cut.has_value());
  EXPECT_EQ(cut->tokens.size(), 10u);
  EXPECT_EQ(cut->loss_mask.back(), 1);
  Conversation small{{{Role::kUser, "q"}, {Role::kAssistant, "a"}}};  // 6 tokens
  EncodedChat s = EncodeChat(small, t, EncodeBytes);
  // 6 + 6 fit in a 16-token row; the 12-token example does not fit in the 4 left, so it starts
  // the next row; the last 6-token example does not fit beside it either.
  std::vector<PackedRow> rows = Pack({s, s, e, s}, 16, 0);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].segment,
            (std::vector<int32_t>{1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0}));
  EXPECT_EQ(rows[1].segment,
            (std::vector<int32_t>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0}));
  EXPECT_EQ(rows[2].segment,
            (std::vector<int32_t>{1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  for (const PackedRow& r : rows) {
    ASSERT_EQ(r.tokens.size(), 16u);
    for (size_t i = 0; i < 16; ++i) {
      if (r.segment[i] == 0) {
        EXPECT_EQ(r.loss_mask[i], 0);  // padding is never scored
      }
    }
  }
  EXPECT_EQ(std::vector<uint32_t>(rows[1].tokens.begin(), rows[1].tokens.begin() + 12), e.tokens);
}

TEST(ChatTest, GeneratedReasoningIsCorrectAndDeterministic) {
  for (const std::string kind : {"arithmetic", "relation", "mixed"}) {
    auto a = GenerateReasoning(kind, 50, 7), b = GenerateReasoning(kind, 50, 7);
    ASSERT_EQ(a.size(), 50u);
    std::set<std::string> distinct;
    for (size_t i = 0; i < a.size(); ++i) {
      const Conversation& c = a[i].conversation;
      EXPECT_EQ(c.turns[0].text, b[i].conversation.turns[0].text);
      ASSERT_EQ(c.turns.size(), 2u);
      distinct.insert(c.turns[0].text);
      const std::string& reply = c.turns[1].text;
      EXPECT_NE(reply.find("<|begin_of_thought|>"), std::string::npos);
      EXPECT_NE(reply.find("<|end_of_solution|>"), std::string::npos);
      EXPECT_EQ(ExtractAnswer(reply, "gsm8k"), a[i].answer) << reply;
    }
    EXPECT_GT(distinct.size(), 40u) << kind;
  }
  // Independent check of the arithmetic: evaluate the question left to right.
  for (const auto& ex : GenerateReasoning("arithmetic", 30, 3)) {
    std::string q = ex.conversation.turns[0].text;  // "Compute ((a op b) op c) op d."
    int64_t value = 0;
    char op = '+';
    bool have = false;
    for (size_t i = 0; i < q.size(); ++i) {
      if (std::isdigit(static_cast<unsigned char>(q[i]))) {
        const int64_t x = q[i] - '0';
        value = !have ? x : op == '+' ? value + x : op == '-' ? value - x : value * x;
        have = true;
      } else if (q[i] == '+' || q[i] == '*' || (q[i] == '-' && have)) {
        op = q[i];
      }
    }
    EXPECT_EQ(std::to_string(value), ex.answer) << q;
  }
}

TEST(ChatTest, AnswerExtractionAndVoting) {
  EXPECT_EQ(ExtractAnswer("so 3 + 4 = 7\n#### 7", "gsm8k"), "7");
  EXPECT_EQ(ExtractAnswer("#### 1,234 \nmore", "gsm8k"), "1234");
  EXPECT_EQ(ExtractAnswer("#### 1\n#### 2", "gsm8k"), "2");
  EXPECT_EQ(ExtractAnswer("no marker", "gsm8k"), std::nullopt);
  EXPECT_EQ(ExtractAnswer("####   ", "gsm8k"), std::nullopt);
  EXPECT_EQ(ExtractAnswer(R"(so \boxed{\frac{1}{2}} done)", "math"), R"(\frac{1}{2})");
  EXPECT_EQ(ExtractAnswer(R"(\boxed{1} then \boxed{ 42 })", "math"), "42");
  EXPECT_EQ(ExtractAnswer(R"(\boxed{unclosed)", "math"), std::nullopt);
  EXPECT_EQ(ExtractAnswer(R"(\boxed{})", "math"), std::nullopt);
  using A = std::optional<std::string>;
  EXPECT_EQ(MajorityVote({A("3"), A("5"), A("3")}), "3");
  EXPECT_EQ(MajorityVote({A("5"), A("3")}), "5");                  // tie: first to reach 1
  EXPECT_EQ(MajorityVote({A("a"), A("b"), A("b"), A("a")}), "b");  // tie at 2: b got there first
  EXPECT_EQ(MajorityVote({std::nullopt, A("4"), std::nullopt}), "4");
  EXPECT_EQ(MajorityVote({std::nullopt, std::nullopt}), std::nullopt);
  EXPECT_EQ(MajorityVote({}), std::nullopt);
}

}  // namespace
}  // namespace loom::data
