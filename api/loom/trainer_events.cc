#include "loom/trainer_events.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace loom {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using Json = nlohmann::ordered_json;

Json FieldValue(const Message& m, const FieldDescriptor& f) {
  const auto& r = *m.GetReflection();
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return r.GetInt32(m, &f);
    case FieldDescriptor::CPPTYPE_INT64:
      return r.GetInt64(m, &f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return r.GetUInt32(m, &f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return r.GetUInt64(m, &f);
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const double v = r.GetDouble(m, &f);
      return std::isfinite(v) ? Json(v) : Json();
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      const float v = r.GetFloat(m, &f);
      return std::isfinite(v) ? Json(v) : Json();
    }
    case FieldDescriptor::CPPTYPE_BOOL:
      return r.GetBool(m, &f);
    case FieldDescriptor::CPPTYPE_STRING:
      return r.GetString(m, &f);
    case FieldDescriptor::CPPTYPE_ENUM:
      return r.GetEnum(m, &f)->name();
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;  // event messages are flat
  }
  return Json();
}

// A repeated scalar field as a JSON array (the reasoning evaluation's per-problem scores).
Json RepeatedValue(const Message& m, const FieldDescriptor& f) {
  const auto& r = *m.GetReflection();
  Json list = Json::array();
  for (int i = 0; i < r.FieldSize(m, &f); ++i) {
    switch (f.cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        list.push_back(r.GetRepeatedInt32(m, &f, i));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        list.push_back(r.GetRepeatedInt64(m, &f, i));
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        list.push_back(r.GetRepeatedBool(m, &f, i));
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        list.push_back(r.GetRepeatedDouble(m, &f, i));
        break;
      default:  // not in any event: a new kind needs its case here
        return Json();
    }
  }
  return list;
}

}  // namespace

std::string TrainerEventLine(const v1::TrainerEvent& event) {
  Json j = Json::object();
  const auto& r = *event.GetReflection();
  const FieldDescriptor* kind =
      r.GetOneofFieldDescriptor(event, v1::TrainerEvent::descriptor()->FindOneofByName("kind"));
  if (kind == nullptr) return "{}";
  j["event"] = kind->name();
  const Message& body = r.GetMessage(event, kind);
  const auto* d = body.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor& f = *d->field(i);
    if (f.is_repeated()) {
      j[f.name()] = RepeatedValue(body, f);
      continue;
    }
    if (f.has_presence() && !body.GetReflection()->HasField(body, &f)) continue;
    j[f.name()] = FieldValue(body, f);
  }
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

absl::StatusOr<v1::TrainerEvent> ParseTrainerEventLine(std::string_view line) {
  Json j = Json::parse(line.begin(), line.end(), nullptr, false);
  if (!j.is_object() || !j.contains("event") || !j["event"].is_string()) {
    return absl::InvalidArgumentError("trainer event: not a JSON object with an \"event\"");
  }
  const std::string kind = j["event"].get<std::string>();
  v1::TrainerEvent event;
  const FieldDescriptor* f = v1::TrainerEvent::descriptor()->FindFieldByName(kind);
  if (f == nullptr || f->containing_oneof() == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("trainer event: unknown event '", kind, "'"));
  }
  j.erase("event");
  for (auto it = j.begin(); it != j.end();) it = it.value().is_null() ? j.erase(it) : std::next(it);
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  Message* body = event.GetReflection()->MutableMessage(&event, f);
  const auto status = google::protobuf::util::JsonStringToMessage(j.dump(), body, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer event '", kind, "': ", std::string(status.message())));
  }
  return event;
}

}  // namespace loom
