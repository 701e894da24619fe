#include "data/chat.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "storage/confined_files.h"

namespace loom::data {
namespace {

absl::Status LineError(int64_t line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", what));
}

std::optional<Role> ParseRole(const std::string& s) {
  if (s == "system") return Role::kSystem;
  if (s == "user" || s == "human") return Role::kUser;
  if (s == "assistant" || s == "gpt") return Role::kAssistant;
  return std::nullopt;
}

}  // namespace

absl::StatusOr<Conversation> ParseChatLine(std::string_view line, int64_t line_no) {
  nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded()) return LineError(line_no, "not valid JSON");
  if (!j.is_object()) return LineError(line_no, "expected a JSON object");
  Conversation c;
  c.line = line_no;
  const bool openthoughts = j.contains("conversations"), messages = j.contains("messages");
  if (openthoughts == messages) {
    return LineError(line_no,
                     "expected exactly one of \"conversations\" (OpenThoughts) or \"messages\"");
  }
  if (openthoughts && j.contains("system")) {
    if (!j["system"].is_string()) return LineError(line_no, "\"system\" must be a string");
    if (!j["system"].get<std::string>().empty()) c.turns.push_back({Role::kSystem, j["system"]});
  }
  const nlohmann::json& list = openthoughts ? j["conversations"] : j["messages"];
  const char* list_name = openthoughts ? "conversations" : "messages";
  const char* role_key = openthoughts ? "from" : "role";
  const char* text_key = openthoughts ? "value" : "content";
  if (!list.is_array())
    return LineError(line_no, absl::StrCat("\"", list_name, "\" must be an array"));
  if (list.empty()) return LineError(line_no, absl::StrCat("\"", list_name, "\" is empty"));
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& t = list[i];
    const std::string where = absl::StrCat(list_name, "[", i, "]");
    if (!t.is_object()) return LineError(line_no, absl::StrCat(where, " must be an object"));
    if (!t.contains(role_key) || !t[role_key].is_string()) {
      return LineError(line_no, absl::StrCat(where, ".", role_key, " must be a string"));
    }
    if (!t.contains(text_key) || !t[text_key].is_string()) {
      return LineError(line_no, absl::StrCat(where, ".", text_key, " must be a string"));
    }
    auto role = ParseRole(t[role_key].get<std::string>());
    if (!role) {
      return LineError(line_no, absl::StrCat(where, ".", role_key, ": unknown role '",
                                             t[role_key].get<std::string>().substr(0, 40), "'"));
    }
    if (*role == Role::kSystem && (i != 0 || !c.turns.empty())) {
      return LineError(line_no, absl::StrCat(where, ": a system turn may only come first"));
    }
    c.turns.push_back({*role, t[text_key].get<std::string>()});
  }
  bool assistant = false;
  Role prev = Role::kSystem;
  for (const Turn& t : c.turns) {
    if (t.role == Role::kAssistant) {
      if (prev != Role::kUser)
        return LineError(line_no, "an assistant turn must follow a user turn");
      assistant = true;
    }
    if (t.role == Role::kUser && prev == Role::kUser)
      return LineError(line_no, "two user turns in a row");
    prev = t.role;
  }
  if (!assistant) return LineError(line_no, "no assistant turn (nothing to train on)");
  return c;
}

absl::StatusOr<std::vector<Conversation>> ReadChatJsonl(const std::string& path,
                                                        bool skip_malformed, ChatReadReport* report,
                                                        const ChatLineParser& parse) {
  auto stream = storage::OpenConfinedStream(path);
  if (!stream.ok()) return stream.status();
  std::istream& in = **stream;
  ChatReadReport local;
  ChatReadReport& r = report ? *report : local;
  std::vector<Conversation> out;
  std::string line;
  while (std::getline(in, line)) {
    ++r.lines;
    if (absl::StripAsciiWhitespace(line).empty()) {
      ++r.blank;
      continue;
    }
    auto c = parse ? parse(line, r.lines) : ParseChatLine(line, r.lines);
    if (!c.ok()) {
      if (!skip_malformed)
        return absl::InvalidArgumentError(absl::StrCat(path, ": ", c.status().message()));
      ++r.skipped;
      if (r.errors.size() < 20) r.errors.push_back(std::string(c.status().message()));
      continue;
    }
    out.push_back(*std::move(c));
    ++r.conversations;
  }
  return out;
}

namespace {

void Append(EncodedChat& e, uint32_t token, bool scored) {
  e.tokens.push_back(token);
  e.loss_mask.push_back(scored ? 1 : 0);
}

uint32_t Marker(const ChatTemplate& t, Role r) {
  return r == Role::kSystem ? t.system() : r == Role::kUser ? t.user() : t.assistant();
}

// ASCII whitespace off both ends. (Jinja's trim strips Unicode whitespace too, and Python's and
// JavaScript's sets differ, e.g. U+FEFF; text that starts or ends with such characters keeps
// them here: docs/sft.md.)
std::string_view TrimSpace(std::string_view s) {
  auto space = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

const char* RoleName(Role r) {
  return r == Role::kSystem ? "system" : r == Role::kUser ? "user" : "assistant";
}

// Loom's marker, or <|start_header_id|> role <|end_header_id|> "\n\n"; never scored.
void AppendHeader(EncodedChat& e, const ChatTemplate& t, Role r, const TextEncoder& encode) {
  if (!t.headers()) {
    Append(e, Marker(t, r), false);
    return;
  }
  Append(e, static_cast<uint32_t>(t.header_start), false);
  for (uint32_t id : encode(RoleName(r))) Append(e, id, false);
  Append(e, static_cast<uint32_t>(t.header_end), false);
  for (uint32_t id : encode("\n\n")) Append(e, id, false);
}

}  // namespace

std::vector<uint32_t> ChatTemplate::stop_tokens() const {
  if (headers()) return {end(), static_cast<uint32_t>(header_start)};
  return {end(), system(), user(), assistant()};
}

ChatTemplate ChatTemplateFor(
    int64_t base_vocab, const std::function<std::optional<uint32_t>(std::string_view)>& token_id) {
  ChatTemplate t;
  t.base_vocab = base_vocab;
  if (!token_id) return t;
  const auto start = token_id("<|start_header_id|>"), end = token_id("<|end_header_id|>"),
             eot = token_id("<|eot_id|>"), bos = token_id("<|begin_of_text|>");
  if (!start || !end || !eot) return t;
  t.header_start = *start;
  t.header_end = *end;
  t.turn_end = *eot;
  t.begin_of_text = bos ? static_cast<int64_t>(*bos) : -1;
  return t;
}

EncodedChat EncodeChat(const Conversation& c, const ChatTemplate& t, const TextEncoder& encode,
                       std::vector<size_t>* turn_starts) {
  EncodedChat e;
  if (t.headers() && t.begin_of_text >= 0) Append(e, static_cast<uint32_t>(t.begin_of_text), false);
  for (const Turn& turn : c.turns) {
    const bool scored = turn.role == Role::kAssistant;
    if (turn_starts != nullptr) turn_starts->push_back(e.tokens.size());
    AppendHeader(e, t, turn.role, encode);
    // Llama 3's template trims each message; Loom's keeps the text as it is.
    const std::string_view text = t.headers() ? TrimSpace(turn.text) : std::string_view(turn.text);
    for (uint32_t id : encode(text)) Append(e, id, scored);
    Append(e, t.end(), scored);
  }
  return e;
}

std::vector<uint32_t> EncodePrompt(const Conversation& c, const ChatTemplate& t,
                                   const TextEncoder& encode) {
  std::vector<Turn> turns = c.turns;
  if (!turns.empty() && turns.back().role == Role::kAssistant) turns.pop_back();
  Conversation prompt{turns, c.line};
  EncodedChat e = EncodeChat(prompt, t, encode);
  AppendHeader(e, t, Role::kAssistant, encode);
  return e.tokens;
}

std::optional<EncodedChat> Truncate(EncodedChat e, int64_t max_len) {
  if (static_cast<int64_t>(e.tokens.size()) > max_len) {
    e.tokens.resize(static_cast<size_t>(max_len));
    e.loss_mask.resize(static_cast<size_t>(max_len));
  }
  if (std::find(e.loss_mask.begin(), e.loss_mask.end(), 1) == e.loss_mask.end())
    return std::nullopt;
  return e;
}

std::vector<PackedRow> Pack(const std::vector<EncodedChat>& examples, int64_t seq_len,
                            uint32_t pad) {
  std::vector<PackedRow> rows;
  PackedRow row;
  int32_t segment = 0;
  auto finish = [&] {
    if (row.tokens.empty()) return;
    while (static_cast<int64_t>(row.tokens.size()) < seq_len) {
      row.tokens.push_back(pad);
      row.loss_mask.push_back(0);
      row.segment.push_back(0);
    }
    rows.push_back(std::move(row));
    row = PackedRow();
    segment = 0;
  };
  for (const EncodedChat& ex : examples) {
    auto e = Truncate(ex, seq_len);
    if (!e) continue;
    if (static_cast<int64_t>(row.tokens.size() + e->tokens.size()) > seq_len) finish();
    ++segment;
    row.tokens.insert(row.tokens.end(), e->tokens.begin(), e->tokens.end());
    row.loss_mask.insert(row.loss_mask.end(), e->loss_mask.begin(), e->loss_mask.end());
    row.segment.insert(row.segment.end(), e->tokens.size(), segment);
  }
  finish();
  return rows;
}

namespace {

std::string Thought(const std::vector<std::string>& steps, const std::string& answer,
                    const std::string& summary) {
  return absl::StrCat("<|begin_of_thought|>\n", absl::StrJoin(steps, "\n"),
                      "\n<|end_of_thought|>\n", "<|begin_of_solution|>\n", summary, "\n#### ",
                      answer, "\n<|end_of_solution|>");
}

ReasoningExample Arithmetic(std::mt19937_64& rng, const ReasoningOptions& o) {
  std::uniform_int_distribution<int> ops(o.min_ops, o.max_ops), num(1, 9), op(0, 2);
  const int n = ops(rng);
  int64_t value = num(rng);
  std::string expr = std::to_string(value);
  std::vector<std::string> steps;
  for (int i = 0; i < n; ++i) {
    const int o = op(rng);
    const int64_t x = num(rng);
    const char sym = "+-*"[o];
    const int64_t next = o == 0 ? value + x : o == 1 ? value - x : value * x;
    steps.push_back(absl::StrCat("Step ", i + 1, ": ", value, " ", std::string(1, sym), " ", x,
                                 " = ", next, "."));
    expr =
        absl::StrCat(i == 0 ? "" : "(", expr, i == 0 ? "" : ")", " ", std::string(1, sym), " ", x);
    value = next;
  }
  ReasoningExample ex;
  ex.answer = std::to_string(value);
  ex.conversation.turns = {
      {Role::kUser, absl::StrCat("Compute ", expr, ".")},
      {Role::kAssistant, Thought(steps, ex.answer, absl::StrCat("The result is ", value, "."))}};
  return ex;
}

ReasoningExample RelationChain(std::mt19937_64& rng, const ReasoningOptions& o) {
  std::vector<std::string> names = {"ada", "bo",  "cy",  "di", "ed",  "flo",
                                    "gus", "hal", "ivy", "jo", "kim", "lu"};
  std::shuffle(names.begin(), names.end(), rng);
  // Chains of 3..6 people, or with explicit hops just enough people for them (+0..1 distractor).
  std::uniform_int_distribution<int> len(o.relation_hops_set ? o.min_ops + 1 : 3,
                                         o.relation_hops_set ? std::min(6, o.max_ops + 2) : 6);
  const int n = len(rng);  // chain names[0] -> names[1] -> ... (parent of the next)
  std::uniform_int_distribution<int> hops_d(
      o.relation_hops_set ? o.min_ops : 2,
      o.relation_hops_set ? std::min(o.max_ops, n - 1) : n - 1);
  const int hops = hops_d(rng);
  std::vector<std::string> facts;
  for (int i = 0; i + 1 < n; ++i)
    facts.push_back(absl::StrCat(names[i], " is the parent of ", names[i + 1], "."));
  std::shuffle(facts.begin(), facts.end(), rng);
  const int start = n - 1;
  std::vector<std::string> steps;
  int at = start;
  for (int h = 0; h < hops; ++h) {
    steps.push_back(
        absl::StrCat("Step ", h + 1, ": the parent of ", names[at], " is ", names[at - 1], "."));
    --at;
  }
  ReasoningExample ex;
  ex.answer = names[at];
  ex.conversation.turns = {
      {Role::kUser, absl::StrCat(absl::StrJoin(facts, " "), " Who is ", names[start],
                                 "'s ancestor ", hops, " generations up?")},
      {Role::kAssistant,
       Thought(steps, ex.answer,
               absl::StrCat("Going up ", hops, " generations gives ", ex.answer, "."))}};
  return ex;
}

}  // namespace

bool IsHeldOutProblem(std::string_view prompt) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : prompt) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h % 8 == 0;
}

absl::StatusOr<ReasoningOptions> ParseReasoningOps(std::string_view text) {
  ReasoningOptions o;
  o.relation_hops_set = true;
  const std::string s(text);
  const size_t dash = s.find('-');
  const bool ok = dash == std::string::npos
                      ? absl::SimpleAtoi(s, &o.min_ops) && absl::SimpleAtoi(s, &o.max_ops)
                      : absl::SimpleAtoi(s.substr(0, dash), &o.min_ops) &&
                            absl::SimpleAtoi(s.substr(dash + 1), &o.max_ops);
  if (!ok || o.min_ops < 1 || o.max_ops > 8 || o.min_ops > o.max_ops) {
    return absl::InvalidArgumentError(
        absl::StrCat("task_options.ops: '", s, "' is not N or A-B with 1 <= A <= B <= 8"));
  }
  return o;
}

std::vector<ReasoningExample> GenerateReasoning(const std::string& kind, int64_t count,
                                                uint64_t seed, ReasoningSplit split,
                                                ReasoningOptions options) {
  std::mt19937_64 rng(seed);
  std::vector<ReasoningExample> out;
  const bool want_held_out = split == ReasoningSplit::kHeldOut;
  for (int64_t i = 0; static_cast<int64_t>(out.size()) < count; ++i) {
    const bool arithmetic =
        kind == "arithmetic" || (kind == "mixed" && static_cast<int64_t>(out.size()) % 2 == 0);
    ReasoningExample ex = arithmetic ? Arithmetic(rng, options) : RelationChain(rng, options);
    if (IsHeldOutProblem(ex.conversation.turns.front().text) == want_held_out)
      out.push_back(std::move(ex));
  }
  return out;
}

std::optional<std::string> ExtractAnswer(std::string_view text, std::string_view style) {
  if (style == "math") {
    const size_t at = text.rfind("\\boxed{");
    if (at == std::string_view::npos) return std::nullopt;
    int depth = 1;
    const size_t start = at + 7;
    for (size_t i = start; i < text.size(); ++i) {
      if (text[i] == '{') ++depth;
      if (text[i] == '}' && --depth == 0) {
        const std::string_view inner = text.substr(start, i - start);
        std::string ans(absl::StripAsciiWhitespace(absl::string_view(inner.data(), inner.size())));
        if (ans.empty()) return std::nullopt;
        return ans;
      }
    }
    return std::nullopt;  // unbalanced: no answer
  }
  const size_t at = text.rfind("####");
  if (at == std::string_view::npos) return std::nullopt;
  std::string_view rest = text.substr(at + 4);
  const size_t nl = rest.find('\n');
  if (nl != std::string_view::npos) rest = rest.substr(0, nl);
  std::string ans;
  for (char ch : absl::StripAsciiWhitespace(absl::string_view(rest.data(), rest.size()))) {
    if (ch != ',') ans += ch;
  }
  if (ans.empty()) return std::nullopt;
  return ans;
}

namespace {

std::string NormaliseAnswer(std::string_view text) {
  std::string s;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) s += c;
  if (s.size() >= 2 && s.front() == '$' && s.back() == '$') s = s.substr(1, s.size() - 2);
  while (!s.empty() && s.back() == '.') s.pop_back();
  // Thousands separators: "1,234" -> "1234" (a comma between digits only).
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    const bool between_digits = s[i] == ',' && i > 0 && i + 1 < s.size() &&
                                std::isdigit(static_cast<unsigned char>(s[i - 1])) &&
                                std::isdigit(static_cast<unsigned char>(s[i + 1]));
    if (!between_digits) out += s[i];
  }
  return out;
}

std::optional<double> ParseNumber(const std::string& s) {
  if (s.empty() || s.size() > 64) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace

bool AnswersMatch(std::string_view answer, std::string_view reference) {
  const std::string a = NormaliseAnswer(answer), r = NormaliseAnswer(reference);
  if (a.empty() || r.empty()) return false;
  const auto x = ParseNumber(a), y = ParseNumber(r);
  if (x && y) return std::abs(*x - *y) <= 1e-9 * std::max(1.0, std::abs(*y));
  return a == r;
}

std::optional<std::string> MajorityVote(const std::vector<std::optional<std::string>>& answers) {
  // Votes are counted per normalised answer ("42", "42.0" and " 42." are one answer); the winner
  // is reported as its first spelling.
  auto key = [](const std::string& a) {
    const std::string n = NormaliseAnswer(a);
    const auto v = ParseNumber(n);
    return v ? absl::StrCat("#", *v) : n;
  };
  std::map<std::string, int> counts;
  std::map<std::string, std::string> spelling;
  std::optional<std::string> best;
  int best_count = 0;
  for (const auto& a : answers) {
    if (!a) continue;
    const std::string k = key(*a);
    spelling.emplace(k, *a);
    const int c = ++counts[k];
    if (c > best_count) {  // strictly more: the first to reach a count keeps a tie
      best_count = c;
      best = spelling[k];
    }
  }
  return best;
}

}  // namespace loom::data
