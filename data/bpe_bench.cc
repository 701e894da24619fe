// loom-bench-tokenizer: encoding throughput of a tokenizer on a corpus (one document per line),
// in MB/s of UTF-8 input, on 1 thread and on --threads threads (documents split over them, as
// `loom-data pack --threads` does). scripts/bench-tokenizer runs it next to Tokenizers.js on the
// same corpus and prints the ratios (docs/benchmarks.md).
#include <chrono>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "data/tokenizer.h"

namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// Encodes every document `repeats` times on `threads` threads; returns MB/s and the token count.
double Throughput(const loom::data::Tokenizer& t, const std::vector<std::string>& docs,
                  size_t bytes, int threads, int repeats, size_t* tokens) {
  std::vector<size_t> counts(threads, 0);
  const auto start = std::chrono::steady_clock::now();
  auto work = [&](int id) {
    for (int r = 0; r < repeats; ++r) {
      for (size_t i = id; i < docs.size(); i += threads) counts[id] += t.Encode(docs[i]).size();
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(work, i);
  work(0);
  for (auto& p : pool) p.join();
  const double s = Seconds(start);
  *tokens = 0;
  for (size_t c : counts) *tokens += c;
  return static_cast<double>(bytes) * repeats / s / 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  std::string tokenizer = "byte", model, input;
  int threads = 2, repeats = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--tokenizer")
      tokenizer = value;
    else if (flag == "--tokenizer-model")
      model = value;
    else if (flag == "--input")
      input = value;
    else if ((flag == "--threads" && absl::SimpleAtoi(value, &threads) && threads >= 1) ||
             (flag == "--repeats" && absl::SimpleAtoi(value, &repeats) && repeats >= 1))
      continue;
    else {
      std::cerr << "usage: loom-bench-tokenizer --tokenizer T [--tokenizer-model M] --input FILE "
                   "[--threads N] [--repeats R]\n";
      return 2;
    }
  }
  auto t = loom::data::MakeTokenizer(tokenizer, model);
  if (!t.ok()) {
    std::cerr << "loom-bench-tokenizer: " << t.status().message() << "\n";
    return 2;
  }
  std::ifstream in(input, std::ios::binary);
  if (!in) {
    std::cerr << "loom-bench-tokenizer: cannot open --input '" << input << "'\n";
    return 2;
  }
  std::vector<std::string> docs;
  size_t bytes = 0;
  for (std::string line; std::getline(in, line);) {
    bytes += line.size();
    docs.push_back(std::move(line));
  }
  size_t tokens = 0;
  (void)Throughput(**t, docs, bytes, 1, 1, &tokens);  // warm-up
  const double one = Throughput(**t, docs, bytes, 1, repeats, &tokens);
  const double many = Throughput(**t, docs, bytes, threads, repeats, &tokens);
  std::cout << "{\"documents\": " << docs.size() << ", \"bytes\": " << bytes
            << ", \"tokens\": " << tokens / repeats << ", \"mb_per_s_1\": " << one
            << ", \"threads\": " << threads << ", \"mb_per_s_n\": " << many << "}\n";
  return 0;
}
