// Webhooks (webhooks.h): admins add, list and delete them; job state changes and the end of a
// sweep put their deliveries into the outbox inside the change's own Txn.
#include <algorithm>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "coordinator/coordinator.h"
#include "coordinator/ids.h"

namespace loom::coordinator {
namespace {

bool Subscribed(const v1::Webhook& w, const std::string& type) {
  return std::find(w.events().begin(), w.events().end(), type) != w.events().end();
}

}  // namespace

absl::StatusOr<v1::Webhook> Coordinator::AddWebhook(v1::Webhook webhook, const Caller& caller) {
  if (!caller.admin) return absl::PermissionDeniedError("webhooks are managed by admins");
  LOOM_RETURN_IF_ERROR(ValidateWebhook(webhook));
  std::lock_guard<std::mutex> lock(mutex_);
  if (table_->webhooks().size() >= static_cast<size_t>(kMaxWebhooks)) {
    return absl::FailedPreconditionError(
        absl::StrCat("there are ", kMaxWebhooks, " webhooks already, the most allowed"));
  }
  webhook.set_id(table_->NextWebhookId());
  webhook.set_created_by(caller.user);
  webhook.set_create_time_ms(NowMs());
  Txn txn;
  table_->PutWebhook(txn, webhook);
  txn.on_commit.push_back([this, webhook] { webhooks_->SetWebhook(webhook); });
  LOOM_RETURN_IF_ERROR(table_->Commit(txn));
  return webhook;
}

absl::StatusOr<v1::ListWebhooksResponse> Coordinator::ListWebhooks(const Caller& caller) {
  if (!caller.admin) return absl::PermissionDeniedError("webhooks are managed by admins");
  std::lock_guard<std::mutex> lock(mutex_);
  v1::ListWebhooksResponse out;
  for (const auto& [id, w] : table_->webhooks()) {
    v1::Webhook* listed = out.add_webhooks();
    *listed = w;
    listed->clear_secret();  // shown once, at creation
  }
  return out;
}

absl::Status Coordinator::DeleteWebhook(const std::string& id, const Caller& caller) {
  if (!caller.admin) return absl::PermissionDeniedError("webhooks are managed by admins");
  if (!IsValidId(id)) return absl::InvalidArgumentError("webhook id: malformed");
  std::lock_guard<std::mutex> lock(mutex_);
  if (!table_->webhooks().count(id))
    return absl::NotFoundError(absl::StrCat("webhook '", id, "' not found"));
  Txn txn;
  table_->DeleteWebhook(txn, id);
  txn.on_commit.push_back([this, id] { webhooks_->RemoveWebhook(id); });
  return table_->Commit(txn);
}

// One event: a delivery per webhook subscribed to it, all under one event id, written with the
// change (handed to the sender once that is committed).
void Coordinator::AddDeliveriesLocked(Txn& txn, v1::WebhookDelivery event) {
  std::vector<const v1::Webhook*> hooks;
  for (const auto& [id, w] : table_->webhooks()) {
    if (Subscribed(w, event.type())) hooks.push_back(&w);
  }
  if (hooks.empty()) return;
  event.set_seq(table_->TakeEventSeq(txn));
  event.set_event_id(WebhookEventId(event.seq()));
  event.set_time_ms(NowMs());
  for (const v1::Webhook* w : hooks) {
    event.set_webhook_id(w->id());
    table_->PutDelivery(txn, event);
    txn.on_commit.push_back(
        [this, event] { webhooks_->Enqueue(event, table_->store().LastSequence()); });
  }
}

// The state hook (JobTable::set_on_state): job.<state> for the states webhooks may watch, and
// sweep.finished / sweep.cancelled when this job was the last of its sweep to end.
void Coordinator::NotifyStateLocked(Txn& txn, const v1::Job& job, JobState state) {
  if (table_->webhooks().empty()) return;
  if (state != JobState::kQueued && state != JobState::kScheduled) {
    v1::WebhookDelivery event;
    event.set_type(absl::StrCat("job.", JobStateName(state)));
    *event.mutable_job() = job;
    event.mutable_job()->clear_request();  // the resolved spec and the request: GET the job
    event.mutable_job()->clear_spec();
    event.mutable_job()->clear_events();
    AddDeliveriesLocked(txn, std::move(event));
  }
  if (!IsTerminal(state) || job.sweep_id().empty()) return;
  auto sweep = table_->sweeps().find(job.sweep_id());
  if (sweep == table_->sweeps().end()) return;
  const v1::Sweep now = SweepWithStates(sweep->second);
  if (now.state() == SweepStateName(SweepState::kRunning)) return;
  v1::WebhookDelivery event;
  event.set_type(absl::StrCat("sweep.", now.state()));
  *event.mutable_sweep() = now;
  event.mutable_sweep()->clear_spec();
  AddDeliveriesLocked(txn, std::move(event));
}

}  // namespace loom::coordinator
