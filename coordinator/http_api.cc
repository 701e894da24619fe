#include "http_api.h"

#include <google/protobuf/util/json_util.h>
#include <httplib.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "loom/spec.h"

namespace loom::coordinator {
namespace {

thread_local std::chrono::steady_clock::time_point t_request_start;

int HttpCode(const absl::Status& s) {
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

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

void SendError(httplib::Response& res, int code, const std::string& message) {
  res.status = code;
  res.set_content(absl::StrCat("{\"error\":\"", JsonEscape(message), "\"}\n"), "application/json");
}

void SendStatus(httplib::Response& res, const absl::Status& s) {
  SendError(res, HttpCode(s), std::string(s.message()));
}

void SendMessage(httplib::Response& res, const google::protobuf::Message& m, int code = 200) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(m, &json, options);
  res.status = code;
  res.set_content(json + "\n", "application/json");
}

// The body as a message: 400 naming the field for bad JSON, unknown fields or wrong types.
bool ParseBody(const httplib::Request& req, httplib::Response& res,
               google::protobuf::Message* out) {
  if (req.body.empty()) {
    SendError(res, 400, "request body: expected a JSON object");
    return false;
  }
  const std::string type = req.get_header_value("Content-Type");
  if (!type.empty() && type.find("application/json") == std::string::npos) {
    SendError(
        res, 415,
        absl::StrCat("Content-Type: expected application/json, got '", type.substr(0, 80), "'"));
    return false;
  }
  if (auto s = ParseJsonMessage(req.body, "request body", out); !s.ok()) {
    SendStatus(res, s);
    return false;
  }
  return true;
}

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i % (b.empty() ? 1 : b.size())];
  return diff == 0 && !b.empty();
}

struct Caller {
  bool ok = false;
  std::string user;
};

// Checks the bearer token for a route's audience; answers 401/403 itself when it fails.
Caller Authenticate(const httplib::Request& req, httplib::Response& res, const ApiOptions& options,
                    const std::string& audience) {
  Caller c;
  if (audience == "none") {
    c.ok = true;
    return c;
  }
  if (options.local_mode) {
    c.ok = true;
    c.user = audience == "worker" ? "local-worker" : "local";
    return c;
  }
  const std::string header = req.get_header_value("Authorization");
  absl::string_view token(header);
  if (!absl::ConsumePrefix(&token, "Bearer ") || token.empty()) {
    res.set_header("WWW-Authenticate", "Bearer");
    SendError(res, 401, "missing bearer token (Authorization: Bearer <token>)");
    return c;
  }
  const std::string t(token);
  bool is_worker = ConstantTimeEquals(t, options.worker_token);
  std::string user;
  for (const auto& [tok, name] : options.user_tokens) {
    if (ConstantTimeEquals(t, tok)) user = name;
  }
  if (!is_worker && user.empty()) {
    res.set_header("WWW-Authenticate", "Bearer error=\"invalid_token\"");
    SendError(res, 401, "invalid token");
    return c;
  }
  if (audience == "worker" && !is_worker) {
    SendError(res, 403, "this route needs the worker token");
    return c;
  }
  if (audience == "user" && user.empty()) {
    SendError(res, 403, "this route needs a user token");
    return c;
  }
  c.ok = true;
  c.user = audience == "worker" ? "worker" : user;
  return c;
}

// Query parameters: only the named ones, each at most once.
bool CheckParams(const httplib::Request& req, httplib::Response& res,
                 std::initializer_list<const char*> allowed) {
  for (const auto& [k, v] : req.params) {
    bool ok = false;
    for (const char* a : allowed) ok |= k == a;
    if (!ok) {
      SendError(res, 400, absl::StrCat("unknown query parameter '", k.substr(0, 60), "'"));
      return false;
    }
    if (req.get_param_value_count(k) > 1) {
      SendError(res, 400, absl::StrCat("query parameter '", k, "' given more than once"));
      return false;
    }
  }
  return true;
}

bool IntParam(const httplib::Request& req, httplib::Response& res, const char* name,
              int64_t fallback, int64_t min, int64_t max, int64_t* out) {
  *out = fallback;
  if (!req.has_param(name)) return true;
  const std::string v = req.get_param_value(name);
  if (!absl::SimpleAtoi(v, out) || *out < min || *out > max) {
    SendError(res, 400, absl::StrCat(name, ": expected an integer in ", min, "..", max));
    return false;
  }
  return true;
}

}  // namespace

std::string RouteLabel(const std::string& method, const std::string& path) {
  static const std::vector<std::pair<const Route*, std::regex>> patterns = [] {
    std::vector<std::pair<const Route*, std::regex>> out;
    for (const Route& r : Routes()) {
      std::string re = std::regex_replace(std::string(r.path), std::regex(R"(\{id\})"), "[^/]+");
      out.emplace_back(&r, std::regex(re));
    }
    return out;
  }();
  for (const auto& [route, re] : patterns) {
    if (method == route->method && std::regex_match(path, re)) return route->path;
  }
  return "other";
}

const std::vector<Route>& Routes() {
  static const std::vector<Route> routes = {
      {"GET", "/healthz", "none"},
      {"GET", "/metrics", "none"},
      {"POST", "/v1/jobs", "user"},
      {"GET", "/v1/jobs", "user"},
      {"GET", "/v1/jobs/{id}", "user"},
      {"POST", "/v1/jobs/{id}/cancel", "user"},
      {"GET", "/v1/jobs/{id}/logs", "user"},
      {"GET", "/v1/checkpoints", "user"},
      {"GET", "/v1/workers", "user"},
      {"POST", "/v1/agent/register", "worker"},
      {"POST", "/v1/agent/heartbeat", "worker"},
  };
  return routes;
}

absl::StatusOr<std::map<std::string, std::string>> ReadUserTokens(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--user-tokens: cannot open '", path, "'"));
  std::map<std::string, std::string> tokens;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    absl::string_view l = absl::StripAsciiWhitespace(line);
    if (l.empty() || l[0] == '#') continue;
    std::vector<std::string> parts = absl::StrSplit(l, ' ', absl::SkipEmpty());
    if (parts.size() != 2 || parts[1].size() < 16) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", n, ": expected '<user> <token>' with a token of 16+ characters"));
    }
    tokens[parts[1]] = parts[0];
  }
  if (tokens.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no tokens"));
  return tokens;
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

void InstallRoutes(httplib::Server& server, Coordinator& coordinator, const ApiOptions& options) {
  Coordinator* c = &coordinator;
  const ApiOptions opts = options;
  server.set_payload_max_length(options.max_body_bytes);
  server.set_read_timeout(10, 0);
  server.set_write_timeout(10, 0);

  server.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain");
  });
  server.Get("/metrics", [c](const httplib::Request&, httplib::Response& res) {
    res.set_content(c->RenderMetrics(), "text/plain; version=0.0.4");
  });

  server.Post("/v1/jobs", [c, opts](const httplib::Request& req, httplib::Response& res) {
    Caller caller = Authenticate(req, res, opts, "user");
    if (!caller.ok || !CheckParams(req, res, {})) return;
    v1::SubmitJobRequest request;
    if (!ParseBody(req, res, &request)) return;
    auto r = c->Submit(request, caller.user);
    if (!r.ok()) return SendStatus(res, r.status());
    SendMessage(res, *r, r->created() ? 201 : 200);
  });
  server.Get("/v1/jobs", [c, opts](const httplib::Request& req, httplib::Response& res) {
    if (!Authenticate(req, res, opts, "user").ok) return;
    if (!CheckParams(req, res, {"state", "page_size", "page_token"})) return;
    int64_t page_size;
    if (!IntParam(req, res, "page_size", 50, 1, 500, &page_size)) return;
    auto r = c->ListJobs(req.get_param_value("state"), static_cast<int>(page_size),
                         req.get_param_value("page_token"));
    if (!r.ok()) return SendStatus(res, r.status());
    SendMessage(res, *r);
  });
  server.Get(R"(/v1/jobs/([^/]+))", [c, opts](const httplib::Request& req, httplib::Response& res) {
    if (!Authenticate(req, res, opts, "user").ok || !CheckParams(req, res, {})) return;
    auto r = c->GetJob(req.matches[1]);
    if (!r.ok()) return SendStatus(res, r.status());
    SendMessage(res, *r);
  });
  server.Post(R"(/v1/jobs/([^/]+)/cancel)",
              [c, opts](const httplib::Request& req, httplib::Response& res) {
                Caller caller = Authenticate(req, res, opts, "user");
                if (!caller.ok || !CheckParams(req, res, {})) return;
                auto r = c->Cancel(req.matches[1], caller.user);
                if (!r.ok()) return SendStatus(res, r.status());
                SendMessage(res, *r);
              });
  server.Get(R"(/v1/jobs/([^/]+)/logs)",
             [c, opts](const httplib::Request& req, httplib::Response& res) {
               if (!Authenticate(req, res, opts, "user").ok) return;
               if (!CheckParams(req, res, {"follow", "offset"})) return;
               int64_t offset;
               if (!IntParam(req, res, "offset", 0, 0, INT64_MAX / 2, &offset)) return;
               const std::string follow = req.get_param_value("follow");
               if (!follow.empty() && follow != "true" && follow != "false" && follow != "1" &&
                   follow != "0") {
                 return SendError(res, 400, "follow: expected true or false");
               }
               const std::string id = req.matches[1];
               auto first = c->ReadLog(id, offset, 8 << 20);
               if (!first.ok()) return SendStatus(res, first.status());
               if (follow != "true" && follow != "1") {
                 res.set_header("X-Loom-Log-Offset", std::to_string(first->next_offset));
                 res.set_content(first->data, "text/plain; charset=utf-8");
                 return;
               }
               // Streamed: chunks as the log grows, until the job is over and its last lines
               // arrived.
               auto state = std::make_shared<std::pair<int64_t, int>>(offset, 0);
               res.set_chunked_content_provider(
                   "text/plain; charset=utf-8", [c, id, state](size_t, httplib::DataSink& sink) {
                     for (;;) {
                       auto chunk = c->ReadLog(id, state->first, 1 << 20);
                       if (!chunk.ok()) {
                         sink.done();
                         return true;
                       }
                       if (!chunk->data.empty()) {
                         state->first = chunk->next_offset;
                         return sink.write(chunk->data.data(), chunk->data.size());
                       }
                       // A finished job's agents may still send their last lines: wait a little.
                       if (chunk->done && ++state->second > 15) {
                         sink.done();
                         return true;
                       }
                       if (!sink.is_writable()) return false;
                       std::this_thread::sleep_for(std::chrono::milliseconds(200));
                     }
                   });
             });
  server.Get("/v1/checkpoints", [c, opts](const httplib::Request& req, httplib::Response& res) {
    if (!Authenticate(req, res, opts, "user").ok || !CheckParams(req, res, {"job"})) return;
    auto r = c->ListCheckpoints(req.get_param_value("job"));
    if (!r.ok()) return SendStatus(res, r.status());
    SendMessage(res, *r);
  });
  server.Get("/v1/workers", [c, opts](const httplib::Request& req, httplib::Response& res) {
    if (!Authenticate(req, res, opts, "user").ok || !CheckParams(req, res, {})) return;
    SendMessage(res, c->ListWorkers());
  });
  server.Post("/v1/agent/register", [c, opts](const httplib::Request& req, httplib::Response& res) {
    if (!Authenticate(req, res, opts, "worker").ok || !CheckParams(req, res, {})) return;
    v1::RegisterWorkerRequest request;
    if (!ParseBody(req, res, &request)) return;
    auto r = c->Register(request);
    if (!r.ok()) return SendStatus(res, r.status());
    SendMessage(res, *r);
  });
  server.Post("/v1/agent/heartbeat",
              [c, opts](const httplib::Request& req, httplib::Response& res) {
                if (!Authenticate(req, res, opts, "worker").ok || !CheckParams(req, res, {}))
                  return;
                v1::HeartbeatRequest request;
                if (!ParseBody(req, res, &request)) return;
                auto r = c->Heartbeat(request);
                if (!r.ok()) return SendStatus(res, r.status());
                SendMessage(res, *r);
              });

  // Every error leaves as JSON; unknown routes say so (a test tells them from unknown ids).
  server.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        if (res.status == 404) {
          SendError(res, 404, absl::StrCat("no route ", req.method, " ", req.path.substr(0, 200)));
        } else if (res.status == 413) {
          SendError(res, 413, "request body too large");
        } else {
          SendError(res, res.status, "bad request");
        }
        return httplib::Server::HandlerResponse::Handled;
      }));
  server.set_exception_handler([](const httplib::Request&, httplib::Response& res,
                                  std::exception_ptr) { SendError(res, 500, "internal error"); });
  // Latency: the pre-routing handler and the logger run on the request's thread.
  server.set_pre_routing_handler([](const httplib::Request&, httplib::Response&) {
    t_request_start = std::chrono::steady_clock::now();
    return httplib::Server::HandlerResponse::Unhandled;
  });
  server.set_logger([c](const httplib::Request& req, const httplib::Response& res) {
    const std::string route = RouteLabel(req.method, req.path);
    c->registry().Increment("loom_coordinator_http_requests_total", 1,
                            {{"route", route}, {"code", std::to_string(res.status)}});
    if (route != "/v1/jobs/{id}/logs") {
      c->registry().Observe(
          "loom_coordinator_http_request_duration_seconds",
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t_request_start).count(),
          {{"route", route}});
    }
  });
}

}  // namespace loom::coordinator
