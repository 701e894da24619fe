// The tokenizer a job's text goes through: bytes (the default), a Hugging Face tokenizer.json
// (data.tokenizer bpe), or what a loom-data dataset was packed with; and the chat tokens an SFT
// objective uses with it. The trainer, checkpoint loading (generate, score, serve) and the
// reasoning eval all take it from here, so a model is always read with the tokenizer it was
// trained with.
#ifndef LOOM_WORKER_TRAINER_JOB_TOKENIZER_H_
#define LOOM_WORKER_TRAINER_JOB_TOKENIZER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "data/chat.h"
#include "data/tokenizer.h"
#include "loom/v1/job.pb.h"

namespace loom::trainer {

// data.tokenizer / data.tokenizer_path, or the dataset's own for source shards. A SentencePiece
// dataset's model cannot be loaded in this process (Debian's libsentencepiece carries its own
// protobuf, data/CMakeLists.txt): Unimplemented.
absl::StatusOr<std::unique_ptr<data::Tokenizer>> JobTokenizer(const v1::JobSpec& spec);

// The tokenizer's vocabulary and, for a tokenizer.json with Llama 3's <|start_header_id|>,
// <|end_header_id|> and <|eot_id|>, those ids (data::ChatTemplateFor).
data::ChatTemplate ChatTokensOf(const data::Tokenizer& tokenizer);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_JOB_TOKENIZER_H_
