// safetensors codec (https://github.com/huggingface/safetensors, format v0.x): an 8-byte
// little-endian header length, a JSON header mapping tensor names to {dtype, shape,
// data_offsets} (plus an optional "__metadata__" string map), then the raw little-endian data.
//
// Reading treats every file as hostile: the header length is bounded, the JSON must be
// well-formed with no duplicate keys, every dtype known, every shape non-negative with
// shape × element size == byte span (no overflow), offsets in range, spans non-overlapping and
// covering the data section exactly. Errors name the file and what is wrong.
//
// Writing produces files that Python's safetensors and PyTorch load: header padded with spaces
// to 8 bytes, tensors laid out in order with no gaps; written to a temporary file, fsync'ed and
// renamed into place so readers never see a partial file.
//
// No LibTorch here: the control plane reads checkpoints too. worker/trainer/tensor_io bridges to
// torch::Tensor.
#ifndef LOOM_STORAGE_SAFETENSORS_H_
#define LOOM_STORAGE_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace loom::storage {

enum class DType { kF64, kF32, kF16, kBF16, kI64, kI32, kU8, kBool };

std::string_view DTypeName(DType dtype);  // "F64", "F32", ...
absl::StatusOr<DType> ParseDType(std::string_view name);
size_t DTypeSize(DType dtype);

// Header bound, as in the reference implementation: larger headers are rejected unread.
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

// A parsed file held in memory. Tensor data are views into `bytes`.
class SafetensorsFile {
 public:
  // Parses and validates a whole file's contents. `source` names it in errors.
  static absl::StatusOr<SafetensorsFile> Parse(std::string bytes, std::string source = "<memory>");
  static absl::StatusOr<SafetensorsFile> Read(const std::string& path);

  // Tensors in data-offset order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorInfo* Find(std::string_view name) const;
  // The tensor's bytes (little-endian, row-major).
  std::string_view Data(const TensorInfo& info) const;

 private:
  std::string bytes_;
  size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // shape-product × DTypeSize bytes, little-endian, row-major
  size_t size_bytes = 0;
};

// Serialises tensors and metadata. Tensors are laid out by element size, largest first (stable
// otherwise), so every tensor stays aligned to its element size as in the reference writer. Fails
// on duplicate or reserved names and on data sizes that do not match the shape.
absl::StatusOr<std::string> Serialize(const std::vector<TensorToWrite>& tensors,
                                      const std::map<std::string, std::string>& metadata = {});

// Writes `bytes` to a temporary file next to `path`, fsyncs it, renames it over `path` and
// fsyncs the directory: readers see the old file or the new one, never a part.
absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes);

// Serialize, then write atomically (temporary file in the same directory, fsync, rename).
absl::Status Write(const std::string& path, const std::vector<TensorToWrite>& tensors,
                   const std::map<std::string, std::string>& metadata = {});

}  // namespace loom::storage

#endif  // LOOM_STORAGE_SAFETENSORS_H_
