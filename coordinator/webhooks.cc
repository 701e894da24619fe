#include "coordinator/webhooks.h"

#include <curl/curl.h>
#include <google/protobuf/util/json_util.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "base/random_token.h"

namespace loom::coordinator {
namespace {

using nlohmann::json;

// As submit_validation.h's FieldError (a unity build sees more than one of that name).
absl::Status WebhookFieldError(const std::string& field, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", message));
}

// A URL admins may give: http(s), a host, nothing a header or a log line could be split by.
bool IsWebhookUrl(absl::string_view url) {
  if (url.size() > kMaxWebhookUrlBytes) return false;
  const std::string lower = absl::AsciiStrToLower(url.substr(0, 8));
  size_t rest;
  if (absl::StartsWith(lower, "https://")) {
    rest = 8;
  } else if (absl::StartsWith(lower, "http://")) {
    rest = 7;
  } else {
    return false;
  }
  for (char ch : url) {
    if (static_cast<unsigned char>(ch) <= 0x20 || ch == 0x7f) return false;
  }
  return rest < url.size() && url[rest] != '/' && url[rest] != '?' && url[rest] != '#';
}

json ProtoJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  std::string text;
  if (!google::protobuf::util::MessageToJsonString(m, &text, options).ok()) return nullptr;
  return json::parse(text, nullptr, /*allow_exceptions=*/false);
}

// The report's summary: per cell n, mean and interval; per cell the paired difference.
json ReportSummary(const v1::SweepReport& r) {
  json cells = json::array(), diffs = json::array();
  for (const auto& c : r.cells()) {
    cells.push_back({{"cell", c.cell()},
                     {"n", c.n()},
                     {"pending", c.pending()},
                     {"failed", c.failed()},
                     {"mean", c.mean()},
                     {"ci_low", c.ci_low()},
                     {"ci_high", c.ci_high()}});
  }
  for (const auto& d : r.differences()) {
    diffs.push_back({{"cell", d.cell()},
                     {"baseline", d.baseline()},
                     {"n", d.n()},
                     {"mean", d.mean()},
                     {"ci_low", d.t_low()},
                     {"ci_high", d.t_high()},
                     {"p_value", d.p_value()}});
  }
  return {{"metric", r.metric()},     {"select", r.select()}, {"baseline", r.baseline()},
          {"complete", r.complete()}, {"cells", cells},       {"differences", diffs}};
}

std::string SlackJobText(const v1::WebhookDelivery& d) {
  const v1::Job& j = d.job();
  std::string text = absl::StrCat("Loom job ", j.id());
  if (!j.name().empty()) absl::StrAppend(&text, " (", j.name(), ")");
  absl::StrAppend(&text, " ", j.state());
  if (!j.reason().empty()) absl::StrAppend(&text, ": ", j.reason());
  absl::StrAppend(&text, " [step ", j.progress().step(), "/", j.progress().total_steps(),
                  ", attempt ", j.attempt(), ", by ", j.submitted_by(), "]");
  return text;
}

std::string SlackSweepText(const v1::WebhookDelivery& d) {
  const v1::Sweep& s = d.sweep();
  std::string text = absl::StrCat("Loom sweep ", s.id());
  if (!s.name().empty()) absl::StrAppend(&text, " (", s.name(), ")");
  absl::StrAppend(&text, " ", s.state(), " (", s.jobs_size(), " jobs)");
  if (!d.has_report()) return text;
  const v1::SweepReport& r = d.report();
  absl::StrAppend(&text, ": ", r.metric());
  for (const auto& c : r.cells()) {
    absl::StrAppend(&text, absl::StrFormat("; %s %.4g [%.4g, %.4g] n=%d", c.cell(), c.mean(),
                                           c.ci_low(), c.ci_high(), c.n()));
  }
  for (const auto& p : r.differences()) {
    absl::StrAppend(&text, absl::StrFormat("; %s - %s %+.4g [%.4g, %.4g] n=%d", p.cell(),
                                           p.baseline(), p.mean(), p.t_low(), p.t_high(), p.n()));
  }
  return text;
}

size_t DiscardBody(char*, size_t size, size_t n, void*) { return size * n; }

// POSTs `body`; the HTTP status, or an error (connection, timeout, TLS).
absl::StatusOr<long> CurlPost(const std::string& url, const std::string& body,
                              const std::vector<std::string>& headers, int64_t timeout_ms) {
  CURL* curl = curl_easy_init();
  if (curl == nullptr) return absl::InternalError("curl_easy_init failed");
  curl_slist* list = nullptr;
  for (const std::string& h : headers) list = curl_slist_append(list, h.c_str());
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, list);
  curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);  // a thread of a multi-threaded program
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout_ms));
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(std::min<int64_t>(timeout_ms, 5000)));
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, DiscardBody);
  const CURLcode rc = curl_easy_perform(curl);
  long code = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &code);
  curl_slist_free_all(list);
  curl_easy_cleanup(curl);
  if (rc != CURLE_OK) return absl::UnavailableError(curl_easy_strerror(rc));
  return code;
}

}  // namespace

const std::vector<std::string>& WebhookEventTypes() {
  static const auto* types = new std::vector<std::string>{
      "job.running",   "job.retrying",   "job.succeeded",  "job.failed",
      "job.cancelled", "sweep.finished", "sweep.cancelled"};
  return *types;
}

absl::Status ValidateWebhook(v1::Webhook& w) {
  if (!IsWebhookUrl(w.url()))
    return WebhookFieldError("url", "an http:// or https:// URL with a host, at most 2048 bytes");
  const auto& known = WebhookEventTypes();
  if (w.events().empty() || w.events_size() > static_cast<int>(known.size()))
    return WebhookFieldError("events", absl::StrCat("1 or more of ", absl::StrJoin(known, ", ")));
  for (int i = 0; i < w.events_size(); ++i) {
    const std::string& e = w.events(i);
    if (std::find(known.begin(), known.end(), e) == known.end())
      return WebhookFieldError("events", absl::StrCat("'", e.substr(0, 40), "' is not one of ",
                                                      absl::StrJoin(known, ", ")));
    for (int k = 0; k < i; ++k) {
      if (w.events(k) == e)
        return WebhookFieldError("events", absl::StrCat("'", e, "' given twice"));
    }
  }
  if (w.format().empty()) w.set_format("json");
  if (w.format() != "json" && w.format() != "slack")
    return WebhookFieldError("format", "json or slack");
  if (w.secret().empty()) {
    auto token = RandomHexToken(32);
    if (!token.ok()) return token.status();
    w.set_secret(*token);
  }
  const bool printable = std::all_of(w.secret().begin(), w.secret().end(),
                                     [](char c) { return c > 0x20 && c < 0x7f; });
  if (w.secret().size() < 16 || w.secret().size() > 256 || !printable)
    return WebhookFieldError("secret",
                             "16..256 printable ASCII characters (or none: one is generated)");
  return absl::OkStatus();
}

std::string WebhookEventId(int64_t seq) { return absl::StrFormat("evt-%012d", seq); }

std::string WebhookSignature(absl::string_view secret, absl::string_view body) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(body.data()), body.size(), mac, &len);
  std::string hex = "sha256=";
  for (unsigned int i = 0; i < len; ++i) absl::StrAppend(&hex, absl::StrFormat("%02x", mac[i]));
  return hex;
}

std::string WebhookBody(const v1::WebhookDelivery& d, absl::string_view format) {
  const bool sweep = absl::StartsWith(d.type(), "sweep.");
  if (format == "slack") {
    return json{{"text", sweep ? SlackSweepText(d) : SlackJobText(d)}}.dump();
  }
  json body = {{"id", d.event_id()},
               {"type", d.type()},
               {"time_ms", d.time_ms()},
               {"time", absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(d.time_ms()),
                                         absl::UTCTimeZone())}};
  if (sweep) {
    body["sweep"] = ProtoJson(d.sweep());
    if (d.type() == "sweep.finished")
      body["report"] = d.has_report() ? ReportSummary(d.report()) : json(nullptr);
  } else {
    body["job"] = ProtoJson(d.job());
  }
  return body.dump();
}

int64_t WebhookRetryDelayMs(const WebhookOptions& options, int failed) {
  int64_t delay = options.retry_base_ms;
  for (int i = 1; i < failed && delay < options.retry_max_ms; ++i) delay *= 2;
  return std::min(delay, options.retry_max_ms);
}

WebhookSender::WebhookSender(StateStore& store, metrics::Registry& registry,
                             std::shared_ptr<Clock> clock, WebhookOptions options, ReportFn report)
    : store_(store),
      registry_(registry),
      clock_(std::move(clock)),
      options_(options),
      report_(std::move(report)) {
  static std::once_flag curl_init;
  std::call_once(curl_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  registry_.DeclareCounter("loom_coordinator_webhook_deliveries_total",
                           "Webhook POSTs by result: delivered (2xx), failed (retried later), "
                           "dropped (given up after the attempts or the age allowed)");
  for (const char* result : {"delivered", "failed", "dropped"}) {
    registry_.Increment("loom_coordinator_webhook_deliveries_total", 0, {{"result", result}});
  }
  registry_.DeclareGauge("loom_coordinator_webhook_outbox",
                         "Webhook deliveries waiting in the outbox");
  registry_.Set("loom_coordinator_webhook_outbox", 0);
}

WebhookSender::~WebhookSender() { Stop(); }

absl::Status WebhookSender::Load(const std::map<std::string, v1::Webhook>& webhooks) {
  auto stored = store_.Deliveries();
  if (!stored.ok()) return stored.status();
  std::lock_guard<std::mutex> lock(mu_);
  webhooks_ = webhooks;
  StateStore::Batch orphans;
  for (v1::WebhookDelivery& d : *stored) {
    if (!webhooks_.count(d.webhook_id())) {
      orphans.DeleteDelivery(d);  // its webhook was deleted before the crash
      continue;
    }
    const Key key = KeyOf(d);  // before the move below
    pending_[key] = Pending{std::move(d), 0, 0};
  }
  UpdateGauge();
  return orphans.empty() ? absl::OkStatus() : store_.Commit(orphans, false);
}

void WebhookSender::Start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] { Run(); });
}

void WebhookSender::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void WebhookSender::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    int64_t next = clock_->SteadyMs() + 1000;
    for (const auto& [key, p] : pending_) next = std::min(next, p.due_ms);
    const int64_t wait = next - clock_->SteadyMs();
    if (wait > 0) wake_.wait_for(lock, std::chrono::milliseconds(wait));
    if (stop_) break;
    lock.unlock();
    const bool synced = DeliverDue() >= 0;
    lock.lock();
    // The log could not be synced (a full disk): try again in a second, not in a loop.
    if (!synced) wake_.wait_for(lock, std::chrono::seconds(1));
  }
}

void WebhookSender::Enqueue(const v1::WebhookDelivery& delivery, uint64_t written) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_[KeyOf(delivery)] = Pending{delivery, 0, written};
    UpdateGauge();
  }
  wake_.notify_all();
}

void WebhookSender::SetWebhook(const v1::Webhook& webhook) {
  std::lock_guard<std::mutex> lock(mu_);
  webhooks_[webhook.id()] = webhook;
}

void WebhookSender::RemoveWebhook(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  webhooks_.erase(id);
  StateStore::Batch batch;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->first.second != id) {
      ++it;
      continue;
    }
    batch.DeleteDelivery(it->second.delivery);
    it = pending_.erase(it);
  }
  UpdateGauge();
  // Not synced: one left behind by a crash is deleted at the next Load (its webhook is gone).
  if (!batch.empty()) (void)store_.Commit(batch, false);
}

size_t WebhookSender::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

void WebhookSender::UpdateGauge() {
  registry_.Set("loom_coordinator_webhook_outbox", static_cast<double>(pending_.size()));
}

int WebhookSender::DeliverDue() {
  std::vector<std::pair<Key, Pending>> due;
  std::map<std::string, v1::Webhook> hooks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t now = clock_->SteadyMs();
    for (const auto& [key, p] : pending_) {
      if (p.due_ms <= now) due.emplace_back(key, p);
    }
    hooks = webhooks_;
  }
  uint64_t written = 0;
  for (const auto& [key, p] : due) written = std::max(written, p.written);
  // Nothing goes out before the change that caused it is on disk (group commit: a heartbeat's
  // change is written unsynced and synced after the lock is released).
  if (written > 0 && !store_.SyncLogThrough(written).ok()) return -1;
  for (auto& [key, p] : due) {
    auto hook = hooks.find(key.second);
    if (hook == hooks.end()) continue;  // removed meanwhile: RemoveWebhook dropped it
    const bool delivered = Post(hook->second, p.delivery);
    Finish(key, p.delivery, delivered);
  }
  return static_cast<int>(due.size());
}

void WebhookSender::AddReport(v1::WebhookDelivery& d) {
  if (d.type() != "sweep.finished" || d.has_report() || !report_) return;
  auto report = report_(d.sweep().id());
  if (!report.ok()) {
    std::cerr << "coordinator: webhook " << d.event_id() << ": no report of " << d.sweep().id()
              << ": " << report.status().message() << "\n";
    return;
  }
  *d.mutable_report() = std::move(*report);
}

bool WebhookSender::Post(const v1::Webhook& webhook, v1::WebhookDelivery& d) {
  AddReport(d);  // kept with the delivery (Finish), so every retry sends the same body
  const std::string body = WebhookBody(d, webhook.format());
  const std::vector<std::string> headers = {
      "Content-Type: application/json",
      "User-Agent: loom-coordinator",
      "Expect:",  // no 100-continue round trip
      absl::StrCat("X-Loom-Event: ", d.type()),
      absl::StrCat("X-Loom-Event-Id: ", d.event_id()),
      absl::StrCat("X-Loom-Webhook-Id: ", webhook.id()),
      absl::StrCat("X-Loom-Signature: ", WebhookSignature(webhook.secret(), body))};
  auto code = CurlPost(webhook.url(), body, headers, options_.timeout_ms);
  if (code.ok() && *code >= 200 && *code < 300) return true;
  if (d.attempts() == 0 || d.attempts() % 10 == 9) {  // the first failure, then every tenth
    std::cerr << "coordinator: webhook " << webhook.id() << " " << d.event_id() << " (" << d.type()
              << "): "
              << (code.ok() ? absl::StrCat("HTTP ", *code) : std::string(code.status().message()))
              << "; retrying\n";
  }
  return false;
}

void WebhookSender::Finish(const Key& key, const v1::WebhookDelivery& tried, bool delivered) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(key);
  if (it == pending_.end()) return;  // its webhook was removed while it was being posted
  if (delivered) return Forget(key, tried, "delivered");
  registry_.Increment("loom_coordinator_webhook_deliveries_total", 1, {{"result", "failed"}});
  v1::WebhookDelivery& d = it->second.delivery;
  d = tried;
  d.set_attempts(d.attempts() + 1);
  if (d.attempts() >= options_.max_attempts ||
      clock_->NowMs() - d.time_ms() > options_.max_age_ms) {
    std::cerr << "coordinator: webhook " << key.second << " " << d.event_id() << " (" << d.type()
              << "): dropped after " << d.attempts() << " failed tries\n";
    return Forget(key, d, "dropped");
  }
  it->second.due_ms = clock_->SteadyMs() + WebhookRetryDelayMs(options_, d.attempts());
  StateStore::Batch batch;  // the count (and a sweep's report) survive a restart
  batch.PutDelivery(d);
  (void)store_.Commit(batch, false);
}

// mu_ held: the delivery leaves the outbox (not synced: one a crash brings back is posted
// again, with its id, which at-least-once allows).
void WebhookSender::Forget(const Key& key, const v1::WebhookDelivery& d,
                           const std::string& result) {
  StateStore::Batch batch;
  batch.DeleteDelivery(d);
  (void)store_.Commit(batch, false);
  pending_.erase(key);
  registry_.Increment("loom_coordinator_webhook_deliveries_total", 1, {{"result", result}});
  UpdateGauge();
}

}  // namespace loom::coordinator
