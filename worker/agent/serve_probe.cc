#include "worker/agent/serve_probe.h"

#include <chrono>
#include <memory>
#include <utility>

#include "client/rest_client.h"
#include "loom/lease_clock.h"

namespace loom::agent {

ServeProbe::ServeProbe(std::string url, Options options)
    : url_(std::move(url)), options_(options), thread_([this] { Loop(); }) {}

ServeProbe::~ServeProbe() {
  Stop();
  thread_.join();
}

void ServeProbe::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
}

void ServeProbe::Loop() {
  // No bearer token: /healthz answers without one. A bad URL leaves the server never ready.
  auto client = client::RestClient::Create(url_, "", options_.timeout_ms);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    bool ok = false;
    if (client.ok()) {
      absl::StatusOr<client::HttpResult> r = (*client)->Get("/healthz");
      ok = r.ok() && r->status == 200;
    }
    if (ok) last_ok_ms_ = LeaseClockMs();
    ready_ = ok;
    lock.lock();
    wake_.wait_for(lock, std::chrono::milliseconds(options_.period_ms), [this] { return stop_; });
  }
}

}  // namespace loom::agent
