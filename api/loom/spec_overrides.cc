#include "loom/spec_overrides.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <cmath>
#include <limits>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "base/status_macros.h"

namespace loom {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::ListValue;
using google::protobuf::Message;
using google::protobuf::Reflection;
using google::protobuf::Struct;
using google::protobuf::Value;
using Steps = absl::Span<const PathStep>;

constexpr int kMaxIndex = 1000;

const FieldDescriptor* FindField(const Message& m, const std::string& name) {
  const auto* d = m.GetDescriptor();
  const FieldDescriptor* f = d->FindFieldByName(name);
  return f != nullptr ? f : d->FindFieldByCamelcaseName(name);
}

std::string Indexed(const std::string& where, int index) {
  return absl::StrCat(where, "[", index, "]");
}

// Sets a singular field (index < 0), a list element (index < size) or appends one.
template <typename T>
void Store(Message* m, const FieldDescriptor* f, int index, T v,
           void (Reflection::*set)(Message*, const FieldDescriptor*, T) const,
           void (Reflection::*set_at)(Message*, const FieldDescriptor*, int, T) const,
           void (Reflection::*add)(Message*, const FieldDescriptor*, T) const) {
  const Reflection* r = m->GetReflection();
  if (index < 0) {
    (r->*set)(m, f, std::move(v));
  } else if (index < r->FieldSize(*m, f)) {
    (r->*set_at)(m, f, index, std::move(v));
  } else {
    (r->*add)(m, f, std::move(v));
  }
}

// One assignment: walks the path from a message down to the field and sets it from the text.
// `where` is the path walked so far, from the root message's type ("JobSpec.optimizer").
class Setter {
 public:
  Setter(std::string label, absl::string_view text, const ValueLimits& limits)
      : label_(std::move(label)), text_(std::string(text)), limits_(limits) {}

  absl::Status InMessage(Message* m, Steps steps, const std::string& where) {
    if (auto* s = google::protobuf::DynamicCastToGenerated<Struct>(m)) {
      return InStruct(s, steps, where);
    }
    if (auto* v = google::protobuf::DynamicCastToGenerated<Value>(m)) {
      return InValue(v, steps, where);
    }
    if (auto* l = google::protobuf::DynamicCastToGenerated<ListValue>(m)) {
      return InList(l, steps, where);
    }
    if (steps[0].index >= 0) return Error(absl::StrCat(where, " is not a list"));
    const FieldDescriptor* f = FindField(*m, steps[0].key);
    if (f == nullptr) return Error(absl::StrCat(where, " has no field '", steps[0].key, "'"));
    return InField(m, f, steps.subspan(1), absl::StrCat(where, ".", steps[0].key));
  }

 private:
  absl::Status Error(absl::string_view problem) const {
    return absl::InvalidArgumentError(absl::StrCat(label_, ": ", problem));
  }

  absl::Status InField(Message* m, const FieldDescriptor* f, Steps rest, const std::string& where) {
    if (f->is_map()) return rest.empty() ? ReplaceFromJson(m, f, where) : InMap(m, f, rest, where);
    if (f->is_repeated()) {
      if (rest.empty()) return ReplaceFromJson(m, f, where);
      if (rest[0].index < 0) return Error(absl::StrCat(where, " is a list: index it (name[N])"));
      return InListField(m, f, rest, where);
    }
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      Message* sub = m->GetReflection()->MutableMessage(m, f);
      return rest.empty() ? MessageFromJson(sub, where) : InMessage(sub, rest, where);
    }
    if (!rest.empty()) return NotAMessage(f, where);
    return SetScalar(m, f, -1);
  }

  absl::Status NotAMessage(const FieldDescriptor* f, const std::string& where) const {
    return Error(absl::StrCat(where, " (", f->type_name(), ") is not a message or list"));
  }

  absl::Status PastTheEnd(int index, int size, const std::string& where) const {
    return Error(absl::StrCat("index ", index, " past the end of ", where, " (it has ", size,
                              size == 1 ? " element)" : " elements)"));
  }

  // rest[0] indexes the repeated field f.
  absl::Status InListField(Message* m, const FieldDescriptor* f, Steps rest,
                           const std::string& where) {
    const Reflection* r = m->GetReflection();
    const int index = rest[0].index, size = r->FieldSize(*m, f);
    if (index > size) return PastTheEnd(index, size, where);
    rest = rest.subspan(1);
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) {
      return rest.empty() ? SetScalar(m, f, index) : NotAMessage(f, Indexed(where, index));
    }
    Message* e = index == size ? r->AddMessage(m, f) : r->MutableRepeatedMessage(m, f, index);
    return rest.empty() ? MessageFromJson(e, Indexed(where, index))
                        : InMessage(e, rest, Indexed(where, index));
  }

  // rest[0] names the key of the map field f (string keys).
  absl::Status InMap(Message* m, const FieldDescriptor* f, Steps rest, const std::string& where) {
    if (rest[0].index >= 0) return Error(absl::StrCat(where, " is a map: name a key (name.KEY)"));
    const FieldDescriptor* key = f->message_type()->map_key();
    if (key->cpp_type() != FieldDescriptor::CPPTYPE_STRING) {
      return Error(absl::StrCat(where, " has ", key->type_name(), " keys (only string keys)"));
    }
    const Reflection* r = m->GetReflection();
    Message* entry = nullptr;
    for (int i = 0; i < r->FieldSize(*m, f) && entry == nullptr; ++i) {
      Message* e = r->MutableRepeatedMessage(m, f, i);
      if (e->GetReflection()->GetString(*e, key) == rest[0].key) entry = e;
    }
    if (entry == nullptr) {
      entry = r->AddMessage(m, f);
      entry->GetReflection()->SetString(entry, key, rest[0].key);
    }
    return InField(entry, f->message_type()->map_value(), rest.subspan(1),
                   absl::StrCat(where, ".", rest[0].key));
  }

  absl::Status InStruct(Struct* s, Steps steps, const std::string& where) {
    if (steps[0].index >= 0) return Error(absl::StrCat(where, " is an object, not a list"));
    Value* v = &(*s->mutable_fields())[steps[0].key];
    return InValue(v, steps.subspan(1), absl::StrCat(where, ".", steps[0].key));
  }

  absl::Status InValue(Value* v, Steps steps, const std::string& where) {
    if (steps.empty()) {
      *v = JsonOrString();
      return absl::OkStatus();
    }
    const bool empty = v->kind_case() == Value::KIND_NOT_SET || v->kind_case() == Value::kNullValue;
    if (steps[0].index < 0) {
      if (empty) v->mutable_struct_value();
      if (!v->has_struct_value()) return Error(absl::StrCat(where, " is not an object"));
      return InStruct(v->mutable_struct_value(), steps, where);
    }
    if (empty) v->mutable_list_value();
    if (!v->has_list_value()) return Error(absl::StrCat(where, " is not a list"));
    return InList(v->mutable_list_value(), steps, where);
  }

  absl::Status InList(ListValue* l, Steps steps, const std::string& where) {
    const int index = steps[0].index, size = l->values_size();
    if (index < 0) return Error(absl::StrCat(where, " is a list: index it (name[N])"));
    if (index > size) return PastTheEnd(index, size, where);
    Value* e = index == size ? l->add_values() : l->mutable_values(index);
    return InValue(e, steps.subspan(1), Indexed(where, index));
  }

  // The text as a google.protobuf.Value: its JSON when it parses, else the string.
  Value JsonOrString() const {
    Value v;
    if (!google::protobuf::util::JsonStringToMessage(text_, &v).ok()) v.set_string_value(text_);
    return v;
  }

  absl::Status ParseJson(Message* out, const std::string& json, absl::string_view want,
                         const std::string& where) const {
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    const auto status = google::protobuf::util::JsonStringToMessage(json, out, options);
    if (status.ok()) return absl::OkStatus();
    return Error(absl::StrCat("'", text_, "' is not ", want, " for ", where, ": ",
                              status.message().as_string()));
  }

  // A whole message from JSON: Struct, Value and ListValue are replaced; other messages take
  // the fields the JSON names and keep the rest.
  absl::Status MessageFromJson(Message* target, const std::string& where) {
    if (auto* v = google::protobuf::DynamicCastToGenerated<Value>(target)) {
      *v = JsonOrString();
      return absl::OkStatus();
    }
    const bool list = google::protobuf::DynamicCastToGenerated<ListValue>(target) != nullptr;
    std::unique_ptr<Message> parsed(target->New());
    LOOM_RETURN_IF_ERROR(
        ParseJson(parsed.get(), text_, list ? "a JSON list" : "a JSON object", where));
    if (list || google::protobuf::DynamicCastToGenerated<Struct>(target) != nullptr) {
      target->CopyFrom(*parsed);
      return absl::OkStatus();
    }
    std::vector<const FieldDescriptor*> named;
    parsed->GetReflection()->ListFields(*parsed, &named);
    target->GetReflection()->SwapFields(target, parsed.get(), named);
    return absl::OkStatus();
  }

  // A list or map field as a whole, from a JSON list or object.
  absl::Status ReplaceFromJson(Message* m, const FieldDescriptor* f, const std::string& where) {
    std::unique_ptr<Message> parsed(m->New());
    LOOM_RETURN_IF_ERROR(ParseJson(parsed.get(), absl::StrCat("{\"", f->name(), "\": ", text_, "}"),
                                   f->is_map() ? "a JSON object" : "a JSON list", where));
    m->GetReflection()->SwapFields(m, parsed.get(), {f});
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> ParseSigned(int64_t min, int64_t max, absl::string_view type) const {
    int64_t v = 0;
    if (!absl::SimpleAtoi(text_, &v)) {
      return Error(absl::StrCat("'", text_, "' is not an integer"));
    }
    if (v < min || v > max) return Error(absl::StrCat(v, " is out of range for ", type));
    if (limits_.integer && (v < limits_.integer->first || v > limits_.integer->second)) {
      return OutOfLimits(v, *limits_.integer);
    }
    return v;
  }

  absl::StatusOr<uint64_t> ParseUnsigned(uint64_t max, absl::string_view type) const {
    if (limits_.integer) {
      // A caller's range is an int64 one: the text is read as one, as its flag always was.
      constexpr auto kMax = std::numeric_limits<int64_t>::max();
      LOOM_ASSIGN_OR_RETURN(int64_t v, ParseSigned(-kMax - 1, kMax, type));
      if (v < 0 || static_cast<uint64_t>(v) > max) {
        return Error(absl::StrCat(v, " is out of range for ", type));
      }
      return static_cast<uint64_t>(v);
    }
    uint64_t v = 0;
    if (!absl::SimpleAtoi(text_, &v)) {
      return Error(absl::StrCat("'", text_, "' is not a non-negative integer"));
    }
    if (v > max) return Error(absl::StrCat(v, " is out of range for ", type));
    return v;
  }

  absl::StatusOr<double> ParseReal(double max, absl::string_view type) const {
    double v = 0;
    if (!absl::SimpleAtod(text_, &v) || !std::isfinite(v)) {
      return Error(absl::StrCat("'", text_, "' is not a number"));
    }
    if (std::fabs(v) > max) return Error(absl::StrCat(v, " is out of range for ", type));
    if (limits_.real && (v < limits_.real->first || v > limits_.real->second)) {
      return OutOfLimits(v, *limits_.real);
    }
    return v;
  }

  template <typename V, typename L>
  absl::Status OutOfLimits(V v, const std::pair<L, L>& l) const {
    return Error(absl::StrCat(v, " is out of range [", l.first, ", ", l.second, "]"));
  }

  absl::StatusOr<bool> ParseBool() const {
    if (text_ == "true") return true;
    if (text_ == "false") return false;
    return Error(absl::StrCat("'", text_, "' is not true or false"));
  }

  absl::StatusOr<int> ParseEnum(const FieldDescriptor* f) const {
    const auto* type = f->enum_type();
    const auto* by_name = type->FindValueByName(text_);
    int number = 0;
    if (by_name != nullptr) return by_name->number();
    if (absl::SimpleAtoi(text_, &number) && type->FindValueByNumber(number) != nullptr) {
      return number;
    }
    std::vector<std::string> names;
    for (int i = 0; i < type->value_count(); ++i) names.push_back(type->value(i)->name());
    return Error(absl::StrCat("'", text_, "' is not one of ", absl::StrJoin(names, " | ")));
  }

  // The scalar field f (index < 0), its element `index`, or a new last element.
  absl::Status SetScalar(Message* m, const FieldDescriptor* f, int index) const {
    using R = Reflection;
    constexpr auto kInt32 = std::numeric_limits<int32_t>::max();
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32: {
        LOOM_ASSIGN_OR_RETURN(int64_t v, ParseSigned(-kInt32 - 1, kInt32, "int32"));
        Store<int32_t>(m, f, index, v, &R::SetInt32, &R::SetRepeatedInt32, &R::AddInt32);
        break;
      }
      case FieldDescriptor::CPPTYPE_INT64: {
        constexpr auto kMax = std::numeric_limits<int64_t>::max();
        LOOM_ASSIGN_OR_RETURN(int64_t v, ParseSigned(-kMax - 1, kMax, "int64"));
        Store<int64_t>(m, f, index, v, &R::SetInt64, &R::SetRepeatedInt64, &R::AddInt64);
        break;
      }
      case FieldDescriptor::CPPTYPE_UINT32: {
        LOOM_ASSIGN_OR_RETURN(uint64_t v,
                              ParseUnsigned(std::numeric_limits<uint32_t>::max(), "uint32"));
        Store<uint32_t>(m, f, index, v, &R::SetUInt32, &R::SetRepeatedUInt32, &R::AddUInt32);
        break;
      }
      case FieldDescriptor::CPPTYPE_UINT64: {
        LOOM_ASSIGN_OR_RETURN(uint64_t v,
                              ParseUnsigned(std::numeric_limits<uint64_t>::max(), "uint64"));
        Store<uint64_t>(m, f, index, v, &R::SetUInt64, &R::SetRepeatedUInt64, &R::AddUInt64);
        break;
      }
      case FieldDescriptor::CPPTYPE_DOUBLE: {
        LOOM_ASSIGN_OR_RETURN(double v, ParseReal(std::numeric_limits<double>::max(), "double"));
        Store<double>(m, f, index, v, &R::SetDouble, &R::SetRepeatedDouble, &R::AddDouble);
        break;
      }
      case FieldDescriptor::CPPTYPE_FLOAT: {
        LOOM_ASSIGN_OR_RETURN(double v, ParseReal(std::numeric_limits<float>::max(), "float"));
        Store<float>(m, f, index, static_cast<float>(v), &R::SetFloat, &R::SetRepeatedFloat,
                     &R::AddFloat);
        break;
      }
      case FieldDescriptor::CPPTYPE_BOOL: {
        LOOM_ASSIGN_OR_RETURN(bool v, ParseBool());
        Store<bool>(m, f, index, v, &R::SetBool, &R::SetRepeatedBool, &R::AddBool);
        break;
      }
      case FieldDescriptor::CPPTYPE_ENUM: {
        LOOM_ASSIGN_OR_RETURN(int v, ParseEnum(f));
        Store<int>(m, f, index, v, &R::SetEnumValue, &R::SetRepeatedEnumValue, &R::AddEnumValue);
        break;
      }
      case FieldDescriptor::CPPTYPE_STRING:
        Store<std::string>(m, f, index, text_, &R::SetString, &R::SetRepeatedString, &R::AddString);
        break;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        return absl::InternalError("SetScalar on a message field");
    }
    return absl::OkStatus();
  }

  std::string label_;
  std::string text_;
  const ValueLimits& limits_;
};

}  // namespace

absl::StatusOr<std::vector<PathStep>> ParseFieldPath(absl::string_view path) {
  std::vector<PathStep> steps;
  size_t at = 0;
  for (;;) {
    // A name runs to the next '.', '[' or ']'; then come its indices, then '.' or the end.
    const size_t stop = std::min(path.find_first_of(".[]", at), path.size());
    if (stop == at) return absl::InvalidArgumentError("empty path component");
    steps.push_back({std::string(path.substr(at, stop - at))});
    at = stop;
    while (at < path.size() && path[at] == '[') {
      const size_t close = path.find(']', at);
      int index = -1;
      if (close == absl::string_view::npos ||
          !absl::SimpleAtoi(path.substr(at + 1, close - at - 1), &index) || index < 0 ||
          index > kMaxIndex) {
        return absl::InvalidArgumentError("malformed index (want name[N])");
      }
      steps.push_back({"", index});
      at = close + 1;
    }
    if (at == path.size()) return steps;
    if (path[at] != '.') return absl::InvalidArgumentError("malformed index (want name[N])");
    ++at;
  }
}

absl::Status SetFieldFromText(Message* message, absl::string_view path, absl::string_view value,
                              absl::string_view label, const ValueLimits& limits) {
  const std::string prefix = label.empty() ? absl::StrCat("--set ", path) : std::string(label);
  auto steps = ParseFieldPath(path);
  if (!steps.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": ", steps.status().message()));
  }
  Steps walk = *steps;
  // Sweep paths may start with "spec." (relative to a submit request).
  if (walk.size() > 1 && walk[0].key == "spec" && FindField(*message, "spec") == nullptr) {
    walk = walk.subspan(1);
  }
  // Set on a copy, so a failure leaves the message as it was.
  std::unique_ptr<Message> copy(message->New());
  copy->CopyFrom(*message);
  Setter setter(prefix, value, limits);
  LOOM_RETURN_IF_ERROR(setter.InMessage(copy.get(), walk, message->GetDescriptor()->name()));
  message->GetReflection()->Swap(message, copy.get());
  return absl::OkStatus();
}

absl::Status ApplySetFlag(Message* message, absl::string_view assignment) {
  const size_t eq = assignment.find('=');
  if (eq == absl::string_view::npos || eq == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--set: expected PATH=VALUE, got '", assignment, "'"));
  }
  return SetFieldFromText(message, assignment.substr(0, eq), assignment.substr(eq + 1));
}

absl::Status ApplySetFlags(Message* message, const std::vector<std::string>& assignments) {
  for (const std::string& a : assignments) LOOM_RETURN_IF_ERROR(ApplySetFlag(message, a));
  return absl::OkStatus();
}

}  // namespace loom
