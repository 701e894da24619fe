// SFT plugins: the chat objective a reasoning-SFT job trains and evaluates with.
//
// A plugin of kind LOOM_PLUGIN_KIND_SFT turns one line of its file format into a conversation,
// a conversation into training tokens with a loss mask (which tokens are targets), and into the
// prompt a model answers at evaluation; it owns the chat template (role markers as special
// tokens after the text vocabulary), the truncation policy and the tokens that end an answer.
// The trainer owns files, packing, batching and the model. The job picks the plugin with
// data.format (default "openthoughts") and passes data.format_options as plugin options.
//
// Objects are C++ and cross the boundary like attention modules (same build stamp); every
// virtual is noexcept and reports errors through its return value.
#ifndef LOOM_API_SFT_PLUGIN_H_
#define LOOM_API_SFT_PLUGIN_H_

#include "loom/plugin_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct LoomSftSpecV1 {
  int64_t base_vocab;  // text tokens are 0 .. base_vocab - 1 (the byte tokenizer: 256)
  const LoomOption* options;
  size_t num_options;
  // The tokenizer's own chat tokens, each < base_vocab, or -1 where it has none (ABI 7): with
  // header_start, header_end and turn_end set, a plugin renders the tokenizer's template (Llama
  // 3: <|start_header_id|> role <|end_header_id|> "\n\n" text <|eot_id|>) instead of adding its
  // own markers after base_vocab. begin_of_text is optional.
  int64_t header_start, header_end, turn_end, begin_of_text;
} LoomSftSpecV1;

#ifdef __cplusplus
}  // extern "C"

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

enum class ChatRole { kSystem, kUser, kAssistant };

struct ChatTurn {
  ChatRole role;
  std::string text;
};

struct ChatConversation {
  std::vector<ChatTurn> turns;
  int64_t line = 0;  // 1-based line in its file (0 when generated)
};

struct EncodedConversation {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> loss_mask;  // 1 where the token is a training target
};

using TextEncoder = std::function<std::vector<uint32_t>(std::string_view)>;

class SftObjective {
 public:
  virtual ~SftObjective() = default;
  // Vocabulary a model needs: the text vocabulary plus the template's special tokens.
  virtual int64_t VocabSize() const noexcept = 0;
  // One line of the file format. false: *error says what is wrong, with the line number.
  virtual bool ParseLine(std::string_view line, int64_t line_no, ChatConversation* out,
                         std::string* error) const noexcept = 0;
  // Training tokens and targets of a whole conversation.
  virtual EncodedConversation Encode(const ChatConversation& c,
                                     const TextEncoder& encode) const noexcept = 0;
  // The tokens a model continues to answer the conversation's last user turn (a trailing
  // assistant turn is left out).
  virtual std::vector<uint32_t> Prompt(const ChatConversation& c,
                                       const TextEncoder& encode) const noexcept = 0;
  // Tokens that end a generated answer.
  virtual std::vector<uint32_t> StopTokens() const noexcept = 0;
  // Fits an encoded conversation into max_len tokens; false: drop it (nothing left to learn).
  virtual bool Truncate(EncodedConversation* e, int64_t max_len) const noexcept = 0;
};

using SftObjectivePtr = std::shared_ptr<SftObjective>;

// What an SFT plugin's create() stores in *out.
struct SftObjectiveHolder {
  SftObjectivePtr objective;
};

// Thrown by SFT plugin factories for a bad option; becomes LOOM_INVALID_ARGUMENT at the boundary.
// The message must name the field.
class InvalidSftSpec : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace loom

// Defines the entry point of an SFT plugin. FACTORY: `loom::SftObjectivePtr(const
// LoomSftSpecV1&)`, may throw loom::InvalidSftSpec.
#define LOOM_SFT_PLUGIN(NAME, DESCRIPTION, FACTORY)                          \
  LOOM_DEFINE_PLUGIN(NAME, DESCRIPTION, LOOM_PLUGIN_KIND_SFT, LoomSftSpecV1, \
                     ::loom::SftObjectiveHolder, ::loom::InvalidSftSpec, FACTORY)

#endif  // __cplusplus

#endif  // LOOM_API_SFT_PLUGIN_H_
