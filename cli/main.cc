// loom: the command-line client of the coordinator, and `loom up` (a local coordinator plus
// workers on one box). docs/control-plane.md.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/cli_args.h"
#include "base/random_token.h"
#include "base/read_file.h"
#include "base/status_macros.h"
#include "cli/input_files.h"
#include "cli/output.h"
#include "cli/sweep_commands.h"
#include "cli/webhook_commands.h"
#include "client/rest_client.h"
#include "loom/spec.h"
#include "loom/spec_overrides.h"
#include "loom/v1/control.pb.h"
#include "metrics/prometheus.h"
#include "storage/checkpoint_store.h"

namespace fs = std::filesystem;

namespace loom::cli {
namespace {

// Where `loom up` leaves the user token of a local coordinator for the CLI to find:
// ${XDG_CONFIG_HOME:-$HOME/.config}/loom/local-<port>.token (mode 0600). "" without a home.
std::string LocalTokenPath(const std::string& port) {
  const char* xdg = std::getenv("XDG_CONFIG_HOME");
  const char* home = std::getenv("HOME");
  std::string base;
  if (xdg != nullptr && *xdg != '\0') {
    base = xdg;
  } else if (home != nullptr && *home != '\0') {
    base = (fs::path(home) / ".config").string();
  } else {
    return "";
  }
  return (fs::path(base) / "loom" / absl::StrCat("local-", port, ".token")).string();
}

// The token loom up wrote for a coordinator URL on this box ("" when none).
std::string LocalToken(const std::string& url) {
  static const std::regex local(R"(^http://(127\.0\.0\.1|localhost|\[::1\]):(\d+)/?$)");
  std::smatch m;
  if (!std::regex_match(url, m, local)) return "";
  std::ifstream in(LocalTokenPath(m[2].str()));
  std::string token;
  std::getline(in, token);
  return std::string(absl::StripAsciiWhitespace(token));
}

// Creates (or replaces) a file readable by this user only.
absl::Status WritePrivateFile(const std::string& path, const std::string& text) {
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  const bool ok = ::fchmod(fd, 0600) == 0 &&
                  ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

std::string FormatTime(int64_t ms) {
  if (ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::FromUnixMillis(ms), absl::LocalTimeZone());
}

std::string ProgressBar(const v1::Job& job) {
  const int64_t total = std::max<int64_t>(1, job.progress().total_steps());
  const int64_t step = std::min(job.progress().step(), total);
  const int width = 24;
  const int filled = static_cast<int>(width * step / total);
  std::string bar =
      absl::StrCat("[", std::string(filled, '#'), std::string(width - filled, '.'), "]");
  std::string text = absl::StrFormat("%s %d/%d", bar, step, total);
  if (job.progress().update_time_ms() > 0) {
    absl::StrAppend(&text, absl::StrFormat("  loss %.4f  %.0f tok/s", job.progress().loss(),
                                           job.progress().tokens_per_second()));
  }
  return text;
}

// The request `loom submit` sends: the file (a bare job spec or a whole request, JSON or YAML),
// its flags, then the --set overrides of the spec in order (docs/control-plane.md).
// "k=v,k2=v2" into a map; the error names --flag.
absl::Status ParseKeyValues(const std::string& flag, const std::string& text,
                            google::protobuf::Map<std::string, std::string>* out) {
  for (absl::string_view kv : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv, absl::MaxSplits('=', 1));
    if (p.first.empty() || p.second.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": expected k=v, got '", kv, "'"));
    }
    (*out)[p.first] = p.second;
  }
  return absl::OkStatus();
}

// The flags `loom submit` and `loom serve --submit` share.
absl::Status ApplyRequestFlags(const CliArgs& args, v1::SubmitJobRequest* req) {
  if (args.Has("priority")) {
    LOOM_ASSIGN_OR_RETURN(int64_t v, args.GetInt("priority", 0, -1000, 1000));
    req->set_priority(static_cast<int32_t>(v));
  }
  if (args.Has("max-restarts")) {
    LOOM_ASSIGN_OR_RETURN(int64_t v, args.GetInt("max-restarts", 3, 0, 100));
    req->set_max_restarts(static_cast<int32_t>(v));
  }
  LOOM_RETURN_IF_ERROR(ParseKeyValues("pool", args.Get("pool"), req->mutable_pool()));
  LOOM_RETURN_IF_ERROR(ParseKeyValues("label", args.Get("label"), req->mutable_labels()));
  if (args.Has("description")) req->set_description(args.Get("description"));
  if (args.Has("request-id")) req->set_request_id(args.Get("request-id"));
  if (args.Has("name")) req->mutable_spec()->set_name(args.Get("name"));
  return absl::OkStatus();
}

absl::StatusOr<v1::SubmitJobRequest> SubmitRequest(const std::string& file,
                                                   const std::vector<std::string>& sets,
                                                   const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(const std::string json, ReadJsonOrYamlFile(file));
  auto doc = nlohmann::json::parse(json, nullptr, false);
  if (!doc.is_object())
    return absl::InvalidArgumentError(absl::StrCat(file, ": expected a JSON/YAML object"));
  v1::SubmitJobRequest req;
  if (doc.contains("spec")) {
    LOOM_RETURN_IF_ERROR(ParseJsonMessage(json, file, &req));
  } else {
    LOOM_RETURN_IF_ERROR(ParseJsonMessage(json, file, req.mutable_spec()));
  }
  if (args.Has("world-size")) {
    LOOM_ASSIGN_OR_RETURN(int64_t v, args.GetInt("world-size", 1, 1, 1024));
    req.set_world_size(static_cast<int32_t>(v));
  }
  if (args.Has("init-from")) req.set_init_from(args.Get("init-from"));
  LOOM_RETURN_IF_ERROR(ApplyRequestFlags(args, &req));
  LOOM_RETURN_IF_ERROR(ApplySetFlags(req.mutable_spec(), sets));
  return req;
}

// `loom serve --submit`: a kind: serve job of the checkpoint, placed like any job.
absl::StatusOr<v1::SubmitJobRequest> ServeJobRequest(const CliArgs& args) {
  for (const char* local : {"bind", "allowed-hosts", "port", "port-file", "tls-cert", "tls-key"}) {
    if (args.Has(local)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", local,
                       ": only for a server run here (without --submit or --pool); a serve job "
                       "answers through the coordinator"));
    }
  }
  v1::SubmitJobRequest req;
  req.set_init_from(args.Get("checkpoint"));
  v1::JobSpec* spec = req.mutable_spec();
  spec->set_kind("serve");
  if (args.Has("device")) spec->set_device(args.Get("device"));
  LOOM_ASSIGN_OR_RETURN(int64_t threads, args.GetInt("threads", 0, 0, 1024));
  spec->set_threads(static_cast<int32_t>(threads));
  v1::ServeConfig* serve = spec->mutable_serve();
  serve->set_model_name(args.Get("model-name"));
  const std::pair<const char*, void (v1::ServeConfig::*)(int32_t)> ints[] = {
      {"max-batch", &v1::ServeConfig::set_max_batch},
      {"max-queue", &v1::ServeConfig::set_max_queue},
      {"max-tokens", &v1::ServeConfig::set_max_tokens},
      {"max-n", &v1::ServeConfig::set_max_n},
      {"prefix-cache-mb", &v1::ServeConfig::set_prefix_cache_mb},
      {"startup-seconds", &v1::ServeConfig::set_startup_seconds},
      {"unhealthy-seconds", &v1::ServeConfig::set_unhealthy_seconds}};
  for (const auto& [flag, set] : ints) {
    LOOM_ASSIGN_OR_RETURN(int64_t v, args.GetInt(flag, 0, 0, int64_t{1} << 30));
    (serve->*set)(static_cast<int32_t>(v));
  }
  if (args.Has("share-prefill")) {
    const std::string v = args.Get("share-prefill");
    if (v != "true" && v != "false")
      return absl::InvalidArgumentError("--share-prefill: want true | false");
    serve->set_share_prefill(v == "true");
  }
  LOOM_RETURN_IF_ERROR(ApplyRequestFlags(args, &req));
  return req;
}

class Cli {
 public:
  absl::Status Init(const CliArgs& args) {
    const char* env_url = std::getenv("LOOM_COORDINATOR");
    std::string url = args.Get("coordinator", env_url ? env_url : "http://127.0.0.1:8470");
    std::string token;
    if (args.Has("token-file")) {
      std::ifstream in(args.Get("token-file"));
      if (!in)
        return absl::NotFoundError(
            absl::StrCat("--token-file: cannot open '", args.Get("token-file"), "'"));
      std::getline(in, token);
      token = std::string(absl::StripAsciiWhitespace(token));
    } else if (const char* t = std::getenv("LOOM_TOKEN")) {
      token = t;
    } else {
      token = LocalToken(url);
    }
    if (args.Has("json")) {
      output_ = Output::kJson;
    } else {
      LOOM_ASSIGN_OR_RETURN(output_, ParseOutput(args.Get("output", "table")));
    }
    json_ = output_ != Output::kTable;
    const char* env_ca = std::getenv("LOOM_CA_FILE");
    const std::string ca_file = args.Get("ca-file", env_ca ? env_ca : "");
    LOOM_ASSIGN_OR_RETURN(client_, client::RestClient::Create(url, token, 15000, ca_file));
    return absl::OkStatus();
  }

  absl::StatusOr<v1::Job> GetJob(const std::string& id) {
    v1::Job job;
    LOOM_RETURN_IF_ERROR(client_->Call("GET", "/v1/jobs/" + id, nullptr, &job));
    return job;
  }

  absl::Status Submit(const std::string& file, const std::vector<std::string>& sets,
                      const CliArgs& args) {
    LOOM_ASSIGN_OR_RETURN(v1::SubmitJobRequest req, SubmitRequest(file, sets, args));
    v1::SubmitJobResponse resp;
    LOOM_RETURN_IF_ERROR(client_->Call("POST", "/v1/jobs", &req, &resp));
    if (json_) {
      std::cout << FormatMessage(resp, output_) << "\n";
    } else {
      std::cout << (resp.created() ? "submitted " : "already submitted as ") << resp.id()
                << std::endl;
    }
    if (args.Has("follow")) return Follow(resp.id());
    return absl::OkStatus();
  }

  // Polls until the job is terminal; a live progress bar on a terminal, a line per change
  // otherwise.
  absl::Status Follow(const std::string& id) {
    const bool tty = ::isatty(STDOUT_FILENO) != 0;
    std::string last_line, last_state, last_reason;
    int64_t last_event = -1;
    for (;;) {
      LOOM_ASSIGN_OR_RETURN(v1::Job job, GetJob(id));
      for (const auto& e : job.events()) {
        if (e.seq() <= last_event) continue;
        last_event = e.seq();
        if (!json_) {
          if (tty) std::cout << "\r\033[K";
          std::cout << FormatTime(e.time_ms()) << "  " << (e.state().empty() ? "event" : e.state())
                    << ": " << e.reason() << "\n";
        }
      }
      // A queued job says why it waits (no matching worker, not enough free slots, ...).
      if (!json_ && job.state() == "queued" && job.reason() != last_reason) {
        if (tty) std::cout << "\r\033[K";
        std::cout << "waiting: " << job.reason() << "\n";
      }
      last_reason = job.reason();
      const std::string line = absl::StrCat(job.state(), "  ", ProgressBar(job));
      if (!json_ && line != last_line && job.progress().update_time_ms() > 0) {
        if (tty) {
          std::cout << "\r\033[K" << line << std::flush;
        } else if (job.progress().step() % 10 == 0 || job.state() != last_state) {
          std::cout << line << "\n";
        }
        last_line = line;
      }
      last_state = job.state();
      if (job.state() == "succeeded" || job.state() == "failed" || job.state() == "cancelled") {
        if (tty && !json_) std::cout << "\n";
        if (json_)
          std::cout << FormatMessage(job, output_) << "\n";
        else
          PrintResults(job);
        if (job.state() != "succeeded") {
          return absl::AbortedError(absl::StrCat("job ", id, " ", job.state(), ": ", job.reason()));
        }
        return absl::OkStatus();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }

  void PrintResults(const v1::Job& job) {
    std::cout << job.id() << " " << job.state() << " after " << job.attempt() << " attempt(s), "
              << job.restarts() << " restart(s); step " << job.progress().step() << "/"
              << job.progress().total_steps() << ", loss "
              << absl::StrFormat("%.4f", job.progress().loss()) << "\n";
    for (const auto& e : job.evals()) {
      if (e.kind() == "reasoning") {
        std::cout << absl::StrFormat(
            "  reasoning eval at step %d (%s, %d problems x %d samples): Pass@1 %.3f  Maj@%d %.3f  "
            "answered %.3f\n",
            e.step(), e.task(), e.problems(), e.samples(), e.pass_at_1(), e.samples(), e.maj_at_k(),
            e.answered());
        if (!e.details().empty()) std::cout << "    samples: " << e.details() << "\n";
        continue;
      }
      const std::string kind = e.kind() == "length" ? absl::StrCat("length ", e.length(), " ")
                               : e.kind().empty() || e.kind() == "heldout" ? ""
                                                                           : e.kind() + " ";
      std::cout << absl::StrFormat(
          "  %seval at step %d: loss %.4f  accuracy %.3f  exact match %.3f\n", kind, e.step(),
          e.eval_loss(), e.accuracy(), e.exact_match());
    }
    if (!job.checkpoints().empty()) {
      std::cout << "  checkpoints: " << absl::StrJoin(job.checkpoints(), ", ") << "\n";
    }
  }

  // The newest `--limit` jobs (0: all), oldest first like the API's pages.
  absl::Status List(const CliArgs& args) {
    LOOM_ASSIGN_OR_RETURN(int64_t limit, args.GetInt("limit", 50, 0, 10000000));
    std::string token;
    std::deque<v1::Job> newest;
    do {
      std::string path = "/v1/jobs?page_size=500";
      for (const char* filter : {"state", "label", "user"}) {
        if (args.Has(filter))
          absl::StrAppend(&path, "&", filter, "=", client::QueryValue(args.Get(filter)));
      }
      if (!token.empty()) absl::StrAppend(&path, "&page_token=", token);
      v1::ListJobsResponse page;
      LOOM_RETURN_IF_ERROR(client_->Call("GET", path, nullptr, &page));
      for (auto& j : *page.mutable_jobs()) {
        newest.push_back(std::move(j));
        if (limit > 0 && static_cast<int64_t>(newest.size()) > limit) newest.pop_front();
      }
      token = page.next_page_token();
    } while (!token.empty());
    v1::ListJobsResponse all;
    for (auto& j : newest) *all.add_jobs() = std::move(j);
    if (json_) {
      std::cout << FormatMessage(all, output_) << "\n";
      return absl::OkStatus();
    }
    std::cout << absl::StrFormat("%-11s %-20s %-10s %5s %-40s\n", "ID", "NAME", "STATE", "RANKS",
                                 "PROGRESS");
    for (const auto& j : all.jobs()) {
      std::cout << absl::StrFormat("%-11s %-20s %-10s %5d %s\n", j.id(), j.name().substr(0, 20),
                                   j.state(), j.world_size(), ProgressBar(j));
    }
    return absl::OkStatus();
  }

  absl::Status Status(const std::string& id, const CliArgs& args) {
    if (args.Has("follow")) return Follow(id);
    LOOM_ASSIGN_OR_RETURN(v1::Job job, GetJob(id));
    if (json_) {
      std::cout << FormatMessage(job, output_) << "\n";
      return absl::OkStatus();
    }
    std::cout << job.id() << "  " << job.name() << "\n  state     " << job.state() << " ("
              << job.reason() << ")\n  progress  " << ProgressBar(job) << "\n  ranks     "
              << job.world_size() << "  attempt " << job.attempt() << "  restarts "
              << job.restarts() << "/" << job.max_restarts() << "\n  submitted "
              << FormatTime(job.submit_time_ms()) << " by " << job.submitted_by() << "\n";
    if (!job.request().labels().empty()) {
      std::vector<std::string> labels;
      for (const auto& [k, v] : job.request().labels()) labels.push_back(absl::StrCat(k, "=", v));
      std::sort(labels.begin(), labels.end());
      std::cout << "  labels    " << absl::StrJoin(labels, ",") << "\n";
    }
    if (!job.request().description().empty())
      std::cout << "  about     " << job.request().description() << "\n";
    for (const auto& p : job.placement()) {
      std::cout << "  placed    " << p.worker_id() << " ranks " << absl::StrJoin(p.ranks(), ",")
                << "\n";
    }
    if (job.has_serve()) {
      std::cout << "  serves    '" << job.serve().model() << "' on " << job.serve().address()
                << (job.serve().ready() ? "" : " (not answering yet)") << "\n  base URL  "
                << client_->url() << job.serve().base_path() << " (API key: your Loom token)\n";
    }
    std::cout << "events:\n";
    for (const auto& e : job.events()) {
      std::cout << "  " << FormatTime(e.time_ms()) << "  " << (e.state().empty() ? "-" : e.state())
                << "  " << e.reason() << "\n";
    }
    PrintResults(job);
    return absl::OkStatus();
  }

  absl::Status Logs(const std::string& id, const CliArgs& args) {
    const bool follow = args.Has("follow") || args.Has("f");
    return client_->GetStream(absl::StrCat("/v1/jobs/", id, "/logs", follow ? "?follow=true" : ""),
                              [](const char* data, size_t n) {
                                std::cout.write(data, static_cast<std::streamsize>(n));
                                std::cout.flush();
                                return true;
                              });
  }

  absl::Status Cancel(const std::string& id) {
    v1::Job job;
    LOOM_RETURN_IF_ERROR(
        client_->Call("POST", absl::StrCat("/v1/jobs/", id, "/cancel"), nullptr, &job));
    if (json_)
      std::cout << FormatMessage(job, output_) << "\n";
    else
      std::cout << id << " " << job.state() << "\n";
    return absl::OkStatus();
  }

  // loom update JOB [--priority N] [--keep-last K] [--keep-every E]
  absl::Status Update(const std::string& id, const CliArgs& args) {
    v1::JobUpdate u;
    if (args.Has("priority")) {
      LOOM_ASSIGN_OR_RETURN(int64_t p, args.GetInt("priority", 0, -1000, 1000));
      u.set_priority(static_cast<int32_t>(p));
    }
    if (args.Has("keep-last")) {
      LOOM_ASSIGN_OR_RETURN(int64_t k, args.GetInt("keep-last", 3, 1, 1000000));
      u.set_keep_last(static_cast<int32_t>(k));
    }
    if (args.Has("keep-every")) {
      LOOM_ASSIGN_OR_RETURN(int64_t e, args.GetInt("keep-every", 0, 0, int64_t{1} << 40));
      u.set_keep_every(e);
    }
    if (!u.has_priority() && !u.has_keep_last() && !u.has_keep_every())
      return absl::InvalidArgumentError("give --priority, --keep-last or --keep-every");
    v1::Job job;
    LOOM_RETURN_IF_ERROR(client_->Call("PATCH", absl::StrCat("/v1/jobs/", id), &u, &job));
    if (json_) {
      std::cout << FormatMessage(job, output_) << "\n";
    } else {
      std::cout << id << ": priority " << job.priority() << ", keeps the last "
                << (job.spec().checkpoint().keep_last() > 0 ? job.spec().checkpoint().keep_last()
                                                            : 3)
                << " checkpoints"
                << (job.spec().checkpoint().keep_every() > 0
                        ? absl::StrCat(" and every ", job.spec().checkpoint().keep_every(),
                                       "-th step's")
                        : "")
                << "\n";
    }
    return absl::OkStatus();
  }

  absl::Status Checkpoints(const CliArgs& args) {
    if (args.Has("store")) return StoreCheckpoints(args.Get("store"));
    std::string path = "/v1/checkpoints?page_size=500";
    if (args.Has("job")) path += "&job=" + args.Get("job");
    LOOM_ASSIGN_OR_RETURN(
        v1::ListCheckpointsResponse r,
        client::AllPages<v1::ListCheckpointsResponse>(*client_, path, [](auto& all, auto& page) {
          all.mutable_checkpoints()->MergeFrom(page.checkpoints());
        }));
    if (json_) {
      std::cout << FormatMessage(r, output_) << "\n";
      return absl::OkStatus();
    }
    std::cout << absl::StrFormat("%-22s %-9s %8s %-22s %s\n", "ID", "KIND", "STEP", "PARENT",
                                 "PATH");
    for (const auto& c : r.checkpoints()) {
      std::cout << absl::StrFormat("%-22s %-9s %8d %-22s %s\n", c.id(), c.kind(), c.step(),
                                   c.parent().empty() ? "-" : c.parent(),
                                   c.available() ? c.path() : "(deleted by retention)");
    }
    return absl::OkStatus();
  }

  // The committed steps under a checkpoint root, read from the store itself (a directory or
  // s3://; no coordinator needed).
  absl::Status StoreCheckpoints(const std::string& root) {
    LOOM_ASSIGN_OR_RETURN(auto store, storage::OpenCheckpointStore(root));
    LOOM_ASSIGN_OR_RETURN(std::vector<storage::CheckpointRef> refs, store->List());
    std::cout << absl::StrFormat("%8s %s\n", "STEP", "PATH");
    for (const auto& r : refs) std::cout << absl::StrFormat("%8d %s\n", r.step, r.dir);
    return absl::OkStatus();
  }

  // The directory of a checkpoint: a directory or an s3:// URL as given, or a catalogue id
  // (job-000002.150, or the older job-000002/150) looked up in the coordinator's catalogue.
  absl::StatusOr<std::string> CheckpointPath(const std::string& ref) {
    if (storage::IsRemoteLocation(ref)) return ref;
    if (fs::is_directory(ref)) return fs::absolute(ref).string();
    std::string id = ref;
    std::replace(id.begin(), id.end(), '/', '.');
    const size_t dot = id.rfind('.');
    if (dot == std::string::npos || dot == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--checkpoint: '", ref, "' is neither a directory nor a checkpoint id (job-000002.150)"));
    }
    LOOM_ASSIGN_OR_RETURN(v1::ListCheckpointsResponse r,
                          client::AllPages<v1::ListCheckpointsResponse>(
                              *client_, "/v1/checkpoints?page_size=500&job=" + id.substr(0, dot),
                              [](auto& all, auto& page) {
                                all.mutable_checkpoints()->MergeFrom(page.checkpoints());
                              }));
    for (const auto& c : r.checkpoints()) {
      if (c.id() != id) continue;
      if (!c.available()) {
        return absl::FailedPreconditionError(
            absl::StrCat("--checkpoint: ", id, " was deleted by retention"));
      }
      if (!c.damaged().empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("--checkpoint: ", id, " is damaged: ", c.damaged()));
      }
      return c.path();
    }
    return absl::NotFoundError(absl::StrCat("--checkpoint: no checkpoint ", id,
                                            " in the catalogue (loom checkpoints lists them)"));
  }

  // `loom serve --submit`: the job, and where clients reach it (with --wait, once it answers).
  absl::Status SubmitServeJob(const CliArgs& args) {
    LOOM_ASSIGN_OR_RETURN(v1::SubmitJobRequest req, ServeJobRequest(args));
    v1::SubmitJobResponse resp;
    LOOM_RETURN_IF_ERROR(client_->Call("POST", "/v1/jobs", &req, &resp));
    const std::string base = absl::StrCat(client_->url(), "/v1/jobs/", resp.id(), "/serve/v1");
    if (!args.Has("wait")) {
      if (json_) {
        std::cout << FormatMessage(resp, output_) << "\n";
        return absl::OkStatus();
      }
      std::cout << (resp.created() ? "submitted " : "already submitted as ") << resp.id()
                << "\nOpenAI base URL, once it runs (loom status " << resp.id() << "): " << base
                << "\nAPI key: your Loom token" << std::endl;
      return absl::OkStatus();
    }
    for (;;) {
      LOOM_ASSIGN_OR_RETURN(v1::Job job, GetJob(resp.id()));
      if (job.state() == "running" && job.serve().ready()) {
        if (json_) {
          std::cout << FormatMessage(job, output_) << "\n";
          return absl::OkStatus();
        }
        std::cout << resp.id() << " serves '" << job.serve().model() << "' on "
                  << job.serve().address() << "\nOpenAI base URL: " << base
                  << "\nAPI key: your Loom token" << std::endl;
        return absl::OkStatus();
      }
      if (job.state() == "succeeded" || job.state() == "failed" || job.state() == "cancelled") {
        return absl::FailedPreconditionError(
            absl::StrCat(resp.id(), " is ", job.state(), ": ", job.reason()));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }

  // `loom serve`: resolves the checkpoint, then becomes loom-serve (docs/serve.md); with
  // --submit or --pool, a serve job on the workers instead.
  absl::Status Serve(const CliArgs& args) {
    if (args.Has("submit") || args.Has("pool")) return SubmitServeJob(args);
    for (const char* job_only : {"wait", "priority", "max-restarts", "label", "description",
                                 "request-id", "name", "startup-seconds", "unhealthy-seconds"}) {
      if (args.Has(job_only)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", job_only, ": only with --submit (a serve job)"));
      }
    }
    LOOM_ASSIGN_OR_RETURN(std::string ref, args.Require("checkpoint"));
    LOOM_ASSIGN_OR_RETURN(std::string path, CheckpointPath(ref));
    std::error_code ec;
    const fs::path bin = fs::read_symlink("/proc/self/exe", ec).parent_path() / "loom-serve";
    std::vector<std::string> argv = {bin.string(), "--checkpoint", path};
    if (!fs::is_directory(ref)) argv.insert(argv.end(), {"--model-name", ref});
    for (const char* flag :
         {"bind", "allowed-hosts", "port", "port-file", "token-file", "model-name", "max-batch",
          "max-queue", "max-tokens", "max-n", "share-prefill", "prefix-cache-mb", "device",
          "threads", "tls-cert", "tls-key"}) {
      if (args.Has(flag)) argv.insert(argv.end(), {absl::StrCat("--", flag), args.Get(flag)});
    }
    std::vector<char*> cargv;
    for (auto& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    ::execv(cargv[0], cargv.data());
    return absl::UnavailableError(
        absl::StrCat("cannot run ", bin.string(), ": ", std::strerror(errno)));
  }

  // Loss and throughput over steps from the job's log (rank 0's progress lines), drawn by gnuplot.
  absl::Status Plot(const std::string& id, const CliArgs& args) {
    std::string log;
    LOOM_RETURN_IF_ERROR(
        client_->GetStream(absl::StrCat("/v1/jobs/", id, "/logs"), [&](const char* d, size_t n) {
          log.append(d, n);
          return true;
        }));
    // "[rank 0] step 120/300  loss 2.3456  lr 1.00e-03  grad_norm 0.812  1234 tok/s  ETA ..."
    const std::regex line(
        R"(\[rank 0\] step (\d+)/\d+\s+loss ([0-9.eE+-]+|nan|inf).*?\s([0-9.eE+-]+) tok/s)");
    std::ostringstream data;
    int points = 0;
    std::istringstream in(log);
    for (std::string l; std::getline(in, l);) {
      std::smatch m;
      if (std::regex_search(l, m, line)) {
        data << m[1] << " " << m[2] << " " << m[3] << "\n";
        ++points;
      }
    }
    if (points == 0)
      return absl::NotFoundError(absl::StrCat("job ", id, " has logged no training steps yet"));
    const std::string out = args.Get("file", id + ".png");
    const fs::path tmp = fs::temp_directory_path() / absl::StrCat("loom-plot-", ::getpid(), ".dat");
    std::ofstream(tmp) << data.str();
    const std::string script = absl::StrCat(
        "set terminal pngcairo size 1000,700 font 'sans,10'\n", "set output '", out, "'\n",
        "set multiplot layout 2,1 title 'Loom ", id, "'\n", "set grid\nset xlabel 'step'\n",
        "set ylabel 'loss'\nplot '", tmp.string(),
        "' using 1:2 with lines lw 2 title 'training loss'\n", "set ylabel 'tokens/s'\nplot '",
        tmp.string(), "' using 1:3 with lines lw 2 title 'throughput'\n", "unset multiplot\n");
    FILE* gp = ::popen("gnuplot", "w");
    if (gp == nullptr)
      return absl::UnavailableError("cannot run gnuplot (apt install gnuplot-nox)");
    std::fwrite(script.data(), 1, script.size(), gp);
    const int rc = ::pclose(gp);
    std::error_code ec;
    fs::remove(tmp, ec);
    if (rc != 0)
      return absl::InternalError(
          absl::StrCat("gnuplot failed (exit ", rc, "); is gnuplot-nox installed?"));
    std::cout << "wrote " << out << " (" << points << " points)\n";
    return absl::OkStatus();
  }

  absl::Status Workers() {
    LOOM_ASSIGN_OR_RETURN(v1::ListWorkersResponse r,
                          client::AllPages<v1::ListWorkersResponse>(
                              *client_, "/v1/workers?page_size=500", [](auto& all, auto& page) {
                                all.mutable_workers()->MergeFrom(page.workers());
                              }));
    if (json_) {
      std::cout << FormatMessage(r, output_) << "\n";
      return absl::OkStatus();
    }
    std::cout << absl::StrFormat("%-12s %-16s %-6s %5s %-20s %-14s %s\n", "ID", "NAME", "STATE",
                                 "SLOTS", "LABELS", "GPUS", "LAST HEARTBEAT");
    for (const auto& w : r.workers()) {
      std::string labels, gpus = w.gpus().empty() ? "-" : "";
      for (const auto& [k, v] : w.labels())
        absl::StrAppend(&labels, labels.empty() ? "" : ",", k, "=", v);
      for (const auto& g : w.gpus()) absl::StrAppend(&gpus, gpus.empty() ? "" : ",", g.index());
      std::cout << absl::StrFormat("%-12s %-16s %-6s %2d/%-2d %-20s %-14s %s\n", w.id(),
                                   w.name().substr(0, 16), w.state(), w.used_slots(), w.slots(),
                                   labels, gpus, FormatTime(w.last_heartbeat_ms()));
    }
    return absl::OkStatus();
  }

  // loom admin quota list | set KIND NAME [SLOTS|none] [--weight W] | delete KIND NAME
  absl::Status Quota(const std::string& action, const std::vector<std::string>& words,
                     double weight) {
    if (action == "list") {
      v1::ListQuotasResponse r;
      LOOM_RETURN_IF_ERROR(client_->Call("GET", "/v1/quotas", nullptr, &r));
      if (json_) {
        std::cout << FormatMessage(r, output_) << "\n";
        return absl::OkStatus();
      }
      std::cout << absl::StrFormat("%-8s %-20s %11s %7s\n", "KIND", "NAME", "USED/MAX", "WEIGHT");
      for (const auto& q : r.quotas()) {
        std::cout << absl::StrFormat(
            "%-8s %-20s %5d/%-5s %7s\n", q.kind(), q.name(), q.used(),
            q.has_slots() ? absl::StrCat(q.slots()) : "-",
            q.kind() == "user" ? absl::StrCat(q.weight() > 0 ? q.weight() : 1.0) : "");
      }
      return absl::OkStatus();
    }
    const std::string path = absl::StrCat("/v1/quotas/", client::QueryValue(words.at(0)), "/",
                                          client::QueryValue(words.at(1)));
    if (action == "delete") {
      LOOM_RETURN_IF_ERROR(client_->Call("DELETE", path, nullptr, nullptr));
      std::cout << "removed the quota of " << words[0] << " " << words[1] << "\n";
      return absl::OkStatus();
    }
    v1::Quota q;
    if (words.size() > 2 && words[2] != "none") {
      int64_t slots = 0;
      if (!absl::SimpleAtoi(words[2], &slots))
        return absl::InvalidArgumentError(
            absl::StrCat("SLOTS: '", words[2], "' is not a number (or none)"));
      q.set_slots(static_cast<int32_t>(std::clamp<int64_t>(slots, -1, 1 << 30)));
    }
    if (weight != 0) q.set_weight(weight);
    if (!q.has_slots() && weight == 0)
      return absl::InvalidArgumentError("give SLOTS, --weight, or both");
    v1::Quota stored;
    LOOM_RETURN_IF_ERROR(client_->Call("PUT", path, &q, &stored));
    std::cout << stored.kind() << " " << stored.name() << ": "
              << (stored.has_slots() ? absl::StrCat("at most ", stored.slots(), " slots")
                                     : "no slot limit")
              << (stored.weight() > 0 ? absl::StrCat(", fair-share weight ", stored.weight()) : "")
              << "\n";
    return absl::OkStatus();
  }

  client::RestClient& client() { return *client_; }
  Output output() const { return output_; }

 private:
  bool json_ = false;  // machine-readable output (json or yaml): no progress lines
  Output output_ = Output::kTable;
  std::unique_ptr<client::RestClient> client_;
};

// `loom up`: a local-mode coordinator on loopback and N workers, as child processes.
volatile sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

// Where `loom up` keeps its state: under --data-dir, with the binaries next to this one.
struct UpLayout {
  std::string data;             // --data-dir, absolute
  fs::path bin;                 // the directory of loom, loom-coordinator and loom-worker
  std::string sd_dir;           // Prometheus file_sd targets, one JSON file per process
  std::string port_file;        // the coordinator writes its user port here
  std::string agent_port_file;  // and its agent port here
  fs::path tokens;              // users, worker-token, user-token
  std::string users_file() const { return (tokens / "users").string(); }
  std::string worker_token_file() const { return (tokens / "worker-token").string(); }
};

// Creates the directories and removes the port files a previous run left.
UpLayout PrepareUpLayout(const CliArgs& args) {
  UpLayout l;
  l.data = fs::absolute(args.Get("data-dir", "runs/loom-up")).string();
  std::error_code ec;
  l.bin = fs::read_symlink("/proc/self/exe", ec).parent_path();
  fs::create_directories(l.data, ec);
  l.port_file = (fs::path(l.data) / "coordinator.port").string();
  // Prometheus file-based service discovery: one JSON file per process (deploy/prometheus).
  l.sd_dir =
      fs::absolute(args.Get("prometheus-dir", (fs::path(l.data) / "prometheus-targets").string()))
          .string();
  fs::create_directories(l.sd_dir, ec);
  fs::remove(l.port_file, ec);
  l.tokens = fs::path(l.data) / "tokens";
  l.agent_port_file = (fs::path(l.data) / "coordinator.agent-port").string();
  return l;
}

// Tokens even on one box: any web page the user opens can reach a loopback port. Returns the
// user token. --users adds a shared box's other users ("user token [admin]" lines, checked by
// the coordinator as it reads them).
absl::StatusOr<std::string> WriteUpTokens(const UpLayout& l, const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(const std::string user_token, RandomHexToken());
  LOOM_ASSIGN_OR_RETURN(const std::string enrolment_token, RandomHexToken());
  std::string users = absl::StrCat("local ", user_token, " admin\n");
  if (args.Has("users")) {
    absl::StatusOr<std::string> more = ReadFile(args.Get("users"), "--users");
    if (!more.ok()) return absl::InvalidArgumentError(more.status().message());
    users += *more;
    if (users.back() != '\n') users += '\n';
  }
  LOOM_RETURN_IF_ERROR(WritePrivateFile(l.users_file(), users));
  LOOM_RETURN_IF_ERROR(WritePrivateFile(l.worker_token_file(), enrolment_token + "\n"));
  LOOM_RETURN_IF_ERROR(WritePrivateFile((l.tokens / "user-token").string(), user_token + "\n"));
  return user_token;
}

// The processes `loom up` started, stopped last first.
class ChildProcesses {
 public:
  pid_t Spawn(std::vector<std::string> argv) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::vector<char*> cargv;
      for (auto& s : argv) cargv.push_back(s.data());
      cargv.push_back(nullptr);
      ::execv(cargv[0], cargv.data());
      std::perror(argv[0].c_str());
      _exit(127);
    }
    pids_.push_back(pid);
    return pid;
  }
  // A child that exited and was reaped.
  void Forget(pid_t pid) { pids_.erase(std::remove(pids_.begin(), pids_.end(), pid), pids_.end()); }
  void StopAll() {
    for (auto it = pids_.rbegin(); it != pids_.rend(); ++it) ::kill(*it, SIGTERM);
    for (pid_t p : pids_) ::waitpid(p, nullptr, 0);
  }

 private:
  std::vector<pid_t> pids_;
};

pid_t StartCoordinator(ChildProcesses& children, const UpLayout& l, int64_t port,
                       const CliArgs& args) {
  std::error_code ec;
  fs::remove(l.agent_port_file, ec);
  std::vector<std::string> argv = {(l.bin / "loom-coordinator").string(),
                                   "--data-dir",
                                   (fs::path(l.data) / "coordinator").string(),
                                   "--storage-root",
                                   (fs::path(l.data) / "storage").string(),
                                   "--port",
                                   std::to_string(port),
                                   "--port-file",
                                   l.port_file,
                                   "--agent-port",
                                   "0",
                                   "--agent-port-file",
                                   l.agent_port_file,
                                   "--user-tokens",
                                   l.users_file(),
                                   "--worker-token-file",
                                   l.worker_token_file(),
                                   "--prometheus-sd-file",
                                   (fs::path(l.sd_dir) / "coordinator.json").string()};
  // The scheduling policy of a shared box, passed through (the coordinator checks the values).
  for (const char* flag : {"preempt-after-s", "min-run-s", "fair-share-half-life-s",
                           "max-user-priority", "checkpoint-store"}) {
    if (args.Has(flag)) argv.insert(argv.end(), {absl::StrCat("--", flag), args.Get(flag)});
  }
  if (args.Has("private-jobs")) argv.push_back("--private-jobs");
  return children.Spawn(argv);
}

// The coordinator's bound {user port, agent port}, once it has written both (10 s at most).
absl::StatusOr<std::pair<int, int>> WaitForCoordinatorPorts(ChildProcesses& children,
                                                            const UpLayout& l, pid_t coordinator) {
  int bound = 0, agent_bound = 0;
  for (int i = 0; i < 200 && (bound == 0 || agent_bound == 0); ++i) {
    std::ifstream(l.port_file) >> bound;
    std::ifstream(l.agent_port_file) >> agent_bound;
    int st;
    if (::waitpid(coordinator, &st, WNOHANG) == coordinator) {
      children.Forget(coordinator);
      return absl::UnavailableError("loom-coordinator exited during start-up (see above)");
    }
    if (bound == 0 || agent_bound == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (bound == 0 || agent_bound == 0) {
    children.StopAll();
    return absl::UnavailableError("loom-coordinator did not start within 10 s");
  }
  return std::make_pair(bound, agent_bound);
}

void StartWorkers(ChildProcesses& children, const UpLayout& l, int agent_port, int64_t workers,
                  int64_t slots, const CliArgs& args) {
  for (int i = 0; i < workers; ++i) {
    std::vector<std::string> argv = {
        (l.bin / "loom-worker").string(),
        "--coordinator",
        absl::StrCat("http://127.0.0.1:", agent_port),
        "--token-file",
        l.worker_token_file(),
        "--work-dir",
        (fs::path(l.data) / absl::StrCat("worker-", i)).string(),
        "--slots",
        std::to_string(slots),
        "--name",
        absl::StrCat("local-", i),
        "--metrics-port",
        "-1",
        "--prometheus-sd-file",
        (fs::path(l.sd_dir) / absl::StrCat("worker-", i, ".json")).string()};
    if (args.Has("labels")) argv.insert(argv.end(), {"--labels", args.Get("labels")});
    children.Spawn(argv);
  }
}

void PrintUpBanner(const UpLayout& l, const std::string& url, int64_t workers, int64_t slots,
                   const std::string& user_token, bool cli_finds_token) {
  std::cout << "loom up: coordinator " << url << " with " << workers << " worker(s) x " << slots
            << " slot(s); state in " << l.data
            << "\n"
            // The fragment never reaches a server; the page keeps it in this tab only.
            << "  console: " << url << "/#token=" << user_token << "\n"
            << "  try: LOOM_COORDINATOR=" << url << " loom submit examples/tiny-iha.yaml --follow\n"
            << "  the user token is in " << (l.tokens / "user-token").string()
            << (cli_finds_token ? " (the loom CLI finds it by itself)" : "") << "\n"
            << "  Ctrl-C stops everything" << std::endl;
}

// Until Ctrl-C (or SIGTERM): reports workers that exit; fails when the coordinator does.
absl::Status SuperviseUntilStopped(ChildProcesses& children, pid_t coordinator) {
  while (!g_stop) {
    int st;
    const pid_t done = ::waitpid(-1, &st, WNOHANG);
    if (done > 0) {
      children.Forget(done);
      if (done == coordinator) return absl::UnavailableError("loom-coordinator exited");
      std::cerr << "loom up: a worker (pid " << done << ") exited\n";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return absl::OkStatus();
}

absl::Status Up(const CliArgs& args) {
  LOOM_ASSIGN_OR_RETURN(int64_t workers, args.GetInt("workers", 1, 1, 64));
  LOOM_ASSIGN_OR_RETURN(int64_t slots, args.GetInt("slots", 2, 1, 1024));
  LOOM_ASSIGN_OR_RETURN(int64_t port, args.GetInt("port", 8470, 0, 65535));
  const UpLayout layout = PrepareUpLayout(args);
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  LOOM_ASSIGN_OR_RETURN(const std::string user_token, WriteUpTokens(layout, args));
  ChildProcesses children;
  const pid_t coordinator = StartCoordinator(children, layout, port, args);
  LOOM_ASSIGN_OR_RETURN(const auto ports, WaitForCoordinatorPorts(children, layout, coordinator));
  // The CLI finds the token here for this port (LocalToken).
  const std::string cli_token_file = LocalTokenPath(std::to_string(ports.first));
  if (!cli_token_file.empty()) {
    LOOM_RETURN_IF_ERROR(WritePrivateFile(cli_token_file, user_token + "\n"));
  }
  const std::string url = absl::StrCat("http://127.0.0.1:", ports.first);
  StartWorkers(children, layout, ports.second, workers, slots, args);
  PrintUpBanner(layout, url, workers, slots, user_token, !cli_token_file.empty());
  const absl::Status status = SuperviseUntilStopped(children, coordinator);
  children.StopAll();
  std::error_code ec;
  if (!cli_token_file.empty()) fs::remove(cli_token_file, ec);
  if (status.ok()) std::cout << "loom up: stopped" << std::endl;
  return status;
}

// Exit codes (docs/control-plane.md, CLI): what a script can branch on.
enum ExitCode : int {
  kExitOk = 0,
  kExitError = 1,        // anything else (a local I/O failure, an internal error)
  kExitUsage = 2,        // a bad command line, flag value or input file
  kExitNotFound = 3,     // the coordinator has no such job, sweep or checkpoint
  kExitRefused = 4,      // the coordinator refused the request (4xx: invalid, forbidden, conflict)
  kExitJobFailed = 5,    // --follow: the job ended failed or cancelled
  kExitUnreachable = 6,  // the coordinator could not be reached or is unavailable (503)
};

int ExitCodeOf(const absl::Status& s) {
  if (s.ok()) return kExitOk;
  if (auto http = s.GetPayload(client::kHttpStatusPayload)) {
    const std::string code(*http);
    if (code == "404") return kExitNotFound;
    if (code == "503") return kExitUnreachable;
    return code[0] == '4' ? kExitRefused : kExitError;
  }
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
      return kExitUsage;
    case absl::StatusCode::kAborted:
      return kExitJobFailed;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnreachable;
    default:
      return kExitError;
  }
}

constexpr char kExitCodesHelp[] = R"(
exit codes: 0 ok, 2 usage (bad flag, value or file), 3 not found, 4 refused by the coordinator,
            5 job failed or cancelled (--follow), 6 coordinator unreachable, 1 other errors
environment: LOOM_COORDINATOR (URL), LOOM_TOKEN (a user token), LOOM_CA_FILE (--ca-file))";

// The command line, parsed by CLI11 into the flag map the commands read (CliArgs): every
// option a command was given, by its long name; switches as "true".
class CommandLine {
 public:
  CommandLine() : app_("loom: the command-line client of a Loom coordinator", "loom") {
    app_.set_version_flag("--version", VersionText());
    app_.require_subcommand(1);
    app_.footer(kExitCodesHelp);
    app_.fallthrough();  // common flags may follow the command: loom logs JOB -f --coordinator U
    app_.add_option("--coordinator",
                    "coordinator URL (default $LOOM_COORDINATOR, then "
                    "http://127.0.0.1:8470)")
        ->type_name("URL");
    app_.add_option("--token-file",
                    "file holding a user token (default: the token in $LOOM_TOKEN, then, "
                    "for a loopback coordinator started by `loom up`, the token it wrote)")
        ->type_name("FILE");
    app_.add_option("--ca-file",
                    "PEM file of the CA that signed an https:// coordinator's "
                    "certificate (default $LOOM_CA_FILE, then the system's CAs)")
        ->type_name("FILE");
    app_.add_option("-o,--output", "table (default) | json | yaml: every field of the result")
        ->type_name("FORMAT");
    app_.add_flag("--json", "the same as -o json");
  }

  CLI::App& app() { return app_; }

  CLI::App* Command(const std::string& name, const std::string& help) {
    return app_.add_subcommand(name, help);
  }
  struct FlagSpec {
    const char* name;  // without the leading --
    const char* type;  // the value's placeholder in --help
    const char* help;
  };
  static void Flags(CLI::App* cmd, std::initializer_list<FlagSpec> flags) {
    for (const FlagSpec& f : flags)
      cmd->add_option(std::string("--") + f.name, f.help)->type_name(f.type);
  }
  static void Switch(CLI::App* cmd, const std::string& names, const std::string& help) {
    cmd->add_flag(names, help);
  }

  // The flags given to `cmd` and to loom itself, as CliArgs.
  CliArgs ArgsOf(const CLI::App* cmd) const {
    std::map<std::string, std::string> values;
    for (const CLI::App* a : {static_cast<const CLI::App*>(&app_), cmd}) {
      for (const CLI::Option* o : a->get_options()) {
        if (o->count() == 0 || o->get_lnames().empty()) continue;
        const std::string& name = o->get_lnames()[0];
        if (name == "help" || name == "version") continue;
        values[name] =
            o->get_expected_min() == 0 || o->results().empty() ? "true" : o->results().back();
      }
    }
    return CliArgs::FromValues(std::move(values));
  }

 private:
  static std::string VersionText() {
    const metrics::BuildInfo& b = metrics::GetBuildInfo();
    return absl::StrCat("loom ", b.version, " (commit ", b.commit, ", LibTorch ", b.torch, ")");
  }
  CLI::App app_;
};

// The commands as CLI11 defines them, and where their positionals and --set values land.
struct Commands {
  std::string file, job, sweep_arg;
  std::vector<std::string> quota_words;  // admin quota set/delete: KIND NAME [SLOTS]
  double quota_weight = 0;               // admin quota set --weight
  CLI::App* quota = nullptr;
  std::string webhook_arg;  // admin webhook add URL / delete ID
  CLI::App* webhook = nullptr;
  std::vector<std::string> sets;  // submit --set PATH=VALUE, in order
  CLI::App *up = nullptr, *submit = nullptr, *list = nullptr, *status = nullptr, *logs = nullptr,
           *cancel = nullptr, *plot = nullptr, *checkpoints = nullptr, *workers = nullptr,
           *update = nullptr, *serve = nullptr, *sweep = nullptr;
};

void AddUpCommand(CommandLine& line, Commands& c) {
  c.up = line.Command("up", "run a local coordinator and workers on this box until Ctrl-C");
  CommandLine::Flags(
      c.up, {{"workers", "N", "worker agents (default 1)"},
             {"slots", "N", "trainer ranks per worker (default 2)"},
             {"port", "PORT", "coordinator port on 127.0.0.1 (default 8470)"},
             {"data-dir", "DIR", "state, checkpoints and logs (default runs/loom-up)"},
             {"labels", "K=V,...", "worker labels k=v,..."},
             {"prometheus-dir", "DIR", "file_sd targets (default DATA_DIR/prometheus-targets)"},
             {"users", "FILE", "more users of a shared box: `user token [admin]` lines"},
             {"preempt-after-s", "S",
              "a job waiting S s may preempt lower priorities (default "
              "600; -1 never)"},
             {"min-run-s", "S", "a preempted job is not preempted again for S s (default 600)"},
             {"fair-share-half-life-s", "S", "half-life of the usage fair share counts"},
             {"max-user-priority", "N", "the highest priority a non-admin may set (default any)"},
             {"checkpoint-store", "URL",
              "checkpoints in an object store, s3://bucket/prefix (AWS_* environment)"}});
  CommandLine::Switch(c.up, "--private-jobs", "users see only their own jobs (admins see all)");
}

void AddSubmitCommand(CommandLine& line, Commands& c) {
  c.submit = line.Command(
      "submit",
      "submit a job: a job spec (docs/jobs.md) or {\"spec\": ..., \"world_size\": ...}, "
      "JSON or YAML");
  c.submit->add_option("file", c.file, "the job file")->required();
  CommandLine::Flags(
      c.submit, {{"world-size", "N", "ranks, one slot each (default 1)"},
                 {"priority", "P", "-1000..1000, higher first (default 0)"},
                 {"pool", "K=V,...", "labels a worker must carry, k=v,..."},
                 {"max-restarts", "N", "retries after the job's own failures (default 3)"},
                 {"init-from", "CHECKPOINT", "start from the weights of this catalogue checkpoint"},
                 {"request-id", "KEY", "idempotency key: a retry returns the same job"},
                 {"name", "NAME", "the job's name"},
                 {"label", "K=V,...", "labels to find the job by (loom list --label)"},
                 {"description", "TEXT", "what the job is for (at most 1024 bytes)"}});
  c.submit
      ->add_option("--set", c.sets,
                   "override a job spec field, after the file and the flags; repeatable: "
                   "optimizer.lr=3e-4, model.schedule[0].attention.plugin=iha (docs/jobs.md)")
      ->type_name("PATH=VALUE")
      ->allow_extra_args(false);
  CommandLine::Switch(c.submit, "-f,--follow",
                      "wait, showing progress; the exit code says how it ended");
}

// list, status, logs, cancel, plot, checkpoints, workers.
void AddJobCommands(CommandLine& line, Commands& c) {
  using C = CommandLine;
  c.list = line.Command("list", "jobs, newest last");
  C::Flags(c.list, {{"state", "STATE", "only jobs in this state (queued, running, succeeded, ...)"},
                    {"label", "K=V,...", "only jobs with all these labels"},
                    {"user", "USER", "only this user's jobs"},
                    {"limit", "N", "the newest N jobs (default 50; 0: all)"}});
  c.status = line.Command("status", "a job's state, progress, events, checkpoints and evaluations");
  c.logs = line.Command("logs", "a job's logs");
  c.cancel = line.Command("cancel", "cancel a job");
  c.plot = line.Command("plot", "a job's loss and tokens/s curves as a PNG (gnuplot)");
  c.update = line.Command("update", "change a job's priority or retention (its owner or an admin)");
  for (CLI::App* cmd : {c.status, c.logs, c.cancel, c.plot, c.update}) {
    cmd->add_option("job", c.job, "job id")->required();
  }
  C::Flags(c.update, {{"priority", "N", "the new priority (-1000..1000; higher runs first)"},
                      {"keep-last", "K", "keep the newest K intact checkpoints"},
                      {"keep-every", "E", "and every checkpoint at a multiple of E (0: none)"}});
  C::Switch(c.status, "-f,--follow", "until the job ends");
  C::Switch(c.logs, "-f,--follow", "stream until the job ends");
  C::Flags(c.plot, {{"file", "PNG", "the PNG to write (default JOB.png)"}});
  c.checkpoints = line.Command("checkpoints", "the checkpoint catalogue with lineage");
  C::Flags(c.checkpoints,
           {{"job", "JOB", "only this job's checkpoints"},
            {"store", "ROOT", "the steps under a checkpoint root or s3:// URL itself"}});
  c.workers = line.Command("workers", "registered workers and their slots");
}

void AddServeCommand(CommandLine& line, Commands& c) {
  c.serve = line.Command(
      "serve", "serve a checkpoint over an OpenAI-compatible API until Ctrl-C (docs/serve.md)");
  CommandLine::Flags(
      c.serve,
      {{"checkpoint", "REF", "a catalogue id (job-000002.150) or a checkpoint directory"},
       {"port", "PORT", "listen port (default 8000)"},
       {"bind", "ADDR", "listen address (default 127.0.0.1)"},
       {"allowed-hosts", "H,...", "Host names it answers to (default: loopback names on loopback)"},
       {"port-file", "FILE", "write the bound port here once listening"},
       {"model-name", "NAME", "the model id clients name (default: REF)"},
       {"max-batch", "N", "rows decoded together (default 32)"},
       {"max-queue", "N", "sequences waiting before 429 (default 256)"},
       {"max-tokens", "N", "most tokens one sequence may generate (default 1024)"},
       {"max-n", "N", "most choices per prompt (default 16)"},
       {"share-prefill", "BOOL", "prefill a prompt once for its n choices (default true)"},
       {"prefix-cache-mb", "MB",
        "KV cache of prompt prefixes kept across requests (default 0: off)"},
       {"device", "DEVICE", "cpu | cuda | auto (default auto)"},
       {"threads", "N", "LibTorch threads (default: all cores)"},
       {"tls-cert", "PEM", "serve HTTPS with this certificate chain"},
       {"tls-key", "PEM", "and this private key"},
       {"pool", "K=V,...", "as a serve job on workers with these labels (implies --submit)"},
       {"priority", "P", "serve job: -1000..1000, higher first (default 0)"},
       {"max-restarts", "N", "serve job: restarts after failures (default 3)"},
       {"name", "NAME", "serve job: its name"},
       {"label", "K=V,...", "serve job: labels to find it by"},
       {"description", "TEXT", "serve job: what it is for"},
       {"request-id", "KEY", "serve job: idempotency key"},
       {"startup-seconds", "S", "serve job: fails unless it answers within S s (default 600)"},
       {"unhealthy-seconds", "S",
        "serve job: fails once it stops answering for S s (default 30)"}});
  CommandLine::Switch(c.serve, "--submit",
                      "submit a serve job: the scheduler places it on a worker and the "
                      "coordinator proxies /v1/jobs/ID/serve/v1 to it (docs/serve.md)");
  CommandLine::Switch(c.serve, "--wait", "serve job: return once it answers");
  c.serve->get_option("--checkpoint")->required();
}

// loom admin webhook add URL --events E,... [--format slack] [--secret S] | list | delete ID
void AddWebhookCommands(CLI::App* admin, Commands& c) {
  c.webhook = admin->add_subcommand(
      "webhook", "POSTs on job and sweep state changes (docs/control-plane.md, \"Webhooks\")");
  c.webhook->require_subcommand(1);
  c.webhook->fallthrough();
  CLI::App* add = c.webhook->add_subcommand("add", "add one; prints its secret (only this once)");
  add->add_option("url", c.webhook_arg, "http:// or https:// URL")->required();
  CommandLine::Flags(add,
                     {{"events", "E,...",
                       "job.running, job.retrying, job.succeeded, job.failed, job.cancelled, "
                       "sweep.finished, sweep.cancelled"},
                      {"format", "FORMAT", "json (default) | slack: a {\"text\": ...} body"},
                      {"secret", "S", "the HMAC-SHA256 key (default: 32 random bytes, printed)"}});
  add->get_option("--events")->required();
  c.webhook->add_subcommand("list", "every webhook (without secrets)");
  c.webhook->add_subcommand("delete", "remove one and its deliveries not made yet: ID")
      ->add_option("id", c.webhook_arg, "webhook id")
      ->required();
}

void AddAdminCommands(CommandLine& line, Commands& c) {
  CLI::App* admin = line.Command("admin", "cluster settings (quotas: set by admins, read by all)");
  admin->require_subcommand(1);
  c.quota = admin->add_subcommand("quota", "limits on the slots a user's or a project's jobs hold");
  c.quota->require_subcommand(1);
  c.quota->fallthrough();
  c.quota->add_subcommand("list", "every quota with what it counts now");
  CLI::App* set = c.quota->add_subcommand(
      "set", "set one: KIND (user | project) NAME [SLOTS | none]; replaces what was set");
  set->add_option("words", c.quota_words, "KIND NAME [SLOTS | none]")->expected(2, 3)->required();
  set->add_option("--weight", c.quota_weight,
                  "a user's fair-share weight (default 1): twice the weight, twice the share");
  c.quota->add_subcommand("delete", "remove one: KIND NAME")
      ->add_option("words", c.quota_words, "KIND NAME")
      ->expected(2)
      ->required();
  AddWebhookCommands(admin, c);
}

void AddSweepCommands(CommandLine& line, Commands& c) {
  using C = CommandLine;
  CLI::App* sweep = c.sweep = line.Command("sweep",
                                           "sweeps: cells x seeds as jobs, reports with intervals "
                                           "(docs/sweeps.md)");
  sweep->require_subcommand(1);
  sweep->fallthrough();
  CLI::App* submit = sweep->add_subcommand("submit", "submit a sweep file");
  submit->add_option("file", c.sweep_arg, "the sweep file (YAML or JSON)")->required();
  C::Flags(submit, {{"request-id", "KEY", "idempotency key"}});
  C::Switch(submit, "-f,--follow", "wait, then print the report");
  CLI::App* expand = sweep->add_subcommand(
      "expand", "the job specs a sweep file makes, without a coordinator (--cell, --seed: one)");
  expand->add_option("file", c.sweep_arg, "the sweep file (YAML or JSON)")->required();
  C::Flags(expand, {{"cell", "NAME", "only this cell"}, {"seed", "N", "only this seed"}});
  sweep->add_subcommand("list", "sweeps");
  CLI::App* status = sweep->add_subcommand("status", "a sweep's jobs and their states");
  CLI::App* cancel = sweep->add_subcommand("cancel", "cancel a sweep and its jobs");
  CLI::App* report = sweep->add_subcommand(
      "report", "per cell mean, sd and 95% interval; paired differences against the baseline");
  CLI::App* curves = sweep->add_subcommand(
      "curves", "per cell the metric by step, and the paired differences by step (95% bands)");
  for (CLI::App* cmd : {status, cancel, report, curves}) {
    cmd->add_option("sweep", c.sweep_arg, "sweep id")->required();
  }
  C::Flags(
      curves,
      {{"format", "FORMAT", "table | json | yaml | csv (default: table, or -o)"},
       {"plot", "PNG", "also draw both (PNG)"},
       {"metric", "METRIC",
        "eval_loss | accuracy | exact_match | pass@1 | maj@k | answered (default: the sweep's)"},
       {"baseline", "CELL", "as report's --baseline"},
       {"merge", "SWEEPS", "as report's --merge"}});
  C::Flags(
      report,
      {{"format", "FORMAT", "table | json | yaml | csv (default: table, or -o)"},
       {"plot", "PNG",
        "also draw the metric by step per cell and the paired differences by step, 95% bands "
        "(PNG; as `loom sweep curves --plot`)"},
       {"metric", "METRIC",
        "eval_loss | accuracy | exact_match | pass@1 | maj@k | answered (default: the sweep's)"},
       {"select", "SELECTION", "final | best | test | reach | mean (default: the sweep's)"},
       {"threshold", "X", "select reach: the metric level to reach (steps until it)"},
       {"baseline", "CELL",
        "the cell the others are paired against (default: the sweep's); SWEEP_ID/CELL: another "
        "sweep's cell, paired by seed"},
       {"merge", "SWEEPS",
        "more seeds: the cells of these sweeps (comma-separated ids) join this sweep's cells of "
        "the same name"},
       {"length", "N", "the end-of-run evaluation at this eval.lengths length (0: training)"}});
  C::Switch(report, "-f,--follow", "");  // accepted for symmetry with submit; no effect
}

// Parses the command line into the commands' options; --help and --version exit here.
absl::Status ParseCommandLine(CLI::App& app, int argc, char** argv) {
  if (argc > 1 && argv[1][0] != '-') {
    bool known = false;
    for (const CLI::App* c : app.get_subcommands({})) known |= c->get_name() == argv[1];
    if (!known) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown command '", argv[1], "' (loom --help lists them)"));
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::CallForAllHelp& e) {
    std::exit(app.exit(e));
  } catch (const CLI::CallForVersion& e) {
    std::exit(app.exit(e));
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(e.what(), " (loom --help, or loom <command> --help)"));
  }
  return absl::OkStatus();
}

// Runs the command the line named (after ParseCommandLine).
absl::Status RunCommand(const CommandLine& line, const Commands& c) {
  if (c.up->parsed()) return Up(line.ArgsOf(c.up));
  Cli cli;
  for (CLI::App* cmd : {c.submit, c.list, c.status, c.logs, c.cancel, c.plot, c.checkpoints,
                        c.workers, c.serve, c.update}) {
    if (!cmd->parsed()) continue;
    const CliArgs args = line.ArgsOf(cmd);
    LOOM_RETURN_IF_ERROR(cli.Init(args));
    if (cmd == c.submit) return cli.Submit(c.file, c.sets, args);
    if (cmd == c.list) return cli.List(args);
    if (cmd == c.status) return cli.Status(c.job, args);
    if (cmd == c.logs) return cli.Logs(c.job, args);
    if (cmd == c.cancel) return cli.Cancel(c.job);
    if (cmd == c.update) return cli.Update(c.job, args);
    if (cmd == c.plot) return cli.Plot(c.job, args);
    if (cmd == c.checkpoints) return cli.Checkpoints(args);
    if (cmd == c.serve) return cli.Serve(args);
    return cli.Workers();
  }
  for (CLI::App* cmd : c.sweep->get_subcommands()) {
    const CliArgs args = line.ArgsOf(cmd);
    if (cmd->get_name() == "expand") return ExpandSweepFile(c.sweep_arg, args);  // offline
    LOOM_RETURN_IF_ERROR(cli.Init(args));
    return RunSweepCommand(cli.client(), cmd->get_name(), c.sweep_arg, args, cli.output());
  }
  for (CLI::App* cmd : c.webhook->get_subcommands()) {
    const CliArgs args = line.ArgsOf(cmd);
    LOOM_RETURN_IF_ERROR(cli.Init(args));
    return RunWebhookCommand(cli.client(), cmd->get_name(), c.webhook_arg, args, cli.output());
  }
  for (CLI::App* cmd : c.quota->get_subcommands()) {
    LOOM_RETURN_IF_ERROR(cli.Init(line.ArgsOf(cmd)));
    return cli.Quota(cmd->get_name(), c.quota_words, c.quota_weight);
  }
  return absl::InvalidArgumentError("missing command (loom --help)");
}

absl::Status Dispatch(CommandLine& line, int argc, char** argv) {
  Commands c;
  AddUpCommand(line, c);
  AddSubmitCommand(line, c);
  AddJobCommands(line, c);
  AddServeCommand(line, c);
  AddSweepCommands(line, c);
  AddAdminCommands(line, c);
  LOOM_RETURN_IF_ERROR(ParseCommandLine(line.app(), argc, argv));
  return RunCommand(line, c);
}

}  // namespace
}  // namespace loom::cli

int main(int argc, char** argv) {
  loom::cli::CommandLine line;
  const absl::Status s = loom::cli::Dispatch(line, argc, argv);
  if (!s.ok()) std::cerr << "loom: " << s.message() << "\n";
  return loom::cli::ExitCodeOf(s);
}
