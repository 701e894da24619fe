// Webhooks without a network: the signature against RFC 4231, the retry schedule, the checks on
// an admin's webhook, deliveries written in the commit of the change that causes them (and kept
// over a reopen), one event id per event, and a receiver that never answers: retried, then
// dropped and counted.
#include "coordinator/webhooks.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "coordinator/coordinator_test_fixture.h"

namespace loom::coordinator {
namespace {

TEST(WebhookSignatureTest, IsHmacSha256OfTheBody) {
  // RFC 4231, test case 2.
  EXPECT_EQ(WebhookSignature("Jefe", "what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(WebhookRetryTest, DoublesUpToTheCap) {
  WebhookOptions o;
  o.retry_base_ms = 1000;
  o.retry_max_ms = 8000;
  std::vector<int64_t> delays;
  for (int failed = 1; failed <= 6; ++failed) delays.push_back(WebhookRetryDelayMs(o, failed));
  EXPECT_EQ(delays, (std::vector<int64_t>{1000, 2000, 4000, 8000, 8000, 8000}));
  EXPECT_EQ(WebhookRetryDelayMs(o, 1000), 8000);  // no overflow however many tries
}

TEST(WebhookValidationTest, NamesTheFieldAtFault) {
  auto error_of = [](v1::Webhook w) { return std::string(ValidateWebhook(w).message()); };
  v1::Webhook good;
  good.set_url("https://hooks.example.com/loom?x=1");
  good.add_events("job.failed");
  v1::Webhook w = good;
  ASSERT_TRUE(ValidateWebhook(w).ok());
  EXPECT_EQ(w.format(), "json");
  EXPECT_EQ(w.secret().size(), 64u) << "a generated secret: 32 random bytes as hex";
  for (const char* url : {"ftp://x/", "file:///etc/passwd", "http://", "http:///x", "https://a b",
                          "javascript:alert(1)", "http://a\r\nX-Evil: 1"}) {
    v1::Webhook bad = good;
    bad.set_url(url);
    EXPECT_EQ(error_of(bad).rfind("url:", 0), 0u) << url;
  }
  v1::Webhook bad = good;
  bad.set_url("https://x/" + std::string(kMaxWebhookUrlBytes, 'a'));
  EXPECT_EQ(error_of(bad).rfind("url:", 0), 0u);
  bad = good;
  bad.add_events("job.exploded");
  EXPECT_EQ(error_of(bad).rfind("events:", 0), 0u);
  bad = good;
  bad.add_events("job.failed");
  EXPECT_EQ(error_of(bad).rfind("events:", 0), 0u) << "twice";
  bad = good;
  bad.clear_events();
  EXPECT_EQ(error_of(bad).rfind("events:", 0), 0u);
  bad = good;
  bad.set_format("xml");
  EXPECT_EQ(error_of(bad).rfind("format:", 0), 0u);
  bad = good;
  bad.set_secret("short");
  EXPECT_EQ(error_of(bad).rfind("secret:", 0), 0u);
}

TEST(WebhookBodyTest, JsonCarriesTheEventAndSlackOneLine) {
  v1::WebhookDelivery d;
  d.set_event_id(WebhookEventId(7));
  d.set_type("job.failed");
  d.set_time_ms(1700000000123);
  d.mutable_job()->set_id("job-000003");
  d.mutable_job()->set_state("failed");
  d.mutable_job()->set_reason("rank 0 exited 1");
  const auto body = nlohmann::json::parse(WebhookBody(d, "json"));
  EXPECT_EQ(body["id"], "evt-000000000007");
  EXPECT_EQ(body["type"], "job.failed");
  EXPECT_EQ(body["time"], "2023-11-14T22:13:20.123Z");
  EXPECT_EQ(body["job"]["id"], "job-000003");
  const auto slack = nlohmann::json::parse(WebhookBody(d, "slack"));
  ASSERT_EQ(slack.size(), 1u);
  EXPECT_NE(slack["text"].get<std::string>().find("job-000003 failed: rank 0 exited 1"),
            std::string::npos)
      << slack;
}

class WebhookOutboxTest : public CoordinatorTest {
 protected:
  std::string AddHook(const std::string& url, int max_attempts = 30) {
    options_.webhooks.max_attempts = max_attempts;
    options_.webhooks.retry_base_ms = 0;  // every retry due at once
    options_.webhooks.timeout_ms = 2000;
    Reopen();
    v1::Webhook w;
    w.set_url(url);
    w.add_events("job.cancelled");
    w.add_events("job.failed");
    EXPECT_EQ(c_->AddWebhook(w, Caller{"alice"}).status().code(),
              absl::StatusCode::kPermissionDenied);
    auto added = c_->AddWebhook(w, Caller{"root", true});
    EXPECT_TRUE(added.ok()) << added.status();
    return added.ok() ? added->id() : "";
  }
  double Deliveries(const std::string& result) {
    const std::string text = c_->RenderMetrics();
    const std::string series =
        absl::StrCat("loom_coordinator_webhook_deliveries_total{result=\"", result, "\"} ");
    const size_t at = text.find(series);
    return at == std::string::npos ? -1 : std::stod(text.substr(at + series.size()));
  }
};

// Port 1 on loopback refuses every connection: nothing is ever delivered.
TEST_F(WebhookOutboxTest, EventsAreWrittenWithTheirChangeAndSurviveAReopen) {
  const std::string hook = AddHook("http://127.0.0.1:1/hook");
  ASSERT_EQ(hook, "wh-000001");
  const std::string a = Submit(MicroJob()), b = Submit(MicroJob());
  EXPECT_EQ(c_->webhook_sender().pending(), 0u) << "queued is no event";
  ASSERT_TRUE(c_->Cancel(a, Caller{"alice"}).ok());
  ASSERT_TRUE(c_->Cancel(b, Caller{"alice"}).ok());
  EXPECT_EQ(c_->webhook_sender().pending(), 2u);
  Reopen();  // as after a crash: the outbox is read back, the webhook with it
  EXPECT_EQ(c_->webhook_sender().pending(), 2u);
  auto listed = c_->ListWebhooks(Caller{"root", true});
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->webhooks_size(), 1);
  EXPECT_TRUE(listed->webhooks(0).secret().empty()) << "shown at creation only";
  // Deleting the webhook takes its deliveries with it, now and after a reopen.
  ASSERT_TRUE(c_->DeleteWebhook(hook, Caller{"root", true}).ok());
  EXPECT_EQ(c_->webhook_sender().pending(), 0u);
  Reopen();
  EXPECT_EQ(c_->webhook_sender().pending(), 0u);
  EXPECT_EQ(c_->DeleteWebhook(hook, Caller{"root", true}).code(), absl::StatusCode::kNotFound);
}

TEST_F(WebhookOutboxTest, AnUnreachableReceiverIsRetriedThenDropped) {
  AddHook("http://127.0.0.1:1/hook", /*max_attempts=*/3);
  ASSERT_TRUE(c_->Cancel(Submit(MicroJob()), Caller{"alice"}).ok());
  for (int attempt = 1; attempt <= 2; ++attempt) {
    EXPECT_EQ(c_->webhook_sender().DeliverDue(), 1);
    EXPECT_EQ(c_->webhook_sender().pending(), 1u) << "kept after failed try " << attempt;
  }
  Reopen();  // the failed tries are counted over a restart too
  EXPECT_EQ(c_->webhook_sender().DeliverDue(), 1);
  EXPECT_EQ(c_->webhook_sender().pending(), 0u);
  EXPECT_EQ(Deliveries("dropped"), 1);
  EXPECT_EQ(Deliveries("delivered"), 0);
  Reopen();
  EXPECT_EQ(c_->webhook_sender().pending(), 0u) << "a dropped delivery stays dropped";
}

}  // namespace
}  // namespace loom::coordinator
