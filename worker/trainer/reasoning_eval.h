// Reasoning evaluation (docs/sft.md): k sampled answers per problem with the KV cache, answers
// extracted GSM8K-style (#### x) or MATH-style (\boxed{x}), Pass@1 (mean fraction of correct
// samples) and Maj@k (the majority answer is correct). Problems come from the built-in
// generator's held-out split or from GSM8K / MATH-500 / chat JSONL files.
#ifndef LOOM_WORKER_TRAINER_REASONING_EVAL_H_
#define LOOM_WORKER_TRAINER_REASONING_EVAL_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "data/chat.h"
#include "data/tokenizer.h"
#include "loom/sft_plugin.h"
#include "loom/v1/events.pb.h"
#include "loom/v1/job.pb.h"
#include "worker/trainer/generate.h"
#include "worker/trainer/model.h"

namespace loom::trainer {

struct EvalProblem {
  std::string id;             // "builtin-7", "line-12"
  data::Conversation prompt;  // system / user turns; the model answers as the assistant
  std::string reference;      // the reference answer
};

// Problems for a resolved config. Files: gsm8k {"question", "answer": "... #### 42"}; math500
// {"problem", "answer"}; chat (data/chat.h formats; the reference is extracted from the last
// assistant turn with answer_style). A bad line fails with its line number. problems > 0 keeps
// the first that many.
// Chat files are parsed by the SFT objective plugin.
absl::StatusOr<std::vector<EvalProblem>> LoadEvalProblems(const v1::ReasoningEvalConfig& config,
                                                          const SftObjective& objective);

struct ProblemOutcome {
  std::string id, reference;
  std::vector<std::string> texts;                   // sampled completions
  std::vector<std::optional<std::string>> answers;  // extracted (nullopt: unanswerable)
  std::optional<std::string> majority;
  int64_t correct = 0;  // samples whose answer matches
  bool majority_correct = false;
};

struct ReasoningEvalSummary {
  std::string task;                                // "builtin:mixed", "gsm8k", ...
  int64_t problems = 0, samples = 0, skipped = 0;  // skipped: prompt longer than max_seq_len
  double pass_at_1 = 0, maj_at_k = 0, answered = 0;
  GenerationStats generation;
  std::vector<ProblemOutcome> outcomes;
};

// Scores completions[i][k] (sample k of problems[i]) with answer_style: Pass@1 is the mean over
// problems of the fraction of correct samples; Maj@k the fraction of problems whose majority
// answer (data::MajorityVote: unanswerable samples do not vote, ties go to the answer that
// reached the top count first) matches; answered the fraction of samples with an answer.
ReasoningEvalSummary ScoreCompletions(const std::vector<EvalProblem>& problems,
                                      const std::vector<std::vector<std::string>>& completions,
                                      const std::string& answer_style);

// Prompts and stop tokens come from the SFT objective plugin; text goes through the job's
// tokenizer (job_tokenizer.h), with the chat's special tokens left out of the answers.
absl::StatusOr<ReasoningEvalSummary> RunReasoningEval(Transformer& model,
                                                      const std::vector<EvalProblem>& problems,
                                                      const v1::ReasoningEvalConfig& config,
                                                      const SftObjective& objective,
                                                      const data::Tokenizer& tokenizer);

// The summary as one JSON object; with details, every problem's samples and votes.
std::string ReasoningEvalJson(const ReasoningEvalSummary& s, int64_t step, bool details);
// The event-log record of an evaluation (details: the file with every sample, "" when none).
v1::TrainerEvent ReasoningEvalEvent(const ReasoningEvalSummary& s, int64_t step,
                                    const std::string& details);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_REASONING_EVAL_H_
