#include "coordinator/job_logs.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace fs = std::filesystem;

namespace loom::coordinator {
namespace {

// One line of a series file; false for a torn or foreign line. Lines written before
// tokens_seen and train_flops were kept have 7 fields and read as 0 for both.
bool ParseStepLine(absl::string_view line, int* attempt, v1::StepPoint* p) {
  std::vector<absl::string_view> f = absl::StrSplit(line, '\t');
  int64_t step, time_ms, tokens = 0;
  double loss, lr, tps, grad, flops = 0;
  if ((f.size() != 7 && f.size() != 9) || !absl::SimpleAtoi(f[0], attempt) ||
      !absl::SimpleAtoi(f[1], &step) || !absl::SimpleAtod(f[2], &loss) ||
      !absl::SimpleAtod(f[3], &lr) || !absl::SimpleAtod(f[4], &tps) ||
      !absl::SimpleAtod(f[5], &grad) || !absl::SimpleAtoi(f[6], &time_ms)) {
    return false;
  }
  if (f.size() == 9 && (!absl::SimpleAtoi(f[7], &tokens) || !absl::SimpleAtod(f[8], &flops))) {
    return false;
  }
  p->set_step(step);
  p->set_loss(loss);
  p->set_learning_rate(lr);
  p->set_tokens_per_second(tps);
  p->set_grad_norm(grad);
  p->set_time_ms(time_ms);
  p->set_tokens_seen(tokens);
  p->set_train_flops(flops);
  return true;
}

// At most max_points per series: every k-th point and always the last one.
void Thin(v1::AttemptSeries& series, int max_points) {
  const int n = series.points_size();
  series.set_total_points(n);
  if (n <= max_points) return;
  const int k = (n + max_points - 1) / max_points;
  google::protobuf::RepeatedPtrField<v1::StepPoint> kept;
  for (int i = 0; i < n; ++i) {
    if (i % k == 0 || i == n - 1) *kept.Add() = series.points(i);
  }
  series.mutable_points()->Swap(&kept);
}

}  // namespace

std::string JobLogPath(const std::string& data_dir, const std::string& job_id) {
  return (fs::path(data_dir) / "logs" / (job_id + ".log")).string();
}

std::string JobSeriesPath(const std::string& data_dir, const std::string& job_id) {
  return (fs::path(data_dir) / "series" / (job_id + ".tsv")).string();
}

std::optional<int64_t> NewPartStart(int64_t received, int64_t offset, int64_t count) {
  if (offset + count <= received) return std::nullopt;
  return std::max<int64_t>(0, received - offset);
}

bool AppendToFile(const std::string& path, absl::string_view bytes, bool* no_space) {
  std::error_code ec;
  const uintmax_t before = fs::exists(path, ec) ? fs::file_size(path, ec) : 0;
  if (ec) return false;
  int error = 0;
  {
    errno = 0;
    std::ofstream out(path, std::ios::app | std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (out) return true;
    error = errno;
  }
  if (no_space != nullptr && (error == ENOSPC || error == EDQUOT)) *no_space = true;
  // A short write (a full disk) must not leave a fragment: the agent sends the chunk again and
  // it would follow the fragment.
  fs::resize_file(path, before, ec);
  return false;
}

FileBytes ReadFileBytes(const std::string& path, int64_t offset, int64_t max) {
  FileBytes out;
  std::error_code ec;
  out.size = fs::exists(path, ec) ? static_cast<int64_t>(fs::file_size(path, ec)) : 0;
  if (offset < out.size) {
    const int64_t want = std::min<int64_t>(out.size - offset, max);
    std::ifstream in(path, std::ios::binary);
    in.seekg(offset);
    out.data.resize(static_cast<size_t>(want));
    in.read(out.data.data(), want);
    out.data.resize(static_cast<size_t>(in.gcount()));
  }
  return out;
}

std::string StepLines(const v1::AttemptReport& report, int64_t first) {
  std::string lines;
  for (int64_t i = first; i < report.steps_size(); ++i) {
    const v1::StepPoint& p = report.steps(static_cast<int>(i));
    // train_flops at full precision: it is an x axis, and 1e15-sized values differ late.
    absl::StrAppendFormat(&lines, "%d\t%d\t%.10g\t%.10g\t%.10g\t%.10g\t%d\t%d\t%.17g\n",
                          report.attempt(), p.step(), p.loss(), p.learning_rate(),
                          p.tokens_per_second(), p.grad_norm(), p.time_ms(), p.tokens_seen(),
                          p.train_flops());
  }
  return lines;
}

std::vector<v1::AttemptSeries> ReadStepSeries(const std::string& path, int max_points) {
  std::ifstream in(path, std::ios::binary);
  std::map<int, v1::AttemptSeries> by_attempt;
  std::string line;
  while (std::getline(in, line)) {
    int attempt;
    v1::StepPoint p;
    if (!ParseStepLine(line, &attempt, &p)) continue;
    v1::AttemptSeries& s = by_attempt[attempt];
    s.set_attempt(attempt);
    *s.add_points() = std::move(p);
  }
  std::vector<v1::AttemptSeries> out;
  for (auto& [attempt, s] : by_attempt) {
    Thin(s, max_points);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace loom::coordinator
