// The `openthoughts` SFT plugin: OpenThoughts-style JSONL ({"system", "conversations": [{"from",
// "value"}]}) and the common {"messages": [{"role", "content"}]} form, Loom's chat template
// (<|system|> <|user|> <|assistant|> <|end|> after the text vocabulary) or the tokenizer's own
// (Llama 3's headers, when the job's tokenizer.json has them), assistant-only targets.
// The format functions live in data/chat.h (also used by the trainer's evaluation loaders).
//
// Options:
//   loss: all_assistant (default: every assistant turn and its <|end|>) | last_assistant (only
//     the final answer of multi-turn conversations);
//   truncate: keep_head (default: keep the first max_len tokens, so the answer's tail goes) |
//     drop (leave out conversations longer than max_len);
//   system_prompt: text given as the system turn to conversations that have none.
#include <map>
#include <string>

#include "data/chat.h"
#include "loom/sft_plugin.h"
#include "loom/torch_compat.h"

namespace loom::sft {
namespace {

class OpenThoughtsObjective : public SftObjective {
 public:
  explicit OpenThoughtsObjective(const LoomSftSpecV1& spec) {
    if (spec.base_vocab < 1 || spec.base_vocab > (int64_t{1} << 30))
      throw InvalidSftSpec("openthoughts: base_vocab: must be in [1, 2^30]");
    chat_.base_vocab = spec.base_vocab;
    if (spec.header_start >= 0 || spec.header_end >= 0 || spec.turn_end >= 0) {
      for (int64_t id : {spec.header_start, spec.header_end, spec.turn_end}) {
        if (id < 0 || id >= spec.base_vocab)
          throw InvalidSftSpec(
              "openthoughts: chat tokens: header and turn-end ids must all be "
              "set, below base_vocab");
      }
      chat_.header_start = spec.header_start;
      chat_.header_end = spec.header_end;
      chat_.turn_end = spec.turn_end;
      chat_.begin_of_text = spec.begin_of_text < spec.base_vocab ? spec.begin_of_text : -1;
    }
    std::map<std::string, std::string> options;
    for (size_t i = 0; i < spec.num_options; ++i) {
      const LoomOption& o = spec.options[i];
      if (o.key == nullptr || o.value == nullptr)
        throw InvalidSftSpec("openthoughts: options: null key or value");
      options[o.key] = o.value;
    }
    auto take = [&](const std::string& key, const std::string& fallback,
                    std::initializer_list<const char*> choices) {
      auto it = options.find(key);
      if (it == options.end()) return fallback;
      const std::string value = it->second;
      options.erase(it);
      if (choices.size() == 0) return value;
      std::string allowed;
      for (const char* c : choices) {
        if (value == c) return value;
        allowed += allowed.empty() ? c : std::string(" | ") + c;
      }
      throw InvalidSftSpec("openthoughts: format_options." + key + ": '" + value +
                           "' is not one of " + allowed);
    };
    last_only_ =
        take("loss", "all_assistant", {"all_assistant", "last_assistant"}) == "last_assistant";
    drop_long_ = take("truncate", "keep_head", {"keep_head", "drop"}) == "drop";
    system_prompt_ = take("system_prompt", "", {});
    if (!options.empty())
      throw InvalidSftSpec("openthoughts: format_options." + options.begin()->first +
                           ": unknown option");
  }

  int64_t VocabSize() const noexcept override { return chat_.vocab_size(); }

  bool ParseLine(std::string_view line, int64_t line_no, ChatConversation* out,
                 std::string* error) const noexcept override {
    try {
      auto c = data::ParseChatLine(line, line_no);
      if (!c.ok()) {
        *error = std::string(c.status().message());
        return false;
      }
      *out = *std::move(c);
      return true;
    } catch (const std::exception& e) {
      *error = "line " + std::to_string(line_no) + ": " + e.what();
      return false;
    }
  }

  EncodedConversation Encode(const ChatConversation& c,
                             const TextEncoder& encode) const noexcept override {
    try {
      const ChatConversation full = WithSystem(c);
      std::vector<size_t> starts;
      EncodedConversation e = data::EncodeChat(full, chat_, encode, &starts);
      if (last_only_) {  // keep the targets of the final assistant turn only
        size_t last = e.tokens.size();
        for (size_t i = full.turns.size(); i-- > 0;) {
          if (full.turns[i].role == ChatRole::kAssistant) {
            last = starts[i];
            break;
          }
        }
        for (size_t i = 0; i < last && i < e.loss_mask.size(); ++i) e.loss_mask[i] = 0;
      }
      return e;
    } catch (...) {
      return {};  // out of memory: an empty example trains on nothing
    }
  }

  std::vector<uint32_t> Prompt(const ChatConversation& c,
                               const TextEncoder& encode) const noexcept override {
    try {
      return data::EncodePrompt(WithSystem(c), chat_, encode);
    } catch (...) {
      return {};
    }
  }

  std::vector<uint32_t> StopTokens() const noexcept override {
    try {
      return chat_.stop_tokens();
    } catch (...) {
      return {};
    }
  }

  bool Truncate(EncodedConversation* e, int64_t max_len) const noexcept override {
    if (drop_long_ && static_cast<int64_t>(e->tokens.size()) > max_len) return false;
    auto kept = data::Truncate(*e, max_len);
    if (!kept) return false;
    *e = *std::move(kept);
    return true;
  }

 private:
  ChatConversation WithSystem(const ChatConversation& c) const {
    if (system_prompt_.empty() || (!c.turns.empty() && c.turns.front().role == ChatRole::kSystem))
      return c;
    ChatConversation out = c;
    out.turns.insert(out.turns.begin(), {ChatRole::kSystem, system_prompt_});
    return out;
  }

  data::ChatTemplate chat_;
  bool last_only_ = false, drop_long_ = false;
  std::string system_prompt_;
};

}  // namespace
}  // namespace loom::sft

LOOM_SFT_PLUGIN("openthoughts",
                "OpenThoughts / messages JSONL, Loom chat template, assistant-only loss",
                [](const LoomSftSpecV1& spec) -> loom::SftObjectivePtr {
                  return std::make_shared<loom::sft::OpenThoughtsObjective>(spec);
                })
