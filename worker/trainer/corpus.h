// A small generated corpus for the standalone trainer and its tests: templated English
// sentences about people, objects and places plus arithmetic facts, deterministic by seed.
// It has enough structure that a tiny byte-level model's loss falls well below the unigram
// entropy within a few hundred steps, and needs no files.
#ifndef LOOM_WORKER_TRAINER_CORPUS_H_
#define LOOM_WORKER_TRAINER_CORPUS_H_

#include <torch/torch.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace loom::trainer {

std::string GenerateCorpus(uint64_t seed, size_t min_bytes);

// A read-only token sequence the samplers draw windows from.
class TokenStream {
 public:
  virtual ~TokenStream() = default;
  virtual int64_t size() const = 0;
  virtual void Copy(int64_t start, int64_t n, int64_t* out) const = 0;
};

class VectorTokenStream : public TokenStream {
 public:
  explicit VectorTokenStream(std::vector<int64_t> tokens) : tokens_(std::move(tokens)) {}
  int64_t size() const override { return static_cast<int64_t>(tokens_.size()); }
  void Copy(int64_t start, int64_t n, int64_t* out) const override {
    std::copy(tokens_.begin() + start, tokens_.begin() + start + n, out);
  }

 private:
  std::vector<int64_t> tokens_;
};

// `batch` windows of seq_len + 1 tokens at uniformly random offsets: returns {inputs, targets},
// each int64 [batch, seq_len], targets shifted by one.
std::pair<torch::Tensor, torch::Tensor> SampleWindows(const TokenStream& tokens, int64_t batch,
                                                      int64_t seq_len, std::mt19937_64& rng);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_CORPUS_H_
