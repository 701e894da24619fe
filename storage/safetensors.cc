#include "storage/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "storage/confined_files.h"

namespace loom::storage {
namespace {

using nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {DType::kF64, "F64", 8},   {DType::kF32, "F32", 4},   {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2}, {DType::kI64, "I64", 8},   {DType::kI32, "I32", 4},
    {DType::kU8, "U8", 1},     {DType::kBool, "BOOL", 1},
};

// Parses JSON while rejecting duplicate object keys, which nlohmann would silently collapse.
absl::StatusOr<json> ParseStrictJson(std::string_view text, const std::string& source) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  json::parser_callback_t callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && parsed.is_string() &&
            !keys.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      default:
        break;
    }
    return true;
  };
  json value = json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": header is not well-formed JSON"));
  }
  if (!duplicate.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": header has duplicate key '", duplicate, "'"));
  }
  return value;
}

absl::StatusOr<uint64_t> ReadUnsigned(const json& v, const std::string& what) {
  if (!v.is_number_unsigned()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be a non-negative integer"));
  }
  return v.get<uint64_t>();
}

}  // namespace

std::string_view DTypeName(DType dtype) {
  for (const auto& e : kDTypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  for (const auto& e : kDTypes) {
    if (e.name == name) return e.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype '", std::string(name), "'"));
}

size_t DTypeSize(DType dtype) {
  for (const auto& e : kDTypes) {
    if (e.dtype == dtype) return e.size;
  }
  return 0;
}

namespace {

// The error messages below name what is wrong; Parse prefixes the source.
absl::Status Bad(const std::string& what) { return absl::InvalidArgumentError(what); }

// The header's length from the first 8 bytes (little-endian), checked against the file.
absl::StatusOr<uint64_t> HeaderLength(const std::string& bytes) {
  if (bytes.size() < 8) {
    return Bad(
        absl::StrCat("file is ", bytes.size(), " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > kMaxHeaderBytes) {
    return Bad(
        absl::StrCat("header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes));
  }
  if (header_len > bytes.size() - 8) {
    return Bad(absl::StrCat("header length ", header_len, " runs past the end of the file (",
                            bytes.size() - 8, " bytes after the length)"));
  }
  return header_len;
}

// A shape and its byte count, with overflow checks: a hostile shape must not wrap around to a
// small span.
absl::StatusOr<unsigned __int128> ReadShape(const json& shape, const std::string& where,
                                            TensorInfo* info) {
  if (!shape.is_array()) return Bad(absl::StrCat(where, ": shape must be an array"));
  if (shape.size() > 64) return Bad(absl::StrCat(where, ": shape has more than 64 dimensions"));
  unsigned __int128 nbytes = DTypeSize(info->dtype);
  for (const json& dim : shape) {
    auto d = ReadUnsigned(dim, absl::StrCat(where, ": shape entries"));
    if (!d.ok()) return Bad(std::string(d.status().message()));
    if (*d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Bad(absl::StrCat(where, ": shape entry ", *d, " is too large"));
    }
    info->shape.push_back(static_cast<int64_t>(*d));
    nbytes *= *d;
    if (nbytes > std::numeric_limits<uint64_t>::max()) {
      return Bad(absl::StrCat(where, ": shape describes more bytes than can exist"));
    }
  }
  return nbytes;
}

// data_offsets [begin, end] within the data section, spanning exactly the shape's bytes.
absl::Status ReadOffsets(const json& offsets, const std::string& where, uint64_t data_size,
                         unsigned __int128 nbytes, TensorInfo* info) {
  if (!offsets.is_array() || offsets.size() != 2) {
    return Bad(absl::StrCat(where, ": data_offsets must be [begin, end]"));
  }
  auto begin = ReadUnsigned(offsets[0], absl::StrCat(where, ": data_offsets"));
  auto end = ReadUnsigned(offsets[1], absl::StrCat(where, ": data_offsets"));
  if (!begin.ok()) return Bad(std::string(begin.status().message()));
  if (!end.ok()) return Bad(std::string(end.status().message()));
  if (*begin > *end) {
    return Bad(absl::StrCat(where, ": data_offsets begin ", *begin, " > end ", *end));
  }
  if (*end > data_size) {
    return Bad(absl::StrCat(where, ": data_offsets end ", *end, " is past the data section of ",
                            data_size, " bytes"));
  }
  if (static_cast<unsigned __int128>(*end - *begin) != nbytes) {
    return Bad(absl::StrCat(where, ": shape needs ", static_cast<uint64_t>(nbytes),
                            " bytes but data_offsets span ", *end - *begin));
  }
  info->begin = *begin;
  info->end = *end;
  return absl::OkStatus();
}

// One tensor's header entry: exactly dtype, shape and data_offsets.
absl::StatusOr<TensorInfo> ReadTensorEntry(const std::string& name, const json& entry,
                                           uint64_t data_size) {
  const std::string where = absl::StrCat("tensor '", name, "'");
  if (!entry.is_object()) return Bad(absl::StrCat(where, " must be an object"));
  for (const auto& [k, v] : entry.items()) {
    if (k != "dtype" && k != "shape" && k != "data_offsets") {
      return Bad(absl::StrCat(where, " has unknown field '", k, "'"));
    }
  }
  if (!entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets")) {
    return Bad(absl::StrCat(where, " needs dtype, shape and data_offsets"));
  }
  TensorInfo info;
  info.name = name;
  if (!entry["dtype"].is_string()) return Bad(absl::StrCat(where, ": dtype must be a string"));
  auto dtype = ParseDType(entry["dtype"].get<std::string>());
  if (!dtype.ok()) return Bad(absl::StrCat(where, ": ", dtype.status().message()));
  info.dtype = *dtype;
  LOOM_ASSIGN_OR_RETURN(const unsigned __int128 nbytes, ReadShape(entry["shape"], where, &info));
  LOOM_RETURN_IF_ERROR(ReadOffsets(entry["data_offsets"], where, data_size, nbytes, &info));
  return info;
}

// Sorted by offset, the tensors must tile the data section: no overlap, gap or trailing bytes.
absl::Status CheckTiling(std::vector<TensorInfo>& tensors, uint64_t data_size) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : tensors) {
    if (t.begin < cursor) {
      return Bad(absl::StrCat("tensor '", t.name, "' overlaps tensor '", previous->name, "'"));
    }
    if (t.begin > cursor) {
      return Bad(absl::StrCat("gap of ", t.begin - cursor, " bytes before tensor '", t.name, "'"));
    }
    cursor = t.end;
    previous = &t;
  }
  if (cursor != data_size) {
    return Bad(absl::StrCat(data_size - cursor, " trailing bytes after the last tensor"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::string bytes, std::string source) {
  auto fail = [&](const absl::Status& s) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", s.message()));
  };
  const absl::StatusOr<uint64_t> header_len = HeaderLength(bytes);
  if (!header_len.ok()) return fail(header_len.status());
  std::string_view header(bytes.data() + 8, *header_len);
  if (header.empty() || header.front() != '{') return fail(Bad("header must be a JSON object"));
  auto parsed = ParseStrictJson(header, source);
  if (!parsed.ok()) return parsed.status();
  const json& root = *parsed;
  if (!root.is_object()) return fail(Bad("header must be a JSON object"));
  SafetensorsFile file;
  file.data_start_ = 8 + *header_len;
  const uint64_t data_size = bytes.size() - file.data_start_;
  for (const auto& [name, entry] : root.items()) {
    if (name != kMetadataKey) {
      absl::StatusOr<TensorInfo> info = ReadTensorEntry(name, entry, data_size);
      if (!info.ok()) return fail(info.status());
      file.tensors_.push_back(*std::move(info));
      continue;
    }
    if (!entry.is_object()) return fail(Bad("__metadata__ must be an object of strings"));
    for (const auto& [k, v] : entry.items()) {
      if (!v.is_string()) return fail(Bad(absl::StrCat("__metadata__.", k, " must be a string")));
      file.metadata_[k] = v.get<std::string>();
    }
  }
  if (absl::Status s = CheckTiling(file.tensors_, data_size); !s.ok()) return fail(s);
  file.bytes_ = std::move(bytes);
  return file;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Read(const std::string& path) {
  auto bytes = ReadConfinedFile(path);
  if (!bytes.ok()) return bytes.status();
  return Parse(*std::move(bytes), path);
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  for (const TensorInfo& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::string_view SafetensorsFile::Data(const TensorInfo& info) const {
  return std::string_view(bytes_.data() + data_start_ + info.begin, info.end - info.begin);
}

absl::StatusOr<std::string> Serialize(const std::vector<TensorToWrite>& tensors,
                                      const std::map<std::string, std::string>& metadata) {
  std::vector<const TensorToWrite*> order;
  std::set<std::string_view> names;
  for (const TensorToWrite& t : tensors) {
    if (t.name == kMetadataKey) {
      return absl::InvalidArgumentError("tensor name '__metadata__' is reserved");
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name '", t.name, "'"));
    }
    uint64_t expected = DTypeSize(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0)
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", t.name, "': negative dimension"));
      expected *= static_cast<uint64_t>(d);
    }
    if (expected != t.size_bytes || (expected > 0 && t.data == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': shape needs ",
                                                     expected, " bytes, got ", t.size_bytes));
    }
    order.push_back(&t);
  }
  std::stable_sort(order.begin(), order.end(), [](const TensorToWrite* a, const TensorToWrite* b) {
    return DTypeSize(a->dtype) > DTypeSize(b->dtype);
  });

  json header = json::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  uint64_t offset = 0;
  for (const TensorToWrite* t : order) {
    header[t->name] = {{"dtype", std::string(DTypeName(t->dtype))},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + t->size_bytes}}};
    offset += t->size_bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  std::string out;
  out.reserve(8 + text.size() + offset);
  uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  out += text;
  for (const TensorToWrite* t : order) {
    out.append(static_cast<const char*>(t->data), t->size_bytes);
  }
  return out;
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    return absl::InternalError(absl::StrCat(tmp, ": cannot create: ", std::strerror(errno)));
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::InternalError(absl::StrCat(tmp, ": write failed: ", std::strerror(err)));
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat(tmp, ": fsync/close failed: ", std::strerror(err)));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": rename failed: ", std::strerror(err)));
  }
  // Make the rename itself durable.
  const size_t slash = path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

absl::Status Write(const std::string& path, const std::vector<TensorToWrite>& tensors,
                   const std::map<std::string, std::string>& metadata) {
  auto bytes = Serialize(tensors, metadata);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", bytes.status().message()));
  }
  return WriteFileAtomically(path, *bytes);
}

}  // namespace loom::storage
