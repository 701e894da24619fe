#include "serve/server.h"

#include <algorithm>
#include <chrono>
#include <ctime>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "net/connection_metrics.h"

namespace loom::serve {
namespace {

using json = nlohmann::json;
using net::StreamSink;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string Event(const json& j) { return absl::StrCat("data: ", Dump(j), "\n\n"); }

// Constant-time comparison, so the token cannot be guessed byte by byte from response times.
bool SameSecret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ b[i % std::max<size_t>(b.size(), 1)];
  return diff == 0;
}

int64_t GeneratedTokens(const std::vector<std::shared_ptr<Sequence>>& sequences) {
  int64_t total = 0;
  for (const auto& s : sequences) {
    bool done = false;
    total += static_cast<int64_t>(s->Wait(0, std::chrono::milliseconds(0), &done).size());
  }
  return total;
}

}  // namespace

void WriteError(net::HttpResponse& res, const ApiError& e) {
  res.status = e.status;
  res.content_type = "application/json";
  res.body = Dump(ErrorJson(e));
  if (e.status == 429 || e.status == 503) res.SetHeader("Retry-After", "1");
}

Server::Server(trainer::CheckpointModel model, ServeOptions options)
    : model_(std::move(model)), options_(std::move(options)) {
  options_.limits.context = model_.model->config().max_seq_len();
  options_.limits.vocab = model_.model->config().vocab_size();
  created_unix_ = static_cast<int64_t>(std::time(nullptr));
  engine_ = std::make_unique<Engine>(
      model_.model, [this](const std::vector<uint32_t>& ids) { return Decode(ids); },
      options_.engine, &registry_);
}

std::string Server::Decode(const std::vector<uint32_t>& ids) const {
  return DecodeText(*model_.tokenizer, ids);
}

std::string Server::NewId(const char* prefix) {
  return absl::StrCat(prefix, created_unix_, "-", next_id_++);
}

void Server::AddRoutes(net::HttpServer& http) {
  auto bind = [this](void (Server::*handler)(const Request&, Response&)) {
    return [this, handler](const Request& req, Response& res) { (this->*handler)(req, res); };
  };
  http.Route("GET", "/v1/models", "user", bind(&Server::Models));
  http.Route("POST", "/v1/completions", "user", bind(&Server::Completions));
  http.Route("POST", "/v1/chat/completions", "user", bind(&Server::ChatCompletions));
  http.Route("POST", "/tokenize", "user", bind(&Server::Tokenize));
  http.Route("POST", "/detokenize", "user", bind(&Server::Detokenize));
  http.Route("GET", "/healthz", "none",
             [](const Request&, Response& res) { res.body = R"({"status":"ok"})"; });
  auto connections = std::make_shared<net::ConnectionMetrics>(registry_, "loom_serve_http");
  http.Route("GET", "/metrics", "none", [this, &http, connections](const Request&, Response& res) {
    connections->Export(http.Connections());
    res.content_type = "text/plain; version=0.0.4";
    res.body = registry_.Render();
  });
}

void Server::LogRequest(const Request& req, const Response& res, double seconds,
                        const std::string& route) {
  registry_.Increment("loom_serve_requests_total", 1,
                      {{"route", route}, {"code", std::to_string(res.status)}});
  registry_.Observe("loom_serve_request_seconds", seconds, {{"route", route}});
}

bool Server::Admit(const Request& req, Response& res, json* body) {
  if (!options_.token.empty() &&
      !SameSecret(req.Header("authorization"), absl::StrCat("Bearer ", options_.token))) {
    WriteError(res, {401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                     "authentication_error", "", "invalid_api_key"});
    return false;
  }
  if (body == nullptr) return true;
  *body = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body->is_discarded()) {
    WriteError(res,
               {400, "body: not valid JSON (or not UTF-8)", "invalid_request_error", "body", ""});
    return false;
  }
  return true;
}

absl::Status Server::CheckModel(const std::string& requested) const {
  if (requested.empty() || requested == options_.model_name) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat(
      "model '", requested, "' does not exist; this server has '", options_.model_name, "'"));
}

absl::StatusOr<Server::SequenceList> Server::Enqueue(
    const std::vector<std::vector<uint32_t>>& prompts, const CommonRequest& common,
    const std::vector<uint32_t>& stop_tokens) {
  SequenceList sequences;
  for (const auto& prompt : prompts) {
    for (int j = 0; j < common.n; ++j) {
      SequenceParams p = common.params;
      p.prompt = prompt;
      p.seed = common.params.seed + static_cast<uint64_t>(j);
      p.stop_tokens = stop_tokens;
      sequences.push_back(std::make_shared<Sequence>(std::move(p)));
    }
  }
  if (absl::Status s = engine_->Submit(sequences); !s.ok()) return s;
  return sequences;
}

bool Server::AwaitAll(const Request& req, const SequenceList& sequences) {
  for (const auto& s : sequences) {
    bool done = false;
    while (true) {
      s->Wait(SIZE_MAX, std::chrono::milliseconds(50), &done);
      if (done) break;
      if (!req.client_connected()) {
        for (const auto& c : sequences) c->Cancel();
        return false;
      }
    }
  }
  return true;
}

void Server::StreamChoices(StreamSink& sink, const SequenceList& sequences,
                           const std::function<json(int, const std::string&, const json&)>& chunk,
                           const json& usage_event) {
  size_t holdback = 0;  // text that could still turn out to start a stop string is held back
  for (const std::string& s : sequences.front()->params().stop)
    holdback = std::max(holdback, s.size() - 1);
  std::vector<size_t> sent(sequences.size(), 0), have(sequences.size(), 0);
  std::vector<bool> finished(sequences.size(), false);
  auto cancel_all = [&] {
    for (const auto& s : sequences) s->Cancel();
  };
  size_t open = sequences.size();
  while (open > 0) {
    for (size_t i = 0; i < sequences.size(); ++i) {
      if (finished[i]) continue;
      bool done = false;
      sequences[i]->Wait(have[i], std::chrono::milliseconds(20), &done);
      break;  // wait on the first open sequence only; then look at all of them
    }
    if (!sink.ClientConnected()) return cancel_all();
    for (size_t i = 0; i < sequences.size(); ++i) {
      if (finished[i]) continue;
      bool done = false;
      std::vector<TokenOutput> tokens =
          sequences[i]->Wait(have[i], std::chrono::milliseconds(0), &done);
      have[i] = tokens.size();
      std::string text;
      size_t upto = 0;
      if (done) {
        text = sequences[i]->text();
        upto = text.size();
      } else {
        std::vector<uint32_t> ids;
        for (const TokenOutput& t : tokens) ids.push_back(t.token);
        text = Decode(ids);
        upto =
            CompleteUtf8Prefix(text.substr(0, text.size() > holdback ? text.size() - holdback : 0));
      }
      if (upto > sent[i]) {
        if (!sink.Write(
                Event(chunk(static_cast<int>(i), text.substr(sent[i], upto - sent[i]), nullptr))))
          return cancel_all();
        sent[i] = upto;
      }
      if (!done) continue;
      finished[i] = true;
      --open;
      const std::string reason = sequences[i]->finish_reason();
      if (!sequences[i]->status().ok()) {
        sink.Write(Event(ErrorJson(ErrorFromStatus(sequences[i]->status()))));
        return cancel_all();
      }
      sink.Write(Event(chunk(static_cast<int>(i), "", reason == "cancelled" ? "length" : reason)));
    }
  }
  if (!usage_event.is_null()) {
    json usage = usage_event;
    usage["usage"]["completion_tokens"] = GeneratedTokens(sequences);
    usage["usage"]["total_tokens"] =
        usage["usage"]["prompt_tokens"].get<int64_t>() + GeneratedTokens(sequences);
    sink.Write(Event(usage));
  }
  sink.Write("data: [DONE]\n\n");
}

void Server::Completions(const Request& req, Response& res) {
  json body;
  if (!Admit(req, res, &body)) return;
  auto parsed = ParseCompletionRequest(body, options_.limits, *model_.tokenizer);
  if (parsed.ok()) {
    if (absl::Status s = CheckModel(parsed->common.model); !s.ok()) parsed = s;
  }
  if (parsed.ok() && parsed->common.stream && parsed->common.params.logprobs >= 0)
    parsed = absl::InvalidArgumentError("logprobs: not supported with stream");
  if (!parsed.ok()) return WriteError(res, ErrorFromStatus(parsed.status()));
  std::vector<uint32_t> stops;
  if (model_.eos >= 0) stops.push_back(static_cast<uint32_t>(model_.eos));
  auto sequences = Enqueue(parsed->prompts, parsed->common, stops);
  if (!sequences.ok()) return WriteError(res, ErrorFromStatus(sequences.status()));
  int64_t prompt_tokens = 0;
  for (const auto& p : parsed->prompts) prompt_tokens += static_cast<int64_t>(p.size());
  const json head = {{"id", NewId("cmpl-")},
                     {"object", "text_completion"},
                     {"created", static_cast<int64_t>(std::time(nullptr))},
                     {"model", options_.model_name}};
  if (parsed->common.stream) {
    res.content_type = "text/event-stream";
    res.SetHeader("Cache-Control", "no-cache");
    json usage = nullptr;
    if (parsed->common.include_usage) {
      usage = head;
      usage["choices"] = json::array();
      usage["usage"] = Usage(prompt_tokens, 0);
    }
    res.stream = [this, head, usage, sequences = *sequences](StreamSink& sink) {
      StreamChoices(
          sink, sequences,
          [&](int index, const std::string& delta, const json& finish) {
            json c = head;
            c["choices"] = json::array({{{"index", index},
                                         {"text", delta},
                                         {"logprobs", nullptr},
                                         {"finish_reason", finish}}});
            return c;
          },
          usage);
    };
    return;
  }
  if (!AwaitAll(req, *sequences))
    return WriteError(res, {499, "client closed the request", "invalid_request_error", "", ""});
  json out = head, choices = json::array();
  for (size_t k = 0; k < sequences->size(); ++k) {
    const Sequence& s = *(*sequences)[k];
    if (!s.status().ok()) return WriteError(res, ErrorFromStatus(s.status()));
    choices.push_back(CompletionChoice(static_cast<int>(k), s.params().prompt, s, parsed->echo,
                                       *model_.tokenizer));
  }
  out["choices"] = choices;
  out["usage"] = Usage(prompt_tokens, GeneratedTokens(*sequences));
  res.body = Dump(out);
}

void Server::ChatCompletions(const Request& req, Response& res) {
  json body;
  if (!Admit(req, res, &body)) return;
  auto parsed = ParseChatRequest(body, options_.limits);
  if (parsed.ok()) {
    if (absl::Status s = CheckModel(parsed->common.model); !s.ok()) parsed = s;
  }
  if (parsed.ok() && !model_.objective) {
    parsed = absl::InvalidArgumentError(
        "messages: this checkpoint comes from pretraining and has no chat template; use "
        "/v1/completions (or serve an SFT checkpoint)");
  }
  if (parsed.ok() && parsed->common.stream && parsed->logprobs)
    parsed = absl::InvalidArgumentError("logprobs: not supported with stream");
  if (!parsed.ok()) return WriteError(res, ErrorFromStatus(parsed.status()));
  const auto encode = [this](std::string_view text) { return model_.tokenizer->Encode(text); };
  std::vector<uint32_t> prompt = model_.objective->Prompt(parsed->conversation, encode);
  if (static_cast<int64_t>(prompt.size()) > options_.limits.context) {
    return WriteError(res, ErrorFromStatus(absl::InvalidArgumentError(absl::StrCat(
                               "messages: the conversation is ", prompt.size(),
                               " tokens; the model's context is ", options_.limits.context))));
  }
  std::vector<uint32_t> stops = model_.objective->StopTokens();
  if (model_.eos >= 0) stops.push_back(static_cast<uint32_t>(model_.eos));
  auto sequences = Enqueue({prompt}, parsed->common, stops);
  if (!sequences.ok()) return WriteError(res, ErrorFromStatus(sequences.status()));
  const int64_t prompt_tokens = static_cast<int64_t>(prompt.size());
  const json head = {{"id", NewId("chatcmpl-")},
                     {"object", "chat.completion"},
                     {"created", static_cast<int64_t>(std::time(nullptr))},
                     {"model", options_.model_name}};
  if (parsed->common.stream) {
    res.content_type = "text/event-stream";
    res.SetHeader("Cache-Control", "no-cache");
    json chunk_head = head;
    chunk_head["object"] = "chat.completion.chunk";
    json usage = nullptr;
    if (parsed->common.include_usage) {
      usage = chunk_head;
      usage["choices"] = json::array();
      usage["usage"] = Usage(prompt_tokens, 0);
    }
    res.stream = [this, chunk_head, usage, sequences = *sequences](StreamSink& sink) {
      auto chunk = [&](int index, const json& delta, const json& finish) {
        json c = chunk_head;
        c["choices"] = json::array({{{"index", index},
                                     {"delta", delta},
                                     {"logprobs", nullptr},
                                     {"finish_reason", finish}}});
        return c;
      };
      for (size_t i = 0; i < sequences.size(); ++i) {  // the role comes first, as OpenAI sends it
        if (!sink.Write(Event(
                chunk(static_cast<int>(i), {{"role", "assistant"}, {"content", ""}}, nullptr))))
          return;
      }
      StreamChoices(
          sink, sequences,
          [&](int index, const std::string& text, const json& finish) {
            return chunk(index, finish.is_null() ? json{{"content", text}} : json::object(),
                         finish);
          },
          usage);
    };
    return;
  }
  if (!AwaitAll(req, *sequences))
    return WriteError(res, {499, "client closed the request", "invalid_request_error", "", ""});
  json out = head, choices = json::array();
  for (size_t k = 0; k < sequences->size(); ++k) {
    const Sequence& s = *(*sequences)[k];
    if (!s.status().ok()) return WriteError(res, ErrorFromStatus(s.status()));
    choices.push_back(ChatChoice(static_cast<int>(k), s, parsed->logprobs, *model_.tokenizer));
  }
  out["choices"] = choices;
  out["usage"] = Usage(prompt_tokens, GeneratedTokens(*sequences));
  res.body = Dump(out);
}

void Server::Models(const Request& req, Response& res) {
  if (!Admit(req, res, nullptr)) return;
  res.body = Dump({{"object", "list"},
                   {"data", json::array({{{"id", options_.model_name},
                                          {"object", "model"},
                                          {"created", created_unix_},
                                          {"owned_by", "loom"},
                                          {"root", options_.model_root},
                                          {"max_model_len", options_.limits.context}}})}});
}

void Server::Tokenize(const Request& req, Response& res) {
  json body;
  if (!Admit(req, res, &body)) return;
  std::vector<uint32_t> tokens;
  const bool has_prompt = body.is_object() && body.contains("prompt");
  const bool has_messages = body.is_object() && body.contains("messages");
  absl::Status error;
  for (const auto& [key, value] : body.is_object() ? body.items() : json::object().items()) {
    if (key != "model" && key != "prompt" && key != "messages")
      error = absl::InvalidArgumentError(
          absl::StrCat(key, ": unknown field (known: model, prompt, messages)"));
  }
  if (!body.is_object() || has_prompt == has_messages) {
    error = absl::InvalidArgumentError("prompt: give exactly one of prompt (a string) or messages");
  } else if (has_prompt && !body["prompt"].is_string()) {
    error = absl::InvalidArgumentError("prompt: must be a string");
  } else if (has_messages && !model_.objective) {
    error = absl::InvalidArgumentError("messages: this checkpoint has no chat template");
  }
  if (error.ok() && has_prompt) {
    error = CheckTextFits(body["prompt"].get_ref<const std::string&>().size(), options_.limits,
                          "prompt");
  }
  if (error.ok() && has_prompt)
    tokens = model_.tokenizer->Encode(body["prompt"].get<std::string>());
  if (error.ok() && has_messages) {
    auto chat = ParseChatRequest({{"messages", body["messages"]}}, options_.limits);
    if (!chat.ok()) {
      error = chat.status();
    } else {
      tokens = model_.objective->Prompt(
          chat->conversation, [this](std::string_view t) { return model_.tokenizer->Encode(t); });
    }
  }
  if (!error.ok()) return WriteError(res, ErrorFromStatus(error));
  res.body = Dump(
      {{"tokens", tokens}, {"count", tokens.size()}, {"max_model_len", options_.limits.context}});
}

void Server::Detokenize(const Request& req, Response& res) {
  json body;
  if (!Admit(req, res, &body)) return;
  absl::Status error;
  std::vector<uint32_t> tokens;
  if (!body.is_object() || !body.contains("tokens") || !body["tokens"].is_array()) {
    error = absl::InvalidArgumentError("tokens: required, a list of token ids");
  } else {
    for (const auto& [key, value] : body.items()) {
      if (key != "model" && key != "tokens")
        error =
            absl::InvalidArgumentError(absl::StrCat(key, ": unknown field (known: model, tokens)"));
    }
    for (const json& t : body["tokens"]) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 ||
          t.get<int64_t>() >= options_.limits.vocab) {
        error = absl::InvalidArgumentError(
            absl::StrCat("tokens: ids must be integers in [0, ", options_.limits.vocab, ")"));
        break;
      }
      tokens.push_back(static_cast<uint32_t>(t.get<int64_t>()));
    }
  }
  if (!error.ok()) return WriteError(res, ErrorFromStatus(error));
  res.body = Dump({{"prompt", Decode(tokens)}});
}

}  // namespace loom::serve
