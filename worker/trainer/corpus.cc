#include "worker/trainer/corpus.h"

#include <stdexcept>

namespace loom::trainer {
namespace {

const char* const kNames[] = {"alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"};
const char* const kObjects[] = {"apples", "books", "coins", "stones", "shells", "pens"};
const char* const kPlaces[] = {"the market", "the library", "the garden", "the harbour", "school"};

template <typename T, size_t N>
const T& Pick(const T (&items)[N], std::mt19937_64& rng) {
  return items[std::uniform_int_distribution<size_t>(0, N - 1)(rng)];
}

}  // namespace

std::string GenerateCorpus(uint64_t seed, size_t min_bytes) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> small(1, 9), kind(0, 3);
  std::string text;
  while (text.size() < min_bytes) {
    const std::string a = Pick(kNames, rng), b = Pick(kNames, rng), obj = Pick(kObjects, rng);
    const int x = small(rng), y = small(rng);
    switch (kind(rng)) {
      case 0:
        text += a + " has " + std::to_string(x) + " " + obj + ". " + b + " gives " + a + " " +
                std::to_string(y) + " more. now " + a + " has " + std::to_string(x + y) + " " +
                obj + ".\n";
        break;
      case 1:
        text += a + " goes to " + Pick(kPlaces, rng) + " with " + b + ".\n";
        break;
      case 2:
        text +=
            std::to_string(x) + " + " + std::to_string(y) + " = " + std::to_string(x + y) + ".\n";
        break;
      default:
        text +=
            std::to_string(x) + " * " + std::to_string(y) + " = " + std::to_string(x * y) + ".\n";
        break;
    }
  }
  return text;
}

std::pair<torch::Tensor, torch::Tensor> SampleWindows(const TokenStream& tokens, int64_t batch,
                                                      int64_t seq_len, std::mt19937_64& rng) {
  if (tokens.size() < seq_len + 1)
    throw std::invalid_argument("token stream shorter than one training window");
  std::uniform_int_distribution<int64_t> start(0, tokens.size() - seq_len - 1);
  torch::Tensor window = torch::empty({batch, seq_len + 1}, torch::kInt64);
  int64_t* data = window.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    tokens.Copy(start(rng), seq_len + 1, data + b * (seq_len + 1));
  return {window.narrow(1, 0, seq_len).contiguous(), window.narrow(1, 1, seq_len).contiguous()};
}

}  // namespace loom::trainer
