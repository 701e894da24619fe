// loom-serve's HTTP endpoints (api/serve-openapi.yaml): the OpenAI completions and chat
// completions (whole or streamed as server-sent events), models, tokenize / detokenize, health
// and Prometheus metrics, over the engine's continuous batching.
#ifndef LOOM_SERVE_SERVER_H_
#define LOOM_SERVE_SERVER_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "metrics/prometheus.h"
#include "net/http_server.h"
#include "serve/engine.h"
#include "serve/openai_api.h"
#include "worker/trainer/checkpoint_model.h"

namespace loom::serve {

struct ServeOptions {
  std::string model_name = "loom";  // what /v1/models lists and requests must name (or omit)
  std::string model_root = "loom";  // /v1/models' root: "<job>.<step>" of the checkpoint
  std::string token;                // bearer token clients must send; "" = no authentication
  ServeLimits limits;
  EngineOptions engine;
};

class Server {
 public:
  Server(trainer::CheckpointModel model, ServeOptions options);

  // Registers every route on `http` (documented in api/serve-openapi.yaml).
  void AddRoutes(net::HttpServer& http);
  // Counts answered requests (HttpServer::SetLogger).
  void LogRequest(const net::HttpRequest& req, const net::HttpResponse& res, double seconds,
                  const std::string& route);
  metrics::Registry& registry() { return registry_; }

 private:
  using Request = net::HttpRequest;
  using Response = net::HttpResponse;
  using SequenceList = std::vector<std::shared_ptr<Sequence>>;

  void Completions(const Request& req, Response& res);
  void ChatCompletions(const Request& req, Response& res);
  void Models(const Request& req, Response& res);
  void Tokenize(const Request& req, Response& res);
  void Detokenize(const Request& req, Response& res);

  // Parses the JSON body and checks the bearer token; false when it answered with an error.
  bool Admit(const Request& req, Response& res, nlohmann::json* body);
  absl::Status CheckModel(const std::string& requested) const;
  // One sequence per prompt and choice (seeds differ by choice), queued all or none.
  absl::StatusOr<SequenceList> Enqueue(const std::vector<std::vector<uint32_t>>& prompts,
                                       const CommonRequest& common,
                                       const std::vector<uint32_t>& stop_tokens);
  // Waits for every sequence, cancelling them all when the client goes away; false if it did.
  bool AwaitAll(const Request& req, const SequenceList& sequences);
  // Streams text deltas as server-sent events; `chunk` makes the event of (choice, delta,
  // finish reason or null).
  void StreamChoices(
      net::StreamSink& sink, const SequenceList& sequences,
      const std::function<nlohmann::json(int, const std::string&, const nlohmann::json&)>& chunk,
      const nlohmann::json& usage_event);
  std::string Decode(const std::vector<uint32_t>& ids) const;
  std::string NewId(const char* prefix);

  trainer::CheckpointModel model_;
  ServeOptions options_;
  metrics::Registry registry_{"serve"};
  std::unique_ptr<Engine> engine_;
  std::atomic<int64_t> next_id_{1};
  int64_t created_unix_ = 0;
};

void WriteError(net::HttpResponse& res, const ApiError& e);

}  // namespace loom::serve

#endif  // LOOM_SERVE_SERVER_H_
