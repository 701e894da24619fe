#include "cli/sweep_commands.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "base/status_macros.h"
#include "cli/input_files.h"
#include "coordinator/sweep_cells.h"
#include "loom/proto_json.h"
#include "loom/spec.h"
#include "loom/v1/control.pb.h"

namespace fs = std::filesystem;

namespace loom::cli {
namespace {

absl::StatusOr<v1::SweepSpec> ReadSweepFile(const std::string& file) {
  LOOM_ASSIGN_OR_RETURN(const std::string json, ReadJsonOrYamlFile(file));
  v1::SweepSpec spec;
  LOOM_RETURN_IF_ERROR(ParseJsonMessage(json, file, &spec));
  return spec;
}

std::string Counts(const v1::Sweep& s) {
  std::vector<std::string> parts;
  for (const char* state :
       {"queued", "scheduled", "running", "retrying", "succeeded", "failed", "cancelled"}) {
    auto it = s.job_states().find(state);
    if (it != s.job_states().end() && it->second > 0)
      parts.push_back(absl::StrCat(it->second, " ", state));
  }
  return absl::StrJoin(parts, ", ");
}

// "sweep-000005 + sweep-000007": a merged report's or curves' title (no quotes: gnuplot's too).
template <typename ReportOrCurves>
std::string ReportedSweeps(const ReportOrCurves& r) {
  if (r.merged_sweeps().empty()) return r.sweep_id();
  return absl::StrCat(r.sweep_id(), " + ", absl::StrJoin(r.merged_sweeps(), " + "));
}

// select reach: steps to the threshold per cell (censored seeds apart), then which cell got
// there first per seed with the sign test beside the paired t over seeds where both did.
void PrintReachTable(const v1::SweepReport& r) {
  std::cout << absl::StrFormat(
      "sweep %s: steps until %s %s %g (first held-out evaluation there), 95%% intervals%s\n",
      ReportedSweeps(r), r.metric(), r.metric() == "eval_loss" ? "<=" : ">=", r.threshold(),
      r.complete() ? "" : "  [partial: jobs still running]");
  std::cout << absl::StrFormat("%-40s %3s %8s %10s %10s %23s %7s\n", "cell", "n", "censored",
                               "mean", "sd", "95% CI (t)", "pending");
  for (const auto& c : r.cells()) {
    std::cout << absl::StrFormat("%-40s %3d %8d %10.1f %10.1f   [%9.1f, %9.1f] %7d\n",
                                 c.cell().substr(0, 40), c.n(), c.censored(), c.mean(), c.sd(),
                                 c.ci_low(), c.ci_high(), c.pending());
  }
  std::cout << "(n: seeds that reached it; censored: ended without reaching it, not in the mean)\n";
  if (r.differences().empty()) return;
  std::cout << absl::StrFormat(
      "\nvs %s, per seed: which reached it first (exact sign test), and the paired difference "
      "in steps where both did (paired t):\n",
      r.baseline());
  std::cout << absl::StrFormat("%-40s %5s %5s %4s %9s %8s %3s %10s %23s %8s\n", "cell", "first",
                               "later", "tie", "unordered", "sign p", "n", "mean diff",
                               "95% CI (paired t)", "p");
  for (const auto& d : r.differences()) {
    const std::string t = d.n() < 2
                              ? absl::StrFormat("%10s   %23s %8s", "-", "(too few seeds)", "-")
                              : absl::StrFormat("%10.1f   [%9.1f, %9.1f] %8.4f", d.mean(),
                                                d.t_low(), d.t_high(), d.p_value());
    std::cout << absl::StrFormat("%-40s %5d %5d %4d %9d %8.4f %3d %s\n", d.cell().substr(0, 40),
                                 d.first(), d.later(), d.ties(), d.unordered(), d.sign_p_value(),
                                 d.n(), t);
  }
}

// Reasoning metrics: the same differences paired by problem (the uncertainty from the choice of
// problems), where the cells' evaluations scored the same problems.
void PrintProblemTable(const v1::SweepReport& r) {
  bool any = false;
  for (const auto& d : r.differences()) any |= d.problems() > 0;
  if (!any) return;
  std::cout << "\npaired by problem (per problem the cell minus the baseline, averaged over the "
               "paired seeds; paired t over problems):\n";
  std::cout << absl::StrFormat("%-40s %8s %10s %23s %8s\n", "cell", "problems", "mean diff",
                               "95% CI (paired t)", "p");
  for (const auto& d : r.differences()) {
    if (d.problems() == 0) continue;
    std::cout << absl::StrFormat("%-40s %8d %10.4f   [%9.4f, %9.4f] %8.4f\n",
                                 d.cell().substr(0, 40), d.problems(), d.problem_mean(),
                                 d.problem_t_low(), d.problem_t_high(), d.problem_p_value());
  }
}

void PrintReportTable(const v1::SweepReport& r) {
  if (r.select() == "reach") return PrintReachTable(r);
  const std::string at = r.length() > 0 ? absl::StrCat(", at length ", r.length()) : "";
  std::cout << absl::StrFormat("sweep %s: %s (%s%s), 95%% intervals%s\n", ReportedSweeps(r),
                               r.metric(), r.select(), at,
                               r.complete() ? "" : "  [partial: jobs still running]");
  std::cout << absl::StrFormat("%-40s %3s %10s %10s %23s %7s\n", "cell", "n", "mean", "sd",
                               "95% CI (t)", "pending");
  for (const auto& c : r.cells()) {
    std::cout << absl::StrFormat("%-40s %3d %10.4f %10.4f   [%9.4f, %9.4f] %7d\n",
                                 c.cell().substr(0, 40), c.n(), c.mean(), c.sd(), c.ci_low(),
                                 c.ci_high(), c.pending());
  }
  if (r.differences().empty()) return;
  std::cout << absl::StrFormat(
      "\npaired difference vs %s (same seeds; paired t and percentile "
      "bootstrap, 10000 resamples):\n",
      r.baseline());
  std::cout << absl::StrFormat("%-40s %3s %10s %23s %23s %8s\n", "cell", "n", "mean diff",
                               "95% CI (paired t)", "95% CI (bootstrap)", "p");
  for (const auto& d : r.differences()) {
    std::cout << absl::StrFormat("%-40s %3d %10.4f   [%9.4f, %9.4f]   [%9.4f, %9.4f] %8.4f%s\n",
                                 d.cell().substr(0, 40), d.n(), d.mean(), d.t_low(), d.t_high(),
                                 d.boot_low(), d.boot_high(), d.p_value(),
                                 d.n() < 2            ? "  (too few seeds)"
                                 : d.p_value() < 0.05 ? "  significant"
                                                      : "  no significant difference");
  }
  PrintProblemTable(r);
}

void PrintReportCsv(const v1::SweepReport& r) {
  // The last six columns are select reach's (empty otherwise).
  // Then select reach's five, then the reasoning metrics' test over problems (empty otherwise).
  std::cout << "kind,cell,baseline,n,mean,sd,low,high,boot_low,boot_high,p_value,"
               "censored,first,later,ties,unordered,sign_p_value,"
               "problems,problem_mean,problem_low,problem_high,problem_p_value\n";
  const bool reach = r.select() == "reach";
  for (const auto& c : r.cells()) {
    std::cout << absl::StrFormat("cell,\"%s\",,%d,%.17g,%.17g,%.17g,%.17g,,,,%s,,,,,,,,,,\n",
                                 c.cell(), c.n(), c.mean(), c.sd(), c.ci_low(), c.ci_high(),
                                 reach ? absl::StrCat(c.censored()) : "");
  }
  for (const auto& d : r.differences()) {
    std::cout << absl::StrFormat(
        "difference,\"%s\",\"%s\",%d,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%s%s\n", d.cell(),
        d.baseline(), d.n(), d.mean(), d.sd(), d.t_low(), d.t_high(), d.boot_low(), d.boot_high(),
        d.p_value(),
        reach ? absl::StrFormat(",%d,%d,%d,%d,%.17g", d.first(), d.later(), d.ties(), d.unordered(),
                                d.sign_p_value())
              : ",,,,,",
        d.problems() == 0
            ? ",,,,,"
            : absl::StrFormat(",%d,%.17g,%.17g,%.17g,%.17g", d.problems(), d.problem_mean(),
                              d.problem_t_low(), d.problem_t_high(), d.problem_p_value()));
  }
}

// "?metric=...&baseline=...&merge=..." of the flags given, of `names`.
std::string QueryOf(const CliArgs& args, std::initializer_list<const char*> names) {
  std::string query;
  for (const char* name : names) {
    if (args.Has(name)) {
      absl::StrAppend(&query, query.empty() ? "?" : "&", name, "=",
                      client::QueryValue(args.Get(name)));
    }
  }
  return query;
}

absl::StatusOr<v1::SweepCurves> GetCurves(client::RestClient& client, const std::string& id,
                                          const CliArgs& args) {
  v1::SweepCurves curves;
  LOOM_RETURN_IF_ERROR(client.Call(
      "GET",
      absl::StrCat("/v1/sweeps/", id, "/curves", QueryOf(args, {"metric", "baseline", "merge"})),
      nullptr, &curves));
  return curves;
}

// One gnuplot data file per curve (step mean low high) and the plot clauses that draw them:
// each curve a line over its translucent band.
template <typename Curve>
std::string PlotClauses(const google::protobuf::RepeatedPtrField<Curve>& curves,
                        const fs::path& dir, const std::string& prefix, int* points) {
  std::string plots;
  int index = 0;
  for (const Curve& curve : curves) {
    const fs::path data = dir / absl::StrCat(prefix, "-", index, ".dat");
    std::ofstream f(data);
    for (const v1::CurvePoint& p : curve.points()) {
      f << absl::StrFormat("%d %.17g %.17g %.17g\n", p.step(), p.mean(), p.ci_low(), p.ci_high());
      ++*points;
    }
    const int color = index % 8 + 1;
    absl::StrAppend(&plots, plots.empty() ? "" : ", ", "'", data.string(),
                    "' using 1:3:4 with filledcurves fs transparent solid 0.2 lc ", color,
                    " notitle, '", data.string(),
                    "' using 1:2 with linespoints lw 2 pt 7 ps 0.5 lc ", color, " title '",
                    absl::StrReplaceAll(curve.cell(), {{"'", ""}}).substr(0, 60), "'");
    ++index;
  }
  return plots;
}

// Two panels: per cell the metric's mean over seeds by step with its 95% band, and per cell the
// paired difference against the baseline by step with its 95% paired-t band (gnuplot).
absl::Status PlotCurves(const v1::SweepCurves& c, const std::string& out) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("loom-sweep-plot-", ::getpid());
  fs::create_directories(dir);
  int points = 0;
  const std::string cells = PlotClauses(c.cells(), dir, "cell", &points);
  if (points == 0) {
    fs::remove_all(dir);
    return absl::NotFoundError("no evaluations reported yet");
  }
  const std::string diffs = PlotClauses(c.differences(), dir, "diff", &points);
  const std::string baseline = absl::StrReplaceAll(c.baseline(), {{"'", ""}});
  std::string script = absl::StrCat("set terminal pngcairo size 1000,", diffs.empty() ? 650 : 1100,
                                    " font 'sans,10' noenhanced\nset output '", out, "'\n",
                                    "set grid\nset key outside right\nset xlabel 'step'\n",
                                    diffs.empty() ? "" : "set multiplot layout 2,1\n",
                                    "set title 'sweep ", ReportedSweeps(c), ": ", c.metric(),
                                    " (mean over seeds, 95% t band)'\nset ylabel '", c.metric(),
                                    "'\nplot ", cells, "\n");
  if (!diffs.empty()) {
    absl::StrAppend(&script, "set title 'cell - ", baseline,
                    ", paired by seed (95% paired-t band, pointwise)'\nset ylabel 'difference in ",
                    c.metric(), "'\nplot 0 with lines lc rgb 'black' dt 2 notitle, ", diffs,
                    "\nunset multiplot\n");
  }
  FILE* gp = ::popen("gnuplot", "w");
  if (gp == nullptr) return absl::UnavailableError("cannot run gnuplot (apt install gnuplot-nox)");
  std::fwrite(script.data(), 1, script.size(), gp);
  const int rc = ::pclose(gp);
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (rc != 0) return absl::InternalError(absl::StrCat("gnuplot failed (exit ", rc, ")"));
  std::cout << "wrote " << out << "\n";
  return absl::OkStatus();
}

void PrintCurvesCsv(const v1::SweepCurves& c) {
  std::cout << "kind,cell,baseline,step,n,mean,sd,low,high,p_value\n";
  for (const v1::CellCurve& cell : c.cells()) {
    for (const v1::CurvePoint& p : cell.points()) {
      std::cout << absl::StrFormat("cell,\"%s\",,%d,%d,%.17g,%.17g,%.17g,%.17g,\n", cell.cell(),
                                   p.step(), p.n(), p.mean(), p.sd(), p.ci_low(), p.ci_high());
    }
  }
  for (const v1::DifferenceCurve& d : c.differences()) {
    for (const v1::CurvePoint& p : d.points()) {
      std::cout << absl::StrFormat("difference,\"%s\",\"%s\",%d,%d,%.17g,%.17g,%.17g,%.17g,%.17g\n",
                                   d.cell(), d.baseline(), p.step(), p.n(), p.mean(), p.sd(),
                                   p.ci_low(), p.ci_high(), p.p_value());
    }
  }
}

// The paired-difference curves as a table: per cell, per step n, mean difference, interval, p.
void PrintCurvesTable(const v1::SweepCurves& c) {
  std::cout << absl::StrFormat(
      "sweep %s: %s - %s by step, paired by seed, 95%% paired-t "
      "intervals (pointwise)%s\n",
      ReportedSweeps(c), c.metric(), c.baseline(),
      c.complete() ? "" : "  [partial: jobs still running]");
  if (c.differences().empty()) std::cout << "(one cell: no differences)\n";
  for (const v1::DifferenceCurve& d : c.differences()) {
    std::cout << absl::StrFormat("\n%s\n%10s %3s %12s %27s %8s\n", d.cell(), "step", "n",
                                 "mean diff", "95% CI (paired t)", "p");
    for (const v1::CurvePoint& p : d.points()) {
      std::cout << absl::StrFormat("%10d %3d %12.5f   [%11.5f, %11.5f] %8.4f\n", p.step(), p.n(),
                                   p.mean(), p.ci_low(), p.ci_high(), p.p_value());
    }
  }
}

// A report or curves in --format (default: table, or -o's); warnings on stderr beside a table or
// CSV (JSON and YAML carry them).
template <typename Message>
absl::Status PrintAs(const Message& m, const CliArgs& args, Output output,
                     void (*table)(const Message&), void (*csv)(const Message&)) {
  const std::string format = args.Get("format", output == Output::kJson   ? "json"
                                                : output == Output::kYaml ? "yaml"
                                                                          : "table");
  if (format == "json" || format == "yaml") {
    std::cout << FormatMessage(m, format == "json" ? Output::kJson : Output::kYaml) << "\n";
    return absl::OkStatus();
  }
  if (format != "table" && format != "csv") {
    return absl::InvalidArgumentError("--format: table | json | yaml | csv");
  }
  (format == "csv" ? csv : table)(m);
  for (const std::string& w : m.warnings()) std::cerr << "warning: " << w << "\n";
  return absl::OkStatus();
}

absl::Status Curves(client::RestClient& client, const std::string& id, const CliArgs& args,
                    Output output) {
  LOOM_ASSIGN_OR_RETURN(const v1::SweepCurves c, GetCurves(client, id, args));
  LOOM_RETURN_IF_ERROR(PrintAs(c, args, output, &PrintCurvesTable, &PrintCurvesCsv));
  return args.Has("plot") ? PlotCurves(c, args.Get("plot")) : absl::OkStatus();
}

absl::Status Report(client::RestClient& client, const std::string& id, const CliArgs& args,
                    Output output) {
  v1::SweepReport r;
  const std::string query =
      QueryOf(args, {"metric", "select", "length", "threshold", "baseline", "merge"});
  LOOM_RETURN_IF_ERROR(
      client.Call("GET", absl::StrCat("/v1/sweeps/", id, "/report", query), nullptr, &r));
  LOOM_RETURN_IF_ERROR(PrintAs(r, args, output, &PrintReportTable, &PrintReportCsv));
  if (!args.Has("plot")) return absl::OkStatus();
  LOOM_ASSIGN_OR_RETURN(const v1::SweepCurves curves, GetCurves(client, id, args));
  return PlotCurves(curves, args.Get("plot"));
}

// Submits a sweep file; with --follow, prints progress until it ends and then its report.
absl::Status SubmitSweep(client::RestClient& client, const std::string& file, const CliArgs& args,
                         Output output) {
  const bool json = output != Output::kTable;  // machine-readable: no progress lines
  LOOM_ASSIGN_OR_RETURN(v1::SweepSpec spec, ReadSweepFile(file));
  if (args.Has("request-id")) spec.set_request_id(args.Get("request-id"));
  v1::CreateSweepResponse r;
  LOOM_RETURN_IF_ERROR(client.Call("POST", "/v1/sweeps", &spec, &r));
  if (json) {
    std::cout << FormatMessage(r, output) << "\n";
  } else {
    std::cout << (r.created() ? "submitted " : "already submitted: ") << r.id() << " (" << r.jobs()
              << " jobs)" << std::endl;
  }
  if (!args.Has("follow")) return absl::OkStatus();
  for (std::string last;;) {
    v1::Sweep s;
    LOOM_RETURN_IF_ERROR(client.Call("GET", "/v1/sweeps/" + r.id(), nullptr, &s));
    if (Counts(s) != last && !json) std::cout << s.id() << ": " << (last = Counts(s)) << std::endl;
    if (s.state() != "running") break;
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
  return Report(client, r.id(), args, output);
}

absl::Status ListSweeps(client::RestClient& client, Output output) {
  LOOM_ASSIGN_OR_RETURN(v1::ListSweepsResponse r,
                        client::AllPages<v1::ListSweepsResponse>(
                            client, "/v1/sweeps?page_size=500", [](auto& all, auto& page) {
                              all.mutable_sweeps()->MergeFrom(page.sweeps());
                            }));
  if (output != Output::kTable) {
    std::cout << FormatMessage(r, output) << "\n";
    return absl::OkStatus();
  }
  std::cout << absl::StrFormat("%-14s %-24s %-10s %5s  %s\n", "ID", "NAME", "STATE", "CELLS",
                               "JOBS");
  for (const auto& s : r.sweeps()) {
    std::cout << absl::StrFormat("%-14s %-24s %-10s %5d  %s\n", s.id(), s.name().substr(0, 24),
                                 s.state(), s.cells_size(), Counts(s));
  }
  return absl::OkStatus();
}

// status, or cancel: the sweep (after cancelling) with its jobs.
absl::Status ShowSweep(client::RestClient& client, const std::string& id, bool cancel,
                       Output output) {
  v1::Sweep s;
  LOOM_RETURN_IF_ERROR(cancel ? client.Call("POST", "/v1/sweeps/" + id + "/cancel", nullptr, &s)
                              : client.Call("GET", "/v1/sweeps/" + id, nullptr, &s));
  if (output != Output::kTable) {
    std::cout << FormatMessage(s, output) << "\n";
    return absl::OkStatus();
  }
  std::cout << s.id() << "  " << s.name() << "  " << s.state() << "  (" << Counts(s) << ")\n";
  for (const auto& sj : s.jobs()) {
    std::cout << absl::StrFormat("  %-40s seed %-6d %s\n", sj.cell().substr(0, 40), sj.seed(),
                                 sj.job_id());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ExpandSweepFile(const std::string& file, const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(const v1::SweepSpec spec, ReadSweepFile(file));
  LOOM_ASSIGN_OR_RETURN(const std::vector<coordinator::SweepCell> cells,
                        coordinator::ExpandSweep(spec));
  std::vector<const coordinator::SweepCell*> chosen;
  std::vector<std::string> names;
  for (const auto& cell : cells) {
    names.push_back(cell.name);
    if (!args.Has("cell") || cell.name == args.Get("cell")) chosen.push_back(&cell);
  }
  if (chosen.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--cell: no cell named '", args.Get("cell"),
                                                   "' (cells: ", absl::StrJoin(names, "; "), ")"));
  }
  std::vector<uint64_t> seeds(spec.seeds().begin(), spec.seeds().end());
  if (args.Has("seed")) {
    LOOM_ASSIGN_OR_RETURN(const int64_t seed, args.GetInt("seed", 0, 1, INT64_MAX));
    if (std::find(seeds.begin(), seeds.end(), static_cast<uint64_t>(seed)) == seeds.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--seed: ", seed, " is not one of the sweep's seeds (", absl::StrJoin(seeds, ", "), ")"));
    }
    seeds = {static_cast<uint64_t>(seed)};
  }
  std::vector<std::string> jobs;
  for (const coordinator::SweepCell* cell : chosen) {
    for (uint64_t seed : seeds) {
      LOOM_ASSIGN_OR_RETURN(const v1::JobSpec job,
                            coordinator::ApplyCell(spec.base().spec(), *cell, seed));
      jobs.push_back(MessageToJsonText(job, /*pretty=*/true));
      if (chosen.size() > 1 || seeds.size() > 1) {
        jobs.back() = absl::StrCat("{\"cell\": \"", absl::CEscape(cell->name),
                                   "\", \"seed\": ", seed, ", \"spec\": ", jobs.back(), "}");
      }
    }
  }
  std::cout << (jobs.size() == 1 ? jobs[0] : absl::StrCat("[", absl::StrJoin(jobs, ",\n"), "]"))
            << "\n";
  return absl::OkStatus();
}

absl::Status RunSweepCommand(client::RestClient& client, const std::string& what,
                             const std::string& arg, const CliArgs& args, Output output) {
  if (what != "list" && arg.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("loom sweep ", what, ": missing ",
                                                   what == "submit" ? "sweep file" : "sweep id"));
  }
  if (what == "submit") return SubmitSweep(client, arg, args, output);
  if (what == "list") return ListSweeps(client, output);
  if (what == "status" || what == "cancel") return ShowSweep(client, arg, what == "cancel", output);
  if (what == "report") return Report(client, arg, args, output);
  if (what == "curves") return Curves(client, arg, args, output);
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown sweep command '", what, "' (submit | list | status | cancel | report | curves)"));
}

}  // namespace loom::cli
