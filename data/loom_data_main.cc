// loom-data: turns text and JSONL into packed token shards for the trainer.
//   pack             tokenize inputs into DIR (shards + index.json)
//   info | verify    describe a dataset | check every shard's size, checksum and ids
//   train-tokenizer  train a SentencePiece model on text files
//   encode | chat    token ids of strings | of conversations (tokenizer and template parity tests)
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/cli_args.h"
#include "base/read_file.h"
#include "base/status_macros.h"
#include "data/bpe_tokenizer.h"
#include "data/chat.h"
#include "data/token_shards.h"
#include "data/tokenizer.h"

namespace loom::data {
namespace {

constexpr char kUsage[] = R"(usage: loom-data <command> [flags]

  pack --output DIR --input FILE[,FILE...] [--format text|lines|jsonl] [--field text]
       [--tokenizer byte|sentencepiece|bpe|TOKENIZER.json] [--tokenizer-model M]
       [--shard-tokens N] [--eos] [--threads N]
       [--on-error fail|skip]
      text: each file is one document; lines: each non-empty line; jsonl: one JSON object per
      line, the document in --field (default "text"). Malformed JSONL lines fail the run with
      their line number, or are skipped and counted with --on-error skip. --threads N tokenizes
      batches of documents on N threads (the shards are the same for any N). --tokenizer
      TOKENIZER.json (or bpe with --tokenizer-model) is a Hugging Face byte-level BPE file.
  info DIR          print the index
  verify DIR        check sizes, CRC-32C checksums and token ids of every shard
  train-tokenizer --input FILE[,FILE...] --vocab-size N --output PREFIX
  encode --tokenizer T [--tokenizer-model M] --input FILE
      each line of FILE is base64 of a byte string; prints one JSON line per input line,
      {"ids": [...], "decoded": "<base64 of Decode(ids)>"} (tokenizer parity tests)
  chat --tokenizer T [--tokenizer-model M] --input FILE.jsonl
      each line a conversation (OpenThoughts or {"messages": [...]}); prints one JSON line each,
      {"tokens", "loss_mask", "prompt"} as an SFT job renders it: Llama 3's template when the
      tokenizer has its header tokens, else Loom's markers (chat template parity tests)

exit status: 0 done; 1 the command failed (an input, tokenizer or dataset is missing or
malformed: the message names the file and the field); 2 the command line is wrong
)";

std::vector<std::string> Inputs(const CliArgs& args) {
  std::vector<std::string> out;
  for (auto part : absl::StrSplit(args.Get("input"), ',', absl::SkipEmpty()))
    out.emplace_back(part);
  return out;
}

absl::Status Encode(const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(std::string input, args.Require("input"));
  LOOM_ASSIGN_OR_RETURN(auto tokenizer,
                        MakeTokenizer(args.Get("tokenizer", "byte"), args.Get("tokenizer-model")));
  std::ifstream in(input, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--input: cannot open '", input, "'"));
  std::string line, bytes;
  int64_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!absl::Base64Unescape(line, &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(input, ":", n, ": not base64"));
    }
    const std::vector<uint32_t> ids = tokenizer->Encode(bytes);
    std::cout << "{\"ids\": [" << absl::StrJoin(ids, ",") << "], \"decoded\": \""
              << absl::Base64Escape(tokenizer->Decode(ids)) << "\"}\n";
  }
  return absl::OkStatus();
}

absl::Status Chat(const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(std::string input, args.Require("input"));
  LOOM_ASSIGN_OR_RETURN(auto tokenizer,
                        MakeTokenizer(args.Get("tokenizer", "byte"), args.Get("tokenizer-model")));
  const auto* bpe = dynamic_cast<const BpeTokenizer*>(tokenizer.get());
  const ChatTemplate chat =
      bpe == nullptr ? ChatTemplateFor(tokenizer->vocab_size(), nullptr)
                     : ChatTemplateFor(tokenizer->vocab_size(),
                                       [bpe](std::string_view t) { return bpe->TokenId(t); });
  const TextEncoder encode = [&](std::string_view text) { return tokenizer->Encode(text); };
  std::ifstream in(input, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--input: cannot open '", input, "'"));
  std::string line;
  int64_t n = 0;
  while (std::getline(in, line)) {
    LOOM_ASSIGN_OR_RETURN(Conversation c, ParseChatLine(line, ++n));
    const EncodedChat e = EncodeChat(c, chat, encode);
    nlohmann::json j = {{"tokens", e.tokens},
                        {"loss_mask", e.loss_mask},
                        {"prompt", EncodePrompt(c, chat, encode)}};
    std::cout << j.dump() << "\n";
  }
  return absl::OkStatus();
}

// Documents tokenized in batches, each split over the threads, and written in order.
class DocumentPacker {
 public:
  DocumentPacker(const Tokenizer& tokenizer, TokenShardWriter& writer, int64_t threads, bool eos)
      : tokenizer_(tokenizer), writer_(writer), threads_(threads), eos_(eos) {}

  absl::Status Add(std::string text) {
    batch_bytes_ += text.size();
    batch_.push_back(std::move(text));
    return batch_.size() >= 4096 || batch_bytes_ >= (32u << 20) ? Flush() : absl::OkStatus();
  }

  absl::Status Flush() {
    std::vector<std::vector<uint32_t>> ids(batch_.size());
    auto work = [&](size_t first, size_t step) {
      for (size_t i = first; i < batch_.size(); i += step) ids[i] = tokenizer_.Encode(batch_[i]);
    };
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < threads_; ++t) pool.emplace_back(work, t, threads_);
    work(0, static_cast<size_t>(threads_));
    for (auto& t : pool) t.join();
    for (auto& d : ids) {
      if (eos_) d.push_back(static_cast<uint32_t>(tokenizer_.eos_id()));
      LOOM_RETURN_IF_ERROR(writer_.AddDocument(d));
    }
    batch_.clear();
    batch_bytes_ = 0;
    return absl::OkStatus();
  }

 private:
  const Tokenizer& tokenizer_;
  TokenShardWriter& writer_;
  int64_t threads_;
  bool eos_;
  std::vector<std::string> batch_;
  size_t batch_bytes_ = 0;
};

// What is wrong with a JSONL line for --field ("" when nothing).
std::string JsonlProblem(const nlohmann::json& j, const std::string& field) {
  if (j.is_discarded()) return "not valid JSON";
  if (!j.is_object() || !j.contains(field)) return absl::StrCat("no \"", field, "\" field");
  if (!j[field].is_string()) return absl::StrCat("\"", field, "\" is not a string");
  return "";
}

struct PackInput {
  std::string format, on_error, field;
};

// One input file's documents: the whole file (text), each line (lines) or each line's field
// (jsonl; malformed lines fail or, with --on-error skip, are counted in *skipped).
absl::Status PackFile(const std::string& path, const PackInput& in, DocumentPacker& packer,
                      int64_t* skipped) {
  if (in.format == "text") {
    LOOM_ASSIGN_OR_RETURN(std::string text, ReadFile(path, "--input"));
    return packer.Add(std::move(text));
  }
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("--input: cannot open '", path, "'"));
  std::string line;
  int64_t number = 0;
  while (std::getline(file, line)) {
    ++number;
    if (line.empty()) continue;
    if (in.format == "lines") {
      LOOM_RETURN_IF_ERROR(packer.Add(line));
      continue;
    }
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    const std::string why = JsonlProblem(j, in.field);
    if (why.empty()) {
      LOOM_RETURN_IF_ERROR(packer.Add(j[in.field].get<std::string>()));
    } else if (in.on_error == "fail") {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": ", why));
    } else {
      ++*skipped;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PackInput> PackInputFromArgs(const CliArgs& args) {
  PackInput in{args.Get("format", "text"), args.Get("on-error", "fail"), args.Get("field", "text")};
  if (in.format != "text" && in.format != "lines" && in.format != "jsonl") {
    return UsageError(absl::StrCat("--format: '", in.format, "' is not text | lines | jsonl"));
  }
  if (in.on_error != "fail" && in.on_error != "skip") {
    return UsageError(absl::StrCat("--on-error: '", in.on_error, "' is not fail | skip"));
  }
  return in;
}

absl::Status Pack(const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(std::string output, args.Require("output"));
  LOOM_RETURN_IF_ERROR(args.Require("input").status());
  LOOM_ASSIGN_OR_RETURN(const PackInput in, PackInputFromArgs(args));
  LOOM_ASSIGN_OR_RETURN(int64_t shard_tokens,
                        args.GetInt("shard-tokens", 1 << 24, 1, int64_t{1} << 32));
  LOOM_ASSIGN_OR_RETURN(auto tokenizer,
                        MakeTokenizer(args.Get("tokenizer", "byte"), args.Get("tokenizer-model")));
  const bool eos = args.Has("eos");
  if (eos && tokenizer->eos_id() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--eos: tokenizer ", tokenizer->Describe(), " has no EOS token"));
  }
  LOOM_ASSIGN_OR_RETURN(
      auto writer, TokenShardWriter::Create(output, tokenizer->vocab_size(), tokenizer->Describe(),
                                            static_cast<uint64_t>(shard_tokens)));
  LOOM_ASSIGN_OR_RETURN(const int64_t threads, args.GetInt("threads", 1, 1, 256));
  DocumentPacker packer(*tokenizer, *writer, threads, eos);
  int64_t skipped = 0;
  for (const std::string& path : Inputs(args)) {
    LOOM_RETURN_IF_ERROR(PackFile(path, in, packer, &skipped));
  }
  LOOM_RETURN_IF_ERROR(packer.Flush());
  LOOM_ASSIGN_OR_RETURN(TokenIndex index, writer->Finish());
  std::cout << "packed " << index.documents << " documents, " << index.total_tokens << " tokens ("
            << index.dtype << ", vocabulary " << index.vocab_size << ", " << index.tokenizer
            << ") into " << index.shards.size() << " shard(s) in " << output << "\n";
  if (skipped > 0) std::cout << "skipped " << skipped << " malformed line(s)\n";
  return absl::OkStatus();
}

absl::Status Info(const std::string& dir, bool verify) {
  if (verify) {
    LOOM_ASSIGN_OR_RETURN(auto shards, TokenShards::Open(dir, true));
    std::cout << dir << ": " << shards->index().shards.size() << " shard(s) verified\n";
    return absl::OkStatus();
  }
  LOOM_ASSIGN_OR_RETURN(TokenIndex index, ReadTokenIndex(dir));
  std::cout << "tokenizer " << index.tokenizer << ", vocabulary " << index.vocab_size << ", "
            << index.dtype << "\n"
            << index.documents << " documents, " << index.total_tokens << " tokens\n";
  for (const auto& s : index.shards)
    std::cout << "  " << s.file << "  " << s.tokens << " tokens  crc32c " << s.crc32c << "\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace loom::data

int main(int argc, char** argv) {
  using namespace loom;
  using namespace loom::data;
  if (argc < 2 || std::string(argv[1]) == "help" || std::string(argv[1]) == "--help") {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  absl::Status status;
  if (command == "pack") {
    auto args = CliArgs::Parse(argc, argv, 2,
                               {"output", "input", "format", "field", "tokenizer",
                                "tokenizer-model", "shard-tokens", "on-error", "threads"},
                               {"eos"});
    status = args.ok() ? Pack(*args) : args.status();
  } else if (command == "chat") {
    auto args = CliArgs::Parse(argc, argv, 2, {"input", "tokenizer", "tokenizer-model"});
    status = args.ok() ? Chat(*args) : args.status();
  } else if (command == "encode") {
    auto args = CliArgs::Parse(argc, argv, 2, {"input", "tokenizer", "tokenizer-model"});
    status = args.ok() ? Encode(*args) : args.status();
  } else if (command == "info" || command == "verify") {
    status = argc == 3 ? Info(argv[2], command == "verify")
                       : UsageError(absl::StrCat(command, " takes one directory"));
  } else if (command == "train-tokenizer") {
    auto args = CliArgs::Parse(argc, argv, 2, {"input", "vocab-size", "output"});
    status = args.status();
    if (args.ok()) {
      auto vocab = args->GetInt("vocab-size", 0, 8, 1 << 20);
      auto out = args->Require("output");
      status = !vocab.ok() ? vocab.status()
               : !out.ok() ? out.status()
                           : TrainSentencePiece(Inputs(*args), static_cast<int>(*vocab), *out);
      if (status.ok()) std::cout << "wrote " << *out << ".model and " << *out << ".vocab\n";
    }
  } else {
    std::cerr << "loom-data: unknown command '" << command << "'\n" << kUsage;
    return 2;
  }
  if (!status.ok()) {
    std::cerr << "loom-data " << command << ": " << status.message() << "\n";
    return IsUsageError(status) ? 2 : 1;
  }
  return 0;
}
