// A job's files under the coordinator's data directory: its log (logs/<job>.log, the lines of
// all its attempts in arrival order) and rank 0's step series (series/<job>.tsv, one line a
// point: "attempt step loss lr tokens/s grad_norm time_ms tokens_seen train_flops"; files from
// before the last two fields have 7). Agents send both in resendable chunks by offset; the
// coordinator keeps what it received per (attempt, worker) in RocksDB and hands only the new
// part (NewPartStart) to the append functions here.
#ifndef LOOM_COORDINATOR_JOB_LOGS_H_
#define LOOM_COORDINATOR_JOB_LOGS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "loom/v1/control.pb.h"

namespace loom::coordinator {

std::string JobLogPath(const std::string& data_dir, const std::string& job_id);
std::string JobSeriesPath(const std::string& data_dir, const std::string& job_id);

// A chunk of `count` items (bytes, points) that starts at item `offset`, when `received` items
// came already: the index in the chunk where the new items start, or nullopt if none are new.
std::optional<int64_t> NewPartStart(int64_t received, int64_t offset, int64_t count);

// Appends and flushes; false when the bytes did not reach the file, which is then as before
// (nothing of a cut-short write stays). *no_space: it failed because the filesystem is full.
bool AppendToFile(const std::string& path, absl::string_view bytes, bool* no_space = nullptr);

// Bytes [offset, offset + max) of a file, and the file's size (0 when it does not exist).
struct FileBytes {
  std::string data;
  int64_t size = 0;
};
FileBytes ReadFileBytes(const std::string& path, int64_t offset, int64_t max);

// The report's step points from index `first` on, as series lines.
std::string StepLines(const v1::AttemptReport& report, int64_t first);
// A series file as one series per attempt, in attempt order, each thinned to at most max_points
// (every k-th point and always the last); torn or foreign lines are skipped.
std::vector<v1::AttemptSeries> ReadStepSeries(const std::string& path, int max_points);

}  // namespace loom::coordinator

#endif  // LOOM_COORDINATOR_JOB_LOGS_H_
