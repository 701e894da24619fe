#include "cli/sweep_commands.h"

#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "base/status_macros.h"
#include "cli/input_files.h"
#include "loom/job_curve.h"
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

// "sweep-000005 + sweep-000007": a merged report's title (no quotes: gnuplot's title too).
std::string ReportedSweeps(const v1::SweepReport& r) {
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
}

void PrintReportCsv(const v1::SweepReport& r) {
  // The last six columns are select reach's (empty otherwise).
  std::cout << "kind,cell,baseline,n,mean,sd,low,high,boot_low,boot_high,p_value,"
               "censored,first,later,ties,unordered,sign_p_value\n";
  const bool reach = r.select() == "reach";
  for (const auto& c : r.cells()) {
    std::cout << absl::StrFormat("cell,\"%s\",,%d,%.17g,%.17g,%.17g,%.17g,,,,%s,,,,,\n", c.cell(),
                                 c.n(), c.mean(), c.sd(), c.ci_low(), c.ci_high(),
                                 reach ? absl::StrCat(c.censored()) : "");
  }
  for (const auto& d : r.differences()) {
    std::cout << absl::StrFormat(
        "difference,\"%s\",\"%s\",%d,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%.17g,%s\n", d.cell(),
        d.baseline(), d.n(), d.mean(), d.sd(), d.t_low(), d.t_high(), d.boot_low(), d.boot_high(),
        d.p_value(),
        reach ? absl::StrFormat(",%d,%d,%d,%d,%.17g", d.first(), d.later(), d.ties(), d.unordered(),
                                d.sign_p_value())
              : ",,,,,");
  }
}

// Each reported cell's job ids: the sweep's own cells with the merged sweeps' jobs of the same
// cell, and a baseline from another sweep.
absl::StatusOr<std::vector<std::pair<std::string, std::vector<std::string>>>> CellJobs(
    client::RestClient& client, const v1::Sweep& sweep, const v1::SweepReport& report) {
  std::vector<v1::Sweep> merged = {sweep};
  for (const std::string& id : report.merged_sweeps()) {
    LOOM_RETURN_IF_ERROR(client.Call("GET", "/v1/sweeps/" + id, nullptr, &merged.emplace_back()));
  }
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  for (const std::string& cell : sweep.cells()) {
    out.push_back({cell, {}});
    for (const v1::Sweep& s : merged) {
      for (const auto& sj : s.jobs()) {
        if (sj.cell() == cell) out.back().second.push_back(sj.job_id());
      }
    }
  }
  for (const v1::CellStats& c : report.cells()) {
    if (c.sweep_id().empty()) continue;
    v1::Sweep other;
    LOOM_RETURN_IF_ERROR(client.Call("GET", "/v1/sweeps/" + c.sweep_id(), nullptr, &other));
    out.push_back({c.cell(), {}});
    for (const auto& sj : other.jobs()) {
      if (absl::StrCat(other.id(), "/", sj.cell()) == c.cell()) {
        out.back().second.push_back(sj.job_id());
      }
    }
  }
  return out;
}

// Metric vs step per cell: the mean over the cell's finished seeds with a ±1 sd band (gnuplot).
absl::Status PlotSweep(client::RestClient& client, const v1::Sweep& sweep,
                       const v1::SweepReport& report, const std::string& out) {
  LOOM_ASSIGN_OR_RETURN(const auto cells, CellJobs(client, sweep, report));
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("loom-sweep-plot-", ::getpid());
  fs::create_directories(dir);
  std::string plots;
  int cell_index = 0, points = 0;
  for (const auto& [cell, job_ids] : cells) {
    std::map<int64_t, std::vector<double>> by_step;
    for (const std::string& job_id : job_ids) {
      v1::Job job;
      LOOM_RETURN_IF_ERROR(client.Call("GET", "/v1/jobs/" + job_id, nullptr, &job));
      for (const v1::EvalResult* e : JobCurve(job)) {  // a resumed attempt's replace earlier ones
        if (!IsHeldOut(*e)) continue;
        by_step[e->step()].push_back(report.metric() == "accuracy"      ? e->accuracy()
                                     : report.metric() == "exact_match" ? e->exact_match()
                                                                        : e->eval_loss());
      }
    }
    const fs::path data = dir / absl::StrCat("cell-", cell_index, ".dat");
    std::ofstream f(data);
    for (const auto& [step, vs] : by_step) {
      double mean = 0, ss = 0;
      for (double v : vs) mean += v / static_cast<double>(vs.size());
      for (double v : vs) ss += (v - mean) * (v - mean);
      const double sd = vs.size() > 1 ? std::sqrt(ss / static_cast<double>(vs.size() - 1)) : 0;
      f << step << " " << mean << " " << mean - sd << " " << mean + sd << "\n";
      ++points;
    }
    const int color = cell_index % 8 + 1;
    absl::StrAppend(&plots, plots.empty() ? "" : ", ", "'", data.string(),
                    "' using 1:3:4 with filledcurves fs transparent solid 0.2 lc ", color,
                    " notitle, '", data.string(), "' using 1:2 with lines lw 2 lc ", color,
                    " title '", absl::StrReplaceAll(cell, {{"'", ""}}).substr(0, 60), "'");
    ++cell_index;
  }
  if (points == 0) return absl::NotFoundError("no evaluations reported yet");
  const std::string script =
      absl::StrCat("set terminal pngcairo size 1000,650 font 'sans,10' noenhanced\nset output '",
                   out, "'\n", "set title 'sweep ", ReportedSweeps(report), ": ", report.metric(),
                   " (mean over seeds, band ±1 sd)'\n",
                   "set grid\nset key outside right\nset xlabel 'step'\nset ylabel '",
                   report.metric(), "'\nplot ", plots, "\n");
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

absl::Status Report(client::RestClient& client, const std::string& id, const CliArgs& args,
                    Output output) {
  v1::SweepReport r;
  std::string query;
  for (const char* name : {"metric", "select", "length", "threshold", "baseline", "merge"}) {
    if (args.Has(name)) {
      absl::StrAppend(&query, query.empty() ? "?" : "&", name, "=",
                      client::QueryValue(args.Get(name)));
    }
  }
  LOOM_RETURN_IF_ERROR(
      client.Call("GET", absl::StrCat("/v1/sweeps/", id, "/report", query), nullptr, &r));
  const std::string format = args.Get("format", output == Output::kJson   ? "json"
                                                : output == Output::kYaml ? "yaml"
                                                                          : "table");
  if (format == "json" || format == "yaml") {
    std::cout << FormatMessage(r, format == "json" ? Output::kJson : Output::kYaml) << "\n";
  } else if (format == "csv") {
    PrintReportCsv(r);
  } else if (format == "table") {
    PrintReportTable(r);
  } else {
    return absl::InvalidArgumentError("--format: table | json | yaml | csv");
  }
  if (format == "table" || format == "csv") {
    for (const std::string& w : r.warnings()) std::cerr << "warning: " << w << "\n";
  }
  if (args.Has("plot")) {
    v1::Sweep sweep;
    LOOM_RETURN_IF_ERROR(client.Call("GET", "/v1/sweeps/" + id, nullptr, &sweep));
    LOOM_RETURN_IF_ERROR(PlotSweep(client, sweep, r, args.Get("plot")));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunSweepCommand(client::RestClient& client, const std::string& what,
                             const std::string& arg, const CliArgs& args, Output output) {
  const bool json = output != Output::kTable;  // machine-readable: no progress lines
  if (what != "list" && arg.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("loom sweep ", what, ": missing ",
                                                   what == "submit" ? "sweep file" : "sweep id"));
  }
  if (what == "submit") {
    LOOM_ASSIGN_OR_RETURN(v1::SweepSpec spec, ReadSweepFile(arg));
    if (args.Has("request-id")) spec.set_request_id(args.Get("request-id"));
    v1::CreateSweepResponse r;
    LOOM_RETURN_IF_ERROR(client.Call("POST", "/v1/sweeps", &spec, &r));
    if (json) {
      std::cout << FormatMessage(r, output) << "\n";
    } else {
      std::cout << (r.created() ? "submitted " : "already submitted: ") << r.id() << " ("
                << r.jobs() << " jobs)" << std::endl;
    }
    if (!args.Has("follow")) return absl::OkStatus();
    for (std::string last;;) {
      v1::Sweep s;
      LOOM_RETURN_IF_ERROR(client.Call("GET", "/v1/sweeps/" + r.id(), nullptr, &s));
      if (Counts(s) != last && !json)
        std::cout << s.id() << ": " << (last = Counts(s)) << std::endl;
      if (s.state() != "running") break;
      std::this_thread::sleep_for(std::chrono::seconds(2));
    }
    return Report(client, r.id(), args, output);
  }
  if (what == "list") {
    LOOM_ASSIGN_OR_RETURN(v1::ListSweepsResponse r,
                          client::AllPages<v1::ListSweepsResponse>(
                              client, "/v1/sweeps?page_size=500", [](auto& all, auto& page) {
                                all.mutable_sweeps()->MergeFrom(page.sweeps());
                              }));
    if (json) {
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
  if (what == "status" || what == "cancel") {
    v1::Sweep s;
    LOOM_RETURN_IF_ERROR(what == "cancel"
                             ? client.Call("POST", "/v1/sweeps/" + arg + "/cancel", nullptr, &s)
                             : client.Call("GET", "/v1/sweeps/" + arg, nullptr, &s));
    if (json) {
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
  if (what == "report") return Report(client, arg, args, output);
  return absl::InvalidArgumentError(absl::StrCat("unknown sweep command '", what,
                                                 "' (submit | list | status | cancel | report)"));
}

}  // namespace loom::cli
