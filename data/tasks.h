// Built-in synthetic tasks, deterministic by seed, each with its metric. No LibTorch: examples are
// plain token vectors; the trainer batches them.
//
//   relation_binary, relation_ternary (the paper's App. D): input a random m×m boolean relation R
//     flattened row-major to m² binary tokens; target, aligned position-wise, the composed relation
//     R∘R (binary; m uniform in 6..10, entries Bernoulli(0.325)) or R∘R∘R (ternary; m in 5..8,
//     Bernoulli(0.264)). Bidirectional encoder with (row, column) positions, per-position binary
//     cross-entropy. Batches share one m (bucketing) so no padding is needed.
//   needle: RULER-style multi-key needle in a haystack. Filler sentences with `needles` key→value
//     facts ("the code for kx417 is 902316.") at random depths, then `queries` questions ("the code
//     for kx417 is"); only the answer digits are scored.
//   khop: a random functional graph on letters ("a>q b>c ..."), then "q:a3=" asks for the node
//     reached from a after 3 hops; only the answer is scored.
//   poly_filter: a random digraph with digit values on its nodes ("a=3 b=7 …", "a>c b>a …"),
//     then "s2(a)=" asks for (A²x)_a, the sum of the values at the ends of all 2-edge walks from a
//     (the polynomial filter of the paper's Theorem 3, as a decoder task).
//   arithmetic: multi-step word problems with worked solutions ("... 3+4=7. 7-2=5. answer 5.");
//     the solution and answer are scored.
// Decoder tasks are byte-level (vocabulary 256, padding 0, which never occurs in the text).
#ifndef LOOM_DATA_TASKS_H_
#define LOOM_DATA_TASKS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace loom::data {

struct Example {
  std::vector<int64_t> tokens;
  std::vector<int64_t> targets;     // per position: class or next-token id; -1 = not scored
  std::vector<int64_t> rows, cols;  // grid coordinates (relation tasks), else empty
};

struct TaskInfo {
  std::string name;
  bool encoder = false;      // bidirectional per-position classification
  int64_t vocab_size = 256;  // input vocabulary
  int64_t num_classes = 0;   // encoder: outputs per position (1 = a binary logit)
  int64_t max_len = 0;       // longest example
  int64_t grid = 0;          // largest grid side (relation tasks), else 0
};

class Task {
 public:
  virtual ~Task() = default;
  virtual const TaskInfo& info() const = 0;
  // `batch` examples drawn with `rng`; decoder examples are right-aligned next-token pairs
  // (targets[t] is the token after tokens[t]).
  virtual std::vector<Example> Batch(int64_t batch, std::mt19937_64& rng) const = 0;
};

// Options are text (from the job spec's task_options); unknown keys are errors naming them.
// max_len: the model's context; decoder tasks that cannot fit are an error.
absl::StatusOr<std::unique_ptr<Task>> MakeTask(const std::string& name,
                                               const std::map<std::string, std::string>& options,
                                               int64_t max_len);

// The composed relation R^times (boolean matrix power), m×m row-major.
std::vector<uint8_t> ComposeRelation(const std::vector<uint8_t>& relation, int m, int times);

}  // namespace loom::data

#endif  // LOOM_DATA_TASKS_H_
