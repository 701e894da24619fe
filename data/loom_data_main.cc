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
#include "bpe_tokenizer.h"
#include "chat.h"
#include "loom/cli_args.h"
#include "loom/status_macros.h"
#include "token_shards.h"
#include "tokenizer.h"

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

absl::Status Pack(const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(std::string output, args.Require("output"));
  LOOM_RETURN_IF_ERROR(args.Require("input").status());
  const std::string format = args.Get("format", "text");
  if (format != "text" && format != "lines" && format != "jsonl") {
    return absl::InvalidArgumentError(
        absl::StrCat("--format: '", format, "' is not text | lines | jsonl"));
  }
  const std::string on_error = args.Get("on-error", "fail");
  if (on_error != "fail" && on_error != "skip") {
    return absl::InvalidArgumentError(
        absl::StrCat("--on-error: '", on_error, "' is not fail | skip"));
  }
  const std::string field = args.Get("field", "text");
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
  int64_t skipped = 0;
  // Documents are tokenized in batches, each split over the threads, and written in order.
  std::vector<std::string> batch;
  size_t batch_bytes = 0;
  auto flush = [&]() -> absl::Status {
    std::vector<std::vector<uint32_t>> ids(batch.size());
    auto work = [&](size_t first, size_t step) {
      for (size_t i = first; i < batch.size(); i += step) ids[i] = tokenizer->Encode(batch[i]);
    };
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work, t, threads);
    work(0, static_cast<size_t>(threads));
    for (auto& t : pool) t.join();
    for (auto& d : ids) {
      if (eos) d.push_back(static_cast<uint32_t>(tokenizer->eos_id()));
      LOOM_RETURN_IF_ERROR(writer->AddDocument(d));
    }
    batch.clear();
    batch_bytes = 0;
    return absl::OkStatus();
  };
  auto add = [&](std::string text) -> absl::Status {
    batch_bytes += text.size();
    batch.push_back(std::move(text));
    return batch.size() >= 4096 || batch_bytes >= (32u << 20) ? flush() : absl::OkStatus();
  };
  for (const std::string& path : Inputs(args)) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat("--input: cannot open '", path, "'"));
    if (format == "text") {
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      LOOM_RETURN_IF_ERROR(add(text));
      continue;
    }
    std::string line;
    int64_t number = 0;
    while (std::getline(in, line)) {
      ++number;
      if (line.empty()) continue;
      if (format == "lines") {
        LOOM_RETURN_IF_ERROR(add(line));
        continue;
      }
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      std::string why;
      if (j.is_discarded()) {
        why = "not valid JSON";
      } else if (!j.is_object() || !j.contains(field)) {
        why = absl::StrCat("no \"", field, "\" field");
      } else if (!j[field].is_string()) {
        why = absl::StrCat("\"", field, "\" is not a string");
      }
      if (!why.empty()) {
        if (on_error == "fail")
          return absl::InvalidArgumentError(absl::StrCat(path, ":", number, ": ", why));
        ++skipped;
        continue;
      }
      LOOM_RETURN_IF_ERROR(add(j[field].get<std::string>()));
    }
  }
  LOOM_RETURN_IF_ERROR(flush());
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
                       : absl::InvalidArgumentError(absl::StrCat(command, " takes one directory"));
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
    return absl::IsInvalidArgument(status) || absl::IsNotFound(status) ||
                   absl::IsAlreadyExists(status)
               ? 2
               : 1;
  }
  return 0;
}
