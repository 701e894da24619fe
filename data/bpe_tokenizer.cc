#include "data/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <map>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"
#include "storage/confined_files.h"

namespace loom::data {
namespace {

using Json = nlohmann::json;

// GPT-2's pre-tokenizer regex: what ByteLevel(use_regex: true) splits with.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// The allowed range of the second byte after a lead byte (the rest are 80..BF), and the length.
bool LeadByte(uint8_t b, int* len, uint8_t* lo, uint8_t* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    *len = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    *len = 3;
    if (b == 0xE0) *lo = 0xA0;
    if (b == 0xED) *hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    *len = 4;
    if (b == 0xF0) *lo = 0x90;
    if (b == 0xF4) *hi = 0x8F;
  } else {
    return false;
  }
  return true;
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to U+0100 upward.
std::vector<uint32_t> ByteToCodepoint() {
  std::vector<uint32_t> map(256, 0);
  std::vector<bool> direct(256, false);
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) map[b] = direct[b] ? static_cast<uint32_t>(b) : next++;
  return map;
}

absl::Status Invalid(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// The regex of the file's pre-tokenizer: a Split (behavior Isolated) followed by ByteLevel
// without its own regex (Llama-3), or ByteLevel with GPT-2's regex.
absl::StatusOr<std::string> PreTokenizerPattern(const Json& j, const std::string& path) {
  const Json& pre = j.value("pre_tokenizer", Json());
  std::vector<Json> steps;
  if (pre.is_object() && pre.value("type", Json()) == "Sequence" &&
      pre.value("pretokenizers", Json()).is_array()) {
    for (const Json& p : pre["pretokenizers"]) steps.push_back(p);
  } else if (pre.is_object()) {
    steps.push_back(pre);
  }
  std::string pattern;
  bool byte_level = false;
  for (const Json& p : steps) {
    const std::string type = p.is_object() ? p.value("type", "") : "";
    if (type == "Split") {
      const Json& pat = p.value("pattern", Json());
      if (!pat.is_object() || !pat.value("Regex", Json()).is_string() || !pattern.empty()) {
        return Invalid(path, "pre_tokenizer: one Split with a Regex pattern is supported");
      }
      if (p.value("behavior", "") != "Isolated" || p.value("invert", false)) {
        return Invalid(path, "pre_tokenizer.Split: only behavior Isolated, invert false");
      }
      pattern = pat["Regex"].get<std::string>();
    } else if (type == "ByteLevel") {
      if (p.value("add_prefix_space", false)) {
        return Invalid(path, "pre_tokenizer.ByteLevel.add_prefix_space: true is not supported");
      }
      byte_level = true;
      if (p.value("use_regex", true)) {
        if (!pattern.empty()) return Invalid(path, "pre_tokenizer: two regexes");
        pattern = kGpt2Pattern;
      }
    } else {
      return Invalid(path, absl::StrCat("pre_tokenizer: '", type.substr(0, 40),
                                        "' is not supported (Split, ByteLevel)"));
    }
  }
  if (!byte_level || pattern.empty()) {
    return Invalid(path, "pre_tokenizer: expected ByteLevel (with a Split regex or its own)");
  }
  return pattern;
}

}  // namespace

std::string SanitizeUtf8(std::string_view in) {
  std::string out;
  out.reserve(in.size());
  size_t i = 0;
  while (i < in.size()) {
    const auto b = static_cast<uint8_t>(in[i]);
    if (b < 0x80) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    }
    int len;
    uint8_t lo, hi;
    if (!LeadByte(b, &len, &lo, &hi)) {
      AppendUtf8(0xFFFD, &out);
      ++i;
      continue;
    }
    // Consume the longest valid prefix; a shorter one is one U+FFFD, the next byte starts over.
    size_t j = i + 1;
    for (int k = 1; k < len; ++k, ++j) {
      if (j >= in.size()) break;
      const auto c = static_cast<uint8_t>(in[j]);
      if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) break;
    }
    if (static_cast<int>(j - i) == len) {
      out.append(in.substr(i, len));
    } else {
      AppendUtf8(0xFFFD, &out);
    }
    i = j;
  }
  return out;
}

struct BpeTokenizer::Impl {
  std::unordered_map<std::string, uint32_t> vocab;  // byte-level form -> id
  std::vector<std::string> id_to_token;             // "" for ids without a token
  struct Merge {
    uint32_t rank, merged;
  };
  std::unordered_map<uint64_t, Merge> merges;  // (left id << 32 | right id) -> rank, result
  bool ignore_merges = false;
  uint32_t byte_id[256];                                 // id of each single byte's token
  std::string byte_piece[256];                           // each byte's character, UTF-8
  std::unordered_map<uint32_t, uint8_t> codepoint_byte;  // for decoding
  // Added tokens: content -> id, split out before pre-tokenizing, longest match first.
  std::map<std::string, uint32_t, std::less<>> added;
  std::vector<bool> is_added;
  size_t longest_added = 0;
  bool added_first[256] = {};  // bytes an added token starts with: the only places to look
  pcre2_code* regex = nullptr;
  int64_t eos = -1;

  ~Impl() { pcre2_code_free(regex); }

  void PreTokenize(std::string_view text, std::vector<std::string_view>* pieces) const;
  void EncodePiece(std::string_view piece, std::vector<uint32_t>* out) const;
  void EncodeSegment(std::string_view text, std::vector<uint32_t>* out) const;

  // Loading tokenizer.json, in order (errors name the file and the field).
  absl::Status LoadVocab(const Json& j, const Json& model, const std::string& path);
  absl::Status LoadByteTokens(const std::string& path);
  absl::Status LoadMerges(const Json& model, const std::string& path);
  absl::Status CompileRegex(const std::string& pattern, const std::string& path);
};

// The Split pre-tokenizer with behavior Isolated: every match is a piece, and so is any text
// between matches.
void BpeTokenizer::Impl::PreTokenize(std::string_view text,
                                     std::vector<std::string_view>* pieces) const {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(regex, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t at = 0, last = 0;
  while (at <= text.size()) {
    const int rc = pcre2_match(regex, subject, text.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc < 0) break;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t start = ov[0], end = ov[1];
    if (end == start) {  // an empty match: step over one character
      if (start >= text.size()) break;
      at = start + 1;
      while (at < text.size() && (static_cast<uint8_t>(text[at]) & 0xC0) == 0x80) ++at;
      continue;
    }
    if (start > last) pieces->push_back(text.substr(last, start - last));
    pieces->push_back(text.substr(start, end - start));
    last = at = end;
  }
  if (last < text.size()) pieces->push_back(text.substr(last));
  pcre2_match_data_free(md);
}

// One pre-tokenized piece: its bytes as single-byte tokens, then the lowest-ranked adjacent pair
// merged (leftmost first) until no pair has a merge. In O(n log n), as Hugging Face tokenizers
// do it: the symbols form a linked list, candidate pairs wait in a min-heap by (rank, position),
// and a popped candidate whose symbols changed since it was pushed is skipped. (Rescanning every
// pair per merge was quadratic: 2 s for a run of 40 000 letters.)
void BpeTokenizer::Impl::EncodePiece(std::string_view piece, std::vector<uint32_t>* out) const {
  if (ignore_merges) {
    std::string word;
    for (unsigned char b : piece) word += byte_piece[b];
    if (auto it = vocab.find(word); it != vocab.end()) {
      out->push_back(it->second);
      return;
    }
  }
  constexpr size_t kNone = std::numeric_limits<size_t>::max();
  struct Symbol {
    uint32_t id;
    size_t prev, next;  // kNone at the ends; a merged-away symbol has id kGone
  };
  constexpr uint32_t kGone = std::numeric_limits<uint32_t>::max();
  std::vector<Symbol> symbols(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) {
    symbols[i] = {byte_id[static_cast<unsigned char>(piece[i])], i == 0 ? kNone : i - 1,
                  i + 1 < piece.size() ? i + 1 : kNone};
  }
  struct Candidate {
    uint32_t rank;
    size_t left;                 // the left symbol's position
    uint32_t left_id, right_id;  // what the pair was when pushed
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push = [&](size_t left) {
    if (left == kNone || symbols[left].next == kNone) return;
    const uint32_t l = symbols[left].id, r = symbols[symbols[left].next].id;
    if (auto it = merges.find(uint64_t{l} << 32 | r); it != merges.end()) {
      heap.push({it->second.rank, left, l, r});
    }
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& left = symbols[c.left];
    if (left.id != c.left_id || left.next == kNone || symbols[left.next].id != c.right_id) {
      continue;  // stale: one of its symbols was merged since
    }
    Symbol& right = symbols[left.next];
    left.id = merges.at(uint64_t{c.left_id} << 32 | c.right_id).merged;
    right.id = kGone;
    left.next = right.next;
    if (right.next != kNone) symbols[right.next].prev = c.left;
    push(left.prev);
    push(c.left);
  }
  for (size_t i = piece.empty() ? kNone : 0; i != kNone; i = symbols[i].next) {
    out->push_back(symbols[i].id);
  }
}

void BpeTokenizer::Impl::EncodeSegment(std::string_view text, std::vector<uint32_t>* out) const {
  std::vector<std::string_view> pieces;
  PreTokenize(text, &pieces);
  for (std::string_view p : pieces) EncodePiece(p, out);
}

BpeTokenizer::BpeTokenizer(std::string path, std::unique_ptr<Impl> impl)
    : path_(std::move(path)), impl_(std::move(impl)) {}
BpeTokenizer::~BpeTokenizer() = default;

namespace {

// Token ids a tokenizer.json may use: 2^24 is 64 times the largest vocabularies in use (256k),
// and ids must be nearly dense (at most twice the number of tokens, plus slack), so a crafted
// file cannot make the loader allocate more than its own size suggests.
constexpr uint64_t kMaxTokenId = (uint64_t{1} << 24) - 1;

// An id field's value, checked: an unsigned integer within kMaxTokenId, else an error naming
// the field and the value.
absl::StatusOr<uint32_t> TokenIdAt(const Json& id, const std::string& field,
                                   const std::string& path) {
  if (!id.is_number_unsigned() || id.get<uint64_t>() > kMaxTokenId) {
    return Invalid(path, absl::StrCat(field, ": ", id.dump().substr(0, 40),
                                      " is not a token id (0..", kMaxTokenId, ")"));
  }
  return static_cast<uint32_t>(id.get<uint64_t>());
}

}  // namespace

// model.vocab and added_tokens (which may extend the id range beyond the vocabulary).
absl::Status BpeTokenizer::Impl::LoadVocab(const Json& j, const Json& model,
                                           const std::string& path) {
  const Json& vocab_json = model.value("vocab", Json());
  if (!vocab_json.is_object() || vocab_json.empty())
    return Invalid(path, "model.vocab: missing or empty");
  uint32_t max_id = 0;
  std::string max_field;
  for (const auto& [token, id_json] : vocab_json.items()) {
    const std::string field = absl::StrCat("model.vocab['", token.substr(0, 40), "']");
    LOOM_ASSIGN_OR_RETURN(const uint32_t id, TokenIdAt(id_json, field, path));
    vocab[token] = id;
    if (id >= max_id) max_id = id, max_field = field;
  }
  const Json& added_json = j.value("added_tokens", Json::array());
  if (!added_json.is_array()) return Invalid(path, "added_tokens: expected an array");
  std::vector<uint32_t> added_ids;
  for (size_t i = 0; i < added_json.size(); ++i) {
    const Json& a = added_json[i];
    const std::string field = absl::StrCat("added_tokens[", i, "]");
    if (!a.is_object() || !a.value("content", Json()).is_string() || !a.contains("id")) {
      return Invalid(path, absl::StrCat(field, ": each needs content and id"));
    }
    LOOM_ASSIGN_OR_RETURN(const uint32_t id, TokenIdAt(a["id"], field + ".id", path));
    added_ids.push_back(id);
    if (id >= max_id) max_id = id, max_field = field + ".id";
  }
  const uint64_t tokens = vocab.size() + added_ids.size();
  if (max_id > 2 * tokens + 1024) {
    return Invalid(path, absl::StrCat(max_field, ": ", max_id, " leaves most ids below it unused (",
                                      tokens, " tokens in all); ids must be dense"));
  }
  id_to_token.assign(max_id + 1, "");
  is_added.assign(max_id + 1, false);
  // One token per id: decoding an id must give back what encoding produced it from.
  for (const auto& [token, id] : vocab) {
    if (token.empty()) return Invalid(path, "model.vocab: an empty token");
    if (!id_to_token[id].empty())
      return Invalid(path, absl::StrCat("model.vocab['", token.substr(0, 40), "']: id ", id,
                                        " is also '", id_to_token[id].substr(0, 40), "'"));
    id_to_token[id] = token;
  }
  for (size_t i = 0; i < added_json.size(); ++i) {
    const std::string content = added_json[i]["content"];
    if (content.empty()) return Invalid(path, absl::StrCat("added_tokens[", i, "]: empty content"));
    const uint32_t id = added_ids[i];
    // An added token may repeat a vocabulary entry (the same text), never displace another.
    if (!id_to_token[id].empty() && id_to_token[id] != content &&
        !(vocab.count(content) && vocab.at(content) == id))
      return Invalid(path, absl::StrCat("added_tokens[", i, "].id: ", id, " is already '",
                                        id_to_token[id].substr(0, 40), "'"));
    added[content] = id;
    id_to_token[id] = content;
    is_added[id] = true;
    longest_added = std::max(longest_added, content.size());
    added_first[static_cast<uint8_t>(content[0])] = true;
    if (content == "<|end_of_text|>" || content == "<|endoftext|>" || content == "</s>") eos = id;
  }
  return absl::OkStatus();
}

// Every byte's character (GPT-2's byte-to-unicode map) must be a token of its own.
absl::Status BpeTokenizer::Impl::LoadByteTokens(const std::string& path) {
  const std::vector<uint32_t> cps = ByteToCodepoint();
  for (int b = 0; b < 256; ++b) {
    AppendUtf8(cps[b], &byte_piece[b]);
    codepoint_byte[cps[b]] = static_cast<uint8_t>(b);
    auto it = vocab.find(byte_piece[b]);
    if (it == vocab.end()) {
      return Invalid(path, absl::StrCat("model.vocab: no token for byte ", b,
                                        " (not a byte-level BPE vocabulary)"));
    }
    byte_id[b] = it->second;
  }
  return absl::OkStatus();
}

// model.merges as "a b" strings or [a, b] pairs, ranked by position.
absl::Status BpeTokenizer::Impl::LoadMerges(const Json& model, const std::string& path) {
  const Json& merges_json = model.value("merges", Json::array());
  uint32_t rank = 0;
  for (const Json& m : merges_json) {
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m;
      const size_t space = s.find(' ', 1);
      if (space == std::string::npos) return Invalid(path, "model.merges: expected 'a b'");
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0];
      right = m[1];
    } else {
      return Invalid(path, "model.merges: expected 'a b' or [a, b]");
    }
    auto l = vocab.find(left), r = vocab.find(right), merged = vocab.find(left + right);
    if (l == vocab.end() || r == vocab.end() || merged == vocab.end()) {
      return Invalid(path, absl::StrCat("model.merges[", rank, "]: '", left.substr(0, 40), "' + '",
                                        right.substr(0, 40), "' names a token not in the vocab"));
    }
    merges.emplace(uint64_t{l->second} << 32 | r->second, Merge{rank, merged->second});
    ++rank;
  }
  return absl::OkStatus();
}

absl::Status BpeTokenizer::Impl::CompileRegex(const std::string& pattern, const std::string& path) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  regex = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                        PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (regex == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return Invalid(path, absl::StrCat("pre_tokenizer regex at offset ", offset, ": ",
                                      reinterpret_cast<const char*>(message)));
  }
  pcre2_jit_compile(regex, PCRE2_JIT_COMPLETE);  // best effort: interpreted otherwise
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Load(const std::string& path) {
  // Llama 3's is 9 MB; the bound keeps a hostile file from exhausting memory before parsing.
  auto text = storage::ReadConfinedFile(path, 256 << 20);
  if (!text.ok())
    return absl::Status(text.status().code(),
                        absl::StrCat("tokenizer file '", path, "': ", text.status().message()));
  return FromJson(*text, path);
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromJson(std::string_view text,
                                                                     const std::string& path) {
  // The checks name the fields they know; a value of a type nobody checked (a number where
  // the file format has a string) is still an error, not an exception out of the loader.
  try {
    return Parse(text, path);
  } catch (const Json::exception& e) {
    return Invalid(path, absl::StrCat("malformed: ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Parse(std::string_view text,
                                                                  const std::string& path) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Invalid(path, "not a JSON object (a Hugging Face tokenizer.json)");
  const Json& model = j.value("model", Json());
  if (!model.is_object() || model.value("type", "") != "BPE") {
    return Invalid(path, "model.type: only BPE is supported");
  }
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    return Invalid(path, "normalizer: not supported (byte-level BPE files have none)");
  }
  if (model.contains("byte_fallback") && model["byte_fallback"].is_boolean() &&
      model["byte_fallback"].get<bool>()) {
    return Invalid(path, "model.byte_fallback: not supported (a SentencePiece-style BPE)");
  }
  auto impl = std::make_unique<Impl>();
  impl->ignore_merges = model.value("ignore_merges", false);
  LOOM_RETURN_IF_ERROR(impl->LoadVocab(j, model, path));
  LOOM_RETURN_IF_ERROR(impl->LoadByteTokens(path));
  LOOM_RETURN_IF_ERROR(impl->LoadMerges(model, path));
  LOOM_ASSIGN_OR_RETURN(const std::string pattern, PreTokenizerPattern(j, path));
  LOOM_RETURN_IF_ERROR(impl->CompileRegex(pattern, path));
  return std::unique_ptr<BpeTokenizer>(new BpeTokenizer(path, std::move(impl)));
}

std::vector<uint32_t> BpeTokenizer::Encode(std::string_view raw) const {
  const std::string text = SanitizeUtf8(raw);
  std::vector<uint32_t> out;
  out.reserve(text.size() / 3 + 1);
  std::string_view rest(text);
  size_t segment = 0;
  // Added tokens first: at each position the longest one that starts there.
  for (size_t i = 0; i < rest.size(); ++i) {
    if (!impl_->added_first[static_cast<uint8_t>(rest[i])]) continue;
    size_t best = 0;
    uint32_t id = 0;
    for (size_t n = std::min(impl_->longest_added, rest.size() - i); n > 0 && best == 0; --n) {
      auto it = impl_->added.find(rest.substr(i, n));
      if (it != impl_->added.end()) {
        best = n;
        id = it->second;
      }
    }
    if (best == 0) continue;
    if (i > segment) impl_->EncodeSegment(rest.substr(segment, i - segment), &out);
    out.push_back(id);
    segment = i + best;
    i = segment - 1;
  }
  if (segment < rest.size()) impl_->EncodeSegment(rest.substr(segment), &out);
  return out;
}

std::string BpeTokenizer::Decode(const std::vector<uint32_t>& ids) const {
  std::string bytes;
  for (uint32_t id : ids) {
    if (id >= impl_->id_to_token.size()) continue;
    const std::string& token = impl_->id_to_token[id];
    if (impl_->is_added[id]) {
      bytes += token;
      continue;
    }
    // Each character of a byte-level token stands for one byte.
    for (size_t i = 0; i < token.size();) {
      const auto b = static_cast<uint8_t>(token[i]);
      const int len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
      uint32_t cp = len == 1 ? b : b & (0xFF >> (len + 1));
      for (int k = 1; k < len && i + k < token.size(); ++k) {
        cp = (cp << 6) | (static_cast<uint8_t>(token[i + k]) & 0x3F);
      }
      auto it = impl_->codepoint_byte.find(cp);
      if (it != impl_->codepoint_byte.end()) {
        bytes.push_back(static_cast<char>(it->second));
      } else {
        bytes.append(token, i, len);
      }
      i += len;
    }
  }
  return SanitizeUtf8(bytes);
}

int64_t BpeTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }
int64_t BpeTokenizer::eos_id() const { return impl_->eos; }

std::optional<uint32_t> BpeTokenizer::TokenId(std::string_view token) const {
  if (auto it = impl_->added.find(token); it != impl_->added.end()) return it->second;
  if (auto it = impl_->vocab.find(std::string(token)); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

}  // namespace loom::data
