#include "worker/trainer/reasoning_eval.h"

#include <openssl/evp.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "storage/confined_files.h"

namespace loom::trainer {
namespace {

uint64_t SampleSeed(uint64_t seed, size_t problem, int64_t sample) {
  return seed * 0x9e3779b97f4a7c15ULL ^ (static_cast<uint64_t>(problem) << 20) ^
         static_cast<uint64_t>(sample);
}

std::string DecodeChatBytes(const std::vector<uint32_t>& tokens) {
  std::string text;
  for (uint32_t t : tokens)
    if (t < 256) text += static_cast<char>(t);  // role markers have no text
  return text;
}

absl::StatusOr<std::vector<EvalProblem>> ReadProblemFile(const v1::ReasoningEvalConfig& c,
                                                         const SftObjective& objective) {
  auto stream = storage::OpenConfinedStream(c.path());
  if (!stream.ok())
    return absl::Status(stream.status().code(),
                        absl::StrCat("reasoning_eval.path: ", stream.status().message()));
  std::istream& in = **stream;
  std::vector<EvalProblem> out;
  std::string line;
  int64_t line_no = 0;
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(c.path(), ":", line_no, ": ", why));
  };
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    EvalProblem p;
    p.id = absl::StrCat("line-", line_no);
    if (c.source() == "chat") {
      data::Conversation parsed;
      std::string error;
      if (!objective.ParseLine(line, line_no, &parsed, &error))
        return absl::InvalidArgumentError(absl::StrCat(c.path(), ": ", error));
      std::optional<data::Conversation> conv = std::move(parsed);
      if (conv->turns.empty() || conv->turns.back().role != data::Role::kAssistant)
        return bad("the last turn must be the assistant's (it holds the reference answer)");
      auto ref = data::ExtractAnswer(conv->turns.back().text, c.answer_style());
      if (!ref) return bad(absl::StrCat("the assistant turn has no ", c.answer_style(), " answer"));
      p.reference = *ref;
      conv->turns.pop_back();
      p.prompt = *std::move(conv);
    } else {
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
      const char* question = c.source() == "gsm8k" ? "question" : "problem";
      if (!j.contains(question) || !j[question].is_string() ||
          j[question].get<std::string>().empty())
        return bad(absl::StrCat("\"", question, "\" must be a non-empty string"));
      if (!j.contains("answer") || !j["answer"].is_string())
        return bad("\"answer\" must be a string");
      const std::string answer = j["answer"].get<std::string>();
      if (c.source() == "gsm8k") {
        auto ref = data::ExtractAnswer(answer, "gsm8k");
        if (!ref) return bad("\"answer\" has no '#### <answer>' line");
        p.reference = *ref;
      } else {
        if (answer.empty()) return bad("\"answer\" is empty");
        p.reference = answer;
      }
      if (j.contains("unique_id") && j["unique_id"].is_string())
        p.id = j["unique_id"].get<std::string>();
      p.prompt.turns.push_back({data::Role::kUser, j[question].get<std::string>()});
      p.prompt.line = line_no;
    }
    out.push_back(std::move(p));
    if (c.problems() > 0 && static_cast<int64_t>(out.size()) >= c.problems()) break;
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(c.path(), ": no problems"));
  return out;
}

// The first 16 hex digits of SHA-256 over the problem ids in order, one per line: what tells a
// sweep that two evaluations scored the same problems.
std::string ProblemSetHash(const std::vector<ProblemOutcome>& outcomes) {
  std::string ids;
  for (const ProblemOutcome& o : outcomes) absl::StrAppend(&ids, o.id, "\n");
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_Digest(ids.data(), ids.size(), digest, &size, EVP_sha256(), nullptr) != 1) return "";
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), size))
      .substr(0, 16);
}

// Per problem, in order: what a sweep's report pairs by problem (EvalResult.problem_*).
void AddProblemScores(const std::vector<ProblemOutcome>& outcomes, v1::ReasoningEvalEvent& e) {
  for (const ProblemOutcome& o : outcomes) {
    e.add_problem_samples(static_cast<int32_t>(o.answers.size()));
    e.add_problem_correct(static_cast<int32_t>(o.correct));
    e.add_problem_answered(static_cast<int32_t>(std::count_if(
        o.answers.begin(), o.answers.end(), [](const auto& a) { return a.has_value(); })));
    e.add_problem_majority_correct(o.majority_correct);
  }
  e.set_problem_set(ProblemSetHash(outcomes));
}

}  // namespace

absl::StatusOr<std::vector<EvalProblem>> LoadEvalProblems(const v1::ReasoningEvalConfig& c,
                                                          const SftObjective& objective) {
  if (c.source() != "builtin") return ReadProblemFile(c, objective);
  std::vector<EvalProblem> out;
  // A fixed seed: every checkpoint of every job is scored on the same held-out problems.
  data::ReasoningOptions difficulty;
  if (!c.ops().empty()) {
    auto parsed = data::ParseReasoningOps(c.ops());
    if (!parsed.ok())
      return absl::InvalidArgumentError(absl::StrCat("reasoning_eval.", parsed.status().message()));
    difficulty = *parsed;
  }
  const auto examples = data::GenerateReasoning(c.task(), c.problems(), 20260211,
                                                data::ReasoningSplit::kHeldOut, difficulty);
  for (size_t i = 0; i < examples.size(); ++i) {
    EvalProblem p;
    p.id = absl::StrCat("builtin-", i);
    p.prompt = examples[i].conversation;
    p.prompt.turns.pop_back();  // drop the reference solution
    p.reference = examples[i].answer;
    out.push_back(std::move(p));
  }
  return out;
}

absl::StatusOr<ReasoningEvalSummary> RunReasoningEval(Transformer& model,
                                                      const std::vector<EvalProblem>& problems,
                                                      const v1::ReasoningEvalConfig& c,
                                                      const SftObjective& objective,
                                                      const data::Tokenizer& tokenizer) {
  const v1::GenerationConfig& g = c.generation();
  if (model.config().vocab_size() < objective.VocabSize()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reasoning eval: model.vocab_size ", model.config().vocab_size(),
                     " has no room for the chat template's ", objective.VocabSize(), " tokens"));
  }
  SamplingOptions o;
  o.greedy = g.greedy();
  o.temperature = g.temperature();
  o.top_p = g.top_p();
  o.max_new_tokens = g.max_new_tokens();
  o.stop.assign(g.stop().begin(), g.stop().end());
  o.stop_tokens = objective.StopTokens();
  o.batch = g.batch();
  ReasoningEvalSummary s;
  s.task = c.source() == "builtin" ? absl::StrCat("builtin:", c.task()) : c.source();
  s.samples = c.samples();
  std::vector<GenerationRequest> requests;
  std::vector<size_t> kept;  // problems whose prompt fits
  for (size_t i = 0; i < problems.size(); ++i) {
    std::vector<uint32_t> prompt = objective.Prompt(
        problems[i].prompt, [&](std::string_view text) { return tokenizer.Encode(text); });
    if (static_cast<int64_t>(prompt.size()) >= model.config().max_seq_len()) {
      ++s.skipped;
      continue;
    }
    kept.push_back(i);
    for (int64_t k = 0; k < c.samples(); ++k)
      requests.push_back({prompt, SampleSeed(g.seed(), i, k)});
  }
  if (kept.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reasoning eval: no problem's prompt fits model.max_seq_len ",
                     model.config().max_seq_len()));
  }
  // Answers as text: bytes as they are for the byte tokenizer (its markers have no text), else
  // the tokenizer's decoding of everything but the chat's stop and marker tokens.
  const std::set<uint32_t> special(o.stop_tokens.begin(), o.stop_tokens.end());
  const TokenDecoder decode = [&](const std::vector<uint32_t>& ids) {
    if (tokenizer.Describe() == "byte") return DecodeChatBytes(ids);
    std::vector<uint32_t> text;
    for (uint32_t id : ids) {
      if (id < tokenizer.vocab_size() && !special.count(id)) text.push_back(id);
    }
    return tokenizer.Decode(text);
  };
  auto generations = Generate(model, requests, o, decode, &s.generation);
  if (!generations.ok()) return generations.status();
  std::vector<EvalProblem> scored;
  std::vector<std::vector<std::string>> completions;
  for (size_t n = 0; n < kept.size(); ++n) {
    scored.push_back(problems[kept[n]]);
    completions.emplace_back();
    for (int64_t k = 0; k < c.samples(); ++k)
      completions.back().push_back((*generations)[n * static_cast<size_t>(c.samples()) + k].text);
  }
  ReasoningEvalSummary scores = ScoreCompletions(scored, completions, c.answer_style());
  scores.task = s.task;
  scores.skipped = s.skipped;
  scores.generation = s.generation;
  return scores;
}

ReasoningEvalSummary ScoreCompletions(const std::vector<EvalProblem>& problems,
                                      const std::vector<std::vector<std::string>>& completions,
                                      const std::string& style) {
  ReasoningEvalSummary s;
  int64_t answered = 0, total_samples = 0;
  double pass = 0, maj = 0;
  for (size_t n = 0; n < problems.size(); ++n) {
    const EvalProblem& p = problems[n];
    ProblemOutcome out;
    out.id = p.id;
    out.reference = p.reference;
    for (const std::string& text : completions[n]) {
      auto answer = data::ExtractAnswer(text, style);
      answered += answer.has_value();
      ++total_samples;
      out.correct += answer && data::AnswersMatch(*answer, p.reference);
      out.texts.push_back(text);
      out.answers.push_back(std::move(answer));
    }
    out.majority = data::MajorityVote(out.answers);
    out.majority_correct = out.majority && data::AnswersMatch(*out.majority, p.reference);
    if (!completions[n].empty())
      pass += static_cast<double>(out.correct) / static_cast<double>(completions[n].size());
    maj += out.majority_correct ? 1 : 0;
    s.samples = std::max<int64_t>(s.samples, static_cast<int64_t>(completions[n].size()));
    s.outcomes.push_back(std::move(out));
  }
  s.problems = static_cast<int64_t>(problems.size());
  if (s.problems > 0) {
    s.pass_at_1 = pass / static_cast<double>(s.problems);
    s.maj_at_k = maj / static_cast<double>(s.problems);
  }
  if (total_samples > 0)
    s.answered = static_cast<double>(answered) / static_cast<double>(total_samples);
  return s;
}

std::string ReasoningEvalJson(const ReasoningEvalSummary& s, int64_t step, bool details) {
  nlohmann::json j = {{"event", "reasoning_eval"},
                      {"step", step},
                      {"task", s.task},
                      {"problems", s.problems},
                      {"skipped", s.skipped},
                      {"samples", s.samples},
                      {"pass_at_1", s.pass_at_1},
                      {"maj_at_k", s.maj_at_k},
                      {"answered", s.answered},
                      {"generated_tokens", s.generation.generated_tokens},
                      {"seconds", s.generation.seconds},
                      {"peak_cache_bytes", s.generation.peak_cache_bytes}};
  if (details) {
    nlohmann::json list = nlohmann::json::array();
    for (const ProblemOutcome& o : s.outcomes) {
      nlohmann::json answers = nlohmann::json::array();
      for (const auto& a : o.answers) answers.push_back(a ? nlohmann::json(*a) : nlohmann::json());
      list.push_back({{"id", o.id},
                      {"reference", o.reference},
                      {"answers", answers},
                      {"majority", o.majority ? nlohmann::json(*o.majority) : nlohmann::json()},
                      {"correct", o.correct},
                      {"majority_correct", o.majority_correct},
                      {"completions", o.texts}});
    }
    j["details"] = list;
  }
  // Replace invalid UTF-8 (sampled bytes) instead of throwing.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

v1::TrainerEvent ReasoningEvalEvent(const ReasoningEvalSummary& s, int64_t step,
                                    const std::string& details) {
  v1::TrainerEvent event;
  v1::ReasoningEvalEvent& e = *event.mutable_reasoning_eval();
  e.set_step(step);
  e.set_task(s.task);
  e.set_problems(s.problems);
  e.set_skipped(s.skipped);
  e.set_samples(static_cast<int32_t>(s.samples));
  e.set_pass_at_1(s.pass_at_1);
  e.set_maj_at_k(s.maj_at_k);
  e.set_answered(s.answered);
  e.set_generated_tokens(s.generation.generated_tokens);
  e.set_seconds(s.generation.seconds);
  e.set_peak_cache_bytes(s.generation.peak_cache_bytes);
  if (!details.empty()) e.set_details(details);
  AddProblemScores(s.outcomes, e);
  return event;
}

}  // namespace loom::trainer
