#include "serve/openai_api.h"

#include <cmath>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace loom::serve {
namespace {

using json = nlohmann::json;

std::string Hex(const std::string& bytes) {
  std::string out = "bytes:";
  for (unsigned char b : bytes) absl::StrAppendFormat(&out, "\\x%02x", b);
  return out;
}

// Well-formed lead and continuation bytes (overlong forms are left to the JSON writer, which
// replaces what it cannot encode).
bool ValidUtf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

int64_t Utf8Chars(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

json LogprobOrNull(double v) { return std::isnan(v) ? json(nullptr) : json(v); }

json TopMap(const std::vector<TokenLogprob>& top, const data::Tokenizer& tokenizer) {
  json m = json::object();
  for (const TokenLogprob& t : top) {
    const std::string key = TokenText(tokenizer, t.token);
    if (!m.contains(key)) m[key] = t.logprob;  // two tokens with one text: the likelier stays
  }
  return m;
}

}  // namespace

size_t CompleteUtf8Prefix(const std::string& text) {
  // Walk back over at most 3 continuation bytes to the last lead byte; keep it only if whole.
  size_t i = text.size(), back = 0;
  while (i > 0 && back < 4 && (static_cast<unsigned char>(text[i - 1]) & 0xC0) == 0x80) {
    --i;
    ++back;
  }
  if (i == 0) return back == 0 ? 0 : text.size();
  const unsigned char lead = static_cast<unsigned char>(text[i - 1]);
  const size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
  return back + 1 >= need ? text.size() : i - 1;
}

std::string DecodeText(const data::Tokenizer& tokenizer, const std::vector<uint32_t>& ids) {
  std::vector<uint32_t> text_ids;
  for (uint32_t id : ids)
    if (id < tokenizer.vocab_size()) text_ids.push_back(id);
  return tokenizer.Decode(text_ids);
}

std::string TokenText(const data::Tokenizer& tokenizer, uint32_t token) {
  if (token >= tokenizer.vocab_size()) return absl::StrCat("<|special:", token, "|>");
  const std::string text = DecodeText(tokenizer, {token});
  return ValidUtf8(text) ? text : Hex(text);
}

json Usage(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

json CompletionChoice(int index, const std::vector<uint32_t>& prompt, const Sequence& s, bool echo,
                      const data::Tokenizer& tokenizer) {
  const SequenceParams& p = s.params();
  bool done = false;
  const std::vector<TokenOutput> generated = s.Wait(0, std::chrono::milliseconds(0), &done);
  std::string text = s.text();
  json logprobs = nullptr;
  if (p.logprobs >= 0) {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    int64_t offset = 0;
    auto add = [&](uint32_t token, double logprob, const std::vector<TokenLogprob>& alternatives,
                   bool first) {
      const std::string t = TokenText(tokenizer, token);
      tokens.push_back(t);
      token_logprobs.push_back(LogprobOrNull(logprob));
      top.push_back(first ? json(nullptr) : TopMap(alternatives, tokenizer));
      offsets.push_back(offset);
      offset += Utf8Chars(DecodeText(tokenizer, {token}));
    };
    if (echo) {
      const std::vector<TokenOutput> scores = s.prompt_scores();
      for (size_t i = 0; i < scores.size(); ++i)
        add(scores[i].token, scores[i].logprob, scores[i].top, i == 0);
    }
    for (const TokenOutput& t : generated) add(t.token, t.logprob, t.top, false);
    logprobs = {{"tokens", tokens},
                {"token_logprobs", token_logprobs},
                {"top_logprobs", top},
                {"text_offset", offsets}};
  }
  if (echo) text = DecodeText(tokenizer, prompt) + text;
  return {{"index", index},
          {"text", text},
          {"logprobs", logprobs},
          {"finish_reason", s.finish_reason() == "cancelled" ? "length" : s.finish_reason()}};
}

json ChatChoice(int index, const Sequence& s, bool logprobs, const data::Tokenizer& tokenizer) {
  bool done = false;
  const std::vector<TokenOutput> generated = s.Wait(0, std::chrono::milliseconds(0), &done);
  json lp = nullptr;
  if (logprobs) {
    json content = json::array();
    for (const TokenOutput& t : generated) {
      json top = json::array();
      for (const TokenLogprob& a : t.top) {
        const std::string bytes = DecodeText(tokenizer, {a.token});
        top.push_back({{"token", TokenText(tokenizer, a.token)},
                       {"logprob", a.logprob},
                       {"bytes", std::vector<unsigned char>(bytes.begin(), bytes.end())}});
      }
      const std::string bytes = DecodeText(tokenizer, {t.token});
      content.push_back({{"token", TokenText(tokenizer, t.token)},
                         {"logprob", t.logprob},
                         {"bytes", std::vector<unsigned char>(bytes.begin(), bytes.end())},
                         {"top_logprobs", top}});
    }
    lp = {{"content", content}};
  }
  return {{"index", index},
          {"message", {{"role", "assistant"}, {"content", s.text()}}},
          {"logprobs", lp},
          {"finish_reason", s.finish_reason() == "cancelled" ? "length" : s.finish_reason()}};
}

}  // namespace loom::serve
