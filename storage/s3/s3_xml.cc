#include "storage/s3/s3_xml.h"

#include <expat.h>

#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace loom::storage {
namespace {

constexpr size_t kMaxDocument = 16 << 20;  // a page of 1 000 keys is ~300 KB
constexpr int kMaxDepth = 16;

// The text of each element, by path ("ListBucketResult/Contents/Key"), in the order the
// elements close: enough for S3's flat documents.
struct Element {
  std::string path, text;
};

struct Collector {
  XML_Parser parser;
  std::vector<std::string> stack;
  std::string text;
  std::vector<Element> closed;
  std::string error;
};

std::string Path(const std::vector<std::string>& stack) {
  std::string out;
  for (const std::string& s : stack) absl::StrAppend(&out, out.empty() ? "" : "/", s);
  return out;
}

void Fail(Collector* c, std::string why) {
  if (c->error.empty()) c->error = std::move(why);
  XML_StopParser(c->parser, XML_FALSE);
}

void OnStart(void* data, const XML_Char* name, const XML_Char**) {
  auto* c = static_cast<Collector*>(data);
  if (c->stack.size() >= static_cast<size_t>(kMaxDepth)) return Fail(c, "nested too deeply");
  c->stack.push_back(name);
  c->text.clear();
}

void OnEnd(void* data, const XML_Char*) {
  auto* c = static_cast<Collector*>(data);
  c->closed.push_back({Path(c->stack), std::move(c->text)});
  c->stack.pop_back();
  c->text.clear();
}

void OnText(void* data, const XML_Char* s, int len) {
  static_cast<Collector*>(data)->text.append(s, len);
}

// Entities and DTDs are what XML bombs are made of; S3 never sends one.
void OnDoctype(void* data, const XML_Char*, const XML_Char*, const XML_Char*, int) {
  Fail(static_cast<Collector*>(data), "a DTD is not accepted");
}

absl::StatusOr<std::vector<Element>> Elements(absl::string_view xml, const char* what) {
  if (xml.size() > kMaxDocument) {
    return absl::DataLossError(absl::StrCat(what, ": answer of ", xml.size(), " bytes"));
  }
  std::unique_ptr<XML_ParserStruct, void (*)(XML_Parser)> parser(XML_ParserCreate("UTF-8"),
                                                                 XML_ParserFree);
  if (!parser) return absl::ResourceExhaustedError("XML parser");
  Collector c{parser.get(), {}, {}, {}, {}};
  XML_SetUserData(parser.get(), &c);
  XML_SetElementHandler(parser.get(), OnStart, OnEnd);
  XML_SetCharacterDataHandler(parser.get(), OnText);
  XML_SetStartDoctypeDeclHandler(parser.get(), OnDoctype);
  const bool ok =
      XML_Parse(parser.get(), xml.data(), static_cast<int>(xml.size()), XML_TRUE) == XML_STATUS_OK;
  if (!ok || !c.error.empty()) {
    return absl::DataLossError(
        absl::StrCat(what, ": malformed XML: ",
                     c.error.empty() ? XML_ErrorString(XML_GetErrorCode(parser.get())) : c.error));
  }
  return std::move(c.closed);
}

}  // namespace

absl::StatusOr<ObjectListing> ParseListObjects(absl::string_view xml) {
  auto elements = Elements(xml, "ListObjectsV2");
  if (!elements.ok()) return elements.status();
  ObjectListing out;
  ObjectInfo current;
  for (const Element& e : *elements) {
    if (e.path == "ListBucketResult/Contents/Key") {
      current.key = e.text;
    } else if (e.path == "ListBucketResult/Contents/Size") {
      if (!absl::SimpleAtoi(e.text, &current.size))
        return absl::DataLossError(absl::StrCat("ListObjectsV2: size '", e.text, "'"));
    } else if (e.path == "ListBucketResult/Contents/ETag") {
      current.etag = e.text;
    } else if (e.path == "ListBucketResult/Contents") {
      if (current.key.empty()) return absl::DataLossError("ListObjectsV2: an object without key");
      out.objects.push_back(std::move(current));
      current = {};
    } else if (e.path == "ListBucketResult/CommonPrefixes/Prefix") {
      out.common_prefixes.push_back(e.text);
    } else if (e.path == "ListBucketResult/IsTruncated") {
      out.truncated = e.text == "true";
    } else if (e.path == "ListBucketResult/NextContinuationToken") {
      out.next_token = e.text;
    } else if (e.path == "ListBucketResult") {
      if (out.truncated && out.next_token.empty())
        return absl::DataLossError("ListObjectsV2: truncated without a continuation token");
      return out;
    }
  }
  return absl::DataLossError("ListObjectsV2: no ListBucketResult");
}

absl::StatusOr<std::string> ParseUploadId(absl::string_view xml) {
  auto elements = Elements(xml, "CreateMultipartUpload");
  if (!elements.ok()) return elements.status();
  for (const Element& e : *elements) {
    if (e.path == "InitiateMultipartUploadResult/UploadId" && !e.text.empty()) return e.text;
  }
  return absl::DataLossError("CreateMultipartUpload: no UploadId");
}

S3Error ParseError(absl::string_view xml) {
  S3Error out;
  auto elements = Elements(xml, "error");
  if (!elements.ok()) return out;
  for (const Element& e : *elements) {
    if (e.path == "Error/Code") out.code = e.text;
    if (e.path == "Error/Message") out.message = e.text;
  }
  return out;
}

}  // namespace loom::storage
