// Sweep statistics against reference values (Student t quantiles and p-values from published
// tables, computed with float64 here), sweep expansion and overrides, and the report from jobs.
#include "coordinator/sweep.h"

#include <gtest/gtest.h>

#include <cmath>

#include "absl/strings/match.h"
#include "coordinator/stats.h"
#include "coordinator/sweep_curves.h"
#include "loom/spec.h"

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

v1::SweepCellSpec* AddCell(v1::SweepSpec& s, const std::string& name) {
  v1::SweepCellSpec* c = s.add_cells();
  c->set_name(name);
  (*c->mutable_set()->mutable_fields())["optimizer.lr"].set_number_value(0.001);
  return c;
}

// The limits are counted from the request: the largest legal sweep expands, the smallest illegal
// one is refused naming the field, and a hostile one (57 000 cells crossed with a grid whose
// product overflows 64 bits) is refused without building anything.
TEST(SweepLimitsTest, JobsAreCountedBeforeAnyCellIsBuilt) {
  v1::SweepSpec s = BaseSweep();  // seeds 1 and 2
  for (int i = 0; i < 10; ++i) AddCell(s, "c" + std::to_string(i));
  auto& lr = (*s.mutable_grid())["optimizer.min_lr"];
  for (int i = 0; i < 10; ++i) lr.add_values()->set_number_value(1e-5 * (i + 1));
  for (int i = 3; i <= 10; ++i) s.add_seeds(i);  // 10 cells x 10 x 10 seeds = 1000 jobs
  auto largest = ExpandSweep(s);
  ASSERT_TRUE(largest.ok()) << largest.status();
  EXPECT_EQ(largest->size() * s.seeds_size(), size_t{kMaxSweepJobs});
  s.add_seeds(11);  // 1100
  EXPECT_TRUE(absl::StrContains(ExpandSweep(s).status().message(),
                                "cells: 10 cells x 10 grid combinations x 11 seeds is more than "
                                "1000 jobs"))
      << ExpandSweep(s).status();

  v1::SweepSpec hostile = BaseSweep();
  for (int i = 0; i < 57000; ++i) AddCell(hostile, "c" + std::to_string(i));
  for (int p = 0; p < 70; ++p) {  // 2^70 combinations
    auto& values = (*hostile.mutable_grid())["model.schedule[0].window" + std::to_string(p)];
    values.add_values()->set_number_value(1);
    values.add_values()->set_number_value(2);
  }
  const absl::Status refused = CheckSweepSize(hostile);
  EXPECT_TRUE(absl::StrContains(refused.message(), "57000 cells x over 1000 grid combinations"))
      << refused;
  EXPECT_EQ(ExpandSweep(hostile).status(), refused);
}

TEST(SweepLimitsTest, TheJobsSpecsAreBoundedInBytes) {
  v1::SweepSpec s = BaseSweep();
  s.clear_seeds();
  s.add_seeds(1);
  for (int i = 0; i < 1000; ++i) AddCell(s, "c" + std::to_string(i));
  ASSERT_TRUE(CheckSweepSize(s).ok()) << CheckSweepSize(s);
  // 1000 jobs of a 40 KB spec each would store 40 MB of specs.
  s.mutable_base()->mutable_spec()->mutable_data()->set_path(std::string(40000, 'p'));
  const absl::Status refused = CheckSweepSize(s);
  EXPECT_TRUE(absl::StartsWith(refused.message(), "base.spec: 1000 jobs of up to ")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "is more than 32 MiB in all")) << refused;
}

// A cell's `set:` of rope_theta 0 under a preset is RoPE off, and so is a base's explicit 0 that
// a cell leaves alone (the base goes through JSON: the 0 must print). Before 2026-12-07 the
// preset's θ replaced both.
TEST(SweepTest, CellsKeepAnExplicitZeroUnderAPreset) {
  v1::JobSpec base;
  base.set_preset("micro");
  SweepCell off{"off", {{"model.rope_theta", {}}}};
  off.set[0].second.set_number_value(0);
  auto spec = ApplyCell(base, off, 1);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto resolved = ResolveJobSpec(*spec);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->model().rope_theta(), 0);
  base.mutable_model()->set_rope_theta(0);
  SweepCell lr{"lr", {{"optimizer.lr", {}}}};
  lr.set[0].second.set_number_value(0.001);
  spec = ApplyCell(base, lr, 1);
  ASSERT_TRUE(spec.ok()) << spec.status();
  resolved = ResolveJobSpec(*spec);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->model().rope_theta(), 0);
  base.mutable_model()->clear_rope_theta();
  spec = ApplyCell(base, lr, 1);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(ResolveJobSpec(*spec)->model().rope_theta(), 10000);
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

// select mean: the metric averaged over the held-out evaluations after step 0 (the area under
// the learning curve); step 0, test and length evaluations are left out; a running job is
// pending however many evaluations it has, and a length cannot be combined with it.
TEST(SweepTest, SelectMeanAveragesTheHeldOutCurveAfterStepZero) {
  v1::SweepSpec spec = BaseSweep();
  spec.set_select("mean");
  spec.set_length(128);
  EXPECT_NE(ExpandSweep(spec).status().message().find("length"), std::string::npos);
  spec.set_length(0);
  spec.set_metric("accuracy");
  ASSERT_TRUE(ExpandSweep(spec).ok());
  v1::Job job;
  job.set_state("succeeded");
  auto add = [&](int64_t step, const std::string& kind, double accuracy) {
    v1::EvalResult* e = job.add_evals();
    e->set_step(step);
    e->set_kind(kind);
    if (kind == "length") e->set_length(128);
    e->set_accuracy(accuracy);
  };
  add(0, "", 0.05);  // the initialisation: not part of the curve
  add(250, "", 0.40);
  add(500, "heldout", 0.50);
  add(500, "test", 0.99);
  add(750, "", 0.90);
  add(750, "length", 0.99);
  v1::SweepReport r = ReportOfOneJob(spec, job);
  ASSERT_EQ(r.cells(0).n(), 1);
  EXPECT_DOUBLE_EQ(r.cells(0).mean(), (0.40 + 0.50 + 0.90) / 3);
  EXPECT_EQ(r.cells(0).values(0).step(), 750);
  EXPECT_FALSE(r.cells(0).values(0).censored());
  job.set_state("running");
  r = ReportOfOneJob(spec, job);
  EXPECT_EQ(r.cells(0).n(), 0);
  EXPECT_EQ(r.cells(0).pending(), 1);
  // Succeeded with only its step-0 evaluation: no curve, counted as failed, not as a 0.
  v1::Job untrained;
  untrained.set_state("succeeded");
  untrained.add_evals()->set_accuracy(0.05);
  r = ReportOfOneJob(spec, untrained);
  EXPECT_EQ(r.cells(0).n(), 0);
  EXPECT_EQ(r.cells(0).failed(), 1);
  spec.set_select("median");
  EXPECT_NE(ExpandSweep(spec).status().message().find("mean"), std::string::npos);
}

// A resumed attempt evaluates again at the steps after its checkpoint: the job's curve is the
// latest attempt's evaluation at each step, for every selection (the report read attempt 1's
// evaluation at step 500 as well, counting the step twice in select mean).
TEST(SweepTest, ResumedAttemptsEvaluationsReplaceTheEarlierOnesAtTheSameStep) {
  v1::Job job;
  job.set_state("succeeded");
  auto add = [&](int attempt, int64_t step, double accuracy) {
    v1::EvalResult* e = job.add_evals();
    e->set_attempt(attempt);
    e->set_step(step);
    e->set_accuracy(accuracy);
    e->set_eval_loss(1 - accuracy);
  };
  add(1, 0, 0.05);
  add(1, 250, 0.40);
  add(1, 500, 0.85);  // attempt 1 died after step 500; attempt 2 resumed from step 400
  add(2, 500, 0.70);
  add(2, 750, 0.90);
  v1::SweepSpec spec = BaseSweep();
  spec.set_metric("accuracy");
  const std::map<std::string, double> expected = {
      {"mean", (0.40 + 0.70 + 0.90) / 3}, {"final", 0.90}, {"best", 0.90}};
  for (const auto& [select, value] : expected) {
    spec.set_select(select);
    const v1::SweepReport r = ReportOfOneJob(spec, job);
    ASSERT_EQ(r.cells(0).n(), 1) << select;
    EXPECT_DOUBLE_EQ(r.cells(0).mean(), value) << select;
  }
  // Attempt 1 reached 0.8 at step 500, but the run that finished did so only at 750.
  spec.set_select("reach");
  spec.set_threshold(0.8);
  const v1::SweepReport r = ReportOfOneJob(spec, job);
  ASSERT_EQ(r.cells(0).n(), 1);
  EXPECT_EQ(r.cells(0).values(0).step(), 750);
}

// What else than the model two jobs compared by seed differ in: paths, seeds and threads are
// not differences of the run.
TEST(SweepTest, SpecDifferencesBesidesTheModelNameTheFields) {
  v1::Job a;
  a.set_world_size(1);
  a.mutable_spec()->set_steps(100);
  a.mutable_spec()->mutable_data()->set_task("khop");
  a.mutable_spec()->mutable_model()->set_n_heads(2);
  a.mutable_spec()->mutable_checkpoint()->set_dir("/storage/jobs/job-000001/checkpoints");
  v1::Job b = a;
  b.mutable_spec()->mutable_model()->set_n_heads(4);
  b.mutable_spec()->mutable_checkpoint()->set_dir("/storage/jobs/job-000002/checkpoints");
  b.mutable_spec()->set_seed(7);
  b.mutable_spec()->set_threads(2);
  EXPECT_TRUE(SpecDifferencesBesidesModel(a, b).empty());
  (*b.mutable_spec()->mutable_data()->mutable_task_options()->mutable_fields())["nodes"]
      .set_number_value(8);
  b.mutable_spec()->set_steps(200);
  b.set_world_size(2);
  EXPECT_EQ(SpecDifferencesBesidesModel(a, b),
            (std::vector<std::string>{"data", "steps", "world_size"}));
}

// Jobs of one cell at two seeds (a pooled sweep's): the seed and what it filled in are not
// differences; the model is, and so is a data seed set apart from the job's.
TEST(SweepTest, SpecDifferencesBesidesTheSeedCompareTheModel) {
  v1::Job a;
  a.set_world_size(1);
  a.mutable_spec()->set_seed(2);
  a.mutable_spec()->mutable_data()->set_seed(2);
  a.mutable_spec()->mutable_model()->set_init_seed(2);
  a.mutable_spec()->mutable_model()->set_n_heads(2);
  v1::Job b = a;
  b.mutable_spec()->set_seed(9);
  b.mutable_spec()->mutable_data()->set_seed(9);
  b.mutable_spec()->mutable_model()->set_init_seed(9);
  b.mutable_spec()->mutable_checkpoint()->set_dir("/storage/jobs/job-000009/checkpoints");
  EXPECT_TRUE(SpecDifferencesBesidesSeed(a, b).empty());
  EXPECT_EQ(SpecDifferencesBesidesModel(a, b), (std::vector<std::string>{"data"}));
  // A 0 set explicitly (a job resolved since 2026-12-07) is the 0 an older job left unset.
  b.mutable_spec()->mutable_model()->set_rope_theta(0);
  b.mutable_spec()->mutable_optimizer()->set_clip_norm(0);
  a.mutable_spec()->mutable_optimizer();
  EXPECT_TRUE(SpecDifferencesBesidesSeed(a, b).empty());
  b.mutable_spec()->mutable_model()->set_rope_theta(10000);
  EXPECT_EQ(SpecDifferencesBesidesSeed(a, b), (std::vector<std::string>{"model"}));
  b.mutable_spec()->mutable_model()->clear_rope_theta();
  b.mutable_spec()->mutable_model()->set_n_heads(4);
  EXPECT_EQ(SpecDifferencesBesidesSeed(a, b), (std::vector<std::string>{"model"}));
  b.mutable_spec()->mutable_model()->set_n_heads(2);
  b.mutable_spec()->mutable_data()->set_seed(5);  // not the job's seed: a fixed data stream
  b.mutable_spec()->set_steps(10);
  EXPECT_EQ(SpecDifferencesBesidesSeed(a, b), (std::vector<std::string>{"data", "steps"}));
}

TEST(StatsTest, SignTestIsTheExactBinomial) {
  EXPECT_DOUBLE_EQ(SignTestPValue(0, 0), 1.0);
  EXPECT_DOUBLE_EQ(SignTestPValue(5, 0), 2.0 / 32);  // the smallest p five seeds can give
  EXPECT_DOUBLE_EQ(SignTestPValue(0, 5), 2.0 / 32);
  EXPECT_DOUBLE_EQ(SignTestPValue(4, 1), 2.0 * 6 / 32);
  EXPECT_DOUBLE_EQ(SignTestPValue(3, 3), 1.0);
  // 9 of 10: 2 (1 + 10) / 1024.
  EXPECT_NEAR(SignTestPValue(9, 1), 22.0 / 1024, 1e-15);
  EXPECT_NEAR(SignTestPValue(1, 9), 22.0 / 1024, 1e-15);
}

// select reach: the value is the step of a job's first held-out evaluation at the threshold; a
// job that ended without reaching it is censored (listed, not in the mean); a running job that
// has reached it counts already. Paired: which seed's job got there first, where known.
TEST(SweepTest, ReachReportsStepsToTheThresholdWithCensoredSeedsApart) {
  v1::SweepSpec spec = BaseSweep();
  spec.set_metric("accuracy");
  spec.set_select("reach");
  EXPECT_NE(ExpandSweep(spec).status().message().find("threshold"), std::string::npos);
  spec.set_threshold(1.5);  // accuracy is a fraction
  EXPECT_NE(ExpandSweep(spec).status().message().find("threshold"), std::string::npos);
  spec.set_threshold(0.95);
  spec.set_length(128);
  EXPECT_NE(ExpandSweep(spec).status().message().find("length"), std::string::npos);
  spec.set_length(0);
  ASSERT_TRUE(ExpandSweep(spec).ok());
  v1::SweepSpec loss = BaseSweep();
  loss.set_select("reach");
  loss.set_threshold(1.5);  // eval_loss <= 1.5 is a fine target
  EXPECT_TRUE(ExpandSweep(loss).ok());

  v1::Sweep sweep;
  sweep.set_id("sweep-000003");
  *sweep.mutable_spec() = spec;
  sweep.add_cells("a");
  sweep.add_cells("b");
  std::map<std::string, v1::Job> jobs;
  // Per seed and cell: the step accuracy first reaches 0.95 (0 = never), and the job's state.
  struct Run {
    int reach_at;
    const char* state;
  };
  const std::vector<std::pair<Run, Run>> runs = {
      {{3000, "succeeded"}, {2000, "succeeded"}},  // b first, both reached: diff -1000
      {{4000, "succeeded"}, {5000, "succeeded"}},  // a first: diff +1000
      {{0, "succeeded"}, {1000, "succeeded"}},     // b first, a censored at 5000
      {{0, "succeeded"}, {0, "succeeded"}},        // neither: unordered
      {{2000, "succeeded"}, {2000, "running"}},    // a tie; b still running, already there
      {{0, "running"}, {0, "running"}},            // both pending
  };
  for (size_t i = 0; i < runs.size(); ++i) {
    for (const std::string cell : {"a", "b"}) {
      const Run& run = cell == "a" ? runs[i].first : runs[i].second;
      v1::SweepJob* sj = sweep.add_jobs();
      sj->set_cell(cell);
      sj->set_seed(i + 1);
      sj->set_job_id(cell + std::to_string(i));
      v1::Job job;
      job.set_state(run.state);
      const int last = std::string(run.state) == "running" ? 3000 : 5000;
      for (int step = 0; step <= last; step += 1000) {
        v1::EvalResult* e = job.add_evals();
        e->set_step(step);
        e->set_accuracy(run.reach_at > 0 && step >= run.reach_at ? 0.97 + 0.001 * step / 1000
                                                                 : 0.5);
        if (step == 1000) {  // a test evaluation past the threshold never counts
          v1::EvalResult* t = job.add_evals();
          t->set_step(step);
          t->set_kind("test");
          t->set_accuracy(1.0);
        }
      }
      jobs[sj->job_id()] = job;
    }
  }
  const v1::SweepReport r = BuildSweepReport(sweep, jobs);
  EXPECT_EQ(r.select(), "reach");
  EXPECT_DOUBLE_EQ(r.threshold(), 0.95);
  EXPECT_FALSE(r.complete());
  ASSERT_EQ(r.cells_size(), 2);
  const auto& a = r.cells(0);  // reached at 3000, 4000, 2000; censored seeds 3 and 4
  EXPECT_EQ(a.n(), 3);
  EXPECT_EQ(a.censored(), 2);
  EXPECT_EQ(a.pending(), 1);
  EXPECT_DOUBLE_EQ(a.mean(), 3000.0);
  EXPECT_DOUBLE_EQ(a.sd(), 1000.0);
  ASSERT_EQ(a.values_size(), 5);
  EXPECT_TRUE(a.values(2).censored());
  EXPECT_EQ(a.values(2).step(), 5000);  // its last held-out evaluation
  const auto& b = r.cells(1);           // 2000, 5000, 1000, and 2000 while running; seed 4 censored
  EXPECT_EQ(b.n(), 4);
  EXPECT_EQ(b.censored(), 1);
  EXPECT_EQ(b.pending(), 1);
  EXPECT_DOUBLE_EQ(b.mean(), 2500.0);
  ASSERT_EQ(r.differences_size(), 1);
  const auto& d = r.differences(0);  // b - a over seeds 1, 2, 5: -1000, +1000, 0
  EXPECT_EQ(d.n(), 3);
  EXPECT_DOUBLE_EQ(d.mean(), 0.0);
  EXPECT_EQ(d.first(), 2);                  // seeds 1 and 3
  EXPECT_EQ(d.later(), 1);                  // seed 2
  EXPECT_EQ(d.ties(), 1);                   // seed 5
  EXPECT_EQ(d.unordered(), 1);              // seed 4
  EXPECT_DOUBLE_EQ(d.sign_p_value(), 1.0);  // 2 against 1
}

// A censored job is known to be later only up to the step it ended at: a seed whose baseline
// stopped at 2000 without reaching it, while the cell reached it at 3000, is unordered.
TEST(SweepTest, ReachOrdersACensoredSeedOnlyUpToItsLastEvaluation) {
  v1::SweepSpec spec = BaseSweep();
  spec.set_metric("eval_loss");
  spec.set_select("reach");
  spec.set_threshold(1.0);
  v1::Sweep sweep;
  sweep.set_id("sweep-000004");
  *sweep.mutable_spec() = spec;
  sweep.add_cells("base");
  sweep.add_cells("other");
  std::map<std::string, v1::Job> jobs;
  auto add = [&](const std::string& cell, uint64_t seed, std::vector<double> losses) {
    v1::SweepJob* sj = sweep.add_jobs();
    sj->set_cell(cell);
    sj->set_seed(seed);
    sj->set_job_id(cell + std::to_string(seed));
    v1::Job job;
    job.set_state("succeeded");
    for (size_t i = 0; i < losses.size(); ++i) {
      v1::EvalResult* e = job.add_evals();
      e->set_step(static_cast<int64_t>(i) * 1000);
      e->set_eval_loss(losses[i]);
    }
    jobs[sj->job_id()] = job;
  };
  add("base", 1, {3.0, 2.0, 1.5});            // ended at 2000 without loss <= 1
  add("other", 1, {3.0, 2.0, 1.5, 0.9});      // reached at 3000: after the base ended
  add("base", 2, {3.0, 2.0, 1.5, 1.2, 1.1});  // censored at 4000
  add("other", 2, {3.0, 1.0, 0.5});           // reached at 1000 (<= 1 counts): known first
  const v1::SweepReport r = BuildSweepReport(sweep, jobs);
  EXPECT_TRUE(r.complete());
  EXPECT_EQ(r.cells(0).n(), 0);
  EXPECT_EQ(r.cells(0).censored(), 2);
  EXPECT_EQ(r.cells(1).n(), 2);
  EXPECT_DOUBLE_EQ(r.cells(1).mean(), 2000.0);
  const auto& d = r.differences(0);
  EXPECT_EQ(d.n(), 0);  // no seed where both reached it
  EXPECT_EQ(d.first(), 1);
  EXPECT_EQ(d.later(), 0);
  EXPECT_EQ(d.unordered(), 1);
  EXPECT_DOUBLE_EQ(d.sign_p_value(), 1.0);
}

// A sweep of cells a and b: seeds 1-3 succeeded with held-out evaluations at steps 5 and 10,
// seed 4 still running (evaluated at step 5 only), seed 5 failed (evaluated at both).
struct CurvesSweep {
  v1::Sweep sweep;
  std::map<std::string, v1::Job> jobs;
};

CurvesSweep MakeCurvesSweep() {
  CurvesSweep s;
  s.sweep.set_id("sweep-000003");
  *s.sweep.mutable_spec() = BaseSweep();
  s.sweep.add_cells("a");
  s.sweep.add_cells("b");
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    for (const std::string cell : {"a", "b"}) {
      v1::SweepJob* sj = s.sweep.add_jobs();
      sj->set_cell(cell);
      sj->set_seed(seed);
      sj->set_job_id(cell + std::to_string(seed));
      v1::Job& job = s.jobs[sj->job_id()];
      job.set_state(seed <= 3 ? "succeeded" : seed == 4 ? "running" : "failed");
      for (int step : {5, 10}) {
        if (seed == 4 && step == 10) continue;
        v1::EvalResult* e = job.add_evals();
        e->set_step(step);
        // Distinct per (cell, seed, step); b is lower than a by a seed-dependent amount.
        e->set_eval_loss(3.0 - 0.1 * step + 0.01 * seed * seed - (cell == "b" ? 0.02 * seed : 0));
      }
    }
  }
  return s;
}

TEST(SweepCurvesTest, PointsPerStepAndTheLastStepIsTheReport) {
  const CurvesSweep s = MakeCurvesSweep();
  const v1::SweepCurves c = BuildSweepCurves(s.sweep, s.jobs);
  EXPECT_FALSE(c.complete());
  EXPECT_EQ(c.metric(), "eval_loss");
  EXPECT_EQ(c.baseline(), "a");
  ASSERT_EQ(c.cells_size(), 2);
  const v1::CellCurve& a = c.cells(0);
  EXPECT_EQ(a.seeds(), 4);  // the failed seed is left out
  ASSERT_EQ(a.points_size(), 2);
  EXPECT_EQ(a.points(0).step(), 5);
  EXPECT_EQ(a.points(0).n(), 4);  // the running seed counts with what it has
  // Step 5 of a: 2.5 + 0.01 s^2 for s = 1..4: mean 2.5 + 0.075.
  EXPECT_NEAR(a.points(0).mean(), 2.575, 1e-12);
  const v1::SweepReport r = BuildSweepReport(s.sweep, s.jobs);
  for (int i = 0; i < 2; ++i) {
    const v1::CurvePoint& last = c.cells(i).points(1);
    EXPECT_EQ(last.step(), 10);
    EXPECT_EQ(last.n(), r.cells(i).n());
    EXPECT_DOUBLE_EQ(last.mean(), r.cells(i).mean());
    EXPECT_DOUBLE_EQ(last.sd(), r.cells(i).sd());
    EXPECT_DOUBLE_EQ(last.ci_low(), r.cells(i).ci_low());
    EXPECT_DOUBLE_EQ(last.ci_high(), r.cells(i).ci_high());
  }
  ASSERT_EQ(c.differences_size(), 1);
  const v1::DifferenceCurve& d = c.differences(0);
  EXPECT_EQ(d.cell(), "b");
  ASSERT_EQ(d.points_size(), 2);
  // Step 5: b - a = -0.02 s over seeds 1-4: mean -0.05, sd 0.02 sqrt(5/3).
  EXPECT_EQ(d.points(0).n(), 4);
  EXPECT_NEAR(d.points(0).mean(), -0.05, 1e-12);
  EXPECT_NEAR(d.points(0).sd(), 0.02 * std::sqrt(5.0 / 3.0), 1e-12);
  EXPECT_NEAR(d.points(0).ci_high() - d.points(0).mean(), 3.182446 * d.points(0).sd() / 2.0,
              1e-7);  // t_{0.975, 3}
  const v1::CurvePoint& last = d.points(1);
  EXPECT_EQ(last.n(), r.differences(0).n());
  EXPECT_DOUBLE_EQ(last.mean(), r.differences(0).mean());
  EXPECT_DOUBLE_EQ(last.ci_low(), r.differences(0).t_low());
  EXPECT_DOUBLE_EQ(last.ci_high(), r.differences(0).t_high());
  EXPECT_DOUBLE_EQ(last.p_value(), r.differences(0).p_value());
}

TEST(SweepCurvesTest, PairsOnlyWhereBothEvaluatedAndReadsOnlyTheLatestHeldOutEvaluations) {
  CurvesSweep s = MakeCurvesSweep();
  s.sweep.mutable_spec()->set_metric("accuracy");
  v1::Job& b1 = s.jobs["b1"];
  b1.add_evals()->set_step(7);  // only b's seed 1 evaluated at step 7
  b1.mutable_evals(2)->set_accuracy(0.3);
  v1::EvalResult* test = b1.add_evals();  // not held out: not on the curve
  test->set_step(10);
  test->set_kind("test");
  test->set_accuracy(0.99);
  v1::EvalResult* resumed = b1.add_evals();  // a restarted attempt's evaluation replaces it
  resumed->set_step(10);
  resumed->set_attempt(2);
  resumed->set_accuracy(0.6);
  const v1::SweepCurves c = BuildSweepCurves(s.sweep, s.jobs);
  const v1::CellCurve& b = c.cells(1);
  ASSERT_EQ(b.points_size(), 3);
  EXPECT_EQ(b.points(1).step(), 7);
  EXPECT_EQ(b.points(1).n(), 1);
  EXPECT_DOUBLE_EQ(b.points(1).mean(), 0.3);
  EXPECT_DOUBLE_EQ(b.points(1).ci_low(), 0.3);  // one value: the point
  EXPECT_DOUBLE_EQ(b.points(1).ci_high(), 0.3);
  EXPECT_NEAR(b.points(2).mean(), 0.6 / 3, 1e-12);  // seeds 2, 3 have accuracy 0
  const v1::DifferenceCurve& d = c.differences(0);
  ASSERT_EQ(d.points_size(), 2);  // steps 5 and 10: a has no step 7
  EXPECT_EQ(d.points(1).step(), 10);
  EXPECT_NEAR(d.points(1).mean(), 0.6 / 3, 1e-12);
}

// A reasoning evaluation of 4 problems x 2 samples: correct counts, majority flags.
v1::EvalResult Reasoning(std::vector<int> correct, std::vector<bool> majority,
                         const std::string& problem_set = "ab12") {
  v1::EvalResult e;
  e.set_kind("reasoning");
  e.set_step(20);
  double pass = 0, maj = 0;
  for (size_t i = 0; i < correct.size(); ++i) {
    e.add_problem_samples(2);
    e.add_problem_correct(correct[i]);
    e.add_problem_answered(2);
    e.add_problem_majority_correct(majority[i]);
    pass += correct[i] / 2.0 / correct.size();
    maj += majority[i] ? 1.0 / correct.size() : 0;
  }
  e.set_pass_at_1(pass);
  e.set_maj_at_k(maj);
  e.set_answered(1);
  e.set_problem_set(problem_set);
  return e;
}

// Cells a and b, seeds 1 and 2, each job with one held-out evaluation and one reasoning one.
struct ReasoningSweep {
  v1::Sweep sweep;
  std::map<std::string, v1::Job> jobs;
  void Add(const std::string& cell, uint64_t seed, const v1::EvalResult& e) {
    v1::SweepJob* sj = sweep.add_jobs();
    sj->set_cell(cell);
    sj->set_seed(seed);
    sj->set_job_id(cell + std::to_string(seed));
    v1::Job& job = jobs[sj->job_id()];
    job.set_state("succeeded");
    job.add_evals()->set_step(20);  // held out: not what a reasoning metric reads
    job.mutable_evals(0)->set_eval_loss(1.0);
    *job.add_evals() = e;
  }
};

ReasoningSweep MakeReasoningSweep(const std::string& b2_problem_set = "ab12") {
  ReasoningSweep s;
  s.sweep.set_id("sweep-000004");
  *s.sweep.mutable_spec() = BaseSweep();
  s.sweep.mutable_spec()->set_metric("pass@1");
  s.sweep.add_cells("a");
  s.sweep.add_cells("b");
  s.Add("a", 1, Reasoning({0, 1, 2, 0}, {false, false, true, false}));
  s.Add("a", 2, Reasoning({1, 1, 0, 0}, {false, false, false, false}));
  s.Add("b", 1, Reasoning({2, 1, 2, 1}, {true, false, true, false}));
  s.Add("b", 2, Reasoning({2, 2, 0, 1}, {true, true, false, false}, b2_problem_set));
  return s;
}

TEST(SweepReasoningTest, PairsBySeedAndByProblem) {
  const ReasoningSweep s = MakeReasoningSweep();
  const v1::SweepReport r = BuildSweepReport(s.sweep, s.jobs);
  ASSERT_EQ(r.cells_size(), 2);
  EXPECT_DOUBLE_EQ(r.cells(0).mean(), (3.0 / 8 + 2.0 / 8) / 2);  // pass@1 of a's two seeds
  const v1::PairedDifference& d = r.differences(0);
  EXPECT_EQ(d.n(), 2);
  // Per problem, b - a averaged over the seeds: (1 + 0.5)/2, (0 + 0.5)/2, 0, (0.5 + 0.5)/2.
  const std::vector<double> per_problem = {0.75, 0.25, 0.0, 0.5};
  EXPECT_EQ(d.problems(), 4);
  EXPECT_NEAR(d.problem_mean(), Mean(per_problem), 1e-12);
  EXPECT_NEAR(d.problem_mean(), d.mean(), 1e-12);  // the same mean, another unit of replication
  const Interval t = TInterval(per_problem);
  EXPECT_NEAR(d.problem_t_low(), t.low, 1e-12);
  EXPECT_NEAR(d.problem_t_high(), t.high, 1e-12);
  EXPECT_NEAR(d.problem_p_value(), TTestPValue(per_problem), 1e-12);
  // maj@k: per problem (1 + 1)/2, (0 + 1)/2, 0, 0.
  v1::Sweep maj = s.sweep;
  maj.mutable_spec()->set_metric("maj@k");
  const v1::PairedDifference dm = BuildSweepReport(maj, s.jobs).differences(0);
  EXPECT_NEAR(dm.problem_mean(), 0.375, 1e-12);
  EXPECT_NEAR(dm.mean(), 0.375, 1e-12);
  // The curves read the reasoning evaluations too.
  const v1::SweepCurves c = BuildSweepCurves(s.sweep, s.jobs);
  ASSERT_EQ(c.differences(0).points_size(), 1);
  EXPECT_NEAR(c.differences(0).points(0).mean(), d.mean(), 1e-12);
}

TEST(SweepReasoningTest, NoTestOverProblemsUnlessTheSameProblemsWithSoundLists) {
  const ReasoningSweep other = MakeReasoningSweep("ffff");  // seed 2 of b scored other problems
  const v1::PairedDifference d = BuildSweepReport(other.sweep, other.jobs).differences(0);
  EXPECT_EQ(d.n(), 2);
  EXPECT_EQ(d.problems(), 0);
  ReasoningSweep hostile = MakeReasoningSweep();
  hostile.jobs["b1"].mutable_evals(1)->set_problem_correct(0, 3);  // 3 of 2 samples correct
  EXPECT_EQ(BuildSweepReport(hostile.sweep, hostile.jobs).differences(0).problems(), 0);
  hostile = MakeReasoningSweep();
  hostile.jobs["a2"].mutable_evals(1)->mutable_problem_samples()->RemoveLast();  // ragged lists
  EXPECT_EQ(BuildSweepReport(hostile.sweep, hostile.jobs).differences(0).problems(), 0);
  // select mean and reach have no single evaluation to pair problems in.
  ReasoningSweep s = MakeReasoningSweep();
  s.sweep.mutable_spec()->set_select("mean");
  EXPECT_EQ(BuildSweepReport(s.sweep, s.jobs).differences(0).problems(), 0);
}

TEST(SweepReasoningTest, SelectionsThatGoByEvalLossAreRefusedNamingTheField) {
  EXPECT_TRUE(CheckMetricAndSelect("pass@1", "final").ok());
  EXPECT_TRUE(CheckMetricAndSelect("answered", "mean").ok());
  EXPECT_TRUE(CheckMetricAndSelect("maj@k", "reach", 0, 0.5).ok());
  for (const char* select : {"best", "test"}) {
    const absl::Status st = CheckMetricAndSelect("maj@k", select);
    EXPECT_TRUE(absl::StartsWith(st.message(), "select: ")) << st;
  }
  EXPECT_TRUE(absl::StartsWith(CheckMetricAndSelect("pass@1", "final", 64).message(), "length: "));
  EXPECT_TRUE(absl::StartsWith(CheckMetricAndSelect("pass@2", "").message(), "metric: "));
}

}  // namespace
}  // namespace loom::coordinator
