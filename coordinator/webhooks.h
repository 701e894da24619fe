// Webhooks (docs/control-plane.md, "Webhooks"): POSTs of job and sweep state changes, at least
// once. The change that causes an event writes its deliveries (one per subscribed webhook) into
// the outbox in the same RocksDB commit (JobTable::PutDelivery), so a crash loses no event and
// records none for a change that did not happen. WebhookSender's thread posts them, off the
// coordinator's lock, and deletes each once its receiver answered 2xx; a failure is retried with
// exponential backoff until max_attempts or max_age, then dropped with a log line and a metric.
// A retry, and every delivery after a restart, carries the same event id (X-Loom-Event-Id).
#ifndef LOOM_COORDINATOR_WEBHOOKS_H_
#define LOOM_COORDINATOR_WEBHOOKS_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/clock.h"
#include "coordinator/state_store.h"
#include "loom/v1/control.pb.h"
#include "metrics/prometheus.h"

namespace loom::coordinator {

inline constexpr int kMaxWebhooks = 100;
inline constexpr size_t kMaxWebhookUrlBytes = 2048;

// The events a webhook may subscribe to, in the order the docs list them.
const std::vector<std::string>& WebhookEventTypes();
// An admin's webhook checked and completed in place (format "json" when empty, a secret of 32
// random bytes as hex when none): InvalidArgument naming the field otherwise.
absl::Status ValidateWebhook(v1::Webhook& webhook);

// "evt-<seq, 12 digits>".
std::string WebhookEventId(int64_t seq);
// "sha256=" + the lowercase hex HMAC-SHA256 of `body` under `secret`.
std::string WebhookSignature(absl::string_view secret, absl::string_view body);
// What is POSTed: {"id", "type", "time", "time_ms", "job" | "sweep" (+ "report")} for json,
// {"text": one line a person reads} for slack.
std::string WebhookBody(const v1::WebhookDelivery& delivery, absl::string_view format);

struct WebhookOptions {
  int64_t retry_base_ms = 1000;   // the first retry's delay; doubled each time
  int64_t retry_max_ms = 300000;  // no delay longer than this
  int max_attempts = 30;          // tries before a delivery is dropped
  int64_t max_age_ms = 86400000;  // a delivery older than this is dropped at its next failure
  int64_t timeout_ms = 10000;     // one POST, connection included
};
// The delay before the next try after `failed` failed tries (1, 2, ...): base·2^(failed-1),
// capped at retry_max_ms.
int64_t WebhookRetryDelayMs(const WebhookOptions& options, int failed);

// The delivery thread. Enqueue/SetWebhook/RemoveWebhook are called from the coordinator's
// Txn::on_commit (its lock held, then this one's briefly); the thread never takes the
// coordinator's lock while holding its own, and does no network I/O under either.
class WebhookSender {
 public:
  // The report of a finished sweep (Coordinator::ReportSweep), called without this lock.
  using ReportFn = std::function<absl::StatusOr<v1::SweepReport>(const std::string& sweep_id)>;

  // `clock`: the coordinator's (due times on its steady clock, ages on its wall clock).
  WebhookSender(StateStore& store, metrics::Registry& registry, std::shared_ptr<Clock> clock,
                WebhookOptions options, ReportFn report);
  ~WebhookSender();

  // The webhooks and the outbox as stored (after a restart: what was not delivered yet, due at
  // once); deliveries of webhooks that no longer exist are deleted.
  absl::Status Load(const std::map<std::string, v1::Webhook>& webhooks);
  void Start();
  void Stop();

  // A delivery just committed (`written`: the store's sequence after that write; it is posted
  // only once the log is on disk through it).
  void Enqueue(const v1::WebhookDelivery& delivery, uint64_t written);
  void SetWebhook(const v1::Webhook& webhook);
  void RemoveWebhook(const std::string& id);  // and its deliveries

  // Tries every delivery due now, once; returns how many it tried (-1: the log holding them
  // could not be synced, none tried). The thread loops on it; tests call it directly.
  int DeliverDue();
  size_t pending() const;

 private:
  struct Pending {
    v1::WebhookDelivery delivery;
    int64_t due_ms = 0;  // steady clock
    uint64_t written = 0;
  };
  using Key = std::pair<int64_t, std::string>;  // (event seq, webhook id): oldest event first
  static Key KeyOf(const v1::WebhookDelivery& d) { return {d.seq(), d.webhook_id()}; }

  void Run();
  // One POST: the delivery as its webhook wants it; true on 2xx.
  bool Post(const v1::Webhook& webhook, v1::WebhookDelivery& delivery);
  void AddReport(v1::WebhookDelivery& delivery);
  void Finish(const Key& key, const v1::WebhookDelivery& tried, bool delivered);
  void Forget(const Key& key, const v1::WebhookDelivery& d, const std::string& result);
  void UpdateGauge();

  StateStore& store_;
  metrics::Registry& registry_;
  std::shared_ptr<Clock> clock_;
  WebhookOptions options_;
  ReportFn report_;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::map<std::string, v1::Webhook> webhooks_;
  std::map<Key, Pending> pending_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_WEBHOOKS_H_
