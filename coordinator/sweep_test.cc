// Sweep statistics against reference values (Student t quantiles and p-values from published
// tables, computed with float64 here), sweep expansion and overrides, and the report from jobs.
#include "coordinator/sweep.h"

#include <gtest/gtest.h>

#include "coordinator/stats.h"

namespace loom::coordinator {
namespace {

TEST(StatsTest, StudentTMatchesTables) {
  // Two-sided 95% critical values (t_{0.975, df}) from standard tables, to 6 digits.
  const std::vector<std::pair<double, double>> table = {{1, 12.706205}, {2, 4.302653},
                                                        {4, 2.776445},  {9, 2.262157},
                                                        {29, 2.045230}, {1000, 1.962339}};
  for (const auto& [df, t] : table) {
    EXPECT_NEAR(StudentTQuantile(0.975, df), t, 1e-5) << "df " << df;
    // The table's 6 decimals move the CDF by at most density x 5e-7 (< 5e-8 here).
    EXPECT_NEAR(StudentTCdf(t, df), 0.975, 5e-8) << "df " << df;
    EXPECT_NEAR(StudentTCdf(-t, df), 0.025, 5e-8) << "df " << df;
  }
  EXPECT_NEAR(StudentTCdf(0, 3), 0.5, 1e-12);
}

TEST(StatsTest, IntervalsAndTests) {
  const std::vector<double> x = {1.0, 2.0, 3.0, 4.0, 5.0};
  EXPECT_DOUBLE_EQ(Mean(x), 3.0);
  EXPECT_NEAR(SampleSd(x), 1.5811388300841898, 1e-12);
  const Interval ci = TInterval(x);  // 3 ± 2.776445 * 1.581139 / sqrt(5)
  EXPECT_NEAR(ci.low, 3 - 1.963243, 1e-5);
  EXPECT_NEAR(ci.high, 3 + 1.963243, 1e-5);
  // t = 3 / (1.581139 / sqrt 5) = 4.242641 on 4 df: p = 0.013236 (two-sided).
  EXPECT_NEAR(TTestPValue(x), 0.0132356, 1e-6);
  EXPECT_DOUBLE_EQ(TTestPValue({0.5}), 1.0);
  // The bootstrap interval of the mean lies within the data's range, brackets the mean, is
  // reproducible for a seed and narrower than the range.
  const Interval b = BootstrapInterval(x, 10000, 7);
  EXPECT_GT(b.low, 1.0);
  EXPECT_LT(b.high, 5.0);
  EXPECT_LT(b.low, 3.0);
  EXPECT_GT(b.high, 3.0);
  const Interval again = BootstrapInterval(x, 10000, 7);
  EXPECT_EQ(b.low, again.low);
  EXPECT_EQ(b.high, again.high);
}

v1::SweepSpec BaseSweep() {
  v1::SweepSpec s;
  s.mutable_base()->mutable_spec()->set_preset("micro");
  s.mutable_base()->mutable_spec()->set_steps(10);
  s.add_seeds(1);
  s.add_seeds(2);
  return s;
}

TEST(SweepTest, ExpandsGridAndCellsAndAppliesOverrides) {
  v1::SweepSpec s = BaseSweep();
  auto* lr = &(*s.mutable_grid())["optimizer.lr"];
  lr->add_values()->set_number_value(0.001);
  lr->add_values()->set_number_value(0.0001);
  v1::SweepCellSpec* mha = s.add_cells();
  mha->set_name("mha");
  (*mha->mutable_set()->mutable_fields())["model.schedule[0].attention.plugin"].set_string_value(
      "mha");
  v1::SweepCellSpec* iha = s.add_cells();
  iha->set_name("iha");
  (*iha->mutable_set()->mutable_fields())["model.schedule[0].attention.plugin"].set_string_value(
      "iha");
  auto cells = ExpandSweep(s);
  ASSERT_TRUE(cells.ok()) << cells.status();
  ASSERT_EQ(cells->size(), 4u);
  EXPECT_EQ((*cells)[0].name, "mha,optimizer.lr=0.001");
  EXPECT_EQ((*cells)[3].name, "iha,optimizer.lr=0.0001");
  auto spec = ApplyCell(s.base().spec(), (*cells)[3], 2);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().schedule(0).attention().plugin(), "iha");
  EXPECT_DOUBLE_EQ(spec->optimizer().lr(), 0.0001);
  EXPECT_EQ(spec->seed(), 2u);
  EXPECT_EQ(spec->steps(), 10);  // the base stays
  // Errors name the field.
  SweepCell bad{"bad", {{"optimizer.learning_rate", {}}}};
  bad.set[0].second.set_number_value(1);
  auto refused = ApplyCell(s.base().spec(), bad, 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("learning_rate"), std::string::npos)
      << refused.status();
  SweepCell gap{"gap", {{"model.schedule[3].window", {}}}};
  gap.set[0].second.set_number_value(4);
  EXPECT_NE(ApplyCell(s.base().spec(), gap, 1).status().message().find("past the end"),
            std::string::npos);
  s.add_seeds(1);
  EXPECT_NE(ExpandSweep(s).status().message().find("seeds"), std::string::npos);
  s = BaseSweep();
  s.set_baseline("nope");
  EXPECT_NE(ExpandSweep(s).status().message().find("baseline"), std::string::npos);
}

TEST(SweepTest, ReportPairsSeedsAndCountsPending) {
  v1::Sweep sweep;
  sweep.set_id("sweep-000001");
  *sweep.mutable_spec() = BaseSweep();
  sweep.mutable_spec()->set_metric("accuracy");
  sweep.add_cells("a");
  sweep.add_cells("b");
  std::map<std::string, v1::Job> jobs;
  const std::vector<double> a = {0.50, 0.60, 0.70}, b = {0.55, 0.68, 0.71};
  for (int i = 0; i < 4; ++i) {
    for (const std::string cell : {"a", "b"}) {
      v1::SweepJob* sj = sweep.add_jobs();
      sj->set_cell(cell);
      sj->set_seed(static_cast<uint64_t>(i + 1));
      sj->set_job_id(cell + std::to_string(i));
      v1::Job job;
      job.set_state(i < 3 ? "succeeded" : "running");
      for (int step : {5, 10}) {
        v1::EvalResult* e = job.add_evals();
        e->set_step(step);
        e->set_accuracy(step == 10 && i < 3 ? (cell == "a" ? a[i] : b[i]) : 0.1);
      }
      jobs[sj->job_id()] = job;
    }
  }
  const v1::SweepReport r = BuildSweepReport(sweep, jobs);
  EXPECT_FALSE(r.complete());
  EXPECT_EQ(r.baseline(), "a");
  ASSERT_EQ(r.cells_size(), 2);
  EXPECT_EQ(r.cells(0).n(), 3);
  EXPECT_EQ(r.cells(0).pending(), 1);
  EXPECT_NEAR(r.cells(0).mean(), 0.6, 1e-12);
  EXPECT_NEAR(r.cells(0).sd(), 0.1, 1e-12);
  EXPECT_NEAR(r.cells(0).ci_high() - r.cells(0).mean(), 4.302653 * 0.1 / std::sqrt(3.0), 1e-6);
  ASSERT_EQ(r.differences_size(), 1);
  const auto& d = r.differences(0);  // b - a: 0.05, 0.08, 0.01
  EXPECT_EQ(d.n(), 3);
  EXPECT_NEAR(d.mean(), 0.14 / 3, 1e-12);
  EXPECT_LT(d.t_low(), d.mean());
  EXPECT_GT(d.t_high(), d.mean());
  EXPECT_GT(d.p_value(), 0.0);
  EXPECT_LT(d.p_value(), 1.0);
}

// The report of a sweep with one cell "a" and one seed, whose job is `job`.
v1::SweepReport ReportOfOneJob(const v1::SweepSpec& spec, const v1::Job& job) {
  v1::Sweep sweep;
  sweep.set_id("sweep-000002");
  *sweep.mutable_spec() = spec;
  sweep.add_cells("a");
  v1::SweepJob* sj = sweep.add_jobs();
  sj->set_cell("a");
  sj->set_seed(1);
  sj->set_job_id("j");
  return BuildSweepReport(sweep, {{"j", job}});
}

// data.splits jobs: select test takes the last test evaluation (the test split at the best
// validation epoch); final and best read the validation evaluations, never the test ones.
TEST(SweepTest, SelectTestTakesTheTestMetricAtTheBestValidationEpoch) {
  v1::SweepSpec spec = BaseSweep();
  spec.set_select("tests");
  EXPECT_NE(ExpandSweep(spec).status().message().find("select"), std::string::npos);
  spec.set_select("test");
  ASSERT_TRUE(ExpandSweep(spec).ok());
  v1::Job job;
  job.set_state("succeeded");
  auto add = [&](int64_t step, const std::string& kind, double loss) {
    v1::EvalResult* e = job.add_evals();
    e->set_step(step);
    e->set_kind(kind);
    e->set_eval_loss(loss);
  };
  add(0, "validation", 0.70);
  add(8, "validation", 0.60);
  add(8, "test", 0.61);
  add(16, "validation", 0.50);
  add(16, "test", 0.52);  // the best validation epoch
  add(24, "validation", 0.55);
  add(32, "validation", 0.58);  // patience 2: stopped here
  auto value = [&](const std::string& select) {
    v1::SweepSpec spec = BaseSweep();
    spec.set_select(select);
    const v1::SweepReport r = ReportOfOneJob(spec, job);
    EXPECT_EQ(r.cells(0).n(), 1) << select;
    return r.cells(0).mean();
  };
  EXPECT_DOUBLE_EQ(value("test"), 0.52);
  EXPECT_DOUBLE_EQ(value("final"), 0.58);
  EXPECT_DOUBLE_EQ(value("best"), 0.50);
}

// eval.lengths jobs end with one evaluation per extra length (kind "length"): a plain report
// never reads them (they come last, at the final step), a report with a length reads only its
// own, and a length cannot be combined with select test.
TEST(SweepTest, LengthSelectsTheEndOfRunEvaluationAtThatLength) {
  v1::SweepSpec spec = BaseSweep();
  spec.set_length(-1);
  EXPECT_NE(ExpandSweep(spec).status().message().find("length"), std::string::npos);
  spec.set_length(128);
  spec.set_select("test");
  EXPECT_NE(ExpandSweep(spec).status().message().find("length"), std::string::npos);
  spec.set_select("final");
  ASSERT_TRUE(ExpandSweep(spec).ok());
  v1::Job job;
  job.set_state("succeeded");
  auto add = [&](int64_t step, int64_t length, double accuracy) {
    v1::EvalResult* e = job.add_evals();
    e->set_step(step);
    if (length > 0) e->set_kind("length");
    e->set_length(length);
    e->set_accuracy(accuracy);
  };
  add(500, 0, 0.30);
  add(1000, 0, 0.40);  // the training length's final evaluation
  add(1000, 128, 0.70);
  add(1000, 256, 0.60);
  auto value = [&](int64_t length) {
    v1::SweepSpec spec = BaseSweep();
    spec.set_metric("accuracy");
    spec.set_length(length);
    const v1::SweepReport r = ReportOfOneJob(spec, job);
    EXPECT_EQ(r.length(), length);
    EXPECT_EQ(r.cells(0).n(), length == 512 ? 0 : 1) << length;
    return r.cells(0).mean();
  };
  EXPECT_DOUBLE_EQ(value(0), 0.40);
  EXPECT_DOUBLE_EQ(value(128), 0.70);
  EXPECT_DOUBLE_EQ(value(256), 0.60);
  value(512);  // no evaluation at that length: the job counts as failed, not as a value
}

}  // namespace
}  // namespace loom::coordinator
