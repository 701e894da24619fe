// Conversations for reasoning SFT (issue: OpenThoughts SFT): reading OpenThoughts-style and
// "messages"-style JSONL, the chat template with role markers as special tokens, the
// assistant-only loss mask, the truncation policy, packing with segment ids, a built-in
// generator of OpenThoughts-format reasoning data, answer extraction and majority voting.
// No LibTorch: the trainer and the evaluation tools both use it.
#ifndef LOOM_DATA_CHAT_H_
#define LOOM_DATA_CHAT_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "loom/sft_plugin.h"

namespace loom::data {

// The conversation types are the SFT plugin ABI's (loom/sft_plugin.h): the built-in objective
// plugin (plugins/sft/openthoughts) is implemented with the functions below.
using Role = ChatRole;
using Turn = ChatTurn;
using Conversation = ChatConversation;
using EncodedChat = EncodedConversation;
using loom::TextEncoder;

// One JSONL line: {"system": "...", "conversations": [{"from": "user"|"assistant"|"human"|"gpt",
// "value": "..."}]} (OpenThoughts) or {"messages": [{"role": "system"|"user"|"assistant",
// "content": "..."}]}. Errors say what is wrong and carry the line number.
absl::StatusOr<Conversation> ParseChatLine(std::string_view line, int64_t line_no);

struct ChatReadReport {
  int64_t lines = 0, conversations = 0, blank = 0, skipped = 0;
  std::vector<std::string> errors;  // the first 20 skipped lines' errors
};

// Reads a JSONL file line by line with `parse` (default: ParseChatLine). skip_malformed: bad
// lines are counted and skipped; otherwise the first one fails the read with its line number.
using ChatLineParser = std::function<absl::StatusOr<Conversation>(std::string_view, int64_t)>;
absl::StatusOr<std::vector<Conversation>> ReadChatJsonl(const std::string& path,
                                                        bool skip_malformed, ChatReadReport* report,
                                                        const ChatLineParser& parse = {});

// The chat template. Two forms:
//
// Loom's own (the byte tokenizer, and any tokenizer without chat tokens): role markers are
// special tokens after the base vocabulary,
//   <|system|> = base, <|user|> = base + 1, <|assistant|> = base + 2, <|end|> = base + 3,
// and a conversation renders as  [<|system|> text <|end|>] (<|user|> text <|end|> <|assistant|>
// text <|end|>)...
//
// The tokenizer's own (a tokenizer.json with <|start_header_id|>, <|end_header_id|> and
// <|eot_id|>: Llama 3's template, as its tokenizer_config.json's chat_template renders it):
//   [<|begin_of_text|>] (<|start_header_id|> role <|end_header_id|> "\n\n" trim(text)
//   <|eot_id|>)...
// with the role written as text ("system", "user", "assistant") and no tokens added to the
// vocabulary. A prompt ends with the assistant's header.
//
// Either way the loss covers exactly the assistant's text tokens and its end token (so the
// model learns to stop); role markers, headers, system and user tokens are never scored.
struct ChatTemplate {
  int64_t base_vocab = 256;
  // The tokenizer's chat tokens (all three set, or none: -1); begin_of_text is optional.
  int64_t header_start = -1, header_end = -1, turn_end = -1, begin_of_text = -1;
  bool headers() const { return header_start >= 0 && header_end >= 0 && turn_end >= 0; }
  uint32_t system() const { return static_cast<uint32_t>(base_vocab); }
  uint32_t user() const { return static_cast<uint32_t>(base_vocab + 1); }
  uint32_t assistant() const { return static_cast<uint32_t>(base_vocab + 2); }
  // What ends a turn: <|end|> or <|eot_id|>.
  uint32_t end() const { return static_cast<uint32_t>(headers() ? turn_end : base_vocab + 3); }
  int64_t vocab_size() const { return headers() ? base_vocab : base_vocab + 4; }
  // Tokens that end a generated answer: the turn end, and anything that starts a new turn.
  std::vector<uint32_t> stop_tokens() const;
};

// The template for a tokenizer: its own chat tokens when `token_id` finds all three header
// tokens, else Loom's markers after `base_vocab`.
ChatTemplate ChatTemplateFor(
    int64_t base_vocab, const std::function<std::optional<uint32_t>(std::string_view)>& token_id);

// `turn_starts` (optional): where each turn's marker or header begins in the tokens.
EncodedChat EncodeChat(const Conversation& c, const ChatTemplate& t, const TextEncoder& encode,
                       std::vector<size_t>* turn_starts = nullptr);

// The prompt for generation: everything up to and including the assistant's marker (or header)
// after the last turn (a trailing assistant turn, if any, is dropped).
std::vector<uint32_t> EncodePrompt(const Conversation& c, const ChatTemplate& t,
                                   const TextEncoder& encode);

// Truncation policy for sequences longer than max_len tokens: keep the first max_len tokens
// (the prompt comes first, so the answer's tail is what is lost). An example whose scored
// tokens all fall beyond max_len is dropped (nullopt): it would train on nothing.
std::optional<EncodedChat> Truncate(EncodedChat e, int64_t max_len);

// Packing: examples are laid end to end into rows of seq_len tokens; an example that does not
// fit in the rest of a row starts the next one (the rest is padding with mask 0 and segment 0).
// Segment ids (1, 2, ... per row) tell attention which tokens may see each other: block-diagonal
// masking keeps packed examples from attending to each other.
struct PackedRow {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> loss_mask;
  std::vector<int32_t> segment;  // 0 = padding
};
std::vector<PackedRow> Pack(const std::vector<EncodedChat>& examples, int64_t seq_len,
                            uint32_t pad);

// Built-in OpenThoughts-format reasoning data (no download): multi-step arithmetic ("Compute
// ((3 + 4) * 2) - 5.") and relation chains ("a is the parent of b, ... Who is the grandparent
// of d?"), with the assistant's answer as "<|begin_of_thought|> steps <|end_of_thought|>
// <|begin_of_solution|> ... #### ANSWER <|end_of_solution|>". Deterministic for a seed.
struct ReasoningExample {
  Conversation conversation;
  std::string answer;
};
// Problems are split by a hash of their prompt text: one in eight belongs to the held-out split
// that evaluation draws from, the rest to the training split, so no seed makes an evaluation
// problem appear in training data.
enum class ReasoningSplit { kTrain, kHeldOut };
// Difficulty: arithmetic problems chain min_ops..max_ops operations (default 2..4); relation
// questions go min_ops..max_ops generations up in chains of min_ops + 1 .. max_ops + 2 people
// (default: 2 .. chain length - 1 generations in chains of 3..6).
struct ReasoningOptions {
  int min_ops = 2, max_ops = 4;
  bool relation_hops_set = false;  // ParseReasoningOps sets it: ops also bounds relation hops
};
// "N" or "A-B" with 1 <= A <= B <= 8 (task option `ops`); errors name the option.
absl::StatusOr<ReasoningOptions> ParseReasoningOps(std::string_view text);
std::vector<ReasoningExample> GenerateReasoning(const std::string& kind, int64_t count,
                                                uint64_t seed,
                                                ReasoningSplit split = ReasoningSplit::kTrain,
                                                ReasoningOptions options = {});
bool IsHeldOutProblem(std::string_view prompt);

// Answer extraction. gsm8k: the text after the last "####" (commas removed, trimmed);
// math: the content of the last \boxed{...} (nested braces kept); builtin: gsm8k's rule.
// nullopt when the text has no answer (an unanswerable sample).
std::optional<std::string> ExtractAnswer(std::string_view text, std::string_view style);

// Whether an extracted answer equals the reference: both are normalised (whitespace removed,
// surrounding $...$ and a trailing period dropped, thousands commas removed); two numbers compare
// numerically (relative 1e-9, so "42.0" = "42"), anything else as exact text.
bool AnswersMatch(std::string_view answer, std::string_view reference);

// Majority vote over sampled answers, counted per normalised answer (as AnswersMatch, so "42"
// and "42.0" are one vote); unanswerable samples (nullopt) do not vote; the most
// frequent answer wins; a tie goes to the answer that reached the top count first in sample
// order (deterministic). nullopt when no sample has an answer.
std::optional<std::string> MajorityVote(const std::vector<std::optional<std::string>>& answers);

}  // namespace loom::data

#endif  // LOOM_DATA_CHAT_H_
