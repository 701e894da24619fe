#include "worker/trainer/tensor_io.h"

#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "storage/safetensors.h"

namespace loom::trainer {
namespace {

using storage::DType;

absl::StatusOr<torch::ScalarType> ToScalarType(DType dtype) {
  switch (dtype) {
    case DType::kF64:
      return torch::kFloat64;
    case DType::kF32:
      return torch::kFloat32;
    case DType::kF16:
      return torch::kFloat16;
    case DType::kBF16:
      return torch::kBFloat16;
    case DType::kI64:
      return torch::kInt64;
    case DType::kI32:
      return torch::kInt32;
    case DType::kU8:
      return torch::kUInt8;
    case DType::kBool:
      return torch::kBool;
  }
  return absl::InvalidArgumentError("unknown dtype");
}

absl::StatusOr<DType> ToDType(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat64:
      return DType::kF64;
    case torch::kFloat32:
      return DType::kF32;
    case torch::kFloat16:
      return DType::kF16;
    case torch::kBFloat16:
      return DType::kBF16;
    case torch::kInt64:
      return DType::kI64;
    case torch::kInt32:
      return DType::kI32;
    case torch::kUInt8:
      return DType::kU8;
    case torch::kBool:
      return DType::kBool;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", c10::toString(type), " has no safetensors encoding in Loom"));
  }
}

}  // namespace

absl::StatusOr<std::map<std::string, torch::Tensor>> TensorsFromFile(
    const storage::SafetensorsFile& file) {
  std::map<std::string, torch::Tensor> out;
  for (const storage::TensorInfo& info : file.tensors()) {
    auto type = ToScalarType(info.dtype);
    if (!type.ok()) return type.status();
    torch::Tensor t = torch::empty(info.shape, torch::TensorOptions().dtype(*type));
    std::string_view data = file.Data(info);
    if (!data.empty()) std::memcpy(t.data_ptr(), data.data(), data.size());
    out.emplace(info.name, std::move(t));
  }
  return out;
}

absl::StatusOr<std::map<std::string, torch::Tensor>> LoadTensors(const std::string& path) {
  auto file = storage::SafetensorsFile::Read(path);
  if (!file.ok()) return file.status();
  return TensorsFromFile(*file);
}

absl::StatusOr<WritableTensors> ToWritable(const NamedTensors& tensors) {
  WritableTensors out;
  out.keep.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    auto dtype = ToDType(tensor.scalar_type());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': ", dtype.status().message()));
    }
    out.keep.push_back(tensor.detach().to(torch::kCPU).contiguous());
    const torch::Tensor& t = out.keep.back();
    out.items.push_back({name, *dtype, t.sizes().vec(), t.data_ptr(),
                         static_cast<size_t>(t.numel()) * t.element_size()});
  }
  return out;
}

absl::Status SaveTensors(const std::string& path, const NamedTensors& tensors,
                         const std::map<std::string, std::string>& metadata) {
  auto writable = ToWritable(tensors);
  if (!writable.ok())
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", writable.status().message()));
  return storage::Write(path, writable->items, metadata);
}

absl::Status LoadIntoModule(torch::nn::Module& module,
                            const std::map<std::string, torch::Tensor>& tensors) {
  std::vector<std::string> missing, mismatched;
  std::set<std::string> used;
  torch::NoGradGuard no_grad;
  auto copy_into = [&](const std::string& name, torch::Tensor& target) {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      missing.push_back(name);
      return;
    }
    used.insert(name);
    if (it->second.sizes() != target.sizes()) {
      mismatched.push_back(absl::StrCat(name, " (expected [", absl::StrJoin(target.sizes(), ", "),
                                        "], got [", absl::StrJoin(it->second.sizes(), ", "), "])"));
      return;
    }
    target.copy_(it->second.to(target.dtype()));
  };
  for (auto& item : module.named_parameters()) copy_into(item.key(), item.value());
  for (auto& item : module.named_buffers()) copy_into(item.key(), item.value());
  std::vector<std::string> unexpected;
  for (const auto& [name, t] : tensors) {
    if (used.count(name) == 0) unexpected.push_back(name);
  }
  if (missing.empty() && mismatched.empty() && unexpected.empty()) return absl::OkStatus();
  std::vector<std::string> parts;
  if (!missing.empty()) parts.push_back(absl::StrCat("missing: ", absl::StrJoin(missing, ", ")));
  if (!mismatched.empty())
    parts.push_back(absl::StrCat("wrong shape: ", absl::StrJoin(mismatched, ", ")));
  if (!unexpected.empty())
    parts.push_back(absl::StrCat("unexpected: ", absl::StrJoin(unexpected, ", ")));
  return absl::InvalidArgumentError(absl::StrJoin(parts, "; "));
}

NamedTensors ModuleTensors(const torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& item : module.named_parameters())
    out.emplace_back(item.key(), item.value().detach());
  for (const auto& item : module.named_buffers())
    out.emplace_back(item.key(), item.value().detach());
  return out;
}

}  // namespace loom::trainer
