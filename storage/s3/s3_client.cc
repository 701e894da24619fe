#include "storage/s3/s3_client.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/property_tree/ini_parser.hpp>
#include <boost/property_tree/ptree.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/env.h"
#include "base/status_macros.h"

namespace loom::storage {

struct S3Client::Request {
  const char* method = "GET";
  std::string bucket, key;
  std::vector<std::pair<std::string, std::string>> query;
  absl::string_view body;
  std::string sink_path;  // GET: the object's bytes go to this file
  uint64_t max_body = 1 << 20;
};

struct S3Client::Response {
  long status = 0;
  std::string body;  // the answer's body (an error document, a listing), not a sink's bytes
  std::string etag;
  uint64_t length = 0;
};

namespace {

namespace fs = std::filesystem;

constexpr char kEmptySha256[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr int kMaxParts = 10000;       // S3's limit
constexpr int kMultipartRestarts = 3;  // a store that forgot the upload (NoSuchUpload)

bool Unreserved(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
         c == '~';
}

// SigV4's URI encoding: every byte but the unreserved ones (and '/' in a key).
std::string Encode(absl::string_view s, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (char c : s) {
    if (Unreserved(c) || (keep_slash && c == '/')) {
      out.push_back(c);
    } else {
      const auto b = static_cast<unsigned char>(c);
      out += {'%', kHex[b >> 4], kHex[b & 15]};
    }
  }
  return out;
}

std::string Sha256Hex(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), digest, &len, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) out += {kHex[digest[i] >> 4], kHex[digest[i] & 15]};
  return out;
}

CURL* ThreadHandle() {
  // One handle per thread keeps its connections alive between requests.
  thread_local std::unique_ptr<CURL, decltype(&curl_easy_cleanup)> handle(curl_easy_init(),
                                                                          curl_easy_cleanup);
  curl_easy_reset(handle.get());
  return handle.get();
}

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

double Jitter(double cap) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return std::uniform_real_distribution<double>(0, cap)(rng);
}

// One attempt's outcome, before it becomes a Status.
struct Outcome {
  CURLcode curl = CURLE_OK;
  std::string curl_error;
  S3Client::Response response;
  S3Error error;  // parsed from an error body
};

struct Transfer {
  absl::string_view body;
  size_t sent = 0;
  std::FILE* sink = nullptr;
  CURL* curl = nullptr;
  Outcome* out = nullptr;
  uint64_t max_body = 0;
  bool too_large = false;
};

size_t ReadBody(char* buffer, size_t size, size_t n, void* p) {
  auto* t = static_cast<Transfer*>(p);
  const size_t len = std::min(size * n, t->body.size() - t->sent);
  std::memcpy(buffer, t->body.data() + t->sent, len);
  t->sent += len;
  return len;
}

int SeekBody(void* p, curl_off_t offset, int origin) {
  auto* t = static_cast<Transfer*>(p);
  if (origin != SEEK_SET || offset < 0 || static_cast<size_t>(offset) > t->body.size())
    return CURL_SEEKFUNC_FAIL;
  t->sent = static_cast<size_t>(offset);
  return CURL_SEEKFUNC_OK;
}

size_t WriteBody(char* data, size_t size, size_t n, void* p) {
  auto* t = static_cast<Transfer*>(p);
  const size_t len = size * n;
  long status = 0;
  curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &status);
  if (t->sink != nullptr && status / 100 == 2) {
    return std::fwrite(data, 1, len, t->sink);
  }
  if (t->out->response.body.size() + len > t->max_body) {
    t->too_large = true;
    return 0;  // abort the transfer
  }
  t->out->response.body.append(data, len);
  return len;
}

size_t ReadHeader(char* data, size_t size, size_t n, void* p) {
  auto* t = static_cast<Transfer*>(p);
  absl::string_view line(data, size * n);
  const size_t colon = line.find(':');
  if (colon != absl::string_view::npos) {
    const std::string name = absl::AsciiStrToLower(line.substr(0, colon));
    const absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
    if (name == "etag") t->out->response.etag = std::string(value);
    if (name == "content-length") (void)absl::SimpleAtoi(value, &t->out->response.length);
  }
  return size * n;
}

bool Retryable(const Outcome& o) {
  switch (o.curl) {
    case CURLE_OK:
      break;
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return true;
    default:
      return false;
  }
  const long s = o.response.status;
  return s >= 500 || s == 429 || o.error.code == "SlowDown" || o.error.code == "RequestTimeout";
}

absl::StatusCode CodeOf(const Outcome& o) {
  if (o.curl == CURLE_FILESIZE_EXCEEDED) return absl::StatusCode::kOutOfRange;
  if (o.curl != CURLE_OK) return absl::StatusCode::kUnavailable;
  switch (o.response.status) {
    case 401:
    case 403:
      return absl::StatusCode::kPermissionDenied;
    case 404:
      return absl::StatusCode::kNotFound;
    case 409:
    case 412:
      return absl::StatusCode::kFailedPrecondition;
    default:
      break;
  }
  if (o.response.status >= 500 || o.response.status == 429) return absl::StatusCode::kUnavailable;
  if (o.response.status >= 400) return absl::StatusCode::kInvalidArgument;
  return absl::StatusCode::kUnknown;
}

std::string Describe(const Outcome& o) {
  if (o.curl != CURLE_OK) {
    return absl::StrCat(curl_easy_strerror(o.curl), o.curl_error.empty() ? "" : ": ", o.curl_error);
  }
  std::string out = absl::StrCat("HTTP ", o.response.status);
  if (!o.error.code.empty()) absl::StrAppend(&out, " ", o.error.code);
  if (!o.error.message.empty()) absl::StrAppend(&out, ": ", o.error.message);
  if (o.error.code == "InvalidAccessKeyId" || o.error.code == "SignatureDoesNotMatch") {
    absl::StrAppend(&out, " (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)");
  }
  return out;
}

absl::StatusOr<int64_t> EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  int64_t out = 0;
  if (!absl::SimpleAtoi(v, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": '", v, "' is not a whole number"));
  }
  return out;
}

absl::Status ReadCredentialsFile(S3Options& o) {
  std::string path = EnvOrEmpty("AWS_SHARED_CREDENTIALS_FILE");
  if (path.empty()) {
    const std::string home = EnvOrEmpty("HOME");
    if (home.empty()) return absl::OkStatus();
    path = (fs::path(home) / ".aws" / "credentials").string();
  }
  std::error_code ec;
  if (!fs::exists(path, ec)) return absl::OkStatus();
  std::string profile = EnvOrEmpty("AWS_PROFILE");
  if (profile.empty()) profile = "default";
  boost::property_tree::ptree ini;
  try {
    boost::property_tree::ini_parser::read_ini(path, ini);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("credentials file ", path, ": ", e.what()));
  }
  auto section = ini.get_child_optional(boost::property_tree::ptree::path_type(profile, '\0'));
  if (!section) return absl::OkStatus();
  auto get = [&](const char* k) {
    return section->get<std::string>(boost::property_tree::ptree::path_type(k, '\0'), "");
  };
  o.access_key = get("aws_access_key_id");
  o.secret_key = get("aws_secret_access_key");
  o.session_token = get("aws_session_token");
  if (o.access_key.empty() != o.secret_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("credentials file ", path, ", profile ", profile,
                                                   ": needs both aws_access_key_id and "
                                                   "aws_secret_access_key"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string S3Location::Url(absl::string_view name) const {
  return absl::StrCat("s3://", bucket, "/", Key(name));
}

std::string S3Location::Key(absl::string_view name) const {
  if (prefix.empty()) return std::string(name);
  if (name.empty()) return prefix;
  return absl::StrCat(prefix, "/", name);
}

bool IsS3Url(absl::string_view url) { return absl::StartsWith(url, "s3://"); }

absl::StatusOr<S3Location> ParseS3Url(absl::string_view url) {
  if (!IsS3Url(url)) return absl::InvalidArgumentError(absl::StrCat("'", url, "' is no s3:// URL"));
  absl::string_view rest = url.substr(5);
  const size_t slash = rest.find('/');
  S3Location out;
  out.bucket = std::string(rest.substr(0, slash));
  const bool bucket_ok =
      out.bucket.size() >= 3 && out.bucket.size() <= 63 &&
      std::all_of(out.bucket.begin(), out.bucket.end(), [](char c) {
        return absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '-' || c == '.';
      });
  if (!bucket_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", url, "': the bucket name must be 3 to 63 of a-z, 0-9, '-' and '.'"));
  }
  if (slash == absl::string_view::npos) return out;
  std::vector<std::string> parts = absl::StrSplit(rest.substr(slash + 1), '/', absl::SkipEmpty());
  for (const std::string& p : parts) {
    if (p == "." || p == "..") {
      return absl::InvalidArgumentError(absl::StrCat("'", url, "': '.' and '..' are not keys"));
    }
    if (std::any_of(p.begin(), p.end(), [](char c) { return static_cast<unsigned char>(c) < 32; }))
      return absl::InvalidArgumentError(absl::StrCat("'", url, "': control characters"));
  }
  out.prefix = absl::StrJoin(parts, "/");
  return out;
}

absl::StatusOr<S3Options> S3OptionsFromEnvironment() {
  S3Options o;
  o.access_key = EnvOrEmpty("AWS_ACCESS_KEY_ID");
  o.secret_key = EnvOrEmpty("AWS_SECRET_ACCESS_KEY");
  o.session_token = EnvOrEmpty("AWS_SESSION_TOKEN");
  if (o.access_key.empty() != o.secret_key.empty()) {
    return absl::InvalidArgumentError(
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: set both or neither");
  }
  if (o.access_key.empty()) LOOM_RETURN_IF_ERROR(ReadCredentialsFile(o));
  for (const char* name : {"AWS_REGION", "AWS_DEFAULT_REGION"}) {
    if (!EnvOrEmpty(name).empty()) {
      o.region = EnvOrEmpty(name);
      break;
    }
  }
  o.endpoint = EnvOrEmpty("AWS_ENDPOINT_URL_S3");
  if (o.endpoint.empty()) o.endpoint = EnvOrEmpty("AWS_ENDPOINT_URL");
  while (absl::EndsWith(o.endpoint, "/")) o.endpoint.pop_back();
  if (!o.endpoint.empty() && !absl::StartsWith(o.endpoint, "http://") &&
      !absl::StartsWith(o.endpoint, "https://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("AWS_ENDPOINT_URL '", o.endpoint, "': must start with http:// or https://"));
  }
  o.ca_file = EnvOrEmpty("AWS_CA_BUNDLE");
  const std::string addressing = EnvOrEmpty("LOOM_S3_ADDRESSING");
  if (!addressing.empty() && addressing != "path" && addressing != "virtual") {
    return absl::InvalidArgumentError("LOOM_S3_ADDRESSING: 'path' or 'virtual'");
  }
  o.path_style = addressing.empty() ? !o.endpoint.empty() : addressing == "path";
  LOOM_ASSIGN_OR_RETURN(int64_t part_mb, EnvInt("LOOM_S3_PART_MB", o.part_bytes >> 20));
  LOOM_ASSIGN_OR_RETURN(int64_t parallel, EnvInt("LOOM_S3_PARALLEL_PARTS", o.parallel_parts));
  LOOM_ASSIGN_OR_RETURN(int64_t attempts, EnvInt("LOOM_S3_MAX_ATTEMPTS", o.max_attempts));
  if (part_mb < 5 || part_mb > 5120)
    return absl::InvalidArgumentError("LOOM_S3_PART_MB: 5 to 5120");
  if (parallel < 1 || parallel > 64)
    return absl::InvalidArgumentError("LOOM_S3_PARALLEL_PARTS: 1 to 64");
  if (attempts < 1 || attempts > 100)
    return absl::InvalidArgumentError("LOOM_S3_MAX_ATTEMPTS: 1 to 100");
  o.part_bytes = part_mb << 20;
  o.parallel_parts = static_cast<int>(parallel);
  o.max_attempts = static_cast<int>(attempts);
  return o;
}

S3Client::S3Client(S3Options options) : options_(std::move(options)) { GlobalInit(); }

namespace {

std::string RequestUrl(const S3Options& o, const S3Client::Request& r) {
  std::string endpoint =
      o.endpoint.empty() ? absl::StrCat("https://s3.", o.region, ".amazonaws.com") : o.endpoint;
  std::string url;
  if (o.path_style) {
    url = absl::StrCat(endpoint, "/", r.bucket, "/", Encode(r.key, true));
  } else {
    const size_t host = endpoint.find("://") + 3;
    url = absl::StrCat(endpoint.substr(0, host), r.bucket, ".", endpoint.substr(host), "/",
                       Encode(r.key, true));
  }
  // Sorted and encoded as SigV4's canonical query string is, so that the query libcurl signs
  // (as written) is the canonical one.
  std::vector<std::string> params;
  for (const auto& [k, v] : r.query)
    params.push_back(absl::StrCat(Encode(k, false), "=", Encode(v, false)));
  std::sort(params.begin(), params.end());
  if (!params.empty()) absl::StrAppend(&url, "?", absl::StrJoin(params, "&"));
  return url;
}

void SetMethod(CURL* c, const S3Client::Request& r, Transfer& t) {
  const absl::string_view method = r.method;
  if (method == "PUT") {
    curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(c, CURLOPT_READFUNCTION, ReadBody);
    curl_easy_setopt(c, CURLOPT_READDATA, &t);
    curl_easy_setopt(c, CURLOPT_SEEKFUNCTION, SeekBody);
    curl_easy_setopt(c, CURLOPT_SEEKDATA, &t);
    curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(r.body.size()));
  } else if (method == "POST") {
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, r.body.data());
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(r.body.size()));
  } else if (method == "HEAD") {
    curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  } else if (method != "GET") {
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, r.method);
  }
}

}  // namespace

namespace {

// One HTTP exchange, no retries.
Outcome Perform(const S3Options& o, const S3Client::Request& r) {
  Outcome out;
  CURL* c = ThreadHandle();
  std::unique_ptr<std::FILE, decltype(&std::fclose)> sink(nullptr, std::fclose);
  if (!r.sink_path.empty()) {
    sink.reset(std::fopen(r.sink_path.c_str(), "wb"));
    if (!sink) {
      out.curl = CURLE_WRITE_ERROR;
      out.curl_error = absl::StrCat("cannot write ", r.sink_path, ": ", std::strerror(errno));
      return out;
    }
  }
  Transfer t{r.body, 0, sink.get(), c, &out, r.max_body, false};
  const std::string url = RequestUrl(o, r);
  char error[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, static_cast<long>(o.connect_timeout_s));
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1024L);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, static_cast<long>(o.low_speed_time_s));
  if (!o.ca_file.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, o.ca_file.c_str());
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, WriteBody);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, ReadHeader);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &t);
  SetMethod(c, r, t);
  const std::string region_sig = absl::StrCat("aws:amz:", o.region, ":s3");
  if (!o.access_key.empty()) {
    curl_easy_setopt(c, CURLOPT_AWS_SIGV4, region_sig.c_str());
    curl_easy_setopt(c, CURLOPT_USERNAME, o.access_key.c_str());
    curl_easy_setopt(c, CURLOPT_PASSWORD, o.secret_key.c_str());
  }
  // The payload's hash is signed: the store refuses a body changed on the way.
  struct curl_slist* headers = nullptr;
  const std::string sha = r.body.empty() ? kEmptySha256 : Sha256Hex(r.body);
  headers = curl_slist_append(headers, absl::StrCat("x-amz-content-sha256: ", sha).c_str());
  if (!o.session_token.empty()) {
    headers =
        curl_slist_append(headers, absl::StrCat("x-amz-security-token: ", o.session_token).c_str());
  }
  if (absl::string_view(r.method) == "POST") {
    headers = curl_slist_append(headers, "Content-Type: application/xml");
  }
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  out.curl = curl_easy_perform(c);
  curl_slist_free_all(headers);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &out.response.status);
  if (t.too_large && out.curl == CURLE_WRITE_ERROR) {
    out.curl = CURLE_FILESIZE_EXCEEDED;
  }
  out.curl_error = error;
  if (sink && std::fflush(sink.get()) != 0) out.curl = CURLE_WRITE_ERROR;
  if (out.curl == CURLE_OK && out.response.status / 100 != 2) {
    out.error = ParseError(out.response.body);
  } else if (out.curl == CURLE_OK && !out.response.body.empty()) {
    // 200 with an <Error> body: CompleteMultipartUpload's way of failing late.
    S3Error late = ParseError(out.response.body);
    if (!late.code.empty()) {
      out.error = late;
      out.response.status = late.code == "InternalError" || late.code == "SlowDown" ? 503 : 400;
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<S3Client::Response> S3Client::Call(const Request& r) {
  for (int attempt = 1;; ++attempt) {
    Outcome o = Perform(options_, r);
    const bool ok = o.curl == CURLE_OK && o.response.status / 100 == 2;
    if (ok) return std::move(o.response);
    if (!Retryable(o) || attempt >= options_.max_attempts) {
      return absl::Status(
          CodeOf(o), absl::StrCat("s3://", r.bucket, "/", r.key, ": ", r.method, ": ", Describe(o),
                                  attempt > 1 ? absl::StrCat(" (after ", attempt, " attempts)")
                                              : std::string()));
    }
    retries_.fetch_add(1);
    const double cap =
        std::min(options_.backoff_cap_s, options_.backoff_base_s * std::pow(2.0, attempt - 1));
    std::this_thread::sleep_for(std::chrono::duration<double>(Jitter(cap)));
  }
}

absl::Status S3Client::PutString(const std::string& bucket, const std::string& key,
                                 absl::string_view data) {
  Request r;
  r.method = "PUT";
  r.bucket = bucket;
  r.key = key;
  r.body = data;
  return Call(r).status();
}

namespace {

// The bytes [offset, offset + len) of an open file.
absl::StatusOr<std::string> ReadRange(int fd, uint64_t offset, uint64_t len,
                                      const std::string& path) {
  std::string out(len, '\0');
  uint64_t done = 0;
  while (done < len) {
    const ssize_t n = ::pread(fd, out.data() + done, len - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat(path, ": read at ", offset + done, ": ",
                                              n == 0 ? "file shrank" : std::strerror(errno)));
    }
    done += n;
  }
  return out;
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

absl::Status S3Client::PutFile(const std::string& bucket, const std::string& key,
                               const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  struct stat st;
  if (f.fd < 0 || ::fstat(f.fd, &st) != 0) {
    return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > static_cast<uint64_t>(options_.part_bytes)) {
    return PutMultipart(bucket, key, path, size);
  }
  LOOM_ASSIGN_OR_RETURN(std::string bytes, ReadRange(f.fd, 0, size, path));
  return PutString(bucket, key, bytes);
}

absl::Status S3Client::PutMultipart(const std::string& bucket, const std::string& key,
                                    const std::string& path, uint64_t size) {
  const uint64_t part_bytes =
      std::max<uint64_t>(options_.part_bytes, (size + kMaxParts - 1) / kMaxParts);
  absl::Status last;
  for (int round = 0; round < kMultipartRestarts; ++round) {
    Request create;
    create.method = "POST";
    create.bucket = bucket;
    create.key = key;
    create.query = {{"uploads", ""}};
    LOOM_ASSIGN_OR_RETURN(Response created, Call(create));
    LOOM_ASSIGN_OR_RETURN(std::string upload_id, ParseUploadId(created.body));
    std::vector<std::string> etags;
    last = UploadParts(bucket, key, upload_id, path, size, part_bytes, etags);
    if (last.ok()) {
      std::string xml = "<CompleteMultipartUpload>";
      for (size_t i = 0; i < etags.size(); ++i) {
        absl::StrAppend(&xml, "<Part><PartNumber>", i + 1, "</PartNumber><ETag>", etags[i],
                        "</ETag></Part>");
      }
      xml += "</CompleteMultipartUpload>";
      Request complete;
      complete.method = "POST";
      complete.bucket = bucket;
      complete.key = key;
      complete.query = {{"uploadId", upload_id}};
      complete.body = xml;
      last = Call(complete).status();
      if (last.ok()) return last;
    }
    Request abort;  // best effort: the store's lifecycle rules reap what this misses
    abort.method = "DELETE";
    abort.bucket = bucket;
    abort.key = key;
    abort.query = {{"uploadId", upload_id}};
    (void)Call(abort);
    if (!absl::StrContains(last.message(), "NoSuchUpload")) return last;
  }
  return last;
}

absl::StatusOr<S3Client::Response> S3Client::UploadPart(const std::string& bucket,
                                                        const std::string& key,
                                                        const std::string& upload_id, int part,
                                                        absl::string_view bytes) {
  Request put;
  put.method = "PUT";
  put.bucket = bucket;
  put.key = key;
  put.query = {{"partNumber", std::to_string(part)}, {"uploadId", upload_id}};
  put.body = bytes;
  return Call(put);
}

absl::Status S3Client::UploadParts(const std::string& bucket, const std::string& key,
                                   const std::string& upload_id, const std::string& path,
                                   uint64_t size, uint64_t part_bytes,
                                   std::vector<std::string>& etags) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) return absl::NotFoundError(absl::StrCat(path, ": ", std::strerror(errno)));
  const int parts = static_cast<int>((size + part_bytes - 1) / part_bytes);
  etags.assign(parts, "");
  std::atomic<int> next{0};
  std::mutex mu;
  absl::Status first_error;
  auto worker = [&] {
    for (int i = next.fetch_add(1); i < parts; i = next.fetch_add(1)) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (!first_error.ok()) return;
      }
      const uint64_t offset = static_cast<uint64_t>(i) * part_bytes;
      auto bytes = ReadRange(f.fd, offset, std::min(part_bytes, size - offset), path);
      absl::StatusOr<Response> answer =
          bytes.ok() ? UploadPart(bucket, key, upload_id, i + 1, *bytes) : bytes.status();
      std::lock_guard<std::mutex> lock(mu);
      if (!answer.ok()) {
        if (first_error.ok()) first_error = answer.status();
        return;
      }
      etags[i] = answer->etag;
    }
  };
  std::vector<std::thread> threads;
  const int n = std::min(parts, options_.parallel_parts);
  for (int t = 0; t < n; ++t) threads.emplace_back(worker);
  for (auto& t : threads) t.join();
  return first_error;
}

absl::StatusOr<std::string> S3Client::GetString(const std::string& bucket, const std::string& key,
                                                uint64_t max_bytes) {
  Request r;
  r.bucket = bucket;
  r.key = key;
  r.max_body = max_bytes;
  auto answer = Call(r);
  if (absl::IsOutOfRange(answer.status())) {
    return absl::OutOfRangeError(
        absl::StrCat("s3://", bucket, "/", key, ": larger than ", max_bytes, " bytes"));
  }
  if (!answer.ok()) return answer.status();
  return std::move(answer->body);
}

absl::Status S3Client::GetFile(const std::string& bucket, const std::string& key,
                               const std::string& path) {
  Request r;
  r.bucket = bucket;
  r.key = key;
  r.sink_path = path + ".part";
  auto answer = Call(r);
  std::error_code ec;
  if (!answer.ok()) {
    fs::remove(r.sink_path, ec);
    return answer.status();
  }
  fs::rename(r.sink_path, path, ec);
  if (ec) return absl::InternalError(absl::StrCat(path, ": ", ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<std::optional<ObjectInfo>> S3Client::Head(const std::string& bucket,
                                                         const std::string& key) {
  Request r;
  r.method = "HEAD";
  r.bucket = bucket;
  r.key = key;
  auto answer = Call(r);
  if (absl::IsNotFound(answer.status())) return std::optional<ObjectInfo>();
  if (!answer.ok()) return answer.status();
  return std::optional<ObjectInfo>(ObjectInfo{key, answer->length, answer->etag});
}

absl::StatusOr<std::vector<ObjectInfo>> S3Client::List(const std::string& bucket,
                                                       const std::string& prefix) {
  std::vector<ObjectInfo> out;
  std::string token;
  for (;;) {
    Request r;
    r.bucket = bucket;
    r.max_body = 16 << 20;
    r.query = {{"list-type", "2"}, {"prefix", prefix}};
    if (!token.empty()) r.query.emplace_back("continuation-token", token);
    LOOM_ASSIGN_OR_RETURN(Response answer, Call(r));
    LOOM_ASSIGN_OR_RETURN(ObjectListing page, ParseListObjects(answer.body));
    for (ObjectInfo& o : page.objects) out.push_back(std::move(o));
    if (!page.truncated) break;
    if (page.next_token == token) return absl::DataLossError("ListObjectsV2: the same page twice");
    token = page.next_token;
  }
  std::sort(out.begin(), out.end(),
            [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
  return out;
}

absl::Status S3Client::Delete(const std::string& bucket, const std::string& key) {
  Request r;
  r.method = "DELETE";
  r.bucket = bucket;
  r.key = key;
  auto answer = Call(r);
  // Gone already is deleted; a missing bucket is not.
  if (absl::IsNotFound(answer.status()) &&
      !absl::StrContains(answer.status().message(), "NoSuchBucket")) {
    return absl::OkStatus();
  }
  return answer.status();
}

}  // namespace loom::storage
