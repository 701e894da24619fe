#include "worker/trainer/batch_source.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "data/task_spec.h"
#include "data/token_shards.h"
#include "loom/spec.h"
#include "worker/trainer/plugin_factory.h"

namespace loom::trainer {
namespace {

// Held-out batches and splits are drawn from seeds derived from data.seed, so they are the same
// for every run of the job.
constexpr uint64_t kEvalSeedMix = 0x9e3779b97f4a7c15ULL;
constexpr uint64_t kTestSeedMix = 0xbf58476d1ce4e5b9ULL;
constexpr uint64_t kEpochOrderSeedMix = 0x94d049bb133111ebULL;

// A slice [begin, begin + length) of a dataset's token stream.
class ShardSlice : public TokenStream {
 public:
  ShardSlice(std::shared_ptr<const data::TokenShards> shards, int64_t begin, int64_t length)
      : shards_(std::move(shards)), begin_(begin), length_(length) {}
  int64_t size() const override { return length_; }
  void Copy(int64_t start, int64_t n, int64_t* out) const override {
    shards_->Copy(begin_ + start, n, out);
  }

 private:
  std::shared_ptr<const data::TokenShards> shards_;
  int64_t begin_, length_;
};

// data.source task: fresh samples, or fixed splits (App. D) with epochs over the train split.
absl::StatusOr<TrainingData> TaskData(const v1::JobSpec& spec, const LogFn& log) {
  const auto& d = spec.data();
  LOOM_ASSIGN_OR_RETURN(data::SpecTasks tasks, data::MakeSpecTasks(spec));
  std::shared_ptr<const data::Task> task = std::move(tasks.task);
  const data::TaskInfo& info = task->info();
  const uint64_t eval_seed = d.seed() ^ kEvalSeedMix;
  TrainingData out;
  if (d.has_splits()) {
    // Train from data.seed, validation from the held-out seed, test from a third derivation; the
    // epoch order from a fourth.
    const auto& sp = d.splits();
    auto train = MakeTaskSplit(*task, sp.train(), d.seed());
    out.validation = MakeTaskSplit(*task, sp.validation(), eval_seed);
    out.test = MakeTaskSplit(*task, sp.test(), d.seed() ^ kTestSeedMix);
    out.train = std::make_unique<SplitSampler>(train, d.seed() ^ kEpochOrderSeedMix);
    log(absl::StrCat("data: ", info.name, " splits of ", sp.train(), " / ", sp.validation(), " / ",
                     sp.test(), " examples (train / validation / test)"));
  } else {
    out.train = std::make_unique<TaskSampler>(task, d.seed());
  }
  out.make_eval = [task, eval_seed] { return std::make_unique<TaskSampler>(task, eval_seed); };
  for (auto& [length, at] : tasks.at_lengths) {
    std::shared_ptr<const data::Task> sized = std::move(at);
    out.length_evals.emplace_back(
        length, [sized, eval_seed] { return std::make_unique<TaskSampler>(sized, eval_seed); });
  }
  return out;
}

// data.source corpus: the generated corpus through the job's tokenizer, and a separate one held
// out.
absl::StatusOr<std::pair<std::shared_ptr<const TokenStream>, std::shared_ptr<const TokenStream>>>
CorpusStreams(const v1::JobSpec& spec, const data::Tokenizer& tokenizer) {
  const auto& d = spec.data();
  const int64_t seq_len = spec.seq_len();
  if (tokenizer.vocab_size() > spec.model().vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.vocab_size: ", spec.model().vocab_size(), " is smaller than the tokenizer's ",
        tokenizer.vocab_size(), " (", tokenizer.Describe(), ")"));
  }
  auto tokens = [&tokenizer](const std::string& text) {
    const std::vector<uint32_t> ids = tokenizer.Encode(text);
    return std::make_shared<VectorTokenStream>(std::vector<int64_t>(ids.begin(), ids.end()));
  };
  std::shared_ptr<const TokenStream> train = tokens(GenerateCorpus(d.seed(), d.corpus_bytes()));
  std::shared_ptr<const TokenStream> eval =
      tokens(GenerateCorpus(d.seed() + 1000003, std::max<int64_t>(1 << 16, 8 * (seq_len + 1))));
  if (train->size() < 4 * (seq_len + 1) || eval->size() < seq_len + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.corpus_bytes: ", d.corpus_bytes(), " bytes make ", train->size(), " tokens with ",
        tokenizer.Describe(), ", too few for training windows of ", seq_len));
  }
  return std::make_pair(train, eval);
}

// data.source dataset: a loom-data dataset; its last 1% of tokens (at least one evaluation's
// worth) are held out.
absl::StatusOr<std::pair<std::shared_ptr<const TokenStream>, std::shared_ptr<const TokenStream>>>
DatasetStreams(const v1::JobSpec& spec, const LogFn& log) {
  const auto& d = spec.data();
  const int64_t seq_len = spec.seq_len();
  LOOM_ASSIGN_OR_RETURN(std::shared_ptr<data::TokenShards> shards,
                        data::TokenShards::Open(d.path()));
  if (shards->index().vocab_size > spec.model().vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat("model.vocab_size: ", spec.model().vocab_size(),
                                                   " is smaller than the dataset's vocabulary ",
                                                   shards->index().vocab_size, " (",
                                                   shards->index().tokenizer, ")"));
  }
  const int64_t total = shards->size();
  const int64_t held =
      std::max(total / 100, spec.eval().batches() * spec.micro_batch() * (seq_len + 1));
  if (total - held < 4 * (seq_len + 1)) {
    return absl::InvalidArgumentError(absl::StrCat("data.path: ", d.path(), " holds ", total,
                                                   " tokens, too few for training windows of ",
                                                   seq_len, " plus a held-out set of ", held));
  }
  log(absl::StrCat("data: ", d.path(), ": ", total, " tokens (", shards->index().tokenizer, "), ",
                   held, " held out"));
  return std::make_pair(std::make_shared<ShardSlice>(shards, 0, total - held),
                        std::make_shared<ShardSlice>(shards, total - held, held));
}

// Random windows over a token stream (corpus or dataset).
absl::StatusOr<TrainingData> StreamData(const v1::JobSpec& spec, const data::Tokenizer* tokenizer,
                                        const LogFn& log) {
  auto streams = spec.data().source() == "corpus" ? CorpusStreams(spec, *tokenizer)
                                                  : DatasetStreams(spec, log);
  if (!streams.ok()) return streams.status();
  auto [train, eval] = *std::move(streams);
  const int64_t seq_len = spec.seq_len();
  const uint64_t eval_seed = spec.data().seed() ^ kEvalSeedMix;
  TrainingData out;
  out.train = std::make_unique<WindowSampler>(train, seq_len, spec.data().seed());
  out.make_eval = [eval, seq_len, eval_seed] {
    return std::make_unique<WindowSampler>(eval, seq_len, eval_seed);
  };
  return out;
}

// The conversations of data.path (JSON lines in the objective's format) or of a generated
// reasoning task.
absl::StatusOr<std::vector<data::Conversation>> ReadConversations(const v1::JobSpec& spec,
                                                                  const SftObjective& objective,
                                                                  const LogFn& log) {
  const auto& d = spec.data();
  LOOM_ASSIGN_OR_RETURN(auto opt, data::TaskOptionsText(d));
  std::vector<data::Conversation> conversations;
  if (!d.path().empty()) {
    const bool skip = opt.count("skip_malformed") == 0 || opt["skip_malformed"] != "false";
    data::ChatReadReport report;
    auto parse = [&objective](std::string_view line,
                              int64_t line_no) -> absl::StatusOr<data::Conversation> {
      data::Conversation c;
      std::string error;
      if (!objective.ParseLine(line, line_no, &c, &error)) return absl::InvalidArgumentError(error);
      return c;
    };
    LOOM_ASSIGN_OR_RETURN(conversations, data::ReadChatJsonl(d.path(), skip, &report, parse));
    log(absl::StrCat("data: ", d.path(), ": ", report.conversations, " conversations from ",
                     report.lines, " lines (", report.skipped, " malformed skipped, ", report.blank,
                     " blank)"));
    for (const std::string& e : report.errors) log(absl::StrCat("data: skipped ", e));
    return conversations;
  }
  int64_t count = 2000;
  if (opt.count("count") &&
      (!absl::SimpleAtoi(opt["count"], &count) || count < 10 || count > 10000000)) {
    return absl::InvalidArgumentError("data.task_options.count: an integer in 10..10000000");
  }
  data::ReasoningOptions difficulty;
  if (opt.count("ops")) {
    LOOM_ASSIGN_OR_RETURN(difficulty, data::ParseReasoningOps(opt["ops"]));
  }
  for (auto& ex : data::GenerateReasoning(d.task(), count, d.seed(), data::ReasoningSplit::kTrain,
                                          difficulty)) {
    conversations.push_back(std::move(ex.conversation));
  }
  return conversations;
}

// data.source chat: conversations packed into rows; the last 5% (at least one, after a seeded
// shuffle) held out.
absl::StatusOr<TrainingData> ChatData(const v1::JobSpec& spec, const data::Tokenizer& tokenizer,
                                      const SftObjective& objective, const LogFn& log) {
  const auto& d = spec.data();
  LOOM_ASSIGN_OR_RETURN(std::vector<data::Conversation> conversations,
                        ReadConversations(spec, objective, log));
  std::mt19937_64 rng(d.seed());
  std::shuffle(conversations.begin(), conversations.end(), rng);
  const size_t held = std::max<size_t>(1, conversations.size() / 20);
  if (conversations.size() < held + 1) {
    return absl::InvalidArgumentError(
        "data.path: too few conversations to train and hold some out");
  }
  const TextEncoder encode = [&tokenizer](std::string_view text) { return tokenizer.Encode(text); };
  const int64_t row = spec.seq_len() + 1;
  auto pack = [&](size_t from, size_t to) {
    std::vector<data::EncodedChat> encoded;
    for (size_t i = from; i < to; ++i) {
      data::EncodedChat e = objective.Encode(conversations[i], encode);
      if (objective.Truncate(&e, row)) encoded.push_back(std::move(e));
    }
    return std::make_shared<const std::vector<data::PackedRow>>(data::Pack(encoded, row, 0));
  };
  auto train = pack(0, conversations.size() - held);
  auto eval = pack(conversations.size() - held, conversations.size());
  if (train->empty() || eval->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len: ", spec.seq_len(), " leaves no conversation with a scored token"));
  }
  log(absl::StrCat("data: ", conversations.size() - held, " conversations packed into ",
                   train->size(), " rows of ", row, " tokens; ", held, " held out (", eval->size(),
                   " rows)"));
  const uint64_t eval_seed = d.seed() ^ kEvalSeedMix;
  TrainingData out;
  out.train = std::make_unique<ChatSampler>(train, d.seed());
  out.make_eval = [eval, eval_seed] { return std::make_unique<ChatSampler>(eval, eval_seed); };
  return out;
}

}  // namespace

TrainBatch WindowSampler::Next(int64_t batch) {
  auto [inputs, targets] = SampleWindows(*tokens_, batch, seq_len_, rng_);
  return {inputs, targets, {}, {}, {}, {}};
}

TrainBatch ChatSampler::Next(int64_t batch) {
  const int64_t len = static_cast<int64_t>(rows_->front().tokens.size()) - 1;
  TrainBatch out;
  out.inputs = torch::empty({batch, len}, torch::kInt64);
  out.targets = torch::empty({batch, len}, torch::kInt64);
  out.positions = torch::empty({batch, len}, torch::kInt64);
  out.segments = torch::empty({batch, len}, torch::kInt64);
  std::uniform_int_distribution<size_t> pick(0, rows_->size() - 1);
  for (int64_t b = 0; b < batch; ++b) {
    const data::PackedRow& row = (*rows_)[pick(rng_)];
    int64_t* in = out.inputs[b].data_ptr<int64_t>();
    int64_t* tg = out.targets[b].data_ptr<int64_t>();
    int64_t* pos = out.positions[b].data_ptr<int64_t>();
    int64_t* seg = out.segments[b].data_ptr<int64_t>();
    for (int64_t i = 0; i < len; ++i) {
      in[i] = row.tokens[i];
      tg[i] = row.loss_mask[i + 1] ? static_cast<int64_t>(row.tokens[i + 1]) : -1;
      seg[i] = row.segment[i];
      pos[i] = (i > 0 && row.segment[i] == row.segment[i - 1]) ? pos[i - 1] + 1 : 0;
    }
  }
  return out;
}

TrainBatch TaskBatch(const std::vector<const data::Example*>& examples, bool mask_padding) {
  size_t len = 0;
  for (const data::Example* e : examples) len = std::max(len, e->tokens.size());
  const int64_t b = static_cast<int64_t>(examples.size()), n = static_cast<int64_t>(len);
  TrainBatch out;
  out.inputs = torch::zeros({b, n}, torch::kInt64);
  out.targets = torch::full({b, n}, -1, torch::kInt64);
  const bool grid = !examples.empty() && !examples[0]->rows.empty();
  if (grid) {
    out.rows = torch::zeros({b, n}, torch::kInt64);
    out.cols = torch::zeros({b, n}, torch::kInt64);
  }
  bool ragged = false;
  for (const data::Example* e : examples) ragged |= e->tokens.size() != len;
  if (mask_padding && ragged) {
    out.segments = torch::zeros({b, n}, torch::kInt64);
    out.positions = torch::arange(n, torch::kInt64).unsqueeze(0).expand({b, n}).contiguous();
  }
  for (int64_t i = 0; i < b; ++i) {
    const data::Example& e = *examples[static_cast<size_t>(i)];
    const int64_t m = static_cast<int64_t>(e.tokens.size());
    auto copy = [&](const std::vector<int64_t>& v, torch::Tensor& t) {
      t.select(0, i).narrow(0, 0, m).copy_(torch::tensor(v, torch::kInt64));
    };
    copy(e.tokens, out.inputs);
    copy(e.targets, out.targets);
    if (grid) {
      copy(e.rows, out.rows);
      copy(e.cols, out.cols);
    }
    if (out.segments.defined()) out.segments.select(0, i).narrow(0, 0, m).fill_(1);
  }
  return out;
}

TrainBatch TaskSampler::Next(int64_t batch) {
  std::vector<data::Example> examples = task_->Batch(batch, rng_);
  std::vector<const data::Example*> refs;
  for (const auto& e : examples) refs.push_back(&e);
  return TaskBatch(refs, false);
}

std::shared_ptr<const TaskSplit> MakeTaskSplit(const data::Task& task, int64_t n, uint64_t seed) {
  auto split = std::make_shared<TaskSplit>();
  std::mt19937_64 rng(seed);
  split->examples.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    std::vector<data::Example> one = task.Batch(1, rng);
    split->examples.push_back(std::move(one.front()));
  }
  split->mask_padding = task.info().encoder;
  return split;
}

SplitSampler::SplitSampler(std::shared_ptr<const TaskSplit> split, uint64_t seed)
    : BatchSource(seed), split_(std::move(split)) {
  Shuffle();
}

void SplitSampler::Shuffle() {
  before_ = rng_;
  order_.resize(split_->examples.size());
  for (size_t i = 0; i < order_.size(); ++i) order_[i] = static_cast<int64_t>(i);
  // Fisher-Yates with the sampler's generator (std::shuffle's draws are library-specific).
  for (size_t i = order_.size(); i > 1; --i) {
    std::swap(order_[i - 1], order_[static_cast<size_t>(rng_() % i)]);
  }
  cursor_ = 0;
  ++pass_;
}

TrainBatch SplitSampler::Next(int64_t batch) {
  std::vector<const data::Example*> refs;
  while (static_cast<int64_t>(refs.size()) < batch) {
    if (cursor_ == static_cast<int64_t>(order_.size())) Shuffle();
    refs.push_back(&split_->examples[static_cast<size_t>(order_[static_cast<size_t>(cursor_++)])]);
  }
  return TaskBatch(refs, split_->mask_padding);
}

std::string SplitSampler::State() const {
  std::ostringstream s;
  s << "split " << pass_ << " " << cursor_ << " " << before_;
  return s.str();
}

absl::Status SplitSampler::Restore(const std::string& state) {
  std::istringstream s(state);
  std::string tag;
  int64_t pass = 0, cursor = 0;
  std::mt19937_64 before;
  s >> tag >> pass >> cursor >> before;
  if (s.fail() || tag != "split" || pass < 1 || cursor < 0 ||
      cursor > static_cast<int64_t>(split_->examples.size())) {
    return absl::DataLossError("data cursor: malformed split sampler state");
  }
  rng_ = before;
  Shuffle();  // the same permutation again, and rng_ where it was after drawing it
  pass_ = pass;
  cursor_ = cursor;
  return absl::OkStatus();
}

std::string BatchSource::State() const {
  std::ostringstream s;
  s << rng_;
  return s.str();
}

absl::Status BatchSource::Restore(const std::string& state) {
  std::istringstream s(state);
  std::mt19937_64 rng;
  s >> rng;
  if (s.fail()) return absl::DataLossError("data cursor: malformed sampler state");
  rng_ = rng;
  return absl::OkStatus();
}

TrainBatch RowsOfRank(const TrainBatch& global, int rank, int64_t rows) {
  auto mine = [&](const torch::Tensor& t) {
    return t.defined() ? t.narrow(0, rank * rows, rows).contiguous() : t;
  };
  return {mine(global.inputs), mine(global.targets),   mine(global.rows),
          mine(global.cols),   mine(global.positions), mine(global.segments)};
}

absl::StatusOr<TrainingData> BuildTrainingData(const v1::JobSpec& spec,
                                               const data::Tokenizer* tokenizer,
                                               const SftObjective* objective, const LogFn& log) {
  const std::string& source = spec.data().source();
  if (spec.model().mode() == "encoder" && source != "task") {
    return absl::InvalidArgumentError("model.mode: encoder models train on built-in tasks only");
  }
  if (source == "chat") return ChatData(spec, *tokenizer, *objective, log);
  if (source == "task") return TaskData(spec, log);
  return StreamData(spec, tokenizer, log);
}

}  // namespace loom::trainer
