#include "data/tasks.h"

#include <algorithm>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace loom::data {
namespace {

// Reads integer/real options and rejects keys nobody asked for.
class TaskOptions {
 public:
  TaskOptions(std::string task, const std::map<std::string, std::string>& values)
      : task_(std::move(task)), values_(values) {}
  absl::StatusOr<int64_t> Int(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) {
    used_.insert(key);
    auto it = values_.find(key);
    if (it == values_.end()) return fallback;
    int64_t v;
    if (!absl::SimpleAtoi(it->second, &v) || v < lo || v > hi) {
      return absl::InvalidArgumentError(absl::StrCat("data.task_options.", key, ": '", it->second,
                                                     "' is not an integer in [", lo, ", ", hi,
                                                     "]"));
    }
    return v;
  }
  absl::StatusOr<double> Real(const std::string& key, double fallback, double lo, double hi) {
    used_.insert(key);
    auto it = values_.find(key);
    if (it == values_.end()) return fallback;
    double v;
    if (!absl::SimpleAtod(it->second, &v) || !(v >= lo && v <= hi)) {
      return absl::InvalidArgumentError(absl::StrCat("data.task_options.", key, ": '", it->second,
                                                     "' is not a number in [", lo, ", ", hi, "]"));
    }
    return v;
  }
  // One of `choices` (the first is the default).
  absl::StatusOr<std::string> Choice(const std::string& key,
                                     const std::vector<std::string>& choices) {
    used_.insert(key);
    auto it = values_.find(key);
    if (it == values_.end()) return choices.front();
    if (std::find(choices.begin(), choices.end(), it->second) == choices.end()) {
      return absl::InvalidArgumentError(absl::StrCat("data.task_options.", key, ": '", it->second,
                                                     "' is not ", absl::StrJoin(choices, " | ")));
    }
    return it->second;
  }
  absl::Status Finish() const {
    for (const auto& [k, v] : values_) {
      if (!used_.count(k)) {
        return absl::InvalidArgumentError(
            absl::StrCat("data.task_options.", k, ": unknown option for task ", task_));
      }
    }
    return absl::OkStatus();
  }

 private:
  std::string task_;
  std::map<std::string, std::string> values_;
  std::set<std::string> used_;
};

int64_t Uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// Decoder example from text segments, each scored or not: tokens are the text minus its last
// byte, targets the text shifted by one, masked (-1) where the predicted byte is not scored.
Example LmExample(const std::vector<std::pair<std::string, bool>>& segments) {
  std::string text;
  std::vector<bool> scored;
  for (const auto& [piece, score] : segments) {
    text += piece;
    scored.insert(scored.end(), piece.size(), score);
  }
  Example e;
  for (size_t i = 0; i + 1 < text.size(); ++i) {
    e.tokens.push_back(static_cast<unsigned char>(text[i]));
    e.targets.push_back(scored[i + 1] ? static_cast<unsigned char>(text[i + 1]) : -1);
  }
  return e;
}

Example LmExample(const std::string& prompt, const std::string& answer) {
  return LmExample({{prompt, false}, {answer, true}});
}

class RelationTask : public Task {
 public:
  RelationTask(TaskInfo info, int times, int64_t m_min, int64_t m_max, double density)
      : info_(std::move(info)), times_(times), m_min_(m_min), m_max_(m_max), density_(density) {}
  const TaskInfo& info() const override { return info_; }
  std::vector<Example> Batch(int64_t batch, std::mt19937_64& rng) const override {
    const int m = static_cast<int>(Uniform(rng, m_min_, m_max_));  // one m per batch: no padding
    std::bernoulli_distribution bit(density_);
    std::vector<Example> out;
    for (int64_t b = 0; b < batch; ++b) {
      std::vector<uint8_t> r(static_cast<size_t>(m * m));
      for (auto& x : r) x = bit(rng);
      std::vector<uint8_t> composed = ComposeRelation(r, m, times_);
      Example e;
      for (int i = 0; i < m * m; ++i) {
        e.tokens.push_back(r[i]);
        e.targets.push_back(composed[i]);
        e.rows.push_back(i / m);
        e.cols.push_back(i % m);
      }
      out.push_back(std::move(e));
    }
    return out;
  }

 private:
  TaskInfo info_;
  int times_;
  int64_t m_min_, m_max_;
  double density_;
};

const char* const kFiller[] = {
    "the grass is green and the sky is blue. ",   "rivers run to the sea over smooth stones. ",
    "a quiet town sleeps under the old hills. ",  "birds sing while the morning sun rises. ",
    "the library keeps its books in long rows. ", "wind moves slowly across the wheat fields. "};

class NeedleTask : public Task {
 public:
  NeedleTask(TaskInfo info, int64_t needles, int64_t queries, int64_t context)
      : info_(std::move(info)), needles_(needles), queries_(queries), context_(context) {}
  const TaskInfo& info() const override { return info_; }
  std::vector<Example> Batch(int64_t batch, std::mt19937_64& rng) const override {
    std::vector<Example> out;
    for (int64_t b = 0; b < batch; ++b) out.push_back(One(rng));
    return out;
  }

 private:
  static std::string Digits(std::mt19937_64& rng, int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s.push_back(static_cast<char>('0' + Uniform(rng, 0, 9)));
    return s;
  }
  Example One(std::mt19937_64& rng) const {
    std::vector<std::pair<std::string, std::string>> facts;
    std::set<std::string> keys;
    while (static_cast<int64_t>(facts.size()) < needles_) {
      std::string key =
          std::string("k") + static_cast<char>('a' + Uniform(rng, 0, 25)) + Digits(rng, 3);
      if (keys.insert(key).second) facts.emplace_back(key, Digits(rng, 6));
    }
    // Question text, so the haystack budget is known: "the code for kx417 is 902316." per fact.
    std::vector<size_t> asked;
    for (int64_t q = 0; q < queries_; ++q)
      asked.push_back(static_cast<size_t>(Uniform(rng, 0, needles_ - 1)));
    const int64_t fact_len = 30, question_len = 28;
    const int64_t budget = context_ - needles_ * fact_len - queries_ * question_len - 8;
    std::vector<std::string> pieces;
    int64_t used = 0;
    while (true) {
      const std::string f = kFiller[Uniform(rng, 0, 5)];
      if (used + static_cast<int64_t>(f.size()) > budget) break;
      pieces.push_back(f);
      used += static_cast<int64_t>(f.size());
    }
    for (const auto& [k, v] : facts) {
      pieces.insert(pieces.begin() + Uniform(rng, 0, static_cast<int64_t>(pieces.size())),
                    "the code for " + k + " is " + v + ". ");
    }
    std::string haystack;
    for (const auto& p : pieces) haystack += p;
    std::vector<std::pair<std::string, bool>> segments = {{haystack + "\n", false}};
    for (size_t q : asked) {
      segments.emplace_back("the code for " + facts[q].first + " is ", false);
      segments.emplace_back(facts[q].second + ".\n", true);
    }
    Example e = LmExample(segments);
    return e;
  }
  TaskInfo info_;
  int64_t needles_, queries_, context_;
};

// A random functional graph and `queries` questions about distinct start nodes, each "the node
// `hops` edges on". Only the answer letters are scored: the rest is as predictable as the prompt.
// With `simple` walks every question's walk visits hops + 1 distinct nodes (graphs are drawn
// again until enough starts have one), so a short cycle never makes a shorter lookup right.
class KHopTask : public Task {
 public:
  KHopTask(TaskInfo info, int64_t nodes, int64_t hops, int64_t queries, bool simple)
      : info_(std::move(info)), nodes_(nodes), hops_(hops), queries_(queries), simple_(simple) {}
  const TaskInfo& info() const override { return info_; }
  std::vector<Example> Batch(int64_t batch, std::mt19937_64& rng) const override {
    std::vector<Example> out;
    for (int64_t b = 0; b < batch; ++b) out.push_back(OneExample(rng));
    return out;
  }
  // Graphs drawn per accepted one with simple walks, estimated from `trials` draws.
  double SimpleAcceptance(int trials) const {
    std::mt19937_64 rng(12345);
    int accepted = 0;
    for (int t = 0; t < trials; ++t) {
      accepted += static_cast<int64_t>(SimpleStarts(RandomGraph(rng)).size()) >= queries_;
    }
    return static_cast<double>(accepted) / trials;
  }

 private:
  std::vector<int> RandomGraph(std::mt19937_64& rng) const {
    std::vector<int> next(static_cast<size_t>(nodes_));
    for (auto& n : next) n = static_cast<int>(Uniform(rng, 0, nodes_ - 1));
    return next;
  }
  // The start nodes whose walk of `hops` edges repeats no node.
  std::vector<int> SimpleStarts(const std::vector<int>& next) const {
    std::vector<int> starts;
    for (int s = 0; s < nodes_; ++s) {
      std::vector<bool> seen(static_cast<size_t>(nodes_));
      int node = s;
      bool simple = true;
      for (int64_t h = 0; h <= hops_ && simple; ++h) {
        simple = !seen[node];
        seen[node] = true;
        node = next[node];
      }
      if (simple) starts.push_back(s);
    }
    return starts;
  }
  Example OneExample(std::mt19937_64& rng) const {
    std::vector<int> next = RandomGraph(rng);
    std::vector<int> simple_starts;
    while (simple_ &&
           static_cast<int64_t>((simple_starts = SimpleStarts(next)).size()) < queries_) {
      next = RandomGraph(rng);
    }
    std::vector<int> order(static_cast<size_t>(nodes_));
    for (int i = 0; i < nodes_; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    std::string graph;
    for (int i : order) graph += absl::StrCat(Letter(i), ">", Letter(next[i]), " ");
    std::vector<std::pair<std::string, bool>> segments = {{graph, false}};
    if (simple_) order = simple_starts;
    std::shuffle(order.begin(), order.end(), rng);  // distinct start nodes
    for (int64_t q = 0; q < queries_; ++q) {
      int node = order[q];
      segments.push_back({absl::StrCat("\nq:", Letter(node), hops_, "="), false});
      for (int64_t h = 0; h < hops_; ++h) node = next[node];
      segments.push_back({Letter(node), true});
      segments.push_back({".", false});
    }
    return LmExample(segments);
  }
  static std::string Letter(int node) { return std::string(1, static_cast<char>('a' + node)); }
  TaskInfo info_;
  int64_t nodes_, hops_, queries_;
  bool simple_;
};

// Polynomial-filter query on a small random digraph: (A^k x)_v, the sum of the values at the
// ends of every walk of exactly k edges from v (walks, not paths: repeats count).
class PolyFilterTask : public Task {
 public:
  PolyFilterTask(TaskInfo info, int64_t nodes, int64_t edges, int64_t hops)
      : info_(std::move(info)), nodes_(nodes), edges_(edges), hops_(hops) {}
  const TaskInfo& info() const override { return info_; }
  std::vector<Example> Batch(int64_t batch, std::mt19937_64& rng) const override {
    std::vector<Example> out;
    for (int64_t b = 0; b < batch; ++b) {
      std::set<std::pair<int, int>> edge_set;
      while (static_cast<int64_t>(edge_set.size()) < edges_) {
        edge_set.insert({static_cast<int>(Uniform(rng, 0, nodes_ - 1)),
                         static_cast<int>(Uniform(rng, 0, nodes_ - 1))});
      }
      std::vector<std::pair<int, int>> edges(edge_set.begin(), edge_set.end());
      std::shuffle(edges.begin(), edges.end(), rng);
      std::vector<int64_t> value(static_cast<size_t>(nodes_));
      std::string prompt;
      for (int64_t v = 0; v < nodes_; ++v) {
        value[v] = Uniform(rng, 0, 9);
        prompt += absl::StrCat(std::string(1, static_cast<char>('a' + v)), "=", value[v], " ");
      }
      prompt += "\n";
      for (const auto& [from, to] : edges) {
        prompt += absl::StrCat(std::string(1, static_cast<char>('a' + from)), ">",
                               std::string(1, static_cast<char>('a' + to)), " ");
      }
      const int start = static_cast<int>(Uniform(rng, 0, nodes_ - 1));
      // x_k = A^k x by repeated propagation: x_{t+1}[u] = sum over edges u>w of x_t[w].
      std::vector<int64_t> x = value;
      for (int64_t h = 0; h < hops_; ++h) {
        std::vector<int64_t> next(static_cast<size_t>(nodes_), 0);
        for (const auto& [from, to] : edges) next[from] += x[to];
        x = std::move(next);
      }
      prompt +=
          absl::StrCat("\ns", hops_, "(", std::string(1, static_cast<char>('a' + start)), ")=");
      out.push_back(LmExample(prompt, absl::StrCat(x[start], ".\n")));
    }
    return out;
  }

 private:
  TaskInfo info_;
  int64_t nodes_, edges_, hops_;
};

const char* const kPeople[] = {"alice", "bob", "carol", "dave", "erin", "frank"};
const char* const kThings[] = {"apples", "coins", "books", "shells"};

class ArithmeticTask : public Task {
 public:
  ArithmeticTask(TaskInfo info, int64_t min_steps, int64_t max_steps)
      : info_(std::move(info)), min_steps_(min_steps), max_steps_(max_steps) {}
  const TaskInfo& info() const override { return info_; }
  std::vector<Example> Batch(int64_t batch, std::mt19937_64& rng) const override {
    std::vector<Example> out;
    for (int64_t b = 0; b < batch; ++b) {
      const std::string who = kPeople[Uniform(rng, 0, 5)], thing = kThings[Uniform(rng, 0, 3)];
      int64_t total = Uniform(rng, 2, 20);
      std::string prompt = absl::StrCat(who, " has ", total, " ", thing, ".");
      std::string solution;
      const int64_t steps = Uniform(rng, min_steps_, max_steps_);
      for (int64_t s = 0; s < steps; ++s) {
        std::string other = who;
        while (other == who) other = kPeople[Uniform(rng, 0, 5)];  // a gift to oneself is no step
        const int64_t amount = Uniform(rng, 1, 9);
        if (Uniform(rng, 0, 1) == 0 || total < amount) {
          prompt += absl::StrCat(" ", other, " gives ", who, " ", amount, " more.");
          solution += absl::StrCat(total, "+", amount, "=", total + amount, ". ");
          total += amount;
        } else {
          prompt += absl::StrCat(" ", who, " gives ", other, " ", amount, ".");
          solution += absl::StrCat(total, "-", amount, "=", total - amount, ". ");
          total -= amount;
        }
      }
      prompt += absl::StrCat(" how many ", thing, " does ", who, " have?\n");
      out.push_back(LmExample(prompt, absl::StrCat(solution, "answer ", total, ".\n")));
    }
    return out;
  }

 private:
  TaskInfo info_;
  int64_t min_steps_, max_steps_;
};

}  // namespace

std::vector<uint8_t> ComposeRelation(const std::vector<uint8_t>& relation, int m, int times) {
  std::vector<uint8_t> acc = relation;
  for (int t = 1; t < times; ++t) {
    std::vector<uint8_t> next(static_cast<size_t>(m * m), 0);
    for (int i = 0; i < m; ++i) {
      for (int k = 0; k < m; ++k) {
        if (!acc[i * m + k]) continue;
        for (int j = 0; j < m; ++j) next[i * m + j] |= relation[k * m + j];
      }
    }
    acc = std::move(next);
  }
  return acc;
}

absl::StatusOr<std::unique_ptr<Task>> MakeTask(const std::string& name,
                                               const std::map<std::string, std::string>& options,
                                               int64_t max_len) {
  TaskOptions o(name, options);
  std::unique_ptr<Task> task;
  TaskInfo info;
  info.name = name;
  if (name == "relation_binary" || name == "relation_ternary") {
    const bool binary = name == "relation_binary";
    auto m_min = o.Int("m_min", binary ? 6 : 5, 1, 64);
    auto m_max = o.Int("m_max", binary ? 10 : 8, 1, 64);
    auto density = o.Real("density", binary ? 0.325 : 0.264, 0.0, 1.0);
    if (!m_min.ok()) return m_min.status();
    if (!m_max.ok()) return m_max.status();
    if (!density.ok()) return density.status();
    if (*m_min > *m_max)
      return absl::InvalidArgumentError("data.task_options.m_min: must be <= m_max");
    info.encoder = true;
    info.vocab_size = 2;
    info.num_classes = 1;
    info.max_len = *m_max * *m_max;
    info.grid = *m_max;
    task = std::make_unique<RelationTask>(info, binary ? 2 : 3, *m_min, *m_max, *density);
  } else if (name == "needle") {
    auto needles = o.Int("needles", 4, 1, 64);
    auto queries = o.Int("queries", 1, 1, 16);
    auto context = o.Int("context", max_len, 64, 1 << 20);
    if (!needles.ok()) return needles.status();
    if (!queries.ok()) return queries.status();
    if (!context.ok()) return context.status();
    if (*context > max_len) {
      return absl::InvalidArgumentError(absl::StrCat("data.task_options.context: ", *context,
                                                     " exceeds the sequence length ", max_len));
    }
    if (*context < *needles * 30 + *queries * 28 + 16) {
      return absl::InvalidArgumentError(
          "data.task_options.context: too short for the needles and questions");
    }
    info.max_len = *context;
    task = std::make_unique<NeedleTask>(info, *needles, *queries, *context);
  } else if (name == "khop") {
    auto nodes = o.Int("nodes", 12, 2, 26);
    auto hops = o.Int("hops", 2, 1, 9);
    if (!nodes.ok()) return nodes.status();
    if (!hops.ok()) return hops.status();
    auto queries = o.Int("queries", 1, 1, *nodes);
    if (!queries.ok()) return queries.status();
    auto walks = o.Choice("walks", {"any", "simple"});
    if (!walks.ok()) return walks.status();
    const bool simple = *walks == "simple";
    if (simple && *hops >= *nodes) {
      return absl::InvalidArgumentError(absl::StrCat("data.task_options.hops: simple walks of ",
                                                     *hops, " hops need more than ", *hops,
                                                     " nodes (", *nodes, ")"));
    }
    info.max_len = *nodes * 4 + *queries * 8 - 1;  // tokens: the text minus its last byte
    auto khop = std::make_unique<KHopTask>(info, *nodes, *hops, *queries, simple);
    // Rejection sampling must end quickly: refuse settings where few graphs qualify.
    if (simple && khop->SimpleAcceptance(4096) < 1e-3) {
      return absl::InvalidArgumentError(
          absl::StrCat("data.task_options.queries: fewer than 1 graph in 1000 has ", *queries,
                       " start nodes with simple walks of ", *hops, " hops on ", *nodes,
                       " nodes; ask fewer queries or hops"));
    }
    task = std::move(khop);
  } else if (name == "poly_filter") {
    auto nodes = o.Int("nodes", 6, 2, 26);
    auto edges = o.Int("edges", 9, 1, 26 * 26);
    auto hops = o.Int("hops", 2, 1, 4);
    if (!nodes.ok()) return nodes.status();
    if (!edges.ok()) return edges.status();
    if (!hops.ok()) return hops.status();
    if (*edges > *nodes * *nodes)
      return absl::InvalidArgumentError("data.task_options.edges: more than nodes²");
    info.max_len = *nodes * 4 + *edges * 4 + 24;
    task = std::make_unique<PolyFilterTask>(info, *nodes, *edges, *hops);
  } else if (name == "arithmetic") {
    auto min_steps = o.Int("min_steps", 2, 1, 8);
    auto max_steps = o.Int("max_steps", 3, 1, 8);
    if (!min_steps.ok()) return min_steps.status();
    if (!max_steps.ok()) return max_steps.status();
    if (*min_steps > *max_steps)
      return absl::InvalidArgumentError("data.task_options.min_steps: must be <= max_steps");
    info.max_len = 60 + *max_steps * 45;
    task = std::make_unique<ArithmeticTask>(info, *min_steps, *max_steps);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.task: '", name,
        "' is not relation_binary | relation_ternary | needle | khop | poly_filter | arithmetic"));
  }
  if (absl::Status s = o.Finish(); !s.ok()) return s;
  if (!info.encoder && info.max_len > max_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len: task ", name, " needs up to ", info.max_len,
                     " tokens, more than the sequence length ", max_len));
  }
  return task;
}

}  // namespace loom::data
