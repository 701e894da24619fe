// Sweeps and what is read back: printable jobs, sweeps and their reports (pairing, merging), lists,
// training curves, and api/openapi.yaml against the served route table.
#include "coordinator/coordinator_test_fixture.h"

namespace loom::coordinator {
namespace {

TEST_F(CoordinatorTest, SubmittedJobsAlwaysPrint) {
  // Free-form options nested deeper than the limit are refused at the API; what is accepted
  // prints and parses back (agents and GET depend on it).
  v1::SubmitJobRequest r = MicroJob();
  google::protobuf::Struct* opts = r.mutable_spec()->mutable_data()->mutable_task_options();
  for (int i = 0; i < 7; ++i) {
    opts = (*opts->mutable_fields())["k"].mutable_struct_value();
  }
  EXPECT_TRUE(CheckMessageLimits(r).ok());
  const std::string id = Submit(r);
  auto list = c_->ListJobs("", 10, "");
  ASSERT_TRUE(list.ok());
  (*opts->mutable_fields())["k"].mutable_struct_value();
  (*opts->mutable_fields())["k"].mutable_struct_value()->mutable_fields();
  auto deep = r;
  google::protobuf::Struct* d = deep.mutable_spec()->mutable_data()->mutable_task_options();
  for (int i = 0; i < 9; ++i) d = (*d->mutable_fields())["k"].mutable_struct_value();
  absl::Status s = CheckMessageLimits(deep);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("spec.data.task_options"), std::string::npos) << s;
  // An agent's log chunk is bounded by the body limit alone; its other strings are not.
  v1::HeartbeatRequest beat;
  v1::AttemptReport* report = beat.add_attempts();
  report->set_log(std::string(100000, 'l'));
  EXPECT_TRUE(CheckMessageLimits(beat).ok());
  report->add_ranks()->set_detail(std::string(5000, 'd'));
  EXPECT_NE(CheckMessageLimits(beat).message().find("attempts[0].ranks[0].detail: longer than"),
            std::string::npos)
      << CheckMessageLimits(beat);
  v1::SubmitJobRequest long_name = MicroJob();
  long_name.mutable_spec()->set_name(std::string(5000, 'x'));
  s = CheckMessageLimits(long_name);
  EXPECT_NE(s.message().find("spec.name: longer than"), std::string::npos) << s;
  EXPECT_TRUE(CheckJsonDepth(std::string(32, '[') + std::string(32, ']'), 32).ok());
  EXPECT_FALSE(CheckJsonDepth(std::string(33, '[') + std::string(33, ']'), 32).ok());
  EXPECT_TRUE(CheckJsonDepth("\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"", 2).ok());
  (void)id;
}

TEST_F(CoordinatorTest, SweepsExpandIntoTaggedJobsAtomically) {
  v1::SweepSpec sweep;
  sweep.set_name("lr");
  *sweep.mutable_base() = MicroJob();
  auto* lr = &(*sweep.mutable_grid())["optimizer.lr"];
  lr->add_values()->set_number_value(0.001);
  lr->add_values()->set_number_value(0.01);
  for (uint64_t seed : {7, 8, 9}) sweep.add_seeds(seed);
  sweep.set_request_id("sweep-key");
  auto created = c_->CreateSweep(sweep, "alice");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->jobs(), 6);
  auto again = c_->CreateSweep(sweep, "alice");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->id(), created->id());
  // One bad cell refuses the whole sweep, naming the cell; nothing is stored.
  v1::SweepSpec bad = sweep;
  bad.set_request_id("");
  (*bad.mutable_grid())["model.n_heads"].add_values()->set_number_value(3);
  auto refused = c_->CreateSweep(bad, "alice");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("cell 'model.n_heads=3"), std::string::npos)
      << refused.status();
  auto jobs = c_->ListJobs("", 500, "");
  ASSERT_TRUE(jobs.ok());
  ASSERT_EQ(jobs->jobs_size(), 6);
  for (const auto& j : jobs->jobs()) {
    EXPECT_EQ(j.sweep_id(), created->id());
    EXPECT_EQ(j.spec().seed(), j.sweep_seed());
    EXPECT_EQ(j.spec().model().init_seed(), j.sweep_seed());  // seeds vary the init too
  }
  EXPECT_DOUBLE_EQ(jobs->jobs(5).spec().optimizer().lr(), 0.01);
  // It survives a restart; cancelling it cancels its jobs; the report counts them as failed.
  Reopen();
  auto got = c_->GetSweep(created->id());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->state(), "running");
  EXPECT_EQ(got->job_states().at("queued"), 6);
  auto cancelled = c_->CancelSweep(created->id(), Caller{"bob", true});
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->state(), "cancelled");
  EXPECT_EQ(Job(got->jobs(0).job_id()).state(), "cancelled");
  auto report = c_->ReportSweep(created->id());
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->complete());
  EXPECT_EQ(report->cells(0).failed(), 3);
  EXPECT_EQ(c_->ListSweeps()->sweeps_size(), 1);
  EXPECT_EQ(c_->GetSweep("sweep-999999").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Submit(MicroJob()), "job-000007");  // the job counter moved past the sweep's jobs
}

// A report's baseline may be a cell of another sweep: it joins the report as SWEEP_ID/CELL with
// that sweep's jobs (paired by seed; docs/sweeps.md), or the query names what is wrong.
TEST_F(CoordinatorTest, ReportsPairAgainstAnotherSweepsCell) {
  auto sweep_of = [&](const std::vector<uint64_t>& seeds, const std::string& cell) {
    v1::SweepSpec spec;
    *spec.mutable_base() = MicroJob();
    if (cell.empty()) {
      auto* lr = &(*spec.mutable_grid())["optimizer.lr"];
      lr->add_values()->set_number_value(0.001);
      lr->add_values()->set_number_value(0.01);
    } else {
      spec.add_cells()->set_name(cell);
    }
    for (uint64_t seed : seeds) spec.add_seeds(seed);
    auto created = c_->CreateSweep(spec, "alice");
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->id() : std::string();
  };
  const std::string a = sweep_of({7, 8, 9}, ""), b = sweep_of({8, 9, 10}, "x");
  ASSERT_TRUE(c_->CancelSweep(b, Caller{"alice"}).ok());
  Coordinator::ReportQuery query;
  query.baseline = b + "/x";
  auto r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->baseline(), b + "/x");
  ASSERT_EQ(r->cells_size(), 3);
  EXPECT_EQ(r->cells(2).cell(), b + "/x");
  EXPECT_EQ(r->cells(2).sweep_id(), b);
  EXPECT_EQ(r->cells(2).failed(), 3);  // b's three cancelled jobs, not a's
  EXPECT_EQ(r->cells(0).pending(), 3);
  EXPECT_TRUE(r->cells(0).sweep_id().empty());
  ASSERT_EQ(r->differences_size(), 2);
  EXPECT_EQ(r->differences(0).baseline(), b + "/x");
  // Each of a's cells sets an lr; b's is the default: the pairing compares more than models.
  ASSERT_EQ(r->warnings_size(), 2);
  EXPECT_NE(r->warnings(1).find("cell 'optimizer.lr=0.01' and the baseline '" + b +
                                "/x' differ in more than the model: optimizer"),
            std::string::npos)
      << r->warnings(1);
  // The sweep's own cell, plainly or as SWEEP_ID/CELL of itself.
  for (const std::string& own : {std::string("optimizer.lr=0.01"), a + "/optimizer.lr=0.01"}) {
    query.baseline = own;
    auto self = c_->ReportSweep(a, query);
    ASSERT_TRUE(self.ok()) << self.status();
    EXPECT_EQ(self->baseline(), "optimizer.lr=0.01");
    EXPECT_EQ(self->cells_size(), 2);
  }
  for (const auto& [bad, says] : std::vector<std::pair<std::string, std::string>>{
           {"optimizer.lr=0.5", "no cell named 'optimizer.lr=0.5' (cells: optimizer.lr=0.001; "},
           {"sweep-424242/x", "no sweep 'sweep-424242'"},
           {"../x", "no sweep '..'"},
           {b + "/y", b + " has no cell named 'y' (cells: x)"},
           {std::string(300, 'x'), "longer than 256"}}) {
    query.baseline = bad;
    ExpectReportRefused(a, query, "baseline: " + says);
  }
}

// ?merge=: another sweep's cells join this sweep's cells of the same name as more seeds (a
// replication on new seeds); a seed counts once, and what differs besides the seed is a warning.
TEST_F(CoordinatorTest, ReportsMergeAnotherSweepsSeedsIntoTheSameCells) {
  auto sweep_of = [&](const std::vector<uint64_t>& seeds,
                      std::vector<std::pair<std::string, double>> cells) {
    v1::SweepSpec spec;
    *spec.mutable_base() = MicroJob();
    if (cells.empty()) {
      auto* lr = &(*spec.mutable_grid())["optimizer.lr"];
      lr->add_values()->set_number_value(0.001);
      lr->add_values()->set_number_value(0.01);
    }
    for (const auto& [name, lr] : cells) {
      v1::SweepCellSpec* cell = spec.add_cells();
      cell->set_name(name);
      (*cell->mutable_set()->mutable_fields())["optimizer.lr"].set_number_value(lr);
    }
    for (uint64_t seed : seeds) spec.add_seeds(seed);
    auto created = c_->CreateSweep(spec, "alice");
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->id() : std::string();
  };
  const std::string a = sweep_of({7, 8, 9}, {}), more = sweep_of({10, 11}, {});
  Coordinator::ReportQuery query;
  query.merge = {more};
  auto r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->merged_sweeps_size(), 1);
  EXPECT_EQ(r->merged_sweeps(0), more);
  ASSERT_EQ(r->cells_size(), 2);
  EXPECT_EQ(r->cells(0).pending(), 5);  // seeds 7-9 here and 10-11 there, none run yet
  EXPECT_EQ(r->cells(1).pending(), 5);
  EXPECT_EQ(r->warnings_size(), 0) << r->warnings(0);
  ASSERT_TRUE(c_->CancelSweep(more, Caller{"alice"}).ok());
  r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cells(0).pending(), 3);
  EXPECT_EQ(r->cells(0).failed(), 2);

  // A namesake cell with another lr, and a cell with no namesake: both said, the first merged.
  const std::string odd = sweep_of({12}, {{"optimizer.lr=0.001", 0.003}, {"x", 0.001}});
  query.merge = {more, odd};
  query.baseline = "optimizer.lr=0.01";
  r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->baseline(), "optimizer.lr=0.01");
  EXPECT_EQ(r->cells(0).pending() + r->cells(0).failed(), 6);
  EXPECT_EQ(r->cells(1).pending() + r->cells(1).failed(), 5);
  EXPECT_EQ(
      std::vector<std::string>(r->warnings().begin(), r->warnings().end()),
      (std::vector<std::string>{"cell 'optimizer.lr=0.001' of " + odd + " differs from " + a +
                                    "'s besides the seed: optimizer",
                                odd + "'s cells 'x' have no namesake in " + a + ": not merged"}));
  // With a baseline from another sweep as well.
  query.merge = {more};
  query.baseline = odd + "/x";
  r = c_->ReportSweep(a, query);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->cells_size(), 3);
  EXPECT_EQ(r->cells(0).pending() + r->cells(0).failed(), 5);

  const std::string overlap = sweep_of({9, 13}, {}), apart = sweep_of({14}, {{"y", 0.001}});
  query.baseline.clear();
  for (const auto& [merge, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{a}, a + " is the reported sweep"},
           {{more, more}, more + " is listed twice"},
           {{"sweep-424242"}, "no sweep 'sweep-424242'"},
           {{""}, "no sweep ''"},
           {{more, overlap},
            overlap + "'s cell 'optimizer.lr=0.001' has seed 9, which the cell "
                      "has already"},
           {{apart}, apart + " has no cell named like one of " + a + "'s (its cells: y)"},
           {std::vector<std::string>(17, more), "at most 16 sweeps"}}) {
    query.merge = merge;
    ExpectReportRefused(a, query, "merge: " + says);
  }
}

TEST_F(CoordinatorTest, ListsPaginateAndFilter) {
  for (int i = 0; i < 7; ++i) Submit(MicroJob());
  ASSERT_TRUE(c_->Cancel("job-000002", Caller{"alice"}).ok());
  std::set<std::string> seen;
  std::string token;
  int pages = 0;
  do {
    auto page = c_->ListJobs("", 3, token);
    ASSERT_TRUE(page.ok());
    for (const auto& j : page->jobs()) EXPECT_TRUE(seen.insert(j.id()).second);
    token = page->next_page_token();
    ++pages;
  } while (!token.empty());
  EXPECT_EQ(seen.size(), 7u);
  EXPECT_EQ(pages, 3);
  auto cancelled = c_->ListJobs("cancelled", 50, "");
  ASSERT_TRUE(cancelled.ok());
  ASSERT_EQ(cancelled->jobs_size(), 1);
  EXPECT_EQ(cancelled->jobs(0).id(), "job-000002");
  EXPECT_EQ(c_->ListJobs("exploded", 50, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->ListJobs("", 0, "").status().code(), absl::StatusCode::kInvalidArgument);
}

// Rank 0's steps become the job's curves: resent points are dropped, each attempt is its own
// series (a resumed attempt repeats steps), the series survive a reopen, long ones are thinned.
TEST_F(CoordinatorTest, StepPointsBecomePerAttemptCurves) {
  const std::string w = RegisterWorker("a", 1);
  v1::SubmitJobRequest r = MicroJob(1);
  r.set_max_restarts(2);
  const std::string id = Submit(r);
  c_->Tick();
  ASSERT_EQ(Beat(w, "", 0, {}).assignments_size(), 1);
  auto steps = [&](int attempt, int64_t offset, int64_t first, int n, bool finished = false) {
    v1::HeartbeatRequest req;
    req.set_worker_id(w);
    v1::AttemptReport* a = req.add_attempts();
    a->set_job_id(id);
    a->set_attempt(attempt);
    v1::RankStatus* rank = a->add_ranks();
    rank->set_running(!finished);
    rank->set_exit_code(finished ? 137 : 0);
    a->set_finished(finished);
    a->set_steps_offset(offset);
    for (int i = 0; i < n; ++i) {
      v1::StepPoint* p = a->add_steps();
      p->set_step(first + i);
      p->set_loss(5.0 - 0.01 * static_cast<double>(first + i));
      p->set_learning_rate(1e-3);
      p->set_time_ms(1000 + first + i);
    }
    return c_->Heartbeat(req, w);
  };
  ASSERT_TRUE(steps(1, 0, 1, 30).ok());
  ASSERT_TRUE(steps(1, 20, 21, 15).ok());  // a lost reply: points 20..29 come again
  auto m = c_->JobMetrics(id, 2000);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->series_size(), 1);
  ASSERT_EQ(m->series(0).points_size(), 35);
  for (int i = 0; i < 35; ++i) EXPECT_EQ(m->series(0).points(i).step(), i + 1);
  EXPECT_DOUBLE_EQ(m->series(0).points(34).loss(), 5.0 - 0.35);
  // The attempt dies; the next resumes from step 20 and logs 21.. again in its own series.
  ASSERT_TRUE(steps(1, 35, 36, 0, true).ok());
  c_->Tick();
  ASSERT_EQ(Beat(w, "", 0, {}).assignments_size(), 1);
  ASSERT_EQ(Job(id).attempt(), 2);
  ASSERT_TRUE(steps(2, 0, 21, 5).ok());
  Reopen();
  m = c_->JobMetrics(id, 2000);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->series_size(), 2);
  EXPECT_EQ(m->series(1).attempt(), 2);
  EXPECT_EQ(m->series(1).points(0).step(), 21);
  EXPECT_EQ(m->series(0).points_size(), 35);
  // Thinned: every k-th point and the last.
  m = c_->JobMetrics(id, 10);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->series(0).total_points(), 35);
  EXPECT_LE(m->series(0).points_size(), 10);
  EXPECT_EQ(m->series(0).points(m->series(0).points_size() - 1).step(), 35);
  EXPECT_EQ(c_->JobMetrics(id, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->JobMetrics("job-999999", 100).status().code(), absl::StatusCode::kNotFound);
  // A worker cannot flood the coordinator or write negative steps.
  auto flood = steps(2, 5, 26, Coordinator::kMaxStepsPerReport + 1);
  EXPECT_EQ(flood.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(flood.status().message().find("attempts.steps"), std::string::npos);
  EXPECT_EQ(steps(2, 5, -7, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->JobMetrics(id, 2000)->series(1).points_size(), 5);
}

TEST_F(CoordinatorTest, JobListsFilterByUserKindAndSweepNewestFirst) {
  Submit(MicroJob());
  auto bob = c_->Submit(MicroJob(), "bob");
  ASSERT_TRUE(bob.ok()) << bob.status();
  Submit(MicroJob());
  Coordinator::JobFilter f;
  f.user = "bob";
  auto page = c_->ListJobs(f, 10, "");
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_EQ(page->jobs_size(), 1);
  EXPECT_EQ(page->jobs(0).id(), bob->id());
  f = {};
  f.kind = "pretrain";
  EXPECT_EQ(c_->ListJobs(f, 10, "")->jobs_size(), 3);
  f.kind = "sft";
  EXPECT_EQ(c_->ListJobs(f, 10, "")->jobs_size(), 0);
  f = {};
  f.sweep = "sweep-000001";
  EXPECT_EQ(c_->ListJobs(f, 10, "")->jobs_size(), 0);
  // Newest first, paged; a token only continues its own filter and order.
  f = {};
  f.newest_first = true;
  std::vector<std::string> ids;
  std::string token, first;
  do {
    auto p = c_->ListJobs(f, 2, token);
    ASSERT_TRUE(p.ok()) << p.status();
    for (const auto& j : p->jobs()) ids.push_back(j.id());
    token = p->next_page_token();
    if (first.empty()) first = token;
  } while (!token.empty());
  EXPECT_EQ(ids, (std::vector<std::string>{"job-000003", "job-000002", "job-000001"}));
  EXPECT_EQ(c_->ListJobs("", 2, first).status().code(), absl::StatusCode::kInvalidArgument);
  f.user = std::string(200, 'u');
  EXPECT_EQ(c_->ListJobs(f, 2, "").status().code(), absl::StatusCode::kInvalidArgument);
}

// The document against the router itself: the routes the user listener registers
// (InstallUserRoutes), not a second list kept by hand. Agents speak gRPC on their own port
// (agent_service.h, api/loom/v1/agent.proto), which the document does not describe.
TEST_F(CoordinatorTest, OpenApiDocumentsExactlyTheRegisteredRoutes) {
  const char* path = std::getenv("LOOM_OPENAPI");
  ASSERT_NE(path, nullptr);
  YAML::Node doc = YAML::LoadFile(path);
  EXPECT_EQ(doc["openapi"].as<std::string>().substr(0, 2), "3.");
  HttpServer users{HttpServerOptions{}};
  InstallUserRoutes(users, *c_, ApiOptions{});
  std::map<std::string, std::string> served;  // "GET /v1/jobs" -> auth
  for (const auto& r : users.Routes()) served[r.method + " " + r.path] = r.auth;
  std::map<std::string, std::string> documented;  // "GET /v1/jobs" -> none | authenticated
  for (const auto& p : doc["paths"]) {
    for (const auto& op : p.second) {
      const std::string method = op.first.as<std::string>();
      if (method == "parameters") continue;
      std::string upper;
      for (char ch : method) upper += static_cast<char>(std::toupper(ch));
      const bool open = op.second["security"] && op.second["security"].size() == 0;
      documented[upper + " " + p.first.as<std::string>()] = open ? "none" : "authenticated";
    }
  }
  std::set<std::string> served_keys, documented_keys;
  for (const auto& [k, auth] : served) served_keys.insert(k);
  for (const auto& [k, auth] : documented) documented_keys.insert(k);
  EXPECT_EQ(documented_keys, served_keys) << "routes served but not documented, or vice versa";
  for (const auto& [k, auth] : served) {
    if (documented.count(k)) {
      EXPECT_EQ(documented[k] == "none", auth == "none") << k << ": security vs the router";
    }
  }
  EXPECT_GE(served.size(), 16u);
  EXPECT_EQ(users.RouteTemplate("GET", "/v1/jobs/job-000001/logs"), "/v1/jobs/{id}/logs");
  EXPECT_EQ(users.RouteTemplate("GET", "/v1/nope"), "other");
}

}  // namespace
}  // namespace loom::coordinator
