// Where a training step's time goes: self time per LibTorch operator, autograd node and named
// region (RECORD_USER_SCOPE), from at::RecordFunction callbacks on the thread that made the
// OpProfile (the step's: CPU autograd runs there too) while it is alive; work handed to
// LibTorch's pool shows as its caller's self time, so the rows are wall time. Self time excludes
// nested records, so the rows add up to the time spent inside records; the benchmark reports the
// rest of the step as "outside any op". One profile at a time per process.
#ifndef LOOM_WORKER_TRAINER_OP_PROFILE_H_
#define LOOM_WORKER_TRAINER_OP_PROFILE_H_

#include <cstdint>
#include <string>
#include <vector>

namespace loom::trainer {

class OpProfile {
 public:
  OpProfile();  // starts recording
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  struct Row {
    std::string name;
    double self_s = 0;
    int64_t calls = 0;
  };
  // Rows so far, by self time, largest first.
  std::vector<Row> Rows() const;

 private:
  uint64_t handle_ = 0;
};

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_OP_PROFILE_H_
