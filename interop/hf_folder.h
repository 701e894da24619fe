// Hugging Face model folders: export a Loom checkpoint as one, import one as a Loom checkpoint
// (docs/interop.md has the exact name mapping and every decision).
//
// Export writes `config.json` (LlamaForCausalLM for all-global SwiGLU models with RoPE,
// MistralForCausalLM with `sliding_window` for all-local ones, else LoomIhaForCausalLM: IHA,
// hybrid and mixed stacks, GELU FFNs, no RoPE), the weights under Hugging Face names
// (`model.safetensors`, or shards and `model.safetensors.index.json`), `generation_config.json`,
// the tokenizer files and, for LoomIhaForCausalLM, `modeling_loom_iha.py` (a readable PyTorch
// implementation that `transformers` loads with trust_remote_code and that also runs with plain
// torch). Import reads Llama, Mistral and Loom-IHA folders back into a weights-only checkpoint
// for `--init-from`. Tensor bytes are copied, never recomputed: a round trip is bitwise.
//
// No LibTorch: both directions work on safetensors bytes and the model spec.
#ifndef LOOM_INTEROP_HF_FOLDER_H_
#define LOOM_INTEROP_HF_FOLDER_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "loom/v1/model.pb.h"

namespace loom::interop {

struct ExportOptions {
  std::string checkpoint;  // a step directory, or a checkpoint root (its newest intact one)
  std::string out_dir;     // created; must not exist or be empty
  // Largest weights file; more weights go into numbered shards with an index (transformers'
  // default max_shard_size is 5 GB).
  uint64_t max_shard_bytes = 5'000'000'000;
};

struct ExportSummary {
  std::string architecture;  // "LlamaForCausalLM", "MistralForCausalLM", "LoomIhaForCausalLM"
  std::string checkpoint_dir;
  int64_t step = 0;
  int64_t tensors = 0;
  uint64_t bytes = 0;
  int shards = 0;
};

absl::StatusOr<ExportSummary> ExportHuggingFace(const ExportOptions& options);

struct ImportOptions {
  std::string in_dir;    // config.json + model.safetensors (or an index and its shards)
  std::string out_root;  // checkpoint root: step-00000000/ is committed inside, model.json beside
  // RoPE pairing of the source's q/k rows: "half" (Hugging Face's rotate-half layout, what every
  // transformers folder holds, and Loom's) or "interleaved" (dimension pairs (2i, 2i+1), Meta's
  // original Llama layout): those rows are permuted into Loom's.
  std::string rope_pairing = "half";
  int64_t max_seq_len = 0;  // 0 = the folder's max_position_embeddings
};

struct ImportSummary {
  std::string architecture;
  std::string checkpoint_dir;  // the committed step directory
  int64_t tensors = 0;
  v1::ModelConfig model;  // what a job that starts from the checkpoint must use
};

absl::StatusOr<ImportSummary> ImportHuggingFace(const ImportOptions& options);

// What import-hf reads before any weight, from the files' text (no file access; the fuzz
// harness fuzz/hf_import_fuzzer.cc drives these). config.json: the architecture and the Loom
// model it describes (max_seq_len 0 = max_position_embeddings).
struct HfConfig {
  std::string architecture;
  v1::ModelConfig model;
};
absl::StatusOr<HfConfig> ParseHfConfig(const std::string& text, int64_t max_seq_len);
// model.safetensors.index.json: the tensor names each shard file of the folder holds.
absl::StatusOr<std::map<std::string, std::set<std::string>>> ParseWeightIndex(
    const std::string& text);

// The Python implementation written next to a LoomIhaForCausalLM export (embedded at build).
std::string_view ModelingLoomIhaPy();

}  // namespace loom::interop

#endif  // LOOM_INTEROP_HF_FOLDER_H_
