#include "coordinator/http_api.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <mutex>
#include <regex>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "console/console.h"
#include "loom/spec.h"
#include "net/connection_metrics.h"
#include "net/http_proxy.h"

namespace loom::coordinator {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

int HttpCode(const absl::Status& s) {
  if (IsStorageFull(s)) return 507;  // Insufficient Storage: nothing was stored
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

void SendStatus(HttpResponse& res, const absl::Status& s) {
  SetJsonError(res, HttpCode(s), s.message(), absl::StatusCodeToString(s.code()));
}

// A message as JSON; a message that cannot be printed is a 500 that says so, never an empty 200.
void SendMessage(HttpResponse& res, const Message& m, int code = 200) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  if (auto s = google::protobuf::util::MessageToJsonString(m, &json, options); !s.ok()) {
    SetJsonError(res, 500,
                 absl::StrCat("cannot serialise the ", m.GetDescriptor()->name(),
                              " response: ", s.ToString()));
    return;
  }
  res.status = code;
  res.content_type = "application/json";
  res.body = json + "\n";
}

// The body as a message: 415 unless JSON, 400 naming the field for bad JSON, unknown fields,
// wrong types, too deep nesting or too long strings.
bool ParseBody(const HttpRequest& req, HttpResponse& res, Message* out) {
  const std::string type = req.Header("content-type");
  const std::string media = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(absl::string_view(type).substr(0, type.find(';'))));
  if (media != "application/json") {
    SetJsonError(
        res, 415,
        absl::StrCat("Content-Type: expected application/json, got '", type.substr(0, 80), "'"));
    return false;
  }
  if (req.body.empty()) {
    SetJsonError(res, 400, "request body: expected a JSON object");
    return false;
  }
  absl::Status s = CheckJsonDepth(req.body, kMaxJsonDepth);
  if (s.ok()) s = ParseJsonMessage(req.body, "request body", out);
  if (s.ok()) s = CheckMessageLimits(*out);
  if (!s.ok()) {
    SendStatus(res, s);
    return false;
  }
  return true;
}

std::string BearerToken(const HttpRequest& req) {
  const std::string header = req.Header("authorization");
  absl::string_view token(header);
  if (!absl::ConsumePrefix(&token, "Bearer ")) return "";
  return std::string(token);
}

bool MissingToken(const HttpRequest& req, HttpResponse& res, std::string* token) {
  *token = BearerToken(req);
  if (!token->empty()) return false;
  res.SetHeader("WWW-Authenticate", "Bearer");
  SetJsonError(res, 401, "missing bearer token (Authorization: Bearer <token>)");
  return true;
}

// A user route: the caller's user name, or "" after answering 401/403.
std::string AuthenticateUser(const HttpRequest& req, HttpResponse& res, const ApiOptions& options) {
  std::string token;
  if (MissingToken(req, res, &token)) return "";
  std::string user = UserForToken(options, token);
  if (!user.empty()) return user;
  if (ConstantTimeEquals(token, options.enrolment_token)) {
    SetJsonError(res, 403, "this route needs a user token (that is the worker enrolment token)");
    return "";
  }
  res.SetHeader("WWW-Authenticate", "Bearer error=\"invalid_token\"");
  SetJsonError(res, 401, "invalid token");
  return "";
}

// Query parameters: only the named ones, each at most once.
bool CheckParams(const HttpRequest& req, HttpResponse& res,
                 std::initializer_list<const char*> allowed) {
  for (const auto& [k, v] : req.params) {
    bool ok = false;
    for (const char* a : allowed) ok |= k == a;
    if (!ok) {
      SetJsonError(res, 400, absl::StrCat(k.substr(0, 60), ": unknown query parameter"));
      return false;
    }
    if (req.ParamCount(k) > 1) {
      SetJsonError(res, 400,
                   absl::StrCat(k.substr(0, 60), ": query parameter given more than once"));
      return false;
    }
  }
  return true;
}

bool IntParam(const HttpRequest& req, HttpResponse& res, const char* name, int64_t fallback,
              int64_t min, int64_t max, int64_t* out) {
  *out = fallback;
  if (!req.HasParam(name)) return true;
  if (!absl::SimpleAtoi(req.Param(name), out) || *out < min || *out > max) {
    SetJsonError(res, 400, absl::StrCat(name, ": expected an integer in ", min, "..", max));
    return false;
  }
  return true;
}

// page_size of a paged list (paging.h); false when it answered a 400.
bool PageSize(const HttpRequest& req, HttpResponse& res, int* out) {
  int64_t n;
  if (!IntParam(req, res, "page_size", kDefaultPageSize, 1, kMaxPageSize, &n)) return false;
  *out = static_cast<int>(n);
  return true;
}

// The result as JSON, or its error.
template <typename T>
void Reply(HttpResponse& res, const absl::StatusOr<T>& r) {
  if (!r.ok()) return SendStatus(res, r.status());
  SendMessage(res, *r);
}

// DNS rebinding and cross-site requests (ForeignHostOrOrigin in http_server.h).
bool HostAndOriginFilter(const HttpRequest& req, HttpResponse& res, const ApiOptions& options) {
  const std::string refusal = ForeignHostOrOrigin(req, options.allowed_hosts);
  if (refusal.empty()) return false;
  SetJsonError(res, 403, refusal);
  return true;
}

// Concurrent long requests (log streams, proxied requests to a serve job): each holds a thread
// of the user listener until it ends.
class StreamLimits {
 public:
  // `what`: "log streams" ...; `each`: how one is named in the per-user message.
  StreamLimits(int per_user, int total, std::string what, std::string each)
      : per_user_(per_user), total_(total), what_(std::move(what)), each_(std::move(each)) {}
  // A ticket that frees the slot when destroyed, or null when the caller is over a limit.
  std::shared_ptr<void> Acquire(const std::string& user, std::string* why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (by_user_[user] >= per_user_) {
      *why = absl::StrCat("too many ", what_, ": at most ", per_user_, " concurrent ", each_,
                          " per user");
      return nullptr;
    }
    if (open_ >= total_) {
      *why = absl::StrCat("too many ", what_, " on this coordinator (", total_, "); retry later");
      return nullptr;
    }
    ++by_user_[user];
    ++open_;
    // The ticket object itself is a dummy; its deleter frees the slot.
    return std::shared_ptr<void>(new char(0), [this, user](void* p) {
      delete static_cast<char*>(p);
      std::lock_guard<std::mutex> lock(mutex_);
      --by_user_[user];
      --open_;
    });
  }

 private:
  const int per_user_, total_;
  const std::string what_, each_;
  std::mutex mutex_;
  std::map<std::string, int> by_user_;
  int open_ = 0;
};

void ServeLogs(Coordinator* c, StreamLimits* limits, const std::string& user,
               const HttpRequest& req, HttpResponse& res) {
  if (!CheckParams(req, res, {"follow", "offset"})) return;
  int64_t offset;
  if (!IntParam(req, res, "offset", 0, 0, INT64_MAX / 2, &offset)) return;
  const std::string follow = req.Param("follow");
  if (!follow.empty() && follow != "true" && follow != "false" && follow != "1" && follow != "0") {
    return SetJsonError(res, 400, "follow: expected true or false");
  }
  const std::string id = req.matches[0];
  auto first = c->ReadLog(id, offset, 8 << 20);
  if (!first.ok()) return SendStatus(res, first.status());
  res.content_type = "text/plain; charset=utf-8";
  if (follow != "true" && follow != "1") {
    res.SetHeader("X-Loom-Log-Offset", std::to_string(first->next_offset));
    res.body = first->data;
    return;
  }
  std::string why;
  std::shared_ptr<void> ticket = limits->Acquire(user, &why);
  if (!ticket) return SetJsonError(res, 429, why);
  // Streamed: chunks as the log grows, until the job is over and its last lines arrived.
  res.stream = [c, id, offset, ticket](StreamSink& sink) {
    int64_t at = offset;
    int idle_after_end = 0;
    for (;;) {
      auto chunk = c->ReadLog(id, at, 1 << 20);
      if (!chunk.ok()) return;
      if (!chunk->data.empty()) {
        at = chunk->next_offset;
        if (!sink.Write(chunk->data)) return;
        continue;
      }
      // A finished job's agents may still send their last lines: wait a little.
      if (chunk->done && ++idle_after_end > 15) return;
      if (!sink.ClientConnected()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  };
}

// Walks a parsed message: strings and keys at most kMaxStringBytes, free-form Struct/ListValue
// nesting at most kMaxFreeFormDepth. `path` names the field the way errors do (spec.data...).
absl::Status CheckLimitsAt(const Message& m, const std::string& path, int free_depth) {
  const Descriptor* d = m.GetDescriptor();
  const Reflection* r = m.GetReflection();
  const std::string& type = d->full_name();
  if (type == "google.protobuf.Struct" || type == "google.protobuf.ListValue") {
    if (++free_depth > kMaxFreeFormDepth) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": nested deeper than ", kMaxFreeFormDepth, " levels (free-form options)"));
    }
  }
  auto check_string = [](const std::string& s, const std::string& where) {
    if (s.size() <= kMaxStringBytes) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": longer than ", kMaxStringBytes, " bytes (", s.size(), ")"));
  };
  if (type == "google.protobuf.Struct") {
    const auto& s = static_cast<const google::protobuf::Struct&>(m);
    for (const auto& [key, value] : s.fields()) {
      const std::string where = absl::StrCat(path, ".", key.substr(0, 64));
      if (auto st = check_string(key, where); !st.ok()) return st;
      if (auto st = CheckLimitsAt(value, where, free_depth); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  if (type == "google.protobuf.Value") {
    const auto& v = static_cast<const google::protobuf::Value&>(m);
    if (v.has_struct_value()) return CheckLimitsAt(v.struct_value(), path, free_depth);
    if (v.has_list_value()) return CheckLimitsAt(v.list_value(), path, free_depth);
    return check_string(v.string_value(), path);
  }
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const FieldDescriptor* f : fields) {
    const std::string name = path.empty() ? f->name() : absl::StrCat(path, ".", f->name());
    const int n = f->is_repeated() ? r->FieldSize(m, f) : 1;
    for (int i = 0; i < n; ++i) {
      const std::string where = f->is_repeated() ? absl::StrCat(name, "[", i, "]") : name;
      if (f->full_name() == kUnboundedStringField) continue;
      if (f->type() == FieldDescriptor::TYPE_STRING || f->type() == FieldDescriptor::TYPE_BYTES) {
        std::string scratch;
        const std::string& s = f->is_repeated() ? r->GetRepeatedStringReference(m, f, i, &scratch)
                                                : r->GetStringReference(m, f, &scratch);
        if (auto st = check_string(s, where); !st.ok()) return st;
      } else if (f->type() == FieldDescriptor::TYPE_MESSAGE) {
        const Message& sub =
            f->is_repeated() ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f);
        const std::string sub_path = f->is_map() ? name : where;
        if (auto st = CheckLimitsAt(sub, sub_path, free_depth); !st.ok()) return st;
      }
    }
  }
  return absl::OkStatus();
}

// The caller of a user route: who, whether an admin, and under --private-jobs the owner its
// reads are limited to ("" = every job and sweep).
struct Who {
  std::string user;
  bool admin = false;
  std::string scope;
  int max_priority = 1000;  // the highest priority this caller may give a job
  Caller caller() const { return Caller{user, admin}; }
};

// False (and a 403) when the caller may not give a job this priority: with preemption, a high
// priority stops other people's jobs, so a cluster can keep the high ones for admins.
bool MayUsePriority(const Who& who, int priority, HttpResponse& res) {
  // One out of -1000..1000 is left to the request's own checks: a 400 naming the range.
  if (priority <= who.max_priority || priority > 1000) return true;
  SetJsonError(res, 403,
               absl::StrCat("priority: ", priority, " is above ", who.max_priority,
                            ", the most a user may set here (--max-user-priority); ask an admin"),
               "PERMISSION_DENIED");
  return false;
}

template <typename Handler>
HttpHandler UserRoute(Coordinator* c, const ApiOptions& opts, Handler handler) {
  return [c, opts, handler](const HttpRequest& req, HttpResponse& res) {
    const std::string user = AuthenticateUser(req, res, opts);
    if (user.empty()) return;
    Who who{user, opts.admins.count(user) > 0, ""};
    if (opts.private_jobs && !who.admin) who.scope = user;
    if (!who.admin) who.max_priority = opts.max_user_priority;
    handler(c, who, req, res);
  };
}

// Under --private-jobs a user reads only their own jobs and sweeps: false (and a 403 naming
// the owner) for another's.
template <typename T>
bool MayRead(const Who& who, absl::string_view what, const absl::StatusOr<T>& resource,
             HttpResponse& res) {
  if (!resource.ok()) {
    SendStatus(res, resource.status());
    return false;
  }
  if (who.scope.empty() || resource->submitted_by() == who.scope) return true;
  SetJsonError(res, 403,
               absl::StrCat(what, " ", resource->id(), " belongs to ", resource->submitted_by(),
                            ": with --private-jobs only its owner or an admin may read it"),
               "PERMISSION_DENIED");
  return false;
}

void InstallCommon(HttpServer& server, Coordinator& coordinator, const ApiOptions& options) {
  Coordinator* c = &coordinator;
  server.SetFilter([options](const HttpRequest& req, HttpResponse& res) {
    return HostAndOriginFilter(req, res, options);
  });
  // Credentials are checked as soon as the head is complete: a client without one never gets
  // to send a body. The handlers check again (and learn who the caller is).
  server.SetAuthenticator(
      [options](const std::string& auth, const HttpRequest& req, HttpResponse& res) {
        if (auth == "user") return AuthenticateUser(req, res, options).empty();
        SetJsonError(res, 500, "route with an unknown security scheme");
        return true;
      });
  server.Route("GET", "/healthz", "none", [](const HttpRequest&, HttpResponse& res) {
    res.content_type = "text/plain";
    res.body = "ok\n";
  });
  server.SetLogger([c, &server](const HttpRequest& req, const HttpResponse& res, double seconds) {
    const std::string route = server.RouteTemplate(req.method, req.path);
    c->registry().Increment("loom_coordinator_http_requests_total", 1,
                            {{"route", route}, {"code", std::to_string(res.status)}});
    if (route != "/v1/jobs/{id}/logs") {
      c->registry().Observe("loom_coordinator_http_request_duration_seconds", seconds,
                            {{"route", route}});
    }
  });
}

}  // namespace

absl::Status CheckJsonDepth(absl::string_view json, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char ch : json) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (ch == '\\') {
        escaped = true;
      } else if (ch == '"') {
        in_string = false;
      }
      continue;
    }
    if (ch == '"') {
      in_string = true;
    } else if (ch == '{' || ch == '[') {
      if (++depth > max_depth) {
        return absl::InvalidArgumentError(
            absl::StrCat("request body: JSON nested deeper than ", max_depth, " levels"));
      }
    } else if (ch == '}' || ch == ']') {
      --depth;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckMessageLimits(const Message& message) { return CheckLimitsAt(message, "", 0); }

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i % (b.empty() ? 1 : b.size())];
  return diff == 0 && !b.empty();
}

std::string UserForToken(const ApiOptions& options, const std::string& token) {
  std::string user;
  for (const auto& [tok, name] : options.user_tokens) {
    if (ConstantTimeEquals(token, tok)) user = name;
  }
  return user;
}

absl::StatusOr<UserTokens> ReadUserTokens(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--user-tokens: cannot open '", path, "'"));
  UserTokens users;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    absl::string_view l = absl::StripAsciiWhitespace(line);
    if (l.empty() || l[0] == '#') continue;
    std::vector<std::string> parts = absl::StrSplit(l, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const bool role_ok = parts.size() == 2 || (parts.size() == 3 && parts[2] == "admin");
    if (!role_ok || parts[1].size() < 16) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", n, ": expected '<user> <token> [admin]' with a token of 16+ characters"));
    }
    if (users.tokens.count(parts[1]))
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": a token given twice"));
    users.tokens[parts[1]] = parts[0];
    if (parts.size() == 3) users.admins.insert(parts[0]);
  }
  if (users.tokens.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no tokens"));
  return users;
}

absl::StatusOr<std::string> ReadWorkerToken(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  std::string token;
  std::getline(in, token);
  token = std::string(absl::StripAsciiWhitespace(token));
  if (token.size() < 16)
    return absl::InvalidArgumentError(absl::StrCat(path, ": token needs 16+ characters"));
  return token;
}

namespace {

// The user routes' handlers: the caller is authenticated (UserRoute) as `user`.
using Req = const HttpRequest&;

// A created resource is 201, a retry that found it (idempotency key) 200.
template <typename T>
void ReplyCreated(HttpResponse& res, const absl::StatusOr<T>& r) {
  if (!r.ok()) return SendStatus(res, r.status());
  SendMessage(res, *r, r->created() ? 201 : 200);
}

void SubmitJob(Coordinator* c, const Who& who, Req req, HttpResponse& res) {
  const std::string& user = who.user;
  v1::SubmitJobRequest request;
  if (!CheckParams(req, res, {}) || !ParseBody(req, res, &request) ||
      !MayUsePriority(who, request.priority(), res))
    return;
  ReplyCreated(res, c->Submit(request, user));
}

void ListJobs(Coordinator* c, const Who& who, Req req, HttpResponse& res) {
  if (!CheckParams(req, res,
                   {"state", "user", "kind", "sweep", "label", "order", "page_size", "page_token"}))
    return;
  int64_t page_size;
  if (!IntParam(req, res, "page_size", 50, 1, 500, &page_size)) return;
  Coordinator::JobFilter filter;
  filter.state = req.Param("state");
  filter.user = req.Param("user");
  if (!who.scope.empty() && !filter.user.empty() && filter.user != who.scope) {
    return SetJsonError(res, 403, "user: with --private-jobs a user lists only their own jobs",
                        "PERMISSION_DENIED");
  }
  if (!who.scope.empty()) filter.user = who.scope;
  filter.kind = req.Param("kind");
  filter.sweep = req.Param("sweep");
  filter.labels = req.Param("label");
  const std::string order = req.Param("order");
  if (!order.empty() && order != "asc" && order != "desc") {
    return SetJsonError(res, 400, "order: expected asc or desc");
  }
  filter.newest_first = order == "desc";
  Reply(res, c->ListJobs(filter, static_cast<int>(page_size), req.Param("page_token")));
}

void GetJobMetrics(Coordinator* c, const Who& who, Req req, HttpResponse& res) {
  if (!CheckParams(req, res, {"max_points"})) return;
  if (!who.scope.empty() && !MayRead(who, "job", c->GetJob(req.matches[0]), res)) return;
  int64_t max_points;
  if (!IntParam(req, res, "max_points", 2000, 10, 100000, &max_points)) return;
  Reply(res, c->JobMetrics(req.matches[0], static_cast<int>(max_points)));
}

void ListCheckpoints(Coordinator* c, const Who& who, Req req, HttpResponse& res) {
  int page_size;
  if (!CheckParams(req, res, {"job", "page_size", "page_token"}) || !PageSize(req, res, &page_size))
    return;
  Reply(res, c->ListCheckpoints(req.Param("job"), page_size, req.Param("page_token"), who.scope));
}

void CreateSweep(Coordinator* c, const Who& who, Req req, HttpResponse& res) {
  v1::SweepSpec spec;
  if (!CheckParams(req, res, {}) || !ParseBody(req, res, &spec) ||
      !MayUsePriority(who, spec.base().priority(), res))
    return;
  ReplyCreated(res, c->CreateSweep(spec, who.user));
}

// A report's or curves' metric, baseline and merge (the coordinator checks their values).
bool ComparisonQuery(Req req, HttpResponse& res, Coordinator::ReportQuery* query) {
  query->metric = req.Param("metric");
  query->baseline = req.Param("baseline");
  if (req.Param("merge").size() > 1024) {
    SetJsonError(res, 400, "merge: longer than 1024 characters");
    return false;
  }
  if (req.HasParam("merge")) query->merge = absl::StrSplit(req.Param("merge"), ',');
  return true;
}

void ReportSweep(Coordinator* c, const Who& who, Req req, HttpResponse& res) {
  if (!who.scope.empty() && !MayRead(who, "sweep", c->GetSweep(req.matches[0]), res)) return;
  int64_t length = 0;
  double threshold = 0;
  if (!CheckParams(req, res, {"metric", "select", "length", "threshold", "baseline", "merge"}) ||
      !IntParam(req, res, "length", 0, 0, int64_t{1} << 40, &length)) {
    return;
  }
  if (req.HasParam("threshold") &&
      (!absl::SimpleAtod(req.Param("threshold"), &threshold) || !std::isfinite(threshold))) {
    SetJsonError(res, 400, "threshold: expected a number");
    return;
  }
  Coordinator::ReportQuery query;
  if (!ComparisonQuery(req, res, &query)) return;
  query.select = req.Param("select");
  if (req.HasParam("length")) query.length = length;
  if (req.HasParam("threshold")) query.threshold = threshold;
  Reply(res, c->ReportSweep(req.matches[0], query));
}

void SweepCurves(Coordinator* c, const Who& who, Req req, HttpResponse& res) {
  if (!who.scope.empty() && !MayRead(who, "sweep", c->GetSweep(req.matches[0]), res)) return;
  Coordinator::ReportQuery query;
  if (CheckParams(req, res, {"metric", "baseline", "merge"}) && ComparisonQuery(req, res, &query))
    Reply(res, c->SweepCurves(req.matches[0], query));
}

// GET .../{id}: no query parameters; the answer is the resource.
template <typename T>
HttpHandler GetById(Coordinator* c, const ApiOptions& options,
                    absl::StatusOr<T> (Coordinator::*get)(const std::string&)) {
  return UserRoute(c, options, [get](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
    if (!CheckParams(req, res, {})) return;
    auto resource = (c->*get)(req.matches[0]);
    if (MayRead(who, T::descriptor()->name() == "Sweep" ? "sweep" : "job", resource, res))
      Reply(res, std::move(resource));
  });
}

// POST .../{id}/<action> by the caller: no query parameters; the answer is the resource after.
template <typename T>
HttpHandler ActOnId(Coordinator* c, const ApiOptions& options,
                    absl::StatusOr<T> (Coordinator::*act)(const std::string&, const Caller&)) {
  return UserRoute(c, options, [act](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
    if (CheckParams(req, res, {})) Reply(res, (c->*act)(req.matches[0], who.caller()));
  });
}

// A paged list with no filter: page_size and page_token (paging.h).
template <typename T>
HttpHandler PagedList(Coordinator* c, const ApiOptions& options,
                      absl::StatusOr<T> (Coordinator::*list)(int, const std::string&)) {
  return UserRoute(c, options, [list](Coordinator* c, const Who&, Req req, HttpResponse& res) {
    int page_size;
    if (!CheckParams(req, res, {"page_size", "page_token"}) || !PageSize(req, res, &page_size))
      return;
    Reply(res, (c->*list)(page_size, req.Param("page_token")));
  });
}

// /v1/jobs...: submit, list, inspect, cancel, curves and logs.
void InstallJobRoutes(HttpServer& server, Coordinator* c, const ApiOptions& options) {
  server.Route("POST", "/v1/jobs", "user", UserRoute(c, options, SubmitJob));
  server.Route("GET", "/v1/jobs", "user", UserRoute(c, options, ListJobs));
  server.Route("GET", "/v1/jobs/{id}/metrics", "user", UserRoute(c, options, GetJobMetrics));
  server.Route("GET", "/v1/jobs/{id}", "user", GetById(c, options, &Coordinator::GetJob));
  server.Route("POST", "/v1/jobs/{id}/cancel", "user", ActOnId(c, options, &Coordinator::Cancel));
  server.Route(
      "PATCH", "/v1/jobs/{id}", "user",
      UserRoute(c, options, [](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
        v1::JobUpdate update;
        if (!CheckParams(req, res, {}) || !ParseBody(req, res, &update) ||
            (update.has_priority() && !MayUsePriority(who, update.priority(), res)))
          return;
        Reply(res, c->UpdateJob(req.matches[0], update, who.caller()));
      }));
  auto limits = std::make_shared<StreamLimits>(
      options.max_followers_per_user, options.max_followers, "log streams", "?follow=true streams");
  server.Route(
      "GET", "/v1/jobs/{id}/logs", "user",
      UserRoute(c, options, [limits](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
        if (who.scope.empty() || MayRead(who, "job", c->GetJob(req.matches[0]), res))
          ServeLogs(c, limits.get(), who.user, req, res);
      }));
}

// One request to a serve job's server, under the caller's own token: the coordinator checks it
// (and, with --private-jobs, that the job is theirs) and sends the server's token instead.
void ProxyToServer(Coordinator* c, StreamLimits* limits, const Who& who, const HttpRequest& req,
                   HttpResponse& res, const std::string& upstream_path) {
  if (!CheckParams(req, res, {})) return;
  auto target = c->ServeTargetOf(req.matches[0], who.scope);
  if (!target.ok()) return SendStatus(res, target.status());
  std::string why;
  std::shared_ptr<void> ticket = limits->Acquire(who.user, &why);
  if (!ticket) return SetJsonError(res, 429, why, "RESOURCE_EXHAUSTED");
  net::ProxyTarget t;
  t.host = target->host;
  t.port = target->port;
  t.path = upstream_path;
  t.bearer_token = target->token;
  t.what = absl::StrCat("job ", target->job_id, "'s server");
  net::ForwardRequest(t, req, res);
  if (res.status == 401) {  // its token changed with a restart the coordinator has not heard of
    res = HttpResponse();
    return SetJsonError(res, 503,
                        absl::StrCat(t.what,
                                     " did not take the coordinator's credentials (it "
                                     "restarted just now?); retry"));
  }
  if (res.stream) {
    res.stream = [ticket, stream = std::move(res.stream)](net::StreamSink& sink) { stream(sink); };
  }
}

// /v1/jobs/{id}/serve/...: loom-serve's API of a kind: serve job (docs/serve.md).
void InstallServeRoutes(HttpServer& server, Coordinator* c, const ApiOptions& options) {
  auto limits = std::make_shared<StreamLimits>(options.max_proxied, options.max_proxied,
                                               "requests to serve jobs", "requests");
  const std::pair<const char*, const char*> routes[] = {
      {"GET", "/v1/models"}, {"POST", "/v1/completions"}, {"POST", "/v1/chat/completions"},
      {"POST", "/tokenize"}, {"POST", "/detokenize"},     {"GET", "/healthz"},
      {"GET", "/metrics"}};
  for (const auto& [method, path] : routes) {
    const std::string upstream = path;
    server.Route(
        method, absl::StrCat("/v1/jobs/{id}/serve", path), "user",
        UserRoute(c, options,
                  [limits, upstream](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
                    ProxyToServer(c, limits.get(), who, req, res, upstream);
                  }));
  }
}

// /v1/quotas...: everyone lists them (with what they count now); admins set and delete them.
void InstallQuotaRoutes(HttpServer& server, Coordinator* c, const ApiOptions& options) {
  server.Route("GET", "/v1/quotas", "user",
               UserRoute(c, options, [](Coordinator* c, const Who&, Req req, HttpResponse& res) {
                 if (CheckParams(req, res, {})) Reply(res, c->ListQuotas());
               }));
  server.Route(
      "PUT", "/v1/quotas/{kind}/{name}", "user",
      UserRoute(c, options, [](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
        v1::Quota quota;
        if (!CheckParams(req, res, {}) || !ParseBody(req, res, &quota)) return;
        if ((!quota.kind().empty() && quota.kind() != req.matches[0]) ||
            (!quota.name().empty() && quota.name() != req.matches[1]))
          return SetJsonError(res, 400, "kind, name: the body disagrees with the path");
        quota.set_kind(req.matches[0]);
        quota.set_name(req.matches[1]);
        Reply(res, c->SetQuota(quota, who.caller()));
      }));
  server.Route(
      "DELETE", "/v1/quotas/{kind}/{name}", "user",
      UserRoute(c, options, [](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
        if (!CheckParams(req, res, {})) return;
        const absl::Status s = c->DeleteQuota(req.matches[0], req.matches[1], who.caller());
        if (!s.ok()) return SendStatus(res, s);
        res.status = 200;
        res.body = "{}\n";
      }));
}

// /v1/admin/webhooks...: admins add (the answer carries the secret, once), list and delete.
// The admin check comes before the body is read: others learn nothing about what is set.
void InstallWebhookRoutes(HttpServer& server, Coordinator* c, const ApiOptions& options) {
  const auto admin_only = [](const Who& who, HttpResponse& res) {
    if (who.admin) return true;
    SetJsonError(res, 403, "webhooks are managed by admins", "PERMISSION_DENIED");
    return false;
  };
  server.Route("POST", "/v1/admin/webhooks", "user",
               UserRoute(c, options,
                         [admin_only](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
                           v1::Webhook webhook;
                           if (!CheckParams(req, res, {}) || !admin_only(who, res) ||
                               !ParseBody(req, res, &webhook))
                             return;
                           const absl::StatusOr<v1::Webhook> added =
                               c->AddWebhook(webhook, who.caller());
                           if (!added.ok()) return SendStatus(res, added.status());
                           SendMessage(res, *added, 201);
                         }));
  server.Route(
      "GET", "/v1/admin/webhooks", "user",
      UserRoute(c, options, [](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
        if (CheckParams(req, res, {})) Reply(res, c->ListWebhooks(who.caller()));
      }));
  server.Route(
      "DELETE", "/v1/admin/webhooks/{id}", "user",
      UserRoute(c, options, [](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
        if (!CheckParams(req, res, {})) return;
        const absl::Status s = c->DeleteWebhook(req.matches[0], who.caller());
        if (!s.ok()) return SendStatus(res, s);
        res.status = 200;
        res.body = "{}\n";
      }));
}

// /v1/sweeps...: create, list, inspect, cancel, report.
void InstallSweepRoutes(HttpServer& server, Coordinator* c, const ApiOptions& options) {
  server.Route("POST", "/v1/sweeps", "user", UserRoute(c, options, CreateSweep));
  server.Route(
      "GET", "/v1/sweeps", "user",
      UserRoute(c, options, [](Coordinator* c, const Who& who, Req req, HttpResponse& res) {
        int page_size;
        if (!CheckParams(req, res, {"page_size", "page_token"}) || !PageSize(req, res, &page_size))
          return;
        Reply(res, c->ListSweeps(page_size, req.Param("page_token"), who.scope));
      }));
  server.Route("GET", "/v1/sweeps/{id}", "user", GetById(c, options, &Coordinator::GetSweep));
  server.Route("POST", "/v1/sweeps/{id}/cancel", "user",
               ActOnId(c, options, &Coordinator::CancelSweep));
  server.Route("GET", "/v1/sweeps/{id}/report", "user", UserRoute(c, options, ReportSweep));
  server.Route("GET", "/v1/sweeps/{id}/curves", "user", UserRoute(c, options, SweepCurves));
}

}  // namespace

void InstallUserRoutes(HttpServer& server, Coordinator& coordinator, const ApiOptions& options) {
  Coordinator* c = &coordinator;
  InstallCommon(server, coordinator, options);
  console::InstallConsoleRoutes(server);
  auto connections =
      std::make_shared<net::ConnectionMetrics>(c->registry(), "loom_coordinator_http");
  server.Route("GET", "/metrics", "none",
               [c, &server, connections](const HttpRequest&, HttpResponse& res) {
                 connections->Export(server.Connections());
                 res.content_type = "text/plain; version=0.0.4";
                 res.body = c->RenderMetrics();
               });
  InstallJobRoutes(server, c, options);
  InstallServeRoutes(server, c, options);
  server.Route("GET", "/v1/checkpoints", "user", UserRoute(c, options, ListCheckpoints));
  server.Route("GET", "/v1/workers", "user", PagedList(c, options, &Coordinator::ListWorkers));
  InstallSweepRoutes(server, c, options);
  InstallQuotaRoutes(server, c, options);
  InstallWebhookRoutes(server, c, options);
  // Agent routes live on the agent listener only.
  server.RoutePattern("POST", R"(/v1/agent/.*)", [](const HttpRequest& req, HttpResponse& res) {
    SetJsonError(res, 404,
                 absl::StrCat("no route POST ", req.path.substr(0, 100),
                              " on the user listener: agents use the agent port (--agent-port)"));
  });
}

}  // namespace loom::coordinator
