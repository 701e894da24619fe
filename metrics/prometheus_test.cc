#include "metrics/prometheus.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>

namespace loom::metrics {
namespace {

void Fill(Registry& r) {
  r.DeclareGauge("loom_train_loss", "Training loss of the last step.");
  r.DeclareCounter("loom_train_tokens_total", "Tokens processed.");
  r.DeclareHistogram("loom_train_step_seconds", "Step wall time.", {0.01, 0.1, 1, 10});
  r.Set("loom_train_loss", 2.5, {{"job_id", "demo"}, {"rank", "0"}});
  r.Increment("loom_train_tokens_total", 1024, {{"job_id", "demo"}, {"rank", "0"}});
  r.Observe("loom_train_step_seconds", 0.05, {{"job_id", "demo"}});
  r.Observe("loom_train_step_seconds", 2.0, {{"job_id", "demo"}});
  r.Set("loom_train_loss", NAN, {{"job_id", "we\"ird\\name\n"}});
}

TEST(Prometheus, RendersTheTextFormat) {
  Registry r;
  Fill(r);
  const std::string text = r.Render();
  EXPECT_NE(text.find("# TYPE loom_train_loss gauge\n"), std::string::npos);
  EXPECT_NE(text.find("loom_train_loss{job_id=\"demo\",rank=\"0\"} 2.5\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("loom_train_tokens_total{job_id=\"demo\",rank=\"0\"} 1024\n"),
            std::string::npos);
  EXPECT_NE(text.find("loom_train_step_seconds_bucket{job_id=\"demo\",le=\"0.1\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("loom_train_step_seconds_bucket{job_id=\"demo\",le=\"10\"} 2\n"),
            std::string::npos);
  EXPECT_NE(text.find("loom_train_step_seconds_bucket{job_id=\"demo\",le=\"+Inf\"} 2\n"),
            std::string::npos);
  EXPECT_NE(text.find("loom_train_step_seconds_count{job_id=\"demo\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("job_id=\"we\\\"ird\\\\name\\n\"} Nan"), std::string::npos)
      << text;  // promtool accepts it
}

TEST(Prometheus, RemoveWhereAndClearDropSeries) {
  Registry r;
  r.DeclareGauge("g", "a gauge");
  r.DeclareCounter("c_total", "a counter");
  r.Set("g", 1, {{"job_id", "a"}, {"rank", "0"}});
  r.Set("g", 2, {{"job_id", "b"}, {"rank", "0"}});
  r.Increment("c_total", 3, {{"job_id", "a"}});
  r.RemoveWhere("job_id", "a");
  const std::string text = r.Render();
  EXPECT_NE(text.find("# TYPE c_total counter"), std::string::npos);  // the family stays declared
  EXPECT_EQ(text.find("job_id=\"a\""), std::string::npos) << text;
  EXPECT_NE(text.find("g{job_id=\"b\",rank=\"0\"} 2"), std::string::npos) << text;
  r.Clear("g");
  EXPECT_EQ(r.Render().find("g{"), std::string::npos);
  EXPECT_EQ(r.Names(), (std::vector<std::string>{"c_total", "g", "loom_build_info"}));
}

TEST(Prometheus, BuildInfoAndConstantLabels) {
  Registry r("coordinator");
  r.DeclareGauge("g", "a gauge");
  r.Set("g", 1, {{"job_id", "a"}});
  r.Set("g", 2, {{"job_id", "b"}, {"worker", "own"}});
  r.SetConstantLabels({{"worker", "w-1"}});
  const std::string text = r.Render();
  const BuildInfo& b = GetBuildInfo();
  EXPECT_FALSE(b.version.empty());
  EXPECT_FALSE(b.commit.empty());
  EXPECT_NE(
      text.find("loom_build_info{commit=\"" + b.commit + "\",component=\"coordinator\",torch=\"" +
                b.torch + "\",version=\"" + b.version + "\",worker=\"w-1\"} 1\n"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("g{job_id=\"a\",worker=\"w-1\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("g{job_id=\"b\",worker=\"own\"} 2\n"), std::string::npos) << text;
}

TEST(Prometheus, MisuseThrows) {
  Registry r;
  EXPECT_THROW(r.DeclareGauge("bad-name", ""), std::invalid_argument);
  r.DeclareCounter("c_total", "");
  EXPECT_THROW(r.Increment("c_total", -1), std::invalid_argument);
  EXPECT_THROW(r.Set("c_total", 1), std::invalid_argument);
  EXPECT_THROW(r.Set("undeclared", 1), std::invalid_argument);
  EXPECT_THROW(r.DeclareHistogram("h", "", {1, 1}), std::invalid_argument);
}

TEST(Prometheus, PromtoolAcceptsTheOutput) {
  const char* promtool = std::getenv("LOOM_PROMTOOL");
  ASSERT_TRUE(promtool != nullptr && *promtool)
      << "promtool not found (install Debian's prometheus)";
  const std::string path = "/tmp/loom_metrics_" + std::to_string(getpid()) + ".prom";
  Registry r;
  Fill(r);
  std::ofstream(path) << r.Render();
  const std::string cmd = std::string(promtool) + " check metrics < " + path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[512];
  while (fgets(buf, sizeof(buf), p)) output += buf;
  const int rc = pclose(p);
  unlink(path.c_str());
  EXPECT_EQ(rc, 0) << output;
}

}  // namespace
}  // namespace loom::metrics
