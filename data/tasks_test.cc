// Generators are deterministic by seed and their labels are right, each checked by an
// independent brute-force solver written here (path search, text parsing).
#include "data/tasks.h"

#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <set>

namespace loom::data {
namespace {

std::string Text(const Example& e) {
  std::string s;
  for (int64_t t : e.tokens) s.push_back(static_cast<char>(t));
  return s;
}
// The scored bytes, in order.
std::string Scored(const Example& e) {
  std::string s;
  for (int64_t t : e.targets) {
    if (t >= 0) s.push_back(static_cast<char>(t));
  }
  return s;
}

// Is there a path of exactly `len` edges from i to j in relation r (m×m)? Depth-first search.
bool PathOfLength(const std::vector<int64_t>& r, int m, int i, int j, int len) {
  if (len == 0) return i == j;
  for (int k = 0; k < m; ++k) {
    if (r[i * m + k] && PathOfLength(r, m, k, j, len - 1)) return true;
  }
  return false;
}

TEST(Tasks, DeterministicBySeed) {
  for (const char* name :
       {"relation_binary", "relation_ternary", "needle", "khop", "poly_filter", "arithmetic"}) {
    auto task = MakeTask(name, {}, 512);
    ASSERT_TRUE(task.ok()) << name << ": " << task.status();
    std::mt19937_64 a(5), b(5), c(6);
    auto x = (*task)->Batch(3, a), y = (*task)->Batch(3, b), z = (*task)->Batch(3, c);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(x[i].tokens, y[i].tokens) << name;
      EXPECT_EQ(x[i].targets, y[i].targets) << name;
    }
    EXPECT_NE(x[0].tokens, z[0].tokens) << name;
  }
}

TEST(Tasks, RelationLabelsMatchPathSearch) {
  for (auto [name, times] :
       {std::pair<const char*, int>{"relation_binary", 2}, {"relation_ternary", 3}}) {
    auto task = MakeTask(name, {}, 512);
    ASSERT_TRUE(task.ok());
    EXPECT_TRUE((*task)->info().encoder);
    std::mt19937_64 rng(1);
    double ones = 0, cells = 0;
    std::set<int> sizes;
    for (int round = 0; round < 40; ++round) {
      auto batch = (*task)->Batch(4, rng);
      const int m = static_cast<int>(std::lround(std::sqrt(batch[0].tokens.size())));
      sizes.insert(m);
      for (const Example& e : batch) {
        ASSERT_EQ(e.tokens.size(), static_cast<size_t>(m * m));  // one m per batch
        for (int i = 0; i < m; ++i) {
          for (int j = 0; j < m; ++j) {
            EXPECT_EQ(e.targets[i * m + j], PathOfLength(e.tokens, m, i, j, times) ? 1 : 0);
            EXPECT_EQ(e.rows[i * m + j], i);
            EXPECT_EQ(e.cols[i * m + j], j);
          }
        }
        for (int64_t t : e.tokens) ones += static_cast<double>(t);
        cells += static_cast<double>(e.tokens.size());
      }
    }
    const double density = times == 2 ? 0.325 : 0.264;
    EXPECT_NEAR(ones / cells, density, 0.02) << name;
    EXPECT_EQ(*sizes.begin(), times == 2 ? 6 : 5);
    EXPECT_EQ(*sizes.rbegin(), times == 2 ? 10 : 8);
  }
}

TEST(Tasks, NeedleAnswersAreTheStatedCodes) {
  auto task = MakeTask("needle", {{"needles", "5"}, {"queries", "2"}, {"context", "600"}}, 600);
  ASSERT_TRUE(task.ok()) << task.status();
  std::mt19937_64 rng(2);
  for (const Example& e : (*task)->Batch(20, rng)) {
    EXPECT_LE(e.tokens.size(), 600u);
    const std::string text = Text(e);
    std::map<std::string, std::string> facts;
    const std::regex fact("the code for (k[a-z][0-9]{3}) is ([0-9]{6})\\. ");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), fact);
         it != std::sregex_iterator(); ++it) {
      facts[(*it)[1]] = (*it)[2];
    }
    EXPECT_EQ(facts.size(), 5u);
    std::string expected;
    const std::regex question("\nthe code for (k[a-z][0-9]{3}) is ");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), question);
         it != std::sregex_iterator(); ++it) {
      expected += facts.at((*it)[1]) + ".\n";
    }
    // The final newline is the last target; the text (tokens) stops one byte short of it.
    EXPECT_EQ(Scored(e), expected);
  }
}

// A khop example's graph: "a>q b>c ..." as node -> next node.
std::map<char, char> EdgesOf(const std::string& text) {
  std::map<char, char> next;
  const std::regex edge("([a-z])>([a-z]) ");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), edge); it != std::sregex_iterator();
       ++it) {
    next[(*it).str(1)[0]] = (*it).str(2)[0];
  }
  return next;
}

TEST(Tasks, KHopAnswersFollowTheEdges) {
  for (int queries : {1, 5}) {
    auto task = MakeTask(
        "khop", {{"nodes", "10"}, {"hops", "3"}, {"queries", std::to_string(queries)}}, 512);
    ASSERT_TRUE(task.ok());
    std::mt19937_64 rng(3);
    for (const Example& e : (*task)->Batch(30, rng)) {
      ASSERT_LE(static_cast<int64_t>(e.tokens.size()), (*task)->info().max_len);
      const std::string text = Text(e) + ".";  // the last byte is a target only
      const std::map<char, char> next = EdgesOf(text);
      ASSERT_EQ(next.size(), 10u);
      // Only the answer letters are scored, one per question; the questions' starts differ.
      std::string expected;
      std::set<char> starts;
      const std::regex question("\\nq:([a-z])([0-9])=([a-z])\\.");
      for (auto it = std::sregex_iterator(text.begin(), text.end(), question);
           it != std::sregex_iterator(); ++it) {
        char node = (*it).str(1)[0];
        starts.insert(node);
        for (int h = 0; h < std::stoi((*it).str(2)); ++h) node = next.at(node);
        expected.push_back(node);
      }
      EXPECT_EQ(starts.size(), static_cast<size_t>(queries));
      EXPECT_EQ(Scored(e), expected);
    }
  }
  EXPECT_NE(MakeTask("khop", {{"nodes", "6"}, {"queries", "7"}}, 512)
                .status()
                .message()
                .find("data.task_options.queries"),
            std::string::npos);
}

// walks: simple draws graphs until every question's walk repeats no node, so no shorter lookup
// (a cycle back to an earlier node) gives the answer; the default keeps such questions.
TEST(Tasks, KHopSimpleWalksNeverRevisitANode) {
  for (const std::string walks : {"any", "simple"}) {
    auto task =
        MakeTask("khop", {{"nodes", "6"}, {"hops", "3"}, {"queries", "2"}, {"walks", walks}}, 512);
    ASSERT_TRUE(task.ok()) << task.status();
    std::mt19937_64 rng(5);
    int questions = 0, revisiting = 0;
    for (const Example& e : (*task)->Batch(200, rng)) {
      const std::string text = Text(e) + ".";
      const std::map<char, char> next = EdgesOf(text);
      ASSERT_EQ(next.size(), 6u);
      const std::regex question("\\nq:([a-z])3=([a-z])\\.");
      for (auto it = std::sregex_iterator(text.begin(), text.end(), question);
           it != std::sregex_iterator(); ++it) {
        std::set<char> walk = {(*it).str(1)[0]};
        char node = (*it).str(1)[0];
        for (int h = 0; h < 3; ++h) walk.insert(node = next.at(node));
        EXPECT_EQ(node, (*it).str(2)[0]);
        ++questions;
        revisiting += walk.size() < 4;
      }
    }
    EXPECT_EQ(questions, 400);
    if (walks == "simple") {
      EXPECT_EQ(revisiting, 0);
    } else {
      EXPECT_GT(revisiting, 200) << "most 3-walks on 6-node functional graphs revisit a node";
    }
  }
  auto error = [](std::map<std::string, std::string> options) {
    return std::string(MakeTask("khop", options, 512).status().message());
  };
  EXPECT_NE(error({{"walks", "loops"}}).find("data.task_options.walks"), std::string::npos);
  EXPECT_NE(
      error({{"walks", "simple"}, {"nodes", "4"}, {"hops", "4"}}).find("data.task_options.hops"),
      std::string::npos);
  // Every start of 10 nodes simple for 9 hops: only a single 10-cycle (9! / 10^10 = 4e-5).
  EXPECT_NE(error({{"walks", "simple"}, {"nodes", "10"}, {"hops", "9"}, {"queries", "10"}})
                .find("data.task_options.queries"),
            std::string::npos);
}

// Counts walks by explicit enumeration (depth-first), independent of the generator's propagation.
int64_t WalkSum(const std::multimap<char, char>& edges, const std::map<char, int>& value, char node,
                int hops) {
  if (hops == 0) return value.at(node);
  int64_t total = 0;
  auto [lo, hi] = edges.equal_range(node);
  for (auto it = lo; it != hi; ++it) total += WalkSum(edges, value, it->second, hops - 1);
  return total;
}

TEST(Tasks, PolyFilterAnswersCountWalks) {
  auto task = MakeTask("poly_filter", {{"nodes", "5"}, {"edges", "8"}, {"hops", "3"}}, 512);
  ASSERT_TRUE(task.ok()) << task.status();
  std::mt19937_64 rng(9);
  for (const Example& e : (*task)->Batch(30, rng)) {
    const std::string text = Text(e);
    std::map<char, int> value;
    std::multimap<char, char> edges;
    const std::regex val("([a-z])=([0-9]) ");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), val);
         it != std::sregex_iterator(); ++it) {
      value[(*it).str(1)[0]] = std::stoi((*it).str(2));
    }
    const std::regex edge("([a-z])>([a-z]) ");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), edge);
         it != std::sregex_iterator(); ++it) {
      edges.emplace((*it).str(1)[0], (*it).str(2)[0]);
    }
    ASSERT_EQ(value.size(), 5u);
    ASSERT_EQ(edges.size(), 8u);
    std::smatch q;
    ASSERT_TRUE(std::regex_search(text, q, std::regex("s([0-9])\\(([a-z])\\)=")));
    EXPECT_EQ(Scored(e),
              std::to_string(WalkSum(edges, value, q.str(2)[0], std::stoi(q.str(1)))) + ".\n")
        << text;
  }
}

TEST(Tasks, ArithmeticSolutionsAreCorrect) {
  auto task = MakeTask("arithmetic", {{"min_steps", "2"}, {"max_steps", "4"}}, 512);
  ASSERT_TRUE(task.ok());
  std::mt19937_64 rng(4);
  for (const Example& e : (*task)->Batch(30, rng)) {
    const std::string text = Text(e) + "\n";
    std::smatch start;
    ASSERT_TRUE(std::regex_search(text, start, std::regex("^([a-z]+) has ([0-9]+) ")));
    const std::string who = start.str(1);
    int total = std::stoi(start.str(2));
    const std::regex event("([a-z]+) gives ([a-z]+) ([0-9]+)( more)?\\.");
    for (auto it = std::sregex_iterator(text.begin(), text.end(), event);
         it != std::sregex_iterator(); ++it) {
      const int amount = std::stoi((*it).str(3));
      total += (*it).str(2) == who && (*it).str(1) != who ? amount : -amount;
    }
    const std::string scored = Scored(e);
    EXPECT_NE(scored.find("answer " + std::to_string(total) + "."), std::string::npos) << text;
    const std::regex step("([0-9]+)([+-])([0-9]+)=([0-9]+)\\.");
    int checked = 0;
    for (auto it = std::sregex_iterator(scored.begin(), scored.end(), step);
         it != std::sregex_iterator(); ++it) {
      const int a = std::stoi((*it).str(1)), b = std::stoi((*it).str(3)),
                c = std::stoi((*it).str(4));
      EXPECT_EQ((*it).str(2) == "+" ? a + b : a - b, c);
      ++checked;
    }
    EXPECT_GE(checked, 2);
  }
}

TEST(Tasks, BadOptionsNameTheField) {
  EXPECT_NE(MakeTask("sudoku", {}, 512).status().message().find("data.task"), std::string::npos);
  EXPECT_NE(
      MakeTask("khop", {{"hops", "0"}}, 512).status().message().find("data.task_options.hops"),
      std::string::npos);
  EXPECT_NE(MakeTask("khop", {{"colour", "red"}}, 512)
                .status()
                .message()
                .find("data.task_options.colour"),
            std::string::npos);
  EXPECT_NE(MakeTask("needle", {{"context", "900"}}, 512)
                .status()
                .message()
                .find("data.task_options.context"),
            std::string::npos);
  EXPECT_NE(MakeTask("arithmetic", {}, 64).status().message().find("seq_len"), std::string::npos);
  EXPECT_NE(MakeTask("relation_binary", {{"m_min", "9"}, {"m_max", "7"}}, 512)
                .status()
                .message()
                .find("m_min"),
            std::string::npos);
}

}  // namespace
}  // namespace loom::data
