#include "worker/trainer/op_profile.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace loom::trainer {
namespace {

using Clock = std::chrono::steady_clock;

struct Totals {
  std::mutex mu;
  std::map<std::string, OpProfile::Row> rows;
  // The step's thread (the one that made the profile; CPU autograd runs there too). Records of
  // LibTorch's pool threads, such as the row-split linear's per-thread GEMMs, would count the
  // same wall time once per thread; on the step's thread the wait for them stays in the caller.
  std::atomic<std::thread::id> thread;
};
Totals& Global() {
  static Totals* totals = new Totals();  // never destroyed: callbacks may outlive statics
  return *totals;
}

// Open records of this thread, innermost last; each accumulates its children's time.
struct Frame {
  Clock::time_point start;
  double children_s = 0;
};
thread_local std::vector<Frame> open_frames;

bool OnStepThread() { return Global().thread.load() == std::this_thread::get_id(); }

std::unique_ptr<at::ObserverContext> Start(const at::RecordFunction&) {
  if (!OnStepThread()) return nullptr;
  open_frames.push_back({Clock::now(), 0});
  return nullptr;
}

void End(const at::RecordFunction& record, at::ObserverContext*) {
  if (!OnStepThread() || open_frames.empty()) return;  // or started before the profile was
  const Frame frame = open_frames.back();
  open_frames.pop_back();
  const double total = std::chrono::duration<double>(Clock::now() - frame.start).count();
  if (!open_frames.empty()) open_frames.back().children_s += total;
  Totals& g = Global();
  std::lock_guard<std::mutex> lock(g.mu);
  OpProfile::Row& row = g.rows[record.name()];
  row.self_s += total - frame.children_s;
  ++row.calls;
}

}  // namespace

OpProfile::OpProfile() {
  {
    std::lock_guard<std::mutex> lock(Global().mu);
    Global().rows.clear();
  }
  Global().thread = std::this_thread::get_id();
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(&Start, &End)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                   at::RecordScope::USER_SCOPE}));
}

OpProfile::~OpProfile() { at::removeCallback(handle_); }

std::vector<OpProfile::Row> OpProfile::Rows() const {
  std::vector<Row> rows;
  {
    std::lock_guard<std::mutex> lock(Global().mu);
    for (const auto& [name, row] : Global().rows) {
      rows.push_back(row);
      rows.back().name = name;
    }
  }
  std::sort(rows.begin(), rows.end(),
            [](const Row& a, const Row& b) { return a.self_s > b.self_s; });
  return rows;
}

}  // namespace loom::trainer
